"""Partial rollouts and bounded staleness against the synchronous and one-step-off loops on the
long-tail tiny task: whole ``armor train`` processes, side by side, on this machine.

Variants (``configs/tiny_long_tail.yaml``, every one with ``algo.rollout_correction.mode:
token_tis``, the decoupled objective's weight, so that the async mode is the only difference):
``off``, ``one_step``, ``bounded`` at ``orchestration.max_staleness`` 2 and 4 with partial
rollouts (``orchestration.partial_rollout: true``). One round per seed (``run.seed`` 1, 2, 3,
...), the variants in the orders of a Williams design (``bench_step.balanced_orders``: each
in every position, after every other, alike). Per run:

- ``steps/hour`` and ``generated tokens/s`` of the training loop: the steps' summed
  ``timing/step_s`` less validation (the same work in every variant, at step 0 and the last)
  and the summed ``rollout/generated_tokens`` (policy + reference);
- ``val/val/avg@4`` at the last step (learning), and the mean ``staleness/age_mean`` and
  ``async/partial_carried`` of the bounded runs.

Printed: the ratios to ``off`` per seed (median), and each variant's final validation avg@4
per seed against ``off``'s seed band (min..max over its seeds).

    python benchmarks/bench_partial.py [--seeds 3] [--steps 40] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from statistics import mean, median

from bench_async import REPO, run_once
from bench_step import balanced_orders

VARIANTS = {
    "off": ("off", []),
    "one_step": ("one_step", []),
    "bounded_k2": ("bounded", ["orchestration.max_staleness=2"]),
    "bounded_k4": ("bounded", ["orchestration.max_staleness=4"]),
}
"""Label -> (``orchestration.async_rollout``, further overrides)."""
VAL = "val/val/avg@4"


def one_run(label: str, seed: int, args, out: Path) -> dict:
    mode, extra = VARIANTS[label]
    common = [f"run.seed={seed}", "algo.rollout_correction.mode=token_tis",
              f"validation.every={args.steps}", *args.overrides]  # fmt: skip
    r = run_once(args.config, mode, args.steps, out, [*extra, *common])
    loop = r["loop_s"] - r["validate_total_s"]
    lines = r["lines"]
    staleness = [x["staleness/age_mean"] for x in lines if "staleness/age_mean" in x]
    return {"label": label, "seed": seed, "steps_per_hour": r["steps"] / loop * 3600,
            "tokens_per_s": r["tokens"] / loop, "val": lines[-1].get(VAL, float("nan")),
            "staleness": mean(staleness) if staleness else 0.0,
            "carried": mean(x.get("async/partial_carried", 0.0) for x in lines)}  # fmt: skip


def report(runs: list[dict], seeds: list[int]) -> None:
    by = {(r["label"], r["seed"]): r for r in runs}
    print("\nratio to off, per seed (median):")
    for label in VARIANTS:
        for key, name in (("steps_per_hour", "steps/hour"), ("tokens_per_s", "tokens/s")):
            ratios = [by[label, s][key] / by["off", s][key] for s in seeds]
            print(f"  {label:10s} {name:10s} " + " ".join(f"{x:.3f}" for x in ratios)
                  + f"  (median {median(ratios):.3f})")  # fmt: skip
    band = [by["off", s]["val"] for s in seeds]
    low, high = min(band), max(band)
    print(f"\nfinal {VAL} per seed; off's seed band {low:.3f}..{high:.3f}:")
    for label in VARIANTS:
        vals = [by[label, s]["val"] for s in seeds]
        inside = low <= mean(vals) <= high
        print(f"  {label:10s} " + " ".join(f"{v:.3f}" for v in vals)
              + f"  (mean {mean(vals):.3f}, {'inside' if inside else 'OUTSIDE'} the band)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny_long_tail.yaml"))
    parser.add_argument("overrides", nargs="*", help="key=value settings for every variant")
    args = parser.parse_args()
    seeds = list(range(1, args.seeds + 1))
    labels = list(VARIANTS)
    orders = balanced_orders(len(labels))
    print(f"bench_partial: {args.config} run.steps={args.steps} {' '.join(args.overrides)}; "
          f"seeds {seeds}, {os.cpu_count()} cores", flush=True)  # fmt: skip
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_partial_") as tmp:
        for i, seed in enumerate(seeds):
            for label in (labels[j] for j in orders[i % len(orders)]):
                r = one_run(label, seed, args, Path(tmp))
                runs.append(r)
                print(f"seed {seed} {label:10s}: {r['steps_per_hour']:7.0f} steps/h "
                      f"{r['tokens_per_s']:7.0f} tok/s  {VAL} {r['val']:.3f}  "
                      f"staleness {r['staleness']:.2f} carried {r['carried']:.1f}",
                      flush=True)  # fmt: skip
    report(runs, seeds)


if __name__ == "__main__":
    main()
