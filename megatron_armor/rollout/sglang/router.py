"""Registering engines with ``sglang-router`` (used when an engine is restarted).

Two generations of the router API exist (see SGLang's router and slime's engine code):
0.2.x and older take ``POST /add_worker?url=U`` / ``POST /remove_worker?url=U``; newer ones
take ``POST /workers`` with ``{"url": U}`` and ``DELETE /workers/{id}`` (ids listed by
``GET /workers``). :class:`RouterAdmin` tries the newer form and falls back on 404/405. The
newer ones (0.3.2, checked against the real router by the sglang test tier) register workers in
the background: :meth:`RouterAdmin.wait_listed` waits until they route to them.
"""

from __future__ import annotations

import asyncio
from urllib.parse import quote

import aiohttp

MISSING = (404, 405)


class RouterAdmin:
    """Add / remove worker URLs on a running router at ``router_url``."""

    def __init__(
        self, session: aiohttp.ClientSession, router_url: str, timeout_s: float = 60.0
    ) -> None:
        self.session = session
        self.url = router_url
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def add_worker(self, worker_url: str) -> None:
        async with self.session.post(
            f"{self.url}/workers", json={"url": worker_url}, timeout=self.timeout
        ) as r:
            if r.status not in MISSING:
                return await self._check(r, "add", worker_url)
        legacy = f"{self.url}/add_worker?url={quote(worker_url, safe='')}"
        async with self.session.post(legacy, timeout=self.timeout) as r:
            await self._check(r, "add", worker_url)

    async def remove_worker(self, worker_url: str) -> None:
        worker_id = await self._worker_id(worker_url)
        if worker_id is not None:
            async with self.session.delete(
                f"{self.url}/workers/{quote(worker_id, safe='')}", timeout=self.timeout
            ) as r:
                if r.status not in MISSING:
                    return await self._check(r, "remove", worker_url)
        legacy = f"{self.url}/remove_worker?url={quote(worker_url, safe='')}"
        async with self.session.post(legacy, timeout=self.timeout) as r:
            await self._check(r, "remove", worker_url)

    async def wait_listed(self, worker_urls: list[str], timeout_s: float, poll_s: float = 0.5):
        """Until every URL of ``worker_urls`` is a healthy worker of the router. Newer routers
        (0.3.x) register workers, those of ``--worker-urls`` and added ones alike, in the
        background after answering: until then they route nothing to them (and cannot remove
        them). Old routers without ``GET /workers`` register them at once: no wait."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            listed = await self._workers()
            if listed is None:
                return
            healthy = {w.get("url") for w in listed if w.get("is_healthy", True)}
            missing = [u for u in worker_urls if u not in healthy]
            if not missing:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(
                    f"sglang-router at {self.url} has not registered {missing} after "
                    f"{timeout_s:.0f}s; see its log (rollout.sglang.startup_timeout_s)"
                )
            await asyncio.sleep(poll_s)

    async def _workers(self) -> list[dict] | None:
        """The router's workers (``GET /workers``), or ``None`` on old routers."""
        async with self.session.get(f"{self.url}/workers", timeout=self.timeout) as r:
            if r.status in MISSING:
                return None
            body = await r.json(content_type=None)
        return list(body.get("workers", []))

    async def _worker_id(self, worker_url: str) -> str | None:
        """The router's id for ``worker_url`` (``GET /workers``), or ``None`` on old routers."""
        for worker in await self._workers() or []:
            if worker.get("url") == worker_url:
                return str(worker.get("id", worker_url))
        return None

    @staticmethod
    async def _check(response: aiohttp.ClientResponse, verb: str, worker_url: str) -> None:
        if response.status >= 400:
            text = (await response.text())[:300]
            raise RuntimeError(
                f"sglang-router: {verb} worker {worker_url} failed: HTTP {response.status} {text}"
            )
