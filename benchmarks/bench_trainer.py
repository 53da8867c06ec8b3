"""ARMOR-loss overhead and vocab-parallel log-prob memory of the Megatron actor, TP=2 on CPU.

Prints, side by side in one run of 2 gloo processes (tensor parallelism 2, launched by this
script with a free port and a bounded timeout):

1. **fwd+bwd time, ARMOR loss / standard loss.** The same tiny Qwen2 (written with
   transformers to a temp dir, loaded through the trainer's model provider and HF loader,
   wrapped in megatron DDP) and the same packed ARMOR batch (groups of ``G`` samples, the last
   one an anchor, several micro-batches) go through megatron-core's schedule
   (``schedule.run_schedule``, ``forward_only=False``) with ``loss_func`` = the trainer's
   policy loss at ``algo.ratio=mixed`` (needs ``ref_logprobs``; reference-KL metrics on, as
   the actor runs it) and at ``algo.ratio=standard`` (the DAPO loss, no reference metrics).
   The two are timed alternately (A B, B A, ...) so machine noise hits both alike; the table
   shows the medians and their ratio. A second row times ``algo.compute_policy_loss`` alone
   (forward + backward on the packed ``[T]`` tensors, no model), i.e. the raw cost of the ratio.
2. **Peak memory, vocab-parallel log-prob / gathered-logits log-prob.** From the same
   vocab-parallel logits shard ``[N, V/2]`` per rank: ``logprobs.vocab_parallel_logprobs``
   (max / sum-exp / target logit all-reduced over TP, chunked) against all-gathering the
   vocabulary then ``log_softmax`` (entropy as a detached metric in both), forward and
   backward to the shard. Memory is the peak of the CPU allocator's live bytes over the
   tensors allocated *during* the op (``torch.profiler`` with ``profile_memory=True``: every
   ``[memory]`` event carries the allocator's running total of bytes allocated since the
   profiler started and not yet freed; the inputs existed before and do not count). Process
   RSS deltas are not used (the allocator keeps freed pages). Values are per rank (the max of
   the two ranks). Both paths are also checked to agree (log-probs and gradients).

    python benchmarks/bench_trainer.py [--reps 9] [--vocab 32000 --tokens 2048] [--chunk 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

TP = 2
WORLD = TP
TIMEOUT_S = 300


# --- arguments and the launcher (parent process) ---------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15, help="timed A/B pairs (after one warm-up each)")
    p.add_argument("--hidden", type=int, default=128, help="tiny Qwen2 hidden size")
    p.add_argument("--layers", type=int, default=2, help="tiny Qwen2 layers")
    p.add_argument("--model-vocab", type=int, default=2048, help="tiny Qwen2 vocabulary")
    p.add_argument("--groups", type=int, default=4, help="queries in the ARMOR batch")
    p.add_argument("--group-size", type=int, default=8, help="G: samples per query (1 anchor)")
    p.add_argument("--micro-batch-tokens", type=int, default=512, help="trainer.micro_batch_tokens")
    p.add_argument("--loss-iters", type=int, default=50, help="loss-only calls per timing sample")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary of the memory comparison")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the memory comparison")
    p.add_argument("--chunk", type=int, default=1024, help="trainer.logprob_chunk")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--raw", action="store_true", help="also print every repetition's times")
    p.add_argument("--worker", nargs=3, metavar=("RANK", "PORT", "DIR"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_hf_model(path: str, args: argparse.Namespace) -> int:
    """A random tiny Qwen2 (qkv bias, untied embeddings) saved as an HF directory; its size."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.model_vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return model.num_parameters()


def launch(argv: list[str], workdir: str) -> list[dict]:
    """Run the ``WORLD`` ranks of this script to completion (bounded); their result dicts."""
    from megatron_armor.trainer.ranks import run_rank_processes

    port = str(free_port())
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    commands = [
        [sys.executable, os.path.abspath(__file__), *argv, "--worker", str(rank), port, workdir]
        for rank in range(WORLD)
    ]
    logs = [os.path.join(workdir, f"log{rank}.txt") for rank in range(WORLD)]
    try:
        run_rank_processes(commands, logs, env, TIMEOUT_S)
    except RuntimeError as err:
        raise SystemExit(f"bench_trainer: {err}") from None
    return [json.loads(Path(workdir, f"result{r}.json").read_text()) for r in range(WORLD)]


# --- timing helpers ---------------------------------------------------------------------------


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def interleaved_times(
    fns: dict, reps: int, collective: bool = True, warmup: bool = True
) -> dict[str, list[float]]:
    """Seconds per call of each ``fns`` entry, alternating the order every repetition.

    One untimed warm-up call each (``warmup``); then ``reps`` rounds A B, B A, ... With
    ``collective`` the ranks meet at a barrier before and after each call (TP collectives).
    """
    names = list(fns)
    for name in names if warmup else []:
        fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            if collective:
                barrier()
            start = time.perf_counter()
            fns[name]()
            if collective:
                barrier()
            times[name].append(time.perf_counter() - start)
    return times


# --- 1. ARMOR loss vs standard loss (worker) -------------------------------------------------


def make_armor_batch(args: argparse.Namespace):
    """``groups`` queries of ``G`` samples of unequal lengths, the last sample an anchor."""
    from megatron_armor.types import Group, Sample, SampleSource, pack_groups

    rng = random.Random(0)
    groups = []
    for g in range(args.groups):
        prompt = [rng.randrange(args.model_vocab) for _ in range(16 + 2 * g)]
        samples, advantages = [], []
        for i in range(args.group_size):
            response = [rng.randrange(args.model_vocab) for _ in range(rng.randint(8, 48))]
            anchor = i == args.group_size - 1
            source = SampleSource.REFERENCE if anchor else SampleSource.POLICY
            samples.append(Sample(f"q{g}", prompt, response, source=source))
            advantages.append(rng.uniform(-1.5, 1.5))
        groups.append(Group(f"q{g}", samples, args.group_size - 1, advantages))
    return pack_groups(groups)


def build_tp_model(model_dir: str):
    """The trainer's model provider + HF loader + megatron DDP at TP=2, fp32, local spec."""
    from megatron_armor.config.schema import TrainerConfig
    from megatron_armor.trainer.hf_weights import load_hf_weights
    from megatron_armor.trainer.model import build_model, read_hf_spec
    from megatron_armor.trainer.optim import wrap_ddp

    trainer = TrainerConfig(model_path=model_dir, tp=TP, precision="fp32")
    spec = read_hf_spec(model_dir)
    model = build_model(spec, trainer)
    load_hf_weights(model, model_dir, spec)
    return wrap_ddp(model, trainer), spec


def fill_old_and_ref(model, batch, mbs, lp) -> None:
    """Set ``old``/``ref`` log-probs to the model's own log-probs plus noise (ratios spread
    around 1, some outside the clip range)."""
    from megatron_armor.trainer.schedule import logprob_builder, run_schedule

    with torch.no_grad():
        outputs = run_schedule(model, mbs, logprob_builder(lp), forward_only=True)
    logp = torch.zeros(batch.num_tokens)
    for o in outputs:
        logp[o["index"]] = o["logp"].float()
    gen = torch.Generator().manual_seed(1)
    mask = batch.loss_mask.float()
    batch.old_logprobs = (logp + 0.1 * torch.randn(logp.shape, generator=gen)) * mask
    batch.ref_logprobs = (logp + 0.3 * torch.randn(logp.shape, generator=gen)) * mask


def loss_settings() -> dict:
    """``{name: LossSettings}``: ARMOR (mixed ratio, alpha = 15/16, reference-KL metrics as the
    actor logs them) and standard (DAPO clip-higher, no reference)."""
    from megatron_armor.algo.losses import LossSettings

    return {
        "armor": LossSettings(ratio="mixed", alpha=15 / 16, loss_agg="token-mean"),
        "standard": LossSettings(ratio="standard", loss_agg="token-mean", ref_metrics=False),
    }


def bench_loss(args: argparse.Namespace, model_dir: str) -> dict:
    """Medians of the fwd+bwd schedule (model + loss) and of the loss alone, per setting."""
    from megatron_armor.trainer.batching import plan_micro_batches
    from megatron_armor.trainer.schedule import (
        LogprobSettings,
        global_units,
        policy_loss_builder,
        run_schedule,
    )

    model, spec = build_tp_model(model_dir)
    batch = make_armor_batch(args)
    mbs = plan_micro_batches(batch, 0, 1, args.micro_batch_tokens)
    lp = LogprobSettings(spec.vocab_size, args.temperature, args.chunk)
    fill_old_and_ref(model, batch, mbs, lp)
    mbs = plan_micro_batches(batch, 0, 1, args.micro_batch_tokens)
    settings = loss_settings()
    normalizer = global_units(mbs, "token-mean")
    model.train()

    def step(name: str):
        def run() -> None:
            model.zero_grad_buffer()
            run_schedule(model, mbs, policy_loss_builder(lp, settings[name], normalizer), False)

        return run

    full = interleaved_times({name: step(name) for name in settings}, args.reps)
    return {
        "fwd_bwd": full,
        "loss_only": bench_loss_alone(args, batch, settings, normalizer),
        "tokens": batch.num_tokens,
        "samples": batch.num_samples,
        "micro_batches": len(mbs),
    }


def bench_loss_alone(args, batch, settings, normalizer) -> dict[str, list[float]]:
    """Seconds per ``compute_policy_loss`` forward + backward on the packed batch (one entry
    per repetition, each the mean of ``loss_iters`` calls)."""
    from megatron_armor.algo.losses import compute_policy_loss

    base = (batch.old_logprobs + 0.05).clone()
    rest = (
        batch.old_logprobs, batch.ref_logprobs, batch.advantages.float(),
        batch.loss_mask.float(), batch.is_anchor.bool(), batch.sample_index,
    )  # fmt: skip

    def call(name: str):
        def run() -> None:
            for _ in range(args.loss_iters):
                logp = base.clone().requires_grad_(True)
                loss, _ = compute_policy_loss(logp, *rest, settings[name], normalizer)
                loss.backward()

        return run

    times = interleaved_times({name: call(name) for name in settings}, args.reps, False)
    return {k: [t / args.loss_iters for t in v] for k, v in times.items()}


# --- 2. vocab-parallel vs gathered log-probs (worker) ----------------------------------------


class _GatherVocab(torch.autograd.Function):
    """All-gather the vocabulary shards ``[N, V/tp] -> [N, V]``; backward keeps this rank's
    columns (every TP rank computes the same loss on the same full logits)."""

    @staticmethod
    def forward(ctx, shard, group):
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        ctx.rank, ctx.width = dist.get_rank(group), shard.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        lo = ctx.rank * ctx.width
        return grad[:, lo : lo + ctx.width].contiguous(), None


def gathered_logprobs(shard, target, vocab, temperature, group, chunk: int = 1024):
    """The baseline: gather the logits, ``log_softmax`` over the true vocabulary, pick targets.

    Without avoidable temporaries: the temperature divides the gathered logits in place, the
    true-vocabulary columns are a view, and the detached entropy is computed ``chunk`` rows at
    a time. What stays is what the method needs: the gathered ``[N, V]`` logits, the saved
    ``log_softmax`` output and the backward's gradients. ``(logp [N] with grad, entropy [N])``.
    """
    full = _GatherVocab.apply(shard, group)
    if temperature != 1.0:
        full = full.div_(temperature)
    logp_all = torch.log_softmax(full[:, :vocab], dim=-1)
    logp = logp_all.gather(1, target.unsqueeze(1)).squeeze(1)
    with torch.no_grad():
        entropy = torch.cat([-(rows.exp() * rows).sum(-1) for rows in logp_all.split(chunk)])
    return logp, entropy


def peak_allocated_bytes(fn, workdir: str) -> int:
    """Peak bytes live among the CPU tensors allocated while ``fn()`` runs (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    trace = os.path.join(workdir, f"trace{dist.get_rank()}.json")
    prof.export_chrome_trace(trace)
    events = json.loads(Path(trace).read_text())["traceEvents"]
    os.remove(trace)
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals, default=0)


def bench_memory(args: argparse.Namespace, workdir: str) -> dict:
    """Peak op memory, median time and agreement of the two log-prob paths on one shard."""
    from megatron_armor.trainer import parallel
    from megatron_armor.trainer.logprobs import vocab_parallel_logprobs

    group, rank = parallel.tp_group(), parallel.tp_rank()
    padded = -(-args.vocab // (128 * TP)) * 128 * TP
    width = padded // TP
    gen = torch.Generator().manual_seed(10 + rank)
    shard = torch.randn(args.tokens, width, generator=gen).mul_(3.0).requires_grad_(True)
    shared = torch.Generator().manual_seed(5)  # same targets and upstream grad on every rank
    target = torch.randint(0, args.vocab, (args.tokens,), generator=shared)
    grad_out = torch.randn(args.tokens, generator=shared)
    paths = {
        "vocab_parallel": lambda: vocab_parallel_logprobs(
            shard, target, args.vocab, args.temperature, args.chunk, group
        ),
        "gathered": lambda: gathered_logprobs(
            shard, target, args.vocab, args.temperature, group, args.chunk
        ),
    }
    results: dict = {"logp": {}, "grad": {}}

    def fwd_bwd(name: str, keep: bool = False):
        def run() -> None:
            logp, entropy = paths[name]()
            logp.backward(grad_out)
            if keep:
                results["logp"][name], results["grad"][name] = logp.detach(), shard.grad.clone()
            shard.grad = None

        return run

    for name in paths:
        fwd_bwd(name, keep=True)()
    peaks = {}
    for name in paths:
        barrier()
        peaks[name] = peak_allocated_bytes(fwd_bwd(name), workdir)
    times = interleaved_times({name: fwd_bwd(name) for name in paths}, 3, warmup=False)
    lp, gr = results["logp"], results["grad"]
    return {
        "peak_bytes": peaks,
        "seconds": times,
        "logp_max_diff": float((lp["vocab_parallel"] - lp["gathered"]).abs().max()),
        "grad_max_diff": float((gr["vocab_parallel"] - gr["gathered"]).abs().max()),
        "padded_vocab": padded,
    }


def worker(args: argparse.Namespace) -> None:
    """One TP rank: both benchmarks; writes ``DIR/result{rank}.json``."""
    from megatron_armor.trainer import parallel

    rank, port, workdir = int(args.worker[0]), int(args.worker[1]), args.worker[2]
    torch.set_num_threads(args.threads)
    parallel.init_parallel(parallel.ParallelLayout(tp=TP), rank, WORLD, "127.0.0.1", port, 1)
    try:
        start = time.perf_counter()
        result = {"loss": bench_loss(args, os.path.join(workdir, "model"))}
        result["loss_bench_s"] = time.perf_counter() - start
        result["memory"] = bench_memory(args, workdir)
        result["memory_bench_s"] = time.perf_counter() - start - result["loss_bench_s"]
        Path(workdir, f"result{rank}.json").write_text(json.dumps(result))
    finally:
        parallel.destroy_parallel()


# --- report (parent) --------------------------------------------------------------------------


def summarize(times: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float, float]:
    """``(median a, median b, median of the per-repetition ratios a/b, min a / min b)``.

    A repetition's two calls ran back to back, so their ratio cancels most of the machine's
    drift; on a loaded machine noise only adds time, so the ratio of minima is shown too.
    """
    ratios = [x / y for x, y in zip(times[a], times[b], strict=True)]
    medians = statistics.median(times[a]), statistics.median(times[b])
    return *medians, statistics.median(ratios), min(times[a]) / min(times[b])


def print_report(args: argparse.Namespace, results: list[dict], params: int) -> None:
    loss = results[0]["loss"]
    mem = [r["memory"] for r in results]
    print(
        f"TP={TP} on CPU (gloo, {WORLD} processes x {args.threads} torch thread), "
        f"torch {torch.__version__}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(
        f"model: tiny Qwen2 hidden={args.hidden} layers={args.layers} vocab={args.model_vocab} "
        f"({params / 1e6:.2f}M params), batch {loss['samples']} samples "
        f"(G={args.group_size}, 1 anchor each) = {loss['tokens']} tokens in "
        f"{loss['micro_batches']} micro-batches; {args.reps} interleaved A/B reps"
    )
    print(
        f"\n{'measure (median)':<36}{'ARMOR (mixed)':>14}{'standard':>10}{'ARMOR/std':>11}"
        f"{'min/min':>9}"
    )
    for label, times, scale in (
        ("fwd+bwd, model + loss (ms)", loss["fwd_bwd"], 1e3),
        ("fwd+bwd, loss alone (us)", loss["loss_only"], 1e6),
    ):
        a, s, ratio, by_min = summarize(times, "armor", "standard")
        print(f"{label:<36}{a * scale:>14.2f}{s * scale:>10.2f}{ratio:>11.3f}{by_min:>9.3f}")
        if args.raw:
            for name in ("armor", "standard"):
                print(f"  {name:<10}" + " ".join(f"{t * scale:.1f}" for t in times[name]))
    extra = (min(loss["loss_only"]["armor"]) - min(loss["loss_only"]["standard"])) * loss[
        "micro_batches"
    ]
    print(
        f"ARMOR loss extra cost per fwd+bwd, {loss['micro_batches']} micro-batches x (armor - "
        f"standard loss alone, min): {extra * 1e3:.2f} ms = "
        f"{100 * extra / min(loss['fwd_bwd']['standard']):.2f}% of the standard fwd+bwd (min)"
    )
    print(
        f"\nlog-prob fwd+bwd from a [{args.tokens}, {mem[0]['padded_vocab'] // TP}] fp32 "
        f"logits shard per rank (vocab {args.vocab}, chunk {args.chunk})"
    )
    print(f"{'measure':<36}{'vocab-parallel':>14}{'gathered':>10}{'VP/gath':>11}{'min/min':>9}")
    peak = {k: max(m["peak_bytes"][k] for m in mem) for k in ("vocab_parallel", "gathered")}
    vp, ga = peak["vocab_parallel"] / 2**20, peak["gathered"] / 2**20
    print(f"{'peak op memory, max over ranks (MiB)':<36}{vp:>14.1f}{ga:>10.1f}{vp / ga:>11.3f}")
    v, g, ratio, by_min = summarize(mem[0]["seconds"], "vocab_parallel", "gathered")
    print(f"{'time, median (ms)':<36}{v * 1e3:>14.1f}{g * 1e3:>10.1f}{ratio:>11.3f}{by_min:>9.3f}")
    print(
        f"agreement: max |logp diff| {max(m['logp_max_diff'] for m in mem):.2e}, "
        f"max |grad diff| {max(m['grad_max_diff'] for m in mem):.2e}"
    )
    print(
        f"phases (rank 0): loss benchmark {results[0]['loss_bench_s']:.1f} s, "
        f"memory benchmark {results[0]['memory_bench_s']:.1f} s"
    )


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    forwarded = sys.argv[1:]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        params = build_hf_model(os.path.join(tmp, "model"), args)
        results = launch(forwarded, tmp)
    print_report(args, results, params)
    print(f"\ntotal wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
