"""The first minutes on a GPU node: does this node run the recipe's GPU paths?

Needs torch with CUDA, this project and the megatron-core wheel; Transformer Engine, SGLang and
Ray are used where installed (each check says what it used). In order, stopping at the first
broken check (exit 1, the report names it), each within its own budget on an H100
(:data:`CHECKS`, summed: :data:`H100_BUDGET_S`, which leaves a rerun in a 15-minute lease):

1. ``random_model``: a random ~1B Qwen2 written in bf16 (initialised on the GPU).
2. ``embedded_engine``: the embedded engine (``rollout/torch_engine.py``) on CUDA, bf16:
   32 prompts of 64 tokens, 256 new tokens each; tokens/s.
3. ``trainer_step``: the megatron-core trainer (``MegatronTrainer``, TE spec when TE imports,
   else the local spec), bf16, the same model, one 8,192-token micro-batch of ARMOR groups:
   log-probs, then timed updates; seconds per update, TFLOP/s and MFU (``planner.flops``,
   ``observability.throughput.peak_tflops``).
4. ``colocated_handoff``: the trainer hands its memory over (``hand_over_memory``: its cached
   blocks back to CUDA), then another process takes the memory the plan gives a colocated
   engine on this GPU (``planner.memory``: the recipe's ``rollout.sglang.mem_fraction_static``
   of it, configs/base.yaml).
5. ``cuda_ipc_bucket``: a 256 MiB bf16 bucket handed to another process through a CUDA IPC
   handle (torch's reductions, as the ``tensor`` weight transport does) and summed there.
6. ``throughput_report``: the tiny config trained on this GPU for 4 steps (1 step rehearsing)
   and its ``armor report`` (``benchmarks/throughput_run.py``): a dated tokens/s/GPU in
   NeMo-RL's definition and the page.
7. ``gpu_tests``: the ``gpu`` tests that show what only a GPU can (:data:`GPU_TESTS`: CUDA
   IPC into a real SGLang server, the memory saver's release and resume around a push, bf16
   kernels against transformers, TE and FP8, packed ``thd``, grouped-GEMM experts, routed
   experts), in one pytest run.

``--rehearse`` runs the same checks in the same order on CPU (``CUDA_VISIBLE_DEVICES`` empty):
a tiny model, fp32, the local spec on gloo, a notional 1 GiB device for the hand-off, the
bucket through shared memory, and the ``gpu`` tests collected by the same pytest command (they
run on CPU in their own tiers of the same CI run); each check within its CPU deadline.
Neither mode uses the network or downloads anything.

One JSON report (``--out``, default ``runs/gpu_first_contact.json``), rewritten before and
after every check: a kill leaves what had finished. A check past its deadline ends the run
(exit 1) with the report naming it and a traceback of every thread on stderr. Without a GPU
(and without ``--rehearse``) it says so and exits 0. ``scripts/gpu_first_contact.sh`` runs it;
docs/gpu.md, "First contact".
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GiB = 1024**3


@dataclass(frozen=True)
class Sizes:
    """What the checks run at: on a GPU, sized to measure; in the rehearsal, to finish fast."""

    model: dict
    prompts: int
    new_tokens: int
    groups: int
    group_size: int
    seq_len: int
    bucket_mib: int
    notional_device_gib: float  # the rehearsal's stand-in for the GPU's memory (0: the GPU's)

    @property
    def micro_batch_tokens(self) -> int:
        return self.groups * self.group_size * self.seq_len


GPU = Sizes(
    # ~1.0 B parameters: 20 layers of hidden 2048 (GQA 16/4 heads), SwiGLU 5504, vocab 32000
    model=dict(hidden_size=2048, num_hidden_layers=20, num_attention_heads=16,
               num_key_value_heads=4, intermediate_size=5504, vocab_size=32000),
    prompts=32, new_tokens=256, groups=4, group_size=4, seq_len=512,  # one 8k micro-batch
    bucket_mib=256, notional_device_gib=0,
)  # fmt: skip
CPU = Sizes(
    model=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, vocab_size=512),
    prompts=4, new_tokens=16, groups=2, group_size=4, seq_len=32,
    bucket_mib=8, notional_device_gib=0.25,
)  # fmt: skip

GPU_TESTS = {
    "tests/gpu/test_weight_sync_gpu.py": "CUDA-IPC buckets into a real SGLang server, the "
    "memory saver's release / resume around a push at the same version, the push's buffers "
    "back with CUDA, bf16 kernels against transformers (one server, one trainer)",
    "tests/dist/test_trainer_gpu.py::test_the_trainer_matches_hf_and_round_trips": "the "
    "Transformer Engine layer spec: logits and export",
    "tests/dist/test_trainer_gpu.py::test_two_updates_give_finite_metrics_fp8_on_a_gpu": "FP8 "
    "updates (hybrid, delayed scaling)",
    "tests/dist/test_trainer_gpu.py::test_the_trainers_logprobs_equal_the_padded_layout": "packed "
    "thd micro-batches (TE attention)",
    "tests/dist/test_trainer_gpu.py::test_moe_matches_hf_and_trains": "grouped-GEMM experts (TE)",
    "tests/gpu/test_sglang_moe_gpu.py": "routed experts returned by SGLang (cudaHostRegister)",
}
"""The ``gpu`` tests the first contact runs, each with what only a GPU shows in it."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/gpu_first_contact.json", help="the JSON report")
    p.add_argument("--rehearse", action="store_true",
                   help="the same checks on CPU, each within its CPU deadline")  # fmt: skip
    return p.parse_args(argv)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def node_facts(device: torch.device) -> dict:
    facts = {"device": "cpu", "torch": torch.__version__, "cuda": torch.version.cuda,
             "installed": {m: installed(m) for m in ("transformer_engine", "sglang", "ray",
                                                     "fused_weight_gradient_mlp_cuda")}}  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        facts.update(device=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                     memory_gib=round(props.total_memory / GiB, 1))  # fmt: skip
    return facts


# --- the model and the batch ------------------------------------------------------------------


def armor_batch(sizes: Sizes):
    """``groups`` groups of ``group_size`` samples (the last an anchor), ``seq_len`` tokens
    each: one micro-batch, packed as the loop packs it."""
    from megatron_armor.types import Group, Sample, SampleSource, pack_groups

    rng, groups, vocab = random.Random(0), [], sizes.model["vocab_size"]
    prompt_len = sizes.seq_len // 8
    for g in range(sizes.groups):
        samples = []
        for i in range(sizes.group_size):
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            response = [rng.randrange(vocab) for _ in range(sizes.seq_len - prompt_len)]
            source = SampleSource.REFERENCE if i == sizes.group_size - 1 else SampleSource.POLICY
            samples.append(Sample(f"q{g}", prompt, response, source=source))
        advantages = [1.0, -1.0, 0.5, -0.5][: sizes.group_size]
        groups.append(Group(f"q{g}", samples, sizes.group_size - 1, advantages))
    return pack_groups(groups)


# --- the checks -------------------------------------------------------------------------------


def check_random_model(state: dict) -> dict:
    """A random Qwen2 of ``sizes.model`` in bf16 safetensors (initialised on the device)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sizes, device = state["sizes"], state["device"]
    config = Qwen2Config(**sizes.model, max_position_embeddings=16384, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    state["model_dir"] = os.path.join(state["tmp"], "qwen2")
    model.save_pretrained(state["model_dir"])
    params = sum(p.numel() for p in model.parameters())
    del model
    release_memory(device)
    return {"parameters": params}


def check_embedded_engine(state: dict) -> dict:
    from megatron_armor.rollout.protocol import SamplingParams
    from megatron_armor.rollout.torch_engine import TorchEngine

    sizes, device = state["sizes"], state["device"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine = TorchEngine(state["model_dir"], device=device.type, dtype=dtype, max_batch=32)
    rng, vocab = random.Random(1), sizes.model["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(64)] for _ in range(sizes.prompts)]
    engine.generate(prompts[:2], 1, SamplingParams(max_new_tokens=8, seed=0))  # warm-up
    synchronize(device)
    start = time.perf_counter()
    outputs = engine.generate(prompts, 1, SamplingParams(max_new_tokens=sizes.new_tokens, seed=0))
    synchronize(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for group in outputs for o in group)
    engine.close()
    del engine
    release_memory(device)
    return {"sequences": len(prompts), "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def trainer_config(model_dir: str, sizes: Sizes, device: torch.device):
    from megatron_armor.config.schema import ArmorConfig

    config = ArmorConfig()
    t = config.trainer
    t.model_path, t.lr = model_dir, 1e-6
    t.precision = "bf16" if device.type == "cuda" else "fp32"
    t.transformer_impl = (
        "te" if device.type == "cuda" and installed("transformer_engine") else "local"
    )
    t.micro_batch_tokens = sizes.micro_batch_tokens
    config.algo.group_size = sizes.group_size
    config.algo.alpha = (sizes.group_size - 1) / sizes.group_size  # as load resolves 'auto'
    return config


def check_trainer_step(state: dict) -> dict:
    from megatron_armor.observability.throughput import mfu, peak_tflops
    from megatron_armor.planner.flops import training_flops
    from megatron_armor.planner.model import load_model_dims
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    sizes, device = state["sizes"], state["device"]
    config = trainer_config(state["model_dir"], sizes, device)
    trainer = MegatronTrainer(config, 0, 1, "127.0.0.1", free_port())
    state["trainer"] = trainer
    batch = armor_batch(sizes)
    logprobs = trainer.compute_logprobs(batch)
    batch.old_logprobs, batch.ref_logprobs = logprobs.clone(), logprobs.clone()
    trainer.train_step(batch, 1)  # warm-up: kernels, optimizer state
    synchronize(device)
    updates, start = 3, time.perf_counter()
    for _ in range(updates):
        metrics = trainer.train_step(batch, 1)
    synchronize(device)
    seconds = (time.perf_counter() - start) / updates
    if not all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values()):
        raise RuntimeError(f"non-finite update metrics: {metrics}")
    flops = training_flops(load_model_dims(state["model_dir"]), batch.seq_lengths())
    out = {"spec": config.trainer.transformer_impl, "precision": config.trainer.precision,
           "tokens": batch.num_tokens, "seconds_per_update": round(seconds, 4),
           "tflops_per_gpu": round(flops / seconds / 1e12, 3)}  # fmt: skip
    if device.type == "cuda":
        peak = peak_tflops(torch.cuda.get_device_name(0), "bf16")
        out.update(peak_allocated_gib=round(torch.cuda.max_memory_allocated() / GiB, 2),
                   peak_reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 2),
                   mfu=round(mfu(flops, seconds, 1, peak), 3) if peak else None)  # fmt: skip
    return out


def engine_share_bytes(model_dir: str, sizes: Sizes, device: torch.device) -> float:
    """What the memory plan gives a colocated SGLang engine on this GPU (the rehearsal: on a
    notional device of ``sizes.notional_device_gib``): the recipe's
    ``rollout.sglang.mem_fraction_static`` (configs/base.yaml) of it (``planner.memory``)."""
    from megatron_armor.config import load_config
    from megatron_armor.planner.memory import EngineShape
    from megatron_armor.planner.model import load_model_dims

    share = load_config(REPO / "configs" / "base.yaml").rollout.sglang.mem_fraction_static
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
    else:
        total = sizes.notional_device_gib * GiB
    return EngineShape(load_model_dims(model_dir), 1, share, total).static_bytes()


def take_memory(queue, num_bytes: int, device: str) -> None:
    """Another process on the device: allocate and touch ``num_bytes``; report what it got."""
    try:
        block = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        block.fill_(1)
        if device == "cuda":
            torch.cuda.synchronize()
        queue.put({"ok": True, "gib": round(block.numel() / GiB, 2)})
    except Exception as err:  # reported to the parent, which names the check
        queue.put({"ok": False, "error": f"{type(err).__name__}: {err}"})


def check_colocated_handoff(state: dict) -> dict:
    import torch.multiprocessing as mp

    sizes, device, trainer = state["sizes"], state["device"], state["trainer"]
    on_gpu = device.type == "cuda"
    before = torch.cuda.memory_reserved() if on_gpu else 0
    trainer.hand_over_memory()
    out: dict = {}
    if on_gpu:
        after, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        if after - allocated > 2 * GiB:
            raise RuntimeError(f"hand_over_memory left {(after - allocated) / GiB:.1f} GiB cached")
        out = {"reserved_before_gib": round(before / GiB, 2),
               "reserved_after_gib": round(after / GiB, 2),
               "trainer_allocated_gib": round(allocated / GiB, 2)}  # fmt: skip
    share = engine_share_bytes(state["model_dir"], sizes, device)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=take_memory, args=(queue, int(share), device.type))
    child.start()
    state["children"].append(child)
    got = queue.get(timeout=120)
    child.join(timeout=60)
    if not got["ok"]:
        raise RuntimeError(f"the engine's share ({share / GiB:.1f} GiB) after the hand-off: "
                           f"{got['error']}")  # fmt: skip
    return {**out, "engine_share_gib": got["gib"]}


def receive_bucket(queue_in, queue_out) -> None:
    """The receiving process: open the bucket (a CUDA IPC handle; on CPU shared memory) and
    sum it on its device."""
    bucket = queue_in.get(timeout=120)
    queue_out.put(float(bucket.float().sum()))
    del bucket


def check_cuda_ipc_bucket(state: dict) -> dict:
    import torch.multiprocessing as mp

    sizes, device = state["sizes"], state["device"]
    trainer = state.pop("trainer", None)
    if trainer is not None:  # the trainer's part is done: its memory back for what follows
        trainer.close()
        del trainer
        release_memory(device)
    bucket = torch.randn(sizes.bucket_mib << 19, dtype=torch.bfloat16, device=device)
    expected = float(bucket.float().sum())
    ctx = mp.get_context("spawn")
    to_child, from_child = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=receive_bucket, args=(to_child, from_child))
    child.start()
    state["children"].append(child)
    start = time.perf_counter()
    to_child.put(bucket)
    got = from_child.get(timeout=120)
    seconds = time.perf_counter() - start
    child.join(timeout=60)
    if abs(got - expected) > 1e-3 * max(1.0, abs(expected)):
        raise RuntimeError(f"the other process summed {got}, this one {expected}")
    return {"mib": bucket.numel() * 2 // 1024**2, "seconds": round(seconds, 3)}


def gpu_tests_command(collect_only: bool) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GPU_TESTS]
    return [*cmd, "--collect-only"] if collect_only else cmd


def check_gpu_tests(state: dict) -> dict:
    """:data:`GPU_TESTS` in one pytest run (the rehearsal: collected by the same command, every
    one found and none deselected)."""
    rehearse = state["device"].type == "cpu"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    left = state["check_deadline"] - time.monotonic() - 5
    proc = subprocess.Popen(gpu_tests_command(rehearse), cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    state["children"].append(proc)
    try:
        output, _ = proc.communicate(timeout=max(left, 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(
            f"pytest did not finish in the {left:.0f} s left of its budget"
        ) from None
    summary = (output.strip().splitlines() or [""])[-1]
    if proc.returncode != 0:
        raise RuntimeError(f"pytest exit {proc.returncode}: {output[-3000:]}")
    if not rehearse:
        return {"summary": summary}
    collected = [line for line in output.splitlines() if "::" in line]
    missing = [t for t in GPU_TESTS if not any(line.startswith(t) for line in collected)]
    if missing or "deselected" in summary:
        raise RuntimeError(f"not collected here: {missing or summary}")
    return {"summary": summary, "collected": len(collected)}


@dataclass(frozen=True)
class FirstCheck:
    """One check, with its budget on an H100 and its deadline in the rehearsal on CPU."""

    name: str
    run: Callable[[dict], dict]
    h100_budget_s: float
    cpu_deadline_s: float


def check_throughput_report(state: dict) -> dict:
    """The tiny config trained on this GPU (4 steps; rehearsing, 1 step on CPU with smaller
    batches) and its ``armor report`` (``benchmarks/throughput_run.py``): the node's first
    dated end-to-end tokens/s/GPU in NeMo-RL's definition, and where each step's time went."""
    from throughput_run import REHEARSAL, train_and_report

    gpu = state["device"].type == "cuda"
    left = state["check_deadline"] - time.monotonic() - 5
    out = state["run_out"]  # beside the report: the page outlives the check
    return train_and_report(out, 4 if gpu else 1, gpu, left, () if gpu else REHEARSAL)


CHECKS = [
    FirstCheck("random_model", check_random_model, 20, 120),
    FirstCheck("embedded_engine", check_embedded_engine, 45, 120),
    FirstCheck("trainer_step", check_trainer_step, 90, 300),
    FirstCheck("colocated_handoff", check_colocated_handoff, 30, 120),
    FirstCheck("cuda_ipc_bucket", check_cuda_ipc_bucket, 20, 120),
    FirstCheck("throughput_report", check_throughput_report, 45, 240),
    FirstCheck("gpu_tests", check_gpu_tests, 225, 240),
]
H100_BUDGET_S = sum(c.h100_budget_s for c in CHECKS)
"""475 s: under 8 minutes, a rerun fits a 15-minute lease."""


# --- the report and the deadlines -------------------------------------------------------------


class Report:
    """The JSON report, rewritten whenever it changes (a kill leaves what had finished)."""

    def __init__(self, path: Path, body: dict) -> None:
        self.path, self.body = path, body
        self.lock = threading.Lock()

    def write(self) -> None:
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            staging = self.path.with_name(self.path.name + ".tmp")
            staging.write_text(json.dumps(self.body, indent=2) + "\n")
            staging.replace(self.path)

    def set_check(self, name: str, entry: dict) -> None:
        self.body["checks"][name] = entry
        self.write()


def over_deadline(report: Report, check: FirstCheck, deadline_s: float, state: dict) -> None:
    """A check ran past its deadline: the report names it, every thread's stack goes to
    stderr, the processes it started are killed, and the run ends (exit 1)."""
    error = f"over its deadline of {deadline_s:.0f} s"
    report.body["first_broken"] = check.name
    report.set_check(check.name, {"ok": False, "error": error})
    print(f"first contact: BROKEN: {check.name}: {error} (report {report.path}); "
          "the stacks of this process:", file=sys.stderr, flush=True)  # fmt: skip
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    for child in state["children"]:
        child.kill()
    os._exit(1)


def run_check(report: Report, check: FirstCheck, state: dict) -> bool:
    """``check`` under its deadline; its entry in the report; whether it passed."""
    deadline_s = check.cpu_deadline_s if state["device"].type == "cpu" else check.h100_budget_s
    state["check_deadline"] = time.monotonic() + deadline_s
    report.set_check(check.name, {"ok": None, "running": True, "deadline_s": deadline_s})
    watchdog = threading.Timer(deadline_s, over_deadline, (report, check, deadline_s, state))
    watchdog.daemon = True
    watchdog.start()
    start = time.perf_counter()
    try:
        result = check.run(state)
    except Exception as err:
        watchdog.cancel()
        report.body["first_broken"] = check.name
        report.set_check(check.name, {"ok": False, "error": f"{type(err).__name__}: {err}",
                                      "traceback": traceback.format_exc()[-4000:]})  # fmt: skip
        return False
    watchdog.cancel()
    seconds = round(time.perf_counter() - start, 1)
    report.set_check(
        check.name, {"ok": True, "seconds": seconds, "deadline_s": deadline_s, **result}
    )
    print(f"first contact: {check.name}: ok in {seconds} s {json.dumps(result)}", flush=True)
    return True


def run_checks(report: Report, device: torch.device) -> int:
    """Every check in order; the first broken one ends the run (exit 1) and is named."""
    state = {"device": device, "sizes": GPU if device.type == "cuda" else CPU, "children": [],
             "run_out": report.path.with_name(report.path.stem + "_run")}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="armor-first-contact-") as tmp:
        state["tmp"] = tmp
        for check in CHECKS:
            if not run_check(report, check, state):
                return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report(Path(args.out), {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                                     "rehearsal": args.rehearse, "checks": {}})  # fmt: skip
    if args.rehearse and torch.cuda.is_available():
        print("first contact: --rehearse runs on CPU: set CUDA_VISIBLE_DEVICES= "
              "(scripts/gpu_first_contact.sh does)", file=sys.stderr)  # fmt: skip
        return 2
    if not torch.cuda.is_available() and not args.rehearse:
        report.body.update(
            gpu=False, message="no GPU (torch.cuda.is_available() is False): nothing to check"
        )
        report.write()
        print(f"first contact: {report.body['message']}; report {report.path}")
        return 0
    device = torch.device("cpu" if args.rehearse else "cuda")
    budgets = {c.name: c.h100_budget_s for c in CHECKS}
    report.body.update(gpu=device.type == "cuda", node=node_facts(device),
                       h100_budget_s={**budgets, "total": H100_BUDGET_S},
                       gpu_tests=GPU_TESTS)  # fmt: skip
    report.write()
    code = run_checks(report, device)
    if code:
        name = report.body["first_broken"]
        print(f"first contact: BROKEN: {name}: {report.body['checks'][name]['error']} "
              f"(report {report.path})")  # fmt: skip
    else:
        print(f"first contact: every check passed (report {report.path})")
    return code


if __name__ == "__main__":
    sys.exit(main())
