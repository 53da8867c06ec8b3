"""``SGLangEngine``: a pool of SGLang servers (optionally behind ``sglang-router``) as a
:class:`RolloutEngine`. A dead server is restarted out of rotation (:meth:`SGLangEngine.restart_server`)
and rejoins once the trainer re-synced its weights (``orchestration/actors/rollout_fleet.py``,
``ServerHealth.heal``).

An SGLang server holds one weight set (``policy``). The reference is served by
``ref_strategy: swap`` (reload the same servers) or ``dedicated`` (a second
``SGLangEngine`` pool, ``from_config(config, pool="ref")``, whose ``policy`` set holds
``theta_ref``), see ``rollout.reference`` and ``config.sglang_pools``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import secrets
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megatron_armor.config.moe import route_shape, wants_engine_routes
from megatron_armor.config.schema import ArmorConfig, SGLangConfig
from megatron_armor.config.sglang_pools import PoolSpec, policy_pool, pool_specs
from megatron_armor.heartbeat import beat
from megatron_armor.rollout.hf_dir import save_hf_dir
from megatron_armor.rollout.protocol import (
    GenerationOutput,
    PartialRequest,
    RolloutEngine,
    SamplingParams,
    window_finish_reason,
    window_limits,
)
from megatron_armor.rollout.sglang import launch
from megatron_armor.rollout.sglang import weights as transport
from megatron_armor.rollout.sglang.client import (
    PROFILE_START,
    PROFILE_STOP,
    ClientSettings,
    EventLoopThread,
    SGLangClient,
    generate_payload,
    new_rid,
    parse_generate_response,
    parse_routed_experts,
    pause_generation_payload,
    release_memory_occupation_payload,
    resume_memory_occupation_payload,
    sample_seed,
    update_weights_from_disk_payload,
)
from megatron_armor.rollout.sglang.profile import ServerProfile, server_profile
from megatron_armor.rollout.sglang.router import RouterAdmin

NamedTensors = Iterable[tuple[str, torch.Tensor]]
KV_CACHE = "kv_cache"
"""SGLang's memory tag of the KV cache (``weights`` the other one the loop uses)."""


@dataclass
class EngineServer:
    """One SGLang server: its index in the pool, URL, first GPU on its node and (when we
    launched it) its process."""

    index: int
    url: str
    tp: int
    gpu: int = 0
    process: launch.ManagedProcess | None = None
    serving: bool = True


def client_settings(cfg: SGLangConfig, api_key: str = "") -> ClientSettings:
    return ClientSettings(
        max_concurrency=cfg.max_concurrency,
        request_timeout_s=cfg.request_timeout_s,
        max_retries=cfg.max_retries,
        api_key=api_key,
    )


class SGLangEngine(RolloutEngine):
    """Rollout over SGLang servers at ``urls`` (``launch()`` starts them from ``cfg``)."""

    def __init__(
        self,
        model_path: str,
        cfg: SGLangConfig,
        *,
        urls: list[str] | None = None,
        router_url: str | None = None,
        host: str = "127.0.0.1",
        weights_dir: str | None = None,
        pool: PoolSpec | None = None,
        gpu_ids: list[int] | None = None,
        indices: list[int] | None = None,
        model_overrides: dict | None = None,
        on_cpu: bool = False,
        routes: tuple[int, int] | None = None,
        profile: ServerProfile | None = None,
    ) -> None:
        """``model_overrides``: ``trainer.model_overrides``, served as the trainer trains.
        ``on_cpu``: servers without GPUs (``orchestration.layout: cpu``; ``launch.CPU_SERVER_ARGS``).
        ``profile``: how ``logging.profile`` captures the servers (``rollout/sglang/profile.py``).
        ``routes``: ``(layers, k)`` of a mixture-of-experts model whose experts each sample
        returns (``--enable-return-routed-experts``, ``return_routed_experts`` per request;
        ``config/moe.py``: ``route_shape``); ``None``: no routes asked for.
        ``pool`` (default: the policy pool described by ``cfg``) sets the server count, TP
        size, memory flag and ports. This engine runs the pool's servers ``indices`` (default:
        all of them; on several nodes each node's rollout worker runs its own), listening on
        ``host:base_port + index``, with ``gpu_ids`` their first GPUs on this node (default:
        the pool's own numbering)."""
        self.model_path = model_path
        self.cfg = cfg
        self.model_overrides = dict(model_overrides or {})
        self.on_cpu = on_cpu
        self.routes = routes
        self.profile = profile
        self._profiling = False
        self.pool = pool or policy_pool(cfg, len(urls) if urls else max(cfg.num_engines, 1))
        self.host = host
        self.weights_dir = weights_dir
        p = self.pool
        urls_given = bool(urls)
        if indices is None:
            indices = list(range(len(urls) if urls else p.num_engines))
        urls = urls or [f"http://{host}:{p.base_port + i}" for i in indices]
        if gpu_ids is None:
            offsets = p.gpu_offsets()
            gpu_ids = [offsets[i] if i < len(offsets) else 0 for i in indices]
        if not len(urls) == len(gpu_ids) == len(indices):
            raise ValueError(
                f"SGLang {p.name} pool: {len(indices)} server indices, {len(urls)} URLs and "
                f"{len(gpu_ids)} GPU ids must match"
            )
        self.servers = [
            EngineServer(i, url, p.tp, gpu)
            for i, url, gpu in zip(indices, urls, gpu_ids, strict=True)
        ]
        self.router_url = router_url
        self.router_process: launch.ManagedProcess | None = None
        # servers this engine launches answer only its own random key (a new one per run);
        # hex, so it never starts with "-", which argparse would take for a flag
        self._api_key = "" if router_url or urls_given else secrets.token_hex(32)
        self._version = 0
        self.released: list[str] = []
        """The memory tags released and not yet resumed (generation paused while any is)."""
        self._round_robin = itertools.count()
        self._loop = EventLoopThread()
        self._client = SGLangClient(client_settings(cfg, self._api_key))
        self._loop.run(self._client.__aenter__())

    @classmethod
    def from_config(
        cls,
        config: ArmorConfig,
        pool: str = "policy",
        host: str = "127.0.0.1",
        gpu_ids: list[int] | None = None,
        start: bool = True,
        indices: list[int] | None = None,
    ) -> SGLangEngine:
        """The ``pool`` (``policy`` | ``ref``) of ``config.sglang_pools.pool_specs(config)``
        (its servers ``indices`` on GPUs ``gpu_ids`` of this node, ``host`` its address),
        launched unless ``start`` is false (``orchestration.layout: colocated`` turns on SGLang's
        memory saver so ``release_memory`` works); disk updates go under the run dir, one
        directory per pool and node (the servers of a node read what its worker wrote)."""
        specs = pool_specs(config)
        if pool not in specs:
            raise ValueError(
                f"no SGLang {pool!r} pool in this config (pools: {sorted(specs)}); the reference "
                "pool exists for rollout.ref_strategy=dedicated (or cache filled by it)"
            )
        run_dir = os.path.join(config.run.output_dir, config.run.name)
        engine = cls(
            config.trainer.model_path, config.rollout.sglang, host=host, pool=specs[pool],
            weights_dir=os.path.join(run_dir, "sglang_weights", pool, host), gpu_ids=gpu_ids,
            indices=indices, model_overrides=dict(config.trainer.model_overrides),
            on_cpu=config.orchestration.layout == "cpu",
            routes=route_shape(config.trainer.model_path) if wants_engine_routes(config) else None,
            profile=server_profile(config),
        )  # fmt: skip
        if start:
            try:
                engine.launch(config.orchestration.layout == "colocated", run_dir)
            except BaseException:
                engine.close()
                raise
        return engine

    # ------------------------------------------------------------------ lifecycle
    def launch(self, colocated: bool = True, log_dir: str | None = None) -> None:
        """Start every server (``colocated`` enables SGLang's memory saver) and the router."""
        launch.require_sglang(self.cfg.server_module)
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        for server in self.servers:
            server.process = self.server_process(server, colocated, log_dir)
            server.process.start(env=launch.server_env(self.on_cpu))
        for server in self.servers:
            server.process.wait_healthy(self.cfg.startup_timeout_s)
        if self.cfg.router and self.router_url is None:
            self._launch_router(log_dir)

    def server_process(
        self, server: EngineServer, colocated: bool, log_dir: str | None
    ) -> launch.ManagedProcess:
        """The (not yet started) ``sglang.launch_server`` process of ``server``."""
        port = int(server.url.rsplit(":", 1)[1])
        args = launch.server_args_for(
            self.model_path,
            port,
            tp=server.tp,
            mem_fraction_static=round(self.pool.flag, 4),
            host=self.host,
            base_gpu_id=server.gpu,
            colocated=colocated,
            extra_args=dict(self.cfg.extra_args),
            api_key=self._api_key,
            context_length=self.cfg.context_length,
            model_overrides=self.model_overrides,
            on_cpu=self.on_cpu,
            # nothing pushes the reference again after a release: its servers keep a host copy
            weights_cpu_backup=self.pool.name == "ref",
            return_routed_experts=self.routes is not None,
        )
        name = self.server_name(server)
        log = os.path.join(log_dir, f"{name}.log") if log_dir else None
        command = launch.build_server_command(args, module=self.cfg.server_module)
        if self.profile is not None:
            command = self.profile.command(command, name)
        return launch.ManagedProcess(command, f"{server.url}/health_generate", log)

    def server_name(self, server: EngineServer) -> str:
        """``sglang_<i>`` (policy) or ``sglang_<pool>_<i>``: its log's and profile's name."""
        pool = "" if self.pool.name == "policy" else f"{self.pool.name}_"
        return f"sglang_{pool}{server.index}"

    def profile_begin(self, step: int) -> None:
        """At a chosen step, ask every server to start its capture (``rollout/sglang/profile.py``)."""
        if self.profile is None or not self.profile.wants(step):
            return
        if self.profile.start_payload(self.server_name(self.servers[0])) is None:
            return  # the driver's Nsight Systems session follows the servers
        self._post_all(self.servers, PROFILE_START,
                       lambda s: self.profile.start_payload(self.server_name(s)))  # fmt: skip
        self._profiling = True

    def profile_end(self, step: int) -> None:
        """Stop the capture :meth:`profile_begin` started."""
        if self._profiling:
            self._post_all(self.servers, PROFILE_STOP, lambda s: {})
            self._profiling = False

    def _launch_router(self, log_dir: str | None) -> None:
        port = self.pool.router_port
        self.router_url = f"http://{self.host}:{port}"
        command = launch.build_router_command(
            [s.url for s in self.servers], port, self.host, api_key=self._api_key
        )
        suffix = "" if self.pool.name == "policy" else f"_{self.pool.name}"
        log = os.path.join(log_dir, f"sglang_router{suffix}.log") if log_dir else None
        self.router_process = launch.ManagedProcess(command, f"{self.router_url}/health", log)
        self.router_process.start()
        self.router_process.wait_healthy(self.cfg.startup_timeout_s)
        self._router_wait([s.url for s in self.servers])

    def close(self) -> None:
        """Stop what :meth:`launch` started and the client loop."""
        if self.router_process is not None:
            self.router_process.stop()
        for server in self.servers:
            if server.process is not None:
                server.process.stop()
        self._loop.run(self._client.__aexit__(None, None, None))
        self._loop.close()

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, weights: str = "policy"
    ) -> list[list[GenerationOutput]]:
        self._check_weights(weights)
        return self._loop.run(self._generate_all(prompts, n, params))

    async def _generate_all(self, prompts, n, params) -> list[list[GenerationOutput]]:
        started = time.perf_counter()
        return list(
            await asyncio.gather(
                *(self._generate_group(p, n, params, i, started) for i, p in enumerate(prompts))
            )
        )

    async def _generate_group(
        self, prompt: list[int], n: int, params: SamplingParams, index: int, started: float
    ) -> list[GenerationOutput]:
        seeds = [
            None if params.seed is None else sample_seed(params.seed, index, j, n) for j in range(n)
        ]
        asks = self.routes is not None
        bodies = await asyncio.gather(
            *(
                self._generate_one(
                    self._pick_url(), generate_payload(prompt, params, new_rid(), s, asks), started
                )
                for s in seeds
            )
        )
        return [self._output(prompt, *answer) for answer in bodies]

    def generate_window(
        self,
        requests: list[PartialRequest],
        params: SamplingParams,
        window_tokens: int,
        weights: str = "policy",
    ) -> list[GenerationOutput]:
        """One window of a partial rollout (``RolloutEngine.generate_window``): each request is
        sent with its prompt and response so far as ``input_ids`` (the server prefills them
        under its current weights) and ``max_new_tokens`` its window's limit
        (:func:`~megatron_armor.rollout.protocol.window_limits`); request ``i``'s seed is
        ``sample_seed(params.seed, i, 0, 1)``."""
        self._check_weights(weights)
        limits = window_limits(requests, params, window_tokens)

        async def send_all():
            started = time.perf_counter()
            return await asyncio.gather(*(
                self._generate_one(self._pick_url(), generate_payload(
                    list(r.prompt_ids) + list(r.response_ids),
                    dataclasses.replace(params, max_new_tokens=limit), new_rid(),
                    None if params.seed is None else sample_seed(params.seed, i, 0, 1),
                    self.routes is not None), started)
                for i, (r, limit) in enumerate(zip(requests, limits, strict=True))
            ))  # fmt: skip

        out = []
        for request, answer in zip(requests, self._loop.run(send_all()), strict=True):
            sample = self._output(list(request.prompt_ids) + list(request.response_ids), *answer)
            if sample.finish_reason in ("stop", "length"):
                total = len(request.response_ids) + len(sample.token_ids)
                sample.finish_reason = window_finish_reason(
                    sample.finish_reason == "stop", total, params
                )
            out.append(sample)
        return out

    def _output(self, prompt: list[int], body: dict, seconds: float) -> GenerationOutput:
        """The sample of a ``/generate`` answer (``seconds`` after the call's start), with its
        routes when they were asked for."""
        out = parse_generate_response(body, self._version)
        out.seconds = seconds
        if self.routes is not None:
            layers, k = self.routes
            positions = len(prompt) + len(out.token_ids) - 1
            out.routed_experts = parse_routed_experts(body["meta_info"], layers, k, positions)
        return out

    async def _generate_one(
        self, url: str, payload: dict, started: float | None = None
    ) -> tuple[dict, float]:
        """One ``/generate``: its answer and the seconds since ``started`` (the call's start;
        default: this request's); the answer is progress the driver's call deadline sees (a
        beat: a long generation whose samples keep finishing is slow, not stuck)."""
        started = time.perf_counter() if started is None else started
        body = await self._client.generate(url, payload)
        beat()
        return body, time.perf_counter() - started

    def _pick_url(self) -> str:
        if self.router_url is not None:
            return self.router_url
        serving = [s for s in self.servers if s.serving]
        if not serving:
            raise RuntimeError("rollout: no SGLang server is serving (all restarting or down)")
        return serving[next(self._round_robin) % len(serving)].url

    # ------------------------------------------------------------------ weights
    def weight_version(self, weights: str = "policy") -> int:
        self._check_weights(weights)
        return self._version

    def set_weight_version(self, version: int) -> None:
        """Record ``version`` after trainer ranks pushed weights themselves (NCCL transport)."""
        self._version = int(version)

    def update_weights(
        self, named_tensors: NamedTensors, version: int, weights: str = "policy"
    ) -> None:
        """Save HF-named tensors as an HF dir and load it (``update_weights_from_disk``): for
        tools and tests that hold tensors here. A training run never sends weights through
        this process: the trainer ranks push them (``trainer/weight_sync.py``), then the
        worker calls :meth:`update_weights_from_disk` or :meth:`set_weight_version`."""
        self._check_weights(weights)
        self.sync_servers(named_tensors, version, self.servers)
        self._version = int(version)

    @property
    def api_key(self) -> str:
        """The key the servers this engine launched answer (``""``: servers it did not launch)."""
        return self._api_key

    def sync_servers(
        self, named_tensors: NamedTensors, version: int, servers: list[EngineServer]
    ) -> None:
        kind = self.cfg.weight_transport
        if kind != "disk":
            raise ValueError(
                f"rollout.sglang.weight_transport={kind!r} runs on the trainer ranks "
                "(trainer/weight_sync.py), which push into the servers themselves; this process "
                "only saves tensors it holds for weight_transport=disk"
            )
        path = self._save_for_disk(named_tensors, version)
        self._post_all(
            servers,
            transport.DISK_ENDPOINT,
            lambda s: update_weights_from_disk_payload(path, version),
        )
        self._prune_disk_versions(keep=path)

    def update_weights_from_disk(
        self, model_path: str, version: int, servers: list[EngineServer] | None = None
    ) -> None:
        """Load an HF directory the trainer ranks wrote (``/update_weights_from_disk``) into
        ``servers`` (default: all; then ``version`` becomes the pool's)."""
        self._post_all(
            self.servers if servers is None else servers,
            transport.DISK_ENDPOINT,
            lambda s: update_weights_from_disk_payload(model_path, version),
        )
        if servers is None:
            self._version = int(version)

    def _save_for_disk(self, named_tensors: NamedTensors, version: int) -> str:
        if self.weights_dir is None:
            raise ValueError(
                "weight_transport=disk needs SGLangEngine(weights_dir=...) on a shared filesystem"
            )
        out = os.path.join(self.weights_dir, f"v{version}")
        save_hf_dir(named_tensors, self.model_path, out)
        return out

    def _prune_disk_versions(self, keep: str) -> None:
        """Delete the HF dirs of older pushes once the servers loaded ``keep`` (a long run
        would otherwise leave one model copy per step on the shared filesystem)."""
        for entry in os.scandir(self.weights_dir):
            if entry.is_dir() and entry.name.startswith("v") and entry.path != keep:
                shutil.rmtree(entry.path, ignore_errors=True)

    def _post_all(self, servers: list[EngineServer], endpoint: str, payload_fn) -> None:
        async def post_all():
            await asyncio.gather(
                *(self._client.post(s.url, endpoint, payload_fn(s)) for s in servers)
            )

        self._loop.run(post_all())

    @staticmethod
    def _check_weights(weights: str) -> None:
        if weights != "policy":
            raise ValueError(
                f"SGLangEngine holds one weight set ('policy'), not {weights!r}: serve the reference "
                "with rollout.ref_strategy=swap, or a second SGLangEngine pool (dedicated)"
            )

    def begin_weight_update(self, servers: list[EngineServer] | None = None) -> None:
        """Open the weight-update session of ``servers`` (default: all): SGLang 0.5.23 answers
        ``update_weights_from_tensor`` / ``_distributed`` with HTTP 400 outside one
        (docs/weight-sync.md, "The update session")."""
        self._post_all(self._chosen(servers), transport.BEGIN_ENDPOINT, lambda s: {})

    def end_weight_update(self, servers: list[EngineServer] | None = None) -> None:
        """Close the session :meth:`begin_weight_update` opened, then flush each server's
        prefix cache once (the pushed buckets do not, one by one: in 0.5.23 a refused flush
        fails the update that asked for it)."""
        chosen = self._chosen(servers)
        self._post_all(chosen, transport.END_ENDPOINT, lambda s: {})
        self._post_all(chosen, transport.FLUSH_ENDPOINT, lambda s: {})

    def _chosen(self, servers: list[EngineServer] | None) -> list[EngineServer]:
        return self.servers if servers is None else servers

    # ------------------------------------------------------------------ memory / health
    def pause_generation(self, servers: list[EngineServer] | None = None) -> None:
        """``/pause_generation`` (``retract``) on ``servers`` (default: all): the running
        requests wait, none is lost; a weight update may come meanwhile (its cache flush is
        allowed while paused), and after :meth:`continue_generation` each request goes on from
        the tokens it has under the weights then loaded, its KV cache recomputed, its answer
        carrying every token's version (``client.token_versions_of``)."""
        self._post_all(self._chosen(servers), "/pause_generation",
                       lambda s: pause_generation_payload())  # fmt: skip

    def continue_generation(self, servers: list[EngineServer] | None = None) -> None:
        """``/continue_generation`` on ``servers`` (default: all): paused requests go on."""
        self._post_all(self._chosen(servers), "/continue_generation", lambda s: {})

    def release_memory(self) -> None:
        """Pause generation (:meth:`pause_generation`: a release while the scheduler is not idle
        trips an assertion that ends the server), then ``/release_memory_occupation`` of
        weights and KV cache (``client.RELEASED_TAGS``, never the CUDA graphs) on every server
        (colocated)."""
        self._release(self.servers, None)
        self.released = list(release_memory_occupation_payload()["tags"])

    def _release(self, servers: list[EngineServer], tags: list[str] | None) -> None:
        self.pause_generation(servers)
        self._post_all(
            servers, "/release_memory_occupation", lambda s: release_memory_occupation_payload(tags)
        )

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """``/resume_memory_occupation`` of ``tags`` (``weights``, ``kv_cache``; ``None``: both);
        generation continues (``/continue_generation``) once the KV cache is back. The loop
        takes the weights back before a push and the KV cache after it, so the cache is not
        on the GPU beside the push's buckets."""
        resumed = resume_memory_occupation_payload(tags)["tags"]
        self._post_all(self.servers, "/resume_memory_occupation", lambda s: {"tags": resumed})
        self.released = [t for t in self.released if t not in resumed]
        if tags is None or KV_CACHE in tags:
            self.continue_generation()

    def _answers(self, url: str, timeout_s: float = 30.0):
        """The probe of a server that works: ``/health_generate`` (a one-token generation)
        while it serves; while its memory is released it is paused and generates nothing,
        so there its scheduler must answer a control request (``/server_info``)."""
        if self.released:
            return self._client.scheduler_answers(url, timeout_s)
        return self._client.healthy(url, timeout_s)

    def server_healthy(self, server: EngineServer) -> bool:
        if server.process is not None and not server.process.alive():
            return False
        return self._loop.run(self._answers(server.url))

    def health(self) -> bool:
        return all(self.server_healthy(s) for s in self.servers)

    def wedged_servers(self, timeout_s: float) -> list[EngineServer]:
        """The serving servers this engine launched whose ``/health_generate`` gives no 200
        within ``timeout_s``. SGLang 0.5.23 answers it at once while its scheduler is sending
        anything (a busy server that makes progress), runs a one-token generation when idle,
        answers 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) when the scheduler sent
        nothing, and not at all when the HTTP process itself is stopped. While the pool's
        memory is released (colocated, between the rollout and the KV cache's return) the
        servers are paused and generate nothing: they are asked ``/server_info`` instead,
        which a paused scheduler answers and a wedged one does not."""
        chosen = [s for s in self.servers
                  if s.serving and s.process is not None and s.process.alive()]  # fmt: skip

        async def probe_all():
            return await asyncio.gather(*(self._answers(s.url, timeout_s) for s in chosen))

        answers = self._loop.run(probe_all()) if chosen else []
        return [s for s, ok in zip(chosen, answers, strict=True) if not ok]

    def kill_server(self, server: EngineServer) -> None:
        """SIGKILL of a wedged ``server`` and its children, out of rotation: the requests in
        flight on it fail, and the heal (:meth:`restart_server`) brings it back."""
        server.serving = False
        if server.process is not None:
            server.process.kill()

    def restart_server(self, server: EngineServer) -> None:
        """Take ``server`` out of rotation and restart it; the caller re-syncs its weights,
        then puts it back with :meth:`rejoin`. While the pool's memory is released the new
        process releases the same tags (paused, as the others), so the resume that comes next
        finds them released."""
        server.serving = False
        if self.router_url is not None:
            self._router_call("remove_worker", server.url)
        if server.process is None:
            raise RuntimeError(
                f"SGLang server {server.url} is down and was not launched here; restart it by hand"
            )
        server.process.stop()
        server.process.start(env=launch.server_env(self.on_cpu))
        server.process.wait_healthy(self.cfg.startup_timeout_s)
        if self.released:  # as the pool's other servers: the phase resumes these tags next
            self._release([server], self.released)

    def rejoin(self, server: EngineServer) -> None:
        """Put a restarted, re-synced ``server`` back into rotation (and behind the router)."""
        if self.router_url is not None:
            self._router_call("add_worker", server.url)
            self._router_wait([server.url])
        server.serving = True

    def _router_call(self, verb: str, worker_url: str) -> None:
        admin = RouterAdmin(self._client.session, self.router_url)
        self._loop.run(getattr(admin, verb)(worker_url))

    def _router_wait(self, worker_urls: list[str]) -> None:
        """Until the router routes to ``worker_urls`` (:meth:`RouterAdmin.wait_listed`)."""
        admin = RouterAdmin(self._client.session, self.router_url)
        self._loop.run(admin.wait_listed(worker_urls, self.cfg.startup_timeout_s))
