"""Step time of ARMOR against DAPO on the tiny CPU config, side by side in one run.

Three sessions of the real orchestrator (one Ray cluster; each with its own Megatron actor,
embedded engine and scorer) with the same ``B`` and ``G``:

- ``dapo``: ``algo.anchor=none``, ``algo.ratio=standard`` (no reference samples, no ref log-probs)
- ``armor-generate``: anchors from fresh reference samples every step
- ``armor-cache``: anchors generated once per reference period and reused

Their steps are interleaved (step 1 of each, then step 2 of each, ...) so that load changes on
a shared machine hit every variant alike. Printed: the mean step time (step 1 excluded as
warm-up), the ratio to DAPO, the per-phase split, generation batches per step, and the share
of step time spent outside model compute (generation, log-prob forwards, training updates).

    python benchmarks/bench_step.py [--steps 5] [--tiny artifacts/tiny] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "dapo": ["algo.anchor=none", "algo.ratio=standard"],
    "armor-generate": ["algo.anchor=armor", "algo.anchor_source=generate"],
    "armor-cache": ["algo.anchor=armor", "algo.anchor_source=cache"],
}
COMPUTE_PHASES = ("generate", "logprobs", "train")
PHASES = ("generate", "score", "logprobs", "train", "sync", "reset")


def load_variant(name: str, overrides: list[str], args, out: Path):
    from megatron_armor.config import load_config

    tiny = Path(args.tiny)
    return load_config(REPO / "configs" / "tiny_cpu.yaml", [
        f"run.output_dir={out}", f"run.name={name}", f"run.steps={args.steps}",
        "validation.every=0", "logging.progress=false", "logging.tensorboard=false",
        f"trainer.model_path={tiny / 'model'}",
        f"data.train_files=[{tiny / 'data' / 'train.parquet'}]", *overrides, *args.overrides,
    ])  # fmt: skip


def run_interleaved(configs: dict, steps: int) -> dict[str, list[dict[str, float]]]:
    """Start one session per variant, then run their steps round-robin; per-step timings."""
    import ray

    from megatron_armor.orchestration.anchor_rollout import AnchorRollout
    from megatron_armor.orchestration.loop import run_step
    from megatron_armor.orchestration.session import Session

    ray.init(num_cpus=4 * len(configs), include_dashboard=False, object_store_memory=512 * 1024**2)
    sessions, records = {}, {name: [] for name in configs}
    try:
        for name, cfg in configs.items():
            sessions[name] = Session.start(cfg, "none")
            sessions[name].restore()
        rollouts = {n: AnchorRollout(s.config, s.dataset, s.sampler, s.rollout, s.reward, None, s.timers)
                    for n, s in sessions.items()}  # fmt: skip
        for step in range(1, steps + 1):
            for name, s in sessions.items():
                start = time.perf_counter()
                metrics = run_step(s, rollouts[name], step)
                metrics.update(s.timers.pop_metrics(), step_s=time.perf_counter() - start)
                records[name].append(metrics)
                print(f"{name} step {step}: {metrics['step_s']:.2f}s", flush=True)
    finally:
        for s in sessions.values():
            s.close(shutdown_ray=False)
        ray.shutdown()
    return records


def summarize(records: list[dict]) -> dict[str, float]:
    """Mean seconds per phase and per step over the measured steps (step 1 is warm-up)."""
    measured = records[1:] or records

    def avg(key: str) -> float:
        return mean(float(r.get(key) or 0.0) for r in measured)

    out = {p: avg(f"timing/{p}_s") for p in PHASES}
    out["step"] = avg("step_s")
    compute = sum(out[p] for p in COMPUTE_PHASES)
    out["outside_compute_share"] = 1.0 - compute / out["step"] if out["step"] else 0.0
    out["gen_batches"] = avg("anchor/gen_batches")
    return out


def print_table(results: dict[str, dict[str, float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    dapo = results["dapo"]["step"]
    table = Table(title="step time on configs/tiny_cpu.yaml (same B and G)")
    cols = (
        "variant",
        "step s",
        "x DAPO",
        *(f"{p} s" for p in PHASES),
        "gen batches",
        "outside compute",
    )
    for col in cols:
        table.add_column(col, justify="right")
    for name, r in results.items():
        table.add_row(name, f"{r['step']:.2f}", f"{r['step'] / dapo:.2f}",
                      *(f"{r[p]:.2f}" for p in PHASES), f"{r['gen_batches']:.1f}",
                      f"{100 * r['outside_compute_share']:.1f}%")  # fmt: skip
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per variant (>= 2)")
    parser.add_argument(
        "--tiny", default=str(REPO / "artifacts" / "tiny"), help="`armor tiny` output"
    )
    parser.add_argument("overrides", nargs="*", help="extra dotted overrides for every variant")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is warm-up)")
    for key, value in (("RAY_AUTH_MODE", "disabled"), ("RAY_USAGE_STATS_ENABLED", "0")):
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        configs = {name: load_variant(name, ov, args, Path(tmp)) for name, ov in VARIANTS.items()}
        results = {
            name: summarize(recs) for name, recs in run_interleaved(configs, args.steps).items()
        }
    print_table(results)
    for name in ("armor-generate", "armor-cache"):
        print(f"{name} / dapo step time: {results[name]['step'] / results['dapo']['step']:.2f}")


if __name__ == "__main__":
    main()
