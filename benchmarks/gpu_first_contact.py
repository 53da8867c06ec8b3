"""The first ten minutes on a GPU node: does this node run the recipe's GPU paths?

Needs torch with CUDA, this project and the megatron-core wheel; Transformer Engine, SGLang and
Ray are used where installed (each check says what it used). In order, stopping at the first
broken check (exit 1, the report names it):

1. ``embedded_engine``: the embedded engine (``rollout/torch_engine.py``) on CUDA, bf16, a
   random ~1B Qwen2: 32 prompts of 64 tokens, 256 new tokens each; tokens/s.
2. ``trainer_step``: the megatron-core trainer (``MegatronTrainer``, TE spec when TE imports,
   else the local spec), bf16, the same model, one 8,192-token micro-batch of ARMOR groups:
   log-probs, then timed updates; seconds per update, TFLOP/s and MFU (``planner.flops``,
   ``observability.throughput.peak_tflops``).
3. ``colocated_handoff``: the trainer hands its memory over (``hand_over_memory``: its cached
   blocks back to CUDA), then another process takes the memory the plan gives a colocated
   engine on this GPU (``planner.memory``: the recipe's ``rollout.sglang.mem_fraction_static``
   of it, configs/base.yaml).
4. ``cuda_ipc_bucket``: a 256 MiB bf16 bucket handed to another process through a CUDA IPC
   handle (torch's reductions, as the ``tensor`` weight transport does) and summed there.
5. ``throughput_report``: the tiny config trained for 4 steps on this GPU and its
   ``armor report`` (``benchmarks/throughput_run.py``): a dated tokens/s/GPU and the page.
6. ``gpu_tests``: ``pytest -m gpu`` over tests/unit, tests/dist and tests/gpu (each test skips
   what the installed packages lack), in the time left.

One JSON report (``--out``, default ``runs/gpu_first_contact.json``), at most ``--budget-s``
seconds (480). Without a GPU it says so and exits 0. ``scripts/gpu_first_contact.sh`` runs it;
docs/gpu.md, "First contact".
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GiB = 1024**3
# ~1.0 B parameters: 20 layers of hidden 2048 (GQA 16/4 heads), SwiGLU 5504, vocab 32000 untied
MODEL = dict(hidden_size=2048, num_hidden_layers=20, num_attention_heads=16,
             num_key_value_heads=4, intermediate_size=5504, vocab_size=32000)  # fmt: skip
MICRO_BATCH_TOKENS = 8192
GROUPS, GROUP_SIZE, SEQ_LEN = 4, 4, 512  # 16 sequences x 512 = one 8k micro-batch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/gpu_first_contact.json", help="the JSON report")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock bound (seconds)")
    return p.parse_args(argv)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def release_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def node_facts() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
            "memory_gib": round(props.total_memory / GiB, 1), "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "installed": {m: installed(m) for m in ("transformer_engine", "sglang", "ray",
                                                    "fused_weight_gradient_mlp_cuda")}}  # fmt: skip


# --- the model and the batch ------------------------------------------------------------------


def write_random_qwen2(path: str) -> str:
    """A random ~1B Qwen2 in bf16 safetensors (initialised on the GPU: seconds, not minutes)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**MODEL, max_position_embeddings=16384, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    release_cuda()
    return path


def armor_batch(vocab: int):
    """``GROUPS`` groups of ``GROUP_SIZE`` samples (the last an anchor), ``SEQ_LEN`` tokens
    each: one ``MICRO_BATCH_TOKENS`` micro-batch, packed as the loop packs it."""
    from megatron_armor.types import Group, Sample, SampleSource, pack_groups

    rng, groups = random.Random(0), []
    for g in range(GROUPS):
        samples = []
        for i in range(GROUP_SIZE):
            prompt = [rng.randrange(vocab) for _ in range(64)]
            response = [rng.randrange(vocab) for _ in range(SEQ_LEN - 64)]
            source = SampleSource.REFERENCE if i == GROUP_SIZE - 1 else SampleSource.POLICY
            samples.append(Sample(f"q{g}", prompt, response, source=source))
        advantages = [1.0, -1.0, 0.5, -0.5][:GROUP_SIZE]
        groups.append(Group(f"q{g}", samples, GROUP_SIZE - 1, advantages))
    return pack_groups(groups)


# --- the checks -------------------------------------------------------------------------------


def check_embedded_engine(state: dict) -> dict:
    from megatron_armor.rollout.protocol import SamplingParams
    from megatron_armor.rollout.torch_engine import TorchEngine

    engine = TorchEngine(state["model_dir"], device="cuda", dtype=torch.bfloat16, max_batch=32)
    rng = random.Random(1)
    prompts = [[rng.randrange(MODEL["vocab_size"]) for _ in range(64)] for _ in range(32)]
    engine.generate(prompts[:2], 1, SamplingParams(max_new_tokens=8, seed=0))  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, 1, SamplingParams(max_new_tokens=256, seed=0))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for group in outputs for o in group)
    engine.close()
    del engine
    release_cuda()
    return {"sequences": len(prompts), "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip


def trainer_config(model_dir: str):
    from megatron_armor.config.schema import ArmorConfig

    config = ArmorConfig()
    t = config.trainer
    t.model_path, t.precision, t.lr = model_dir, "bf16", 1e-6
    t.transformer_impl = "te" if installed("transformer_engine") else "local"
    t.micro_batch_tokens = MICRO_BATCH_TOKENS
    config.algo.group_size = GROUP_SIZE
    config.algo.alpha = (GROUP_SIZE - 1) / GROUP_SIZE  # as load resolves 'auto'
    return config


def check_trainer_step(state: dict) -> dict:
    from megatron_armor.observability.throughput import mfu, peak_tflops
    from megatron_armor.planner.flops import training_flops
    from megatron_armor.planner.model import load_model_dims
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    config = trainer_config(state["model_dir"])
    trainer = MegatronTrainer(config, 0, 1, "127.0.0.1", free_port())
    state["trainer"] = trainer
    batch = armor_batch(MODEL["vocab_size"])
    logprobs = trainer.compute_logprobs(batch)
    batch.old_logprobs, batch.ref_logprobs = logprobs.clone(), logprobs.clone()
    trainer.train_step(batch, 1)  # warm-up: kernels, optimizer state
    torch.cuda.synchronize()
    updates, start = 3, time.perf_counter()
    for _ in range(updates):
        metrics = trainer.train_step(batch, 1)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / updates
    if not all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values()):
        raise RuntimeError(f"non-finite update metrics: {metrics}")
    flops = training_flops(load_model_dims(state["model_dir"]), batch.seq_lengths())
    peak = peak_tflops(torch.cuda.get_device_name(0), "bf16")
    out = {"spec": config.trainer.transformer_impl, "tokens": batch.num_tokens,
           "seconds_per_update": round(seconds, 4),
           "tflops_per_gpu": round(flops / seconds / 1e12, 1),
           "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GiB, 2),
           "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GiB, 2)}  # fmt: skip
    out["mfu"] = round(mfu(flops, seconds, 1, peak), 3) if peak else None
    return out


def engine_share_bytes(model_dir: str) -> float:
    """What the memory plan gives a colocated SGLang engine on this GPU: the recipe's
    ``rollout.sglang.mem_fraction_static`` (configs/base.yaml) of it (``planner.memory``)."""
    from megatron_armor.config import load_config
    from megatron_armor.planner.memory import EngineShape
    from megatron_armor.planner.model import load_model_dims

    share = load_config(REPO / "configs" / "base.yaml").rollout.sglang.mem_fraction_static
    total = torch.cuda.get_device_properties(0).total_memory
    return EngineShape(load_model_dims(model_dir), 1, share, total).static_bytes()


def take_memory(queue, num_bytes: int) -> None:
    """Another process on the GPU: allocate and touch ``num_bytes``; report what it got."""
    try:
        block = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
        block.fill_(1)
        torch.cuda.synchronize()
        queue.put({"ok": True, "gib": round(block.numel() / GiB, 2)})
    except Exception as err:  # reported to the parent, which names the check
        queue.put({"ok": False, "error": f"{type(err).__name__}: {err}"})


def check_colocated_handoff(state: dict) -> dict:
    import torch.multiprocessing as mp

    trainer = state["trainer"]
    before = torch.cuda.memory_reserved()
    trainer.hand_over_memory()
    after, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    if after - allocated > 2 * GiB:
        raise RuntimeError(f"hand_over_memory left {(after - allocated) / GiB:.1f} GiB cached")
    share = engine_share_bytes(state["model_dir"])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=take_memory, args=(queue, int(share)))
    child.start()
    got = queue.get(timeout=120)
    child.join(timeout=60)
    if not got["ok"]:
        raise RuntimeError(f"the engine's share ({share / GiB:.1f} GiB) after the hand-off: "
                           f"{got['error']}")  # fmt: skip
    return {"reserved_before_gib": round(before / GiB, 2), "reserved_after_gib": round(after / GiB, 2),
            "trainer_allocated_gib": round(allocated / GiB, 2), "engine_share_gib": got["gib"]}  # fmt: skip


def receive_bucket(queue_in, queue_out) -> None:
    """The receiving process: open the bucket by its IPC handle and sum it on the GPU."""
    bucket = queue_in.get(timeout=120)
    queue_out.put(float(bucket.float().sum()))
    del bucket


def check_cuda_ipc_bucket(state: dict) -> dict:
    import torch.multiprocessing as mp

    trainer = state.pop("trainer", None)
    if trainer is not None:  # the trainer's part is done: its memory back for what follows
        trainer.close()
        del trainer
        release_cuda()
    bucket = torch.randn(128 * 1024**2, dtype=torch.bfloat16, device="cuda")  # 256 MiB
    expected = float(bucket.float().sum())
    ctx = mp.get_context("spawn")
    to_child, from_child = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=receive_bucket, args=(to_child, from_child))
    child.start()
    start = time.perf_counter()
    to_child.put(bucket)
    got = from_child.get(timeout=120)
    seconds = time.perf_counter() - start
    child.join(timeout=60)
    if abs(got - expected) > 1e-3 * max(1.0, abs(expected)):
        raise RuntimeError(f"the other process summed {got}, this one {expected}")
    return {"mib": bucket.numel() * 2 // 1024**2, "seconds": round(seconds, 3)}


def check_gpu_tests(state: dict) -> dict:
    left = state["deadline"] - time.monotonic() - 10
    if left < 30:
        return {"skipped": f"{left:.0f} s left of the budget"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/unit", "tests/dist", "tests/gpu",
           "-q", "-x", "-p", "no:cacheprovider"]  # fmt: skip
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"pytest -m gpu did not finish in the {left:.0f} s left") from None
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"pytest -m gpu exit {done.returncode}: {done.stdout[-3000:]}")
    return {"summary": summary}


def check_throughput_report(state: dict) -> dict:
    """The tiny config trained for 4 steps on this GPU and its ``armor report``
    (``benchmarks/throughput_run.py``): the node's first dated end-to-end tokens/s/GPU in
    NeMo-RL's definition, and where each step's time went."""
    from throughput_run import train_and_report

    left = state["deadline"] - time.monotonic() - 30  # the gpu tests' turn after it
    if left < 120:
        return {"skipped": f"{left:.0f} s left of the budget"}
    return train_and_report(REPO / "runs" / "gpu_first_contact_run", 4, True, left)


CHECKS = [
    ("embedded_engine", check_embedded_engine),
    ("trainer_step", check_trainer_step),
    ("colocated_handoff", check_colocated_handoff),
    ("cuda_ipc_bucket", check_cuda_ipc_bucket),
    ("throughput_report", check_throughput_report),
    ("gpu_tests", check_gpu_tests),
]


# --- the report -------------------------------------------------------------------------------


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def run_checks(report: dict, budget_s: float) -> int:
    """Every check in order; the first broken one ends the run (exit 1) and is named."""
    state = {"deadline": time.monotonic() + budget_s}
    with tempfile.TemporaryDirectory(prefix="armor-first-contact-") as tmp:
        state["model_dir"] = write_random_qwen2(os.path.join(tmp, "qwen2-1b"))
        for name, check in CHECKS:
            if time.monotonic() > state["deadline"]:
                report["checks"][name] = {"ok": False, "error": f"over the {budget_s:.0f} s budget"}
                report["first_broken"] = name
                return 1
            start = time.perf_counter()
            try:
                result = check(state)
            except Exception as err:
                report["checks"][name] = {"ok": False, "error": f"{type(err).__name__}: {err}",
                                          "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
                report["first_broken"] = name
                return 1
            report["checks"][name] = {
                "ok": True,
                "seconds": round(time.perf_counter() - start, 1),
                **result,
            }
            print(f"first contact: {name}: ok {json.dumps(result)}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    report: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "checks": {}}
    if not torch.cuda.is_available():
        report.update(
            gpu=False, message="no GPU (torch.cuda.is_available() is False): nothing to check"
        )
        write_report(out, report)
        print(f"first contact: {report['message']}; report {out}")
        return 0
    report.update(gpu=True, node=node_facts())
    code = run_checks(report, args.budget_s)
    write_report(out, report)
    if code:
        name = report["first_broken"]
        print(f"first contact: BROKEN: {name}: {report['checks'][name]['error']} (report {out})")
    else:
        print(f"first contact: every check passed (report {out})")
    return code


if __name__ == "__main__":
    sys.exit(main())
