"""Unit tier: the per-run SGLang API key — on the server and router command lines, sent by
the client as ``Authorization: Bearer KEY``, never printed; a server started with a key
refuses requests without it (the stand-in enforces it like SGLang's middleware)."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import pytest
from aiohttp import web

from megatron_armor.config.schema import SGLangConfig
from megatron_armor.rollout.sglang import launch
from megatron_armor.rollout.sglang.client import ClientSettings, SGLangClient, SGLangError
from megatron_armor.rollout.sglang.engine import SGLangEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from sglang_standin import api_key_middleware  # noqa: E402

pytestmark = pytest.mark.unit


def test_key_on_the_command_lines_and_hidden_from_repr():
    args = launch.server_args_for("/m", 30000, api_key="s3cret")
    cli = launch.args_to_cli(args)
    assert cli[cli.index("--api-key") + 1] == "s3cret"
    assert "api_key" not in launch.server_args_for("/m", 30000)
    router = launch.build_router_command(["http://127.0.0.1:1"], 2, api_key="s3cret")
    assert router[-2:] == ["--api-key", "s3cret"]
    assert "s3cret" not in repr(ClientSettings(api_key="s3cret"))


def test_each_engine_that_launches_servers_gets_its_own_key():
    first, second = SGLangEngine("/m", SGLangConfig()), SGLangEngine("/m", SGLangConfig())
    external = SGLangEngine("/m", SGLangConfig(), urls=["http://127.0.0.1:1"])
    try:
        assert len(first._api_key) >= 32 and first._api_key != second._api_key
        assert external._api_key == ""  # servers someone else started: their own settings
    finally:
        for engine in (first, second, external):
            engine.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _serve_and_call(key: str, client_key: str) -> tuple[bool, str]:
    async def ok(request):
        return web.json_response({"success": True, "message": ""})

    app = web.Application(middlewares=[api_key_middleware(key)])
    app.router.add_post("/flush_cache", ok)
    app.router.add_get("/health_generate", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with SGLangClient(ClientSettings(api_key=client_key)) as client:
            healthy = await client.healthy(url)
            try:
                await client.post(url, "/flush_cache")
                return healthy, "ok"
            except SGLangError as e:
                return healthy, str(e)
    finally:
        await runner.cleanup()


def test_server_refuses_requests_without_the_key():
    assert asyncio.run(_serve_and_call("k1", "k1")) == (True, "ok")
    healthy, error = asyncio.run(_serve_and_call("k1", ""))
    assert healthy and "HTTP 401" in error  # health stays open, like SGLang
