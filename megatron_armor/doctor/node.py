"""The node checks of ``armor doctor``: versions, GPUs, the pinned stack, a TE FP8 GEMM under
the configured recipe, CUDA IPC and NCCL between independent processes, one trainer step.

Multi-process checks run :mod:`megatron_armor.doctor.probes` as ``python -m`` subprocesses,
bounded by timeouts, each with its own free loopback port.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.doctor import pins
from megatron_armor.doctor.report import CheckFailed, NotApplicable
from megatron_armor.net import free_port

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("torch", "transformer-engine", "sglang", "sglang-router", "megatron-core", "ray")
NO_CUDA = "no CUDA device on this node (CPU machine)"


def run_probe(args: list[str], timeout_s: float, stdin: bytes | None = None) -> dict:
    """``python -m megatron_armor.doctor.probes ARGS``; its last stdout line as JSON."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    result = subprocess.run(
        [sys.executable, "-m", "megatron_armor.doctor.probes", *args], input=stdin,
        capture_output=True, timeout=timeout_s, env=env,
    )  # fmt: skip
    out = result.stdout.decode(errors="replace").strip().splitlines()
    if result.returncode != 0 or not out:
        tail = result.stderr.decode(errors="replace")[-1500:]
        raise RuntimeError(f"probe {args[0]} exited with {result.returncode}: {tail}")
    return json.loads(out[-1])


def versions() -> str:
    """Versions of the stack, CUDA and NCCL (never fails: absent packages are listed)."""
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} absent")
    cuda = torch.version.cuda or "none (CPU build)"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "n/a"
    return ", ".join(found) + f"; CUDA {cuda}; NCCL {nccl}"


def gpus() -> str:
    """Each GPU's name, compute capability and free / total memory."""
    if not torch.cuda.is_available():
        raise NotApplicable(NO_CUDA)
    rows = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        rows.append(
            f"{i}: {props.name} sm_{props.major}{props.minor} "
            f"{free / 2**30:.0f}/{total / 2**30:.0f} GiB free"
        )
    return "; ".join(rows)


def stack_pins() -> str:
    """The installed GPU stack is the pinned one (requirements-gpu.txt + requirements.txt)."""
    if not torch.cuda.is_available():
        raise NotApplicable(f"{NO_CUDA}: the CPU stack (requirements-cpu.txt) applies")
    wrong = pins.installed_mismatches(pins.read_pins())
    if wrong:
        raise CheckFailed(
            "; ".join(wrong),
            "pip install -r requirements-gpu.txt -r requirements.txt, or use docker/Dockerfile",
        )
    return "installed versions match the pins"


def te_fp8_gemm(config: ArmorConfig) -> str:
    """A TE ``Linear`` forward + backward under megatron-core's FP8 context for the configured
    ``trainer.fp8`` recipe, against the bf16 product: relative error under 10%."""
    if not torch.cuda.is_available():
        raise NotApplicable(NO_CUDA)
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        if config.trainer.fp8.enabled:
            raise CheckFailed(f"sm_{major}{minor} has no FP8", "set trainer.fp8.enabled=false")
        raise NotApplicable(f"sm_{major}{minor} has no FP8 (trainer.fp8 is off)")
    import transformer_engine.pytorch as te
    from megatron.core.fp8_utils import get_fp8_context
    from megatron.core.transformer import TransformerConfig

    from megatron_armor.trainer.model import fp8_settings

    fp8 = fp8_settings(dataclasses.replace(config.trainer.fp8, enabled=True))
    mcore = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=2, **fp8)
    torch.manual_seed(0)
    layer = te.Linear(256, 512, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with get_fp8_context(mcore):
        y = layer(x)
    y.float().square().mean().backward()
    ref = x.detach().float() @ layer.weight.detach().float().t()
    error = float((y.float() - ref).norm() / ref.norm())
    if not error < 0.1 or x.grad is None or not torch.isfinite(x.grad).all():
        raise CheckFailed(
            f"FP8 GEMM relative error {error:.3f}", "check the TE build (docs/gpu.md)"
        )
    return f"recipe {config.trainer.fp8.recipe}/{config.trainer.fp8.format}: rel. error {error:.4f}"


def cuda_ipc() -> str:
    """CUDA tensors pickled here (IPC handles) and read in an independent process."""
    if not torch.cuda.is_available():
        raise NotApplicable(NO_CUDA)
    from multiprocessing.reduction import ForkingPickler

    tensors = [torch.arange(1 << 20, device="cuda", dtype=torch.float32)]
    payload = bytes(ForkingPickler.dumps(tensors))
    got = run_probe(["ipc-receive"], timeout_s=120, stdin=payload)
    want = [float(t.sum()) for t in tensors]
    if got["sums"] != want:
        raise CheckFailed(
            f"the receiver read {got['sums']} instead of {want}",
            "CUDA IPC needs both processes in one container / IPC namespace (docker --ipc=host)",
        )
    return f"4 MiB read back on {got['devices'][0]} by another process"


def nccl_all_reduce() -> str:
    """An NCCL all-reduce over every GPU of the node, one process per GPU."""
    if not torch.cuda.is_available():
        raise NotApplicable(NO_CUDA)
    world, port = torch.cuda.device_count(), free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron_armor.doctor.probes",
                "nccl-rank",
                str(r),
                str(world),
                str(port),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )  # fmt: skip
        for r in range(world)
    ]
    results = [_finish(p, timeout_s=180) for p in procs]
    bad = [r for r in results if r["value"] != r["expected"]]
    if bad:
        raise CheckFailed(f"all-reduce gave {bad[0]['value']}, expected {bad[0]['expected']}",
                          "run with NCCL_DEBUG=INFO and check the GPU topology (nvidia-smi topo -m)")  # fmt: skip
    return f"{world} GPU(s), 256 MiB all-reduce, bus bandwidth {results[0]['bus_gbps']:.0f} GB/s"


def _finish(proc: subprocess.Popen, timeout_s: float) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"NCCL rank exited with {proc.returncode}: {err.decode()[-1500:]}")
    return json.loads(out.decode().strip().splitlines()[-1])


def trainer_settings(config: ArmorConfig) -> dict:
    """The configured precision / layer spec / FP8 on a GPU; ``local`` fp32 on CPU."""
    t = config.trainer
    if not torch.cuda.is_available():
        return {"transformer_impl": "local", "precision": "fp32", "micro_batch_tokens": 256}
    return {"transformer_impl": t.transformer_impl, "precision": t.precision,
            "fp8": dataclasses.asdict(t.fp8), "micro_batch_tokens": 256}  # fmt: skip


def trainer_step(config: ArmorConfig) -> str:
    """One ARMOR update of a tiny megatron-core model (gloo on CPU)."""
    from megatron_armor.doctor import probes

    with tempfile.TemporaryDirectory(prefix="armor-doctor-") as tmp:
        model_dir = probes.build_tiny_model(str(Path(tmp) / "model"))
        samples = [[[3, 4, 5], [6 + i, 7, 8 + i, 1]] for i in range(8)]
        spec = {"model_dir": model_dir, "port": free_port(), "samples": samples,
                "trainer": trainer_settings(config), "temperature": 1.0}  # fmt: skip
        result = run_probe(["trainer", json.dumps(spec)], timeout_s=300)
    if not result["metrics_finite"]:
        raise CheckFailed(f"non-finite metrics {result['metrics']}",
                          "check trainer.precision / trainer.fp8 with a known-good model")  # fmt: skip
    settings, metrics = trainer_settings(config), result["metrics"]
    return (
        f"{settings['transformer_impl']} {settings['precision']}, one update of 2 groups: "
        f"grad norm {metrics['loss/grad_norm']:.4f}, {metrics['count/tokens']:.0f} tokens"
    )
