"""An SGLang server stand-in for the one fault the real server cannot be made to show on cue: a
server that is alive but unhealthy (a wedge); everything else the project says to SGLang is said
to the real server in the sglang tier (``tests/sglang_tier``). Started exactly as the SGLang
backend starts its servers: ``python -m sglang_standin --model-path DIR --host H --port P ...`` (the
ServerArgs flags; ``rollout.sglang.server_module=sglang_standin`` with this folder on
``PYTHONPATH``).

It answers SGLang's native endpoints the run uses (``/health_generate``, ``/generate`` with
``input_ids`` / ``sampling_params`` / ``return_logprob``, ``/update_weights_from_disk``,
``/init_weights_update_group`` + ``/update_weights_from_distributed`` (gloo broadcasts from the
trainer rank) + ``/destroy_weights_update_group``, ``/release_memory_occupation``,
``/resume_memory_occupation``, ``/pause_generation``, ``/continue_generation``,
``/begin_weight_update`` / ``/end_weight_update`` (a streamed update outside them is refused, as
by SGLang 0.5.23), ``/abort_request``) with real
samples of the HF model in ``--model-path`` drawn by the embedded engine (``TorchEngine``), so
log-probs are exact and a run's engine-vs-trainer checks hold. One request = one sample,
seeded by ``sampling_params.sampling_seed``; ``--tp-size`` must be 1. Not covered by it: the
router, the CUDA-IPC tensor transport, early aborts (the loop does not use them) and SGLang's
own kernels (the gpu tier). ``--api-key`` is enforced like SGLang's.

``ARMOR_STANDIN_WEDGE_AT_VERSION=V`` (with ``ARMOR_STANDIN_MARK_DIR``): once its weights
reach version ``V``, the first process on a port answers ``/health_generate`` with 503 from
then on — a wedged server for the health-check test; the restarted process is healthy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import torch
import torch.distributed as dist
from aiohttp import web
from safetensors.torch import load_file

from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.rollout.sglang import weights as transport
from megatron_armor.rollout.torch_engine import TorchEngine


def api_key_middleware(api_key: str):
    """SGLang's ``--api-key`` check (``add_api_key_middleware`` in sglang.srt.utils): every
    path but ``/health*`` and ``/metrics`` needs ``Authorization: Bearer KEY``, else 401."""

    @web.middleware
    async def check(request: web.Request, handler):
        open_path = request.path.startswith(("/health", "/metrics"))
        if not open_path and request.headers.get("Authorization") != f"Bearer {api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


class StandInServer:
    def __init__(self, model_path: str, port: int, api_key: str = "") -> None:
        self.engine = TorchEngine(model_path)
        self.port = port
        self.api_key = api_key
        self.version = "0"
        self.lock = asyncio.Lock()  # one engine call at a time
        wedge = os.environ.get("ARMOR_STANDIN_WEDGE_AT_VERSION")
        mark_dir = os.environ.get("ARMOR_STANDIN_MARK_DIR")
        self.mark = Path(mark_dir) / f"wedged-{port}" if mark_dir and wedge else None
        self.wedge_at = int(wedge) if self.mark is not None and not self.mark.exists() else None
        self.wedged = False
        self.group = None  # the trainer's weight-sync group (distributed transport)
        self.in_session = False  # SGLang's weight-update session (begin/end_weight_update)

    def app(self) -> web.Application:
        middlewares = [api_key_middleware(self.api_key)] if self.api_key else []
        app = web.Application(client_max_size=1 << 30, middlewares=middlewares)
        app.router.add_get("/health_generate", self.health)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/update_weights_from_disk", self.update_from_disk)
        app.router.add_post("/init_weights_update_group", self.init_group)
        app.router.add_post("/update_weights_from_distributed", self.update_from_distributed)
        app.router.add_post("/destroy_weights_update_group", self.destroy_group)
        app.router.add_post("/begin_weight_update", self.begin_session)
        app.router.add_post("/end_weight_update", self.end_session)
        for endpoint in ("/release_memory_occupation", "/resume_memory_occupation",
                         "/pause_generation", "/continue_generation", "/abort_request",
                         "/flush_cache"):  # fmt: skip
            app.router.add_post(endpoint, self.ok)
        return app

    async def begin_session(self, request: web.Request) -> web.Response:
        if self.in_session:
            return web.json_response({"success": False, "message": "already open"}, status=400)
        self.in_session = True
        return web.json_response({"success": True, "message": ""})

    async def end_session(self, request: web.Request) -> web.Response:
        if not self.in_session:
            return web.json_response({"success": False, "message": "none open"}, status=400)
        self.in_session = False
        return web.json_response({"success": True, "message": ""})

    async def health(self, request: web.Request) -> web.Response:
        if self.wedged:
            return web.Response(status=503, text="wedged")
        return web.Response(text="ok")

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": ""})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        sp = body["sampling_params"]
        params = SamplingParams(
            temperature=sp.get("temperature", 1.0), top_p=sp.get("top_p", 1.0),
            top_k=sp.get("top_k", -1), max_new_tokens=sp["max_new_tokens"],
            stop_token_ids=set(sp.get("stop_token_ids", [])), seed=sp.get("sampling_seed"),
        )  # fmt: skip
        async with self.lock:  # the sample and its version come from the same weights
            loop = asyncio.get_running_loop()
            out = await loop.run_in_executor(
                None, lambda: self.engine.generate([body["input_ids"]], 1, params)[0][0]
            )
            version = self.version
        triples = [[lp, tok, None] for lp, tok in zip(out.logprobs, out.token_ids, strict=True)]
        meta = {"id": body.get("rid", ""), "finish_reason": {"type": out.finish_reason},
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(out.token_ids),
                "weight_version": version, "output_token_logprobs": triples}  # fmt: skip
        return web.json_response({"text": "", "output_ids": out.token_ids, "meta_info": meta})

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        tensors = {}  # every shard of the directory, as SGLang's loader reads it
        for file in sorted(Path(body["model_path"]).glob("*.safetensors")):
            tensors.update(load_file(file))
        return await self._load(list(tensors.items()), body)

    async def init_group(self, request: web.Request) -> web.Response:
        """Join the trainer's weight-sync group (gloo on CPU; rank ``rank_offset``)."""
        body = await request.json()

        def join():
            return transport.new_weight_sync_group(
                body["master_address"], body["master_port"], body["rank_offset"],
                body["world_size"], body["group_name"], body["backend"], timeout_s=120,
            )  # fmt: skip

        self.group = await asyncio.get_running_loop().run_in_executor(None, join)
        return web.json_response({"success": True, "message": ""})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        """Receive the bucket the trainer broadcasts (``names`` / ``dtypes`` / ``shapes``);
        outside a weight-update session refused as SGLang 0.5.23 refuses it."""
        body = await request.json()
        if not self.in_session:
            message = "must run between begin_weight_update() and end_weight_update()"
            return web.json_response({"success": False, "message": message}, status=400)

        def receive():
            out = []
            for name, dtype, shape in zip(
                body["names"], body["dtypes"], body["shapes"], strict=True
            ):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                dist.broadcast(tensor, src=0, group=self.group)
                out.append((name, tensor))
            return out

        tensors = await asyncio.get_running_loop().run_in_executor(None, receive)
        return await self._load(tensors, body)

    async def destroy_group(self, request: web.Request) -> web.Response:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        return web.json_response({"success": True, "message": ""})

    async def _load(self, tensors: list, body: dict) -> web.Response:
        async with self.lock:
            self.engine.update_weights(tensors, int(body.get("weight_version", 0)))
            self.version = str(body.get("weight_version", self.version))
        if self.wedge_at is not None and int(self.version) >= self.wedge_at:
            self.wedged = True
            self.mark.touch()
        return web.json_response({"success": True, "message": "", "num_paused_requests": 0})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--api-key", default="")
    args, _ = parser.parse_known_args()  # the other ServerArgs flags do not apply here
    if args.tp_size != 1:
        raise SystemExit(f"sglang_standin serves one process per server: --tp-size {args.tp_size}")
    torch.set_num_threads(1)
    server = StandInServer(args.model_path, args.port, args.api_key)
    web.run_app(server.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
