"""Step cost of ARMOR against DAPO through the real loop, interleaved, on the tiny CPU model.

One Ray cluster, one session per variant (each its own Megatron actor, embedded engine and
scorer), all at the paper's group shape scaled down (``G = 16``: 15 on-policy + 1 anchor for
ARMOR, ``ref_n = 4``) with the same ``B``. Six sets (``--set``):

- ``fresh`` (default): ``dapo`` (``anchor=none``, ``ratio=standard``), ``armor`` (fresh
  reference anchors every step), ``filter_only`` (rule (b) without the anchor).
- ``cache``: on a recurring-query config (the first ``--recurring`` training queries, so each
  recurs every few steps within a reset period, as the paper's 17k queries do at 512 per step
  over 160 steps): ``dapo``, ``armor`` (fresh anchors on the same queries),
  ``armor-cache`` (``algo.anchor_source=cache``) and ``armor-cache-policyfirst`` (the cache
  with ``rollout.reference_first=false``).
- ``order``: ``dapo``, ``armor-policyfirst`` (``rollout.reference_first=false``),
  ``armor-reffirst`` (``true``: the reference samples first, policy samples only for the
  queries the reference solved), ``armor`` (the default ``auto``: each step's order from
  the shares of the step before) and ``armor-noprefetch`` (``auto`` with
  ``rollout.prefetch_reference=false``: no reference call drawn while the trainer works).
- ``overlap``: ``dapo``, ``armor`` and ``armor-parts2`` (``rollout.reference_parts=2``).
- ``reset``: ``dapo``, ``armor`` (the tiny config's reset every 20 steps) and
  ``armor-reset1`` (``algo.reset.every=1``, the Qwen3-8B recipe's schedule until step 180:
  the reference is the policy at every step's log-prob call, so the trainer skips the
  reference pass, while the reference weights are pushed to the engine every step and no
  reference call is prefetched).
- ``concurrent``: ``dapo`` and ``armor`` as configured (the tiny config's one CPU trainer rank
  runs its reference pass beside the policy pass: ``trainer.concurrent_reference: auto``) and
  each with ``trainer.concurrent_reference=false`` (``-sequential``: one pass after the other;
  DAPO's is the exact-KL diagnostic's pass over its few samples).

ARMOR variants without an order in their name run the default ``rollout.reference_first:
auto``.

After one warm-up step each, every round runs one step of every variant in an order from a
Williams design (:func:`balanced_orders`): over a cycle of rounds (``n`` variants: ``n`` rounds,
``2n`` for odd ``n``) every variant runs in every position equally often and right after every
other variant equally often, so load changes on a shared machine and what a step leaves
behind for the next one (its garbage, its engines' queued work) hit every variant alike. A
plain rotation keeps each variant behind the same predecessor in every round. Per round and
variant: step seconds, generated tokens (policy + reference), and the seconds the trainer
ranks and the engine spent in model compute, measured inside the actors (trainer log-prob
and update calls, engine generation; ``workers.ComputeClock``). Printed: min / median / max
over rounds of each variant's ratio to DAPO in the same round — step time, generated tokens
per kept query, step time per generated token, response tokens trained — and of the share of step time outside model
compute (Ray round trips, serialization, scoring, batching, weight sync): the step time less
the union of the actors' compute intervals within it, so compute that overlaps (the next
step's reference samples drawn while the trainer works) counts once.

    python benchmarks/bench_step.py [--set fresh|cache|order|overlap|reset|concurrent] [--rounds 4] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]
PAPER_SHAPE = ["algo.group_size=16", "algo.ref_n=4"]
DAPO = ["algo.anchor=none", "algo.ratio=standard"]
ARMOR = ["algo.anchor=armor", "algo.anchor_source=generate"]
ARMOR_CACHE = ["algo.anchor=armor", "algo.anchor_source=cache"]
REFERENCE_FIRST = "rollout.reference_first=true"
POLICY_FIRST = "rollout.reference_first=false"
SEQUENTIAL = "trainer.concurrent_reference=false"
SETS = {
    "fresh": {
        "dapo": DAPO,
        "armor": ARMOR,
        "filter_only": ["algo.anchor=filter_only", "algo.ratio=standard"],
    },
    "cache": {
        "dapo": DAPO,
        "armor": ARMOR,
        "armor-cache": ARMOR_CACHE,
        "armor-cache-policyfirst": [*ARMOR_CACHE, POLICY_FIRST],
    },
    "order": {
        "dapo": DAPO,
        "armor-policyfirst": [*ARMOR, POLICY_FIRST],
        "armor-reffirst": [*ARMOR, REFERENCE_FIRST],
        "armor": ARMOR,
        "armor-noprefetch": [*ARMOR, "rollout.prefetch_reference=false"],
    },
    "overlap": {
        "dapo": DAPO,
        "armor": ARMOR,
        "armor-parts2": [*ARMOR, "rollout.reference_parts=2"],
    },
    "reset": {
        "dapo": DAPO,
        "armor": ARMOR,
        "armor-reset1": [*ARMOR, "algo.reset.every=1"],
    },
    "concurrent": {
        "dapo": DAPO,
        "dapo-sequential": [*DAPO, SEQUENTIAL],
        "armor": ARMOR,
        "armor-sequential": [*ARMOR, SEQUENTIAL],
    },
}


def recurring_data(tiny: Path, queries: int, out: Path) -> Path:
    """The first ``queries`` rows of the tiny training set, as a parquet file of their own."""
    import pyarrow.parquet as pq

    path = out / f"train_first{queries}.parquet"
    pq.write_table(pq.read_table(tiny / "data" / "train.parquet").slice(0, queries), path)
    return path


def load_variant(name: str, overrides: list[str], train_file: Path, args, out: Path):
    from megatron_armor.config import load_config

    tiny = Path(args.tiny)
    return load_config(REPO / "configs" / "tiny_cpu.yaml", [
        f"run.output_dir={out}", f"run.name={name}", "validation.every=0",
        "logging.progress=false", "logging.tensorboard=false",
        f"trainer.model_path={tiny / 'model'}", f"data.train_files=[{train_file}]",
        *PAPER_SHAPE, *overrides, *args.overrides,
    ])  # fmt: skip


def covered(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``[start, end]`` inside at least one of ``intervals`` (their union)."""
    total, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total += b - a
            reach = b
    return total


def timed_step(session, rollout, step: int) -> dict[str, float]:
    """One step of the loop; its seconds, generated tokens and actor-side compute seconds:
    the union of the actors' compute intervals within the step, so the engine's work under
    the trainer's (the next step's reference samples drawn while the trainer works,
    ``rollout.prefetch_reference``) counts once; ``engine_compute_s`` is the engine's compute
    outside the trainer's, ``engine_overlap_s`` the rest."""
    from megatron_armor.orchestration.step.loop import run_step

    session.trainer.compute_intervals(), session.rollout.compute_intervals()  # reset the clocks
    session.timers.pop_metrics()
    start = time.monotonic()
    metrics = run_step(session, rollout, step)
    end = time.monotonic()
    train, engine = session.trainer.compute_intervals(), session.rollout.compute_intervals()
    train_s, compute_s = covered(train, start, end), covered(train + engine, start, end)
    engine_s = compute_s - train_s
    phases = {k[len("timing/") : -2]: v for k, v in session.timers.pop_metrics().items()}
    return {"step_s": end - start, "tokens": metrics["rollout/generated_tokens"],
            "kept": metrics["anchor/kept"], "compute_s": compute_s,
            "train_tokens": metrics["train/response_tokens"],
            "train_compute_s": train_s, "engine_compute_s": engine_s,
            "engine_overlap_s": covered(engine, start, end) - engine_s,
            "prefetched": metrics.get("perf/reference_prefetched", 0.0),
            "cache_hits": metrics.get("anchor/cache_hits", 0.0),
            "cache_misses": metrics.get("anchor/cache_misses", 0.0),
            "gen_batches": metrics["anchor/gen_batches"],
            "queries_seen": metrics["anchor/queries_seen"],
            "no_ref_correct": metrics["anchor/rejected_no_ref_correct"],
            "cached_verdicts": metrics["anchor/rejected_cached_no_ref_correct"],
            "reference_first": metrics["anchor/reference_first"],
            **{f"phase_{k}": v for k, v in phases.items()}}  # fmt: skip


def local_ray(cpus: int, out: Path):
    """A Ray head of this benchmark's own on the loopback address (never another user's
    cluster), connected; returns it for ``stop``."""
    import ray

    from megatron_armor.orchestration.actors.placement import LOOPBACK
    from megatron_armor.orchestration.actors.ray_node import LocalRayHead

    args = ["--include-dashboard=false", f"--num-cpus={cpus}", "--num-gpus=0",
            f"--object-store-memory={512 << 20}"]  # fmt: skip
    head = LocalRayHead(args, out / "ray-head.log", 300.0, node_ip=LOOPBACK)
    ray.init(address=head.address, _node_ip_address=LOOPBACK)
    return head


def balanced_orders(n: int) -> list[list[int]]:
    """A Williams design: orders of ``range(n)`` in which each index takes every position
    equally often and follows every other index equally often (``n`` orders for even ``n``,
    ``2n`` for odd: each order then also reversed). The first is ``0, 1, n-1, 2, n-2, ...``;
    the others add ``r`` modulo ``n``."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(i + r) % n for i in first] for r in range(n)]
    return orders if n % 2 == 0 else orders + [order[::-1] for order in orders]


def run_rounds(configs: dict, rounds: int) -> dict[str, list[dict[str, float]]]:
    """Sessions for every variant; a warm-up step each, then ``rounds`` rounds in the orders
    of :func:`balanced_orders`, cycled."""
    import ray

    from megatron_armor.orchestration.run.session import Session
    from megatron_armor.orchestration.step.anchor_rollout import AnchorRollout

    head = local_ray(4 * len(configs), Path(next(iter(configs.values())).run.output_dir))
    sessions, records = {}, {name: [] for name in configs}
    try:
        for name, cfg in configs.items():
            sessions[name] = Session.start(cfg, "none")
            sessions[name].restore()
        rollouts = {n: AnchorRollout(s.config, s.dataset, s.sampler, s.rollout, s.reward,
                                     None, s.timers) for n, s in sessions.items()}  # fmt: skip
        names = list(configs)
        for name in names:
            timed_step(sessions[name], rollouts[name], 1)
        orders = balanced_orders(len(names))
        for r in range(rounds):
            for name in [names[i] for i in orders[r % len(orders)]]:
                rec = timed_step(sessions[name], rollouts[name], r + 2)
                records[name].append(rec)
                outside = 1.0 - rec["compute_s"] / rec["step_s"]
                print(f"round {r + 1} {name}: {rec['step_s']:.2f}s, {rec['tokens']:.0f} tokens, "
                      f"compute {rec['compute_s']:.2f}s ({outside:.1%} outside), "
                      f"{'reference first, ' if rec['reference_first'] else ''}"
                      f"{'its first reference call prefetched, ' if rec['prefetched'] else ''}"
                      f"{rec['gen_batches']:.0f} generation "
                      f"batches, {rec['queries_seen']:.0f} queries seen, "
                      f"{rec['no_ref_correct']:.0f} rejected without a correct reference "
                      f"({rec['cached_verdicts']:.0f} by the anchor cache's verdict, nothing "
                      "drawn)", flush=True)  # fmt: skip
    finally:
        for s in sessions.values():
            s.close(shutdown_ray=False)
        ray.shutdown()
        head.stop()
    return records


def spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {median(values):.3f} / {max(values):.3f}"


def report(records: dict[str, list[dict[str, float]]]) -> None:
    """Per variant: min / median / max over rounds of the ratios to DAPO's step that round."""
    base = records["dapo"]
    print(f"{'variant':20s} ratio to DAPO (min / median / max over rounds)")
    for name, recs in records.items():
        step = [r["step_s"] / b["step_s"] for r, b in zip(recs, base, strict=True)]
        per_query = [(r["tokens"] / r["kept"]) / (b["tokens"] / b["kept"])
                     for r, b in zip(recs, base, strict=True)]  # fmt: skip
        per_token = [(r["step_s"] / r["tokens"]) / (b["step_s"] / b["tokens"])
                     for r, b in zip(recs, base, strict=True)]  # fmt: skip
        outside = [1.0 - r["compute_s"] / r["step_s"] for r in recs]
        trained = [r["train_tokens"] / b["train_tokens"] for r, b in zip(recs, base, strict=True)]
        print(
            f"{name:20s} step time {spread(step)} | generated tokens per kept query "
            f"{spread(per_query)} | step time per generated token {spread(per_token)} | "
            f"trained response tokens {spread(trained)}"
        )
        print(
            f"{'':20s} step s {spread([r['step_s'] for r in recs])} | tokens "
            f"{spread([r['tokens'] for r in recs])} | outside model compute {spread(outside)}"
        )


PHASES = ("rollout", "generate", "score", "logprobs", "train", "sync")


def breakdown(rec: dict[str, float]) -> dict[str, float]:
    """One step's seconds by where they went: model compute inside the actors (engine,
    trainer), the loop's phases less that compute, and the driver's rest."""
    out = {"engine compute": rec["engine_compute_s"], "trainer compute": rec["train_compute_s"],
           "engine under trainer compute": rec["engine_overlap_s"]}  # fmt: skip
    out["rollout outside compute"] = rec.get("phase_rollout", 0.0) - rec["engine_compute_s"]
    out["score (in rollout)"] = rec.get("phase_score", 0.0)
    trainer_phases = rec.get("phase_logprobs", 0.0) + rec.get("phase_train", 0.0)
    out["logprobs+train outside compute"] = trainer_phases - rec["train_compute_s"]
    out["log-prob phase (in the above)"] = rec.get("phase_logprobs", 0.0)
    out["sync"] = rec.get("phase_sync", 0.0) + rec.get("phase_reset", 0.0)
    timed = sum(rec.get(f"phase_{p}", 0.0) for p in ("rollout", "logprobs", "train", "sync"))
    out["driver rest"] = rec["step_s"] - timed - rec.get("phase_reset", 0.0)
    return out


def report_phases(records: dict[str, list[dict[str, float]]]) -> None:
    """Median seconds per part of the step (:func:`breakdown`) and the anchor cache's hits."""
    parts = list(breakdown(next(iter(records.values()))[0]))
    width = max(14, *(len(name) + 2 for name in records))
    print(f"{'median seconds':32s}" + "".join(f"{name:>{width}s}" for name in records))
    for part in parts:
        cells = [median(breakdown(r)[part] for r in recs) for recs in records.values()]
        print(f"{part:32s}" + "".join(f"{c:{width}.3f}" for c in cells))
    for name, recs in records.items():
        hits = sum(r["cache_hits"] for r in recs)
        lookups = hits + sum(r["cache_misses"] for r in recs)
        if lookups:
            print(f"{name}: anchor cache {hits:.0f} hits of {lookups:.0f} look-ups "
                  f"(hit rate {hits / lookups:.3f}) over the measured rounds")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=sorted(SETS), default="fresh")
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds (after warm-up)")
    parser.add_argument("--recurring", type=int, default=16, help="queries of the cache set")
    parser.add_argument(
        "--tiny", default=str(REPO / "artifacts" / "tiny"), help="`armor tiny` output"
    )
    parser.add_argument("overrides", nargs="*", help="extra dotted overrides for every variant")
    args = parser.parse_args()
    for key, value in (("RAY_AUTH_MODE", "disabled"), ("RAY_USAGE_STATS_ENABLED", "0")):
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        train = Path(args.tiny) / "data" / "train.parquet"
        if args.set == "cache":
            train = recurring_data(Path(args.tiny), args.recurring, Path(tmp))
        configs = {name: load_variant(name, ov, train, args, Path(tmp))
                   for name, ov in SETS[args.set].items()}  # fmt: skip
        records = run_rounds(configs, args.rounds)
        report(records)
        report_phases(records)


if __name__ == "__main__":
    main()
