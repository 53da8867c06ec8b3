"""Step time of ARMOR against DAPO on the tiny CPU config, side by side in one run.

Runs three short trainings through the real orchestrator (Ray, Megatron actor, embedded
engine) with the same ``B`` and ``G``:

- ``dapo``: ``algo.anchor=none``, ``algo.ratio=standard`` (no reference samples, no ref log-probs)
- ``armor-generate``: anchors from fresh reference samples every step
- ``armor-cache``: anchors generated once per reference period and reused

and prints the mean step time (first step excluded as warm-up; checkpoint time excluded), the
ARMOR / DAPO ratio, the per-phase split, and the share of step time spent outside model
compute (generation, log-prob forwards, training updates).

    python benchmarks/bench_step.py [--steps 4] [--tiny artifacts/tiny] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile
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


def run_variant(name: str, overrides: list[str], args, out: Path) -> list[dict]:
    """Train one variant for ``args.steps`` steps; its per-step metrics records."""
    from megatron_armor.config import load_config
    from megatron_armor.observability.metrics import read_metrics
    from megatron_armor.orchestration.loop import train

    tiny = Path(args.tiny)
    config = load_config(REPO / "configs" / "tiny_cpu.yaml", [
        f"run.output_dir={out}", f"run.name={name}", f"run.steps={args.steps}",
        f"run.ckpt_every={args.steps}", "validation.every=0", "logging.progress=false",
        "logging.tensorboard=false", f"trainer.model_path={tiny / 'model'}",
        f"data.train_files=[{tiny / 'data' / 'train.parquet'}]", *overrides, *args.overrides,
    ])  # fmt: skip
    code = train(config, "none")
    if code != 0:
        raise SystemExit(f"bench_step: variant {name} exited {code}")
    return [r for r in read_metrics(out / name) if r["step"] >= 1]


def summarize(records: list[dict]) -> dict[str, float]:
    """Mean seconds per phase and per step over the measured steps (step 1 is warm-up)."""
    measured = records[1:] or records

    def avg(key: str) -> float:
        return mean(float(r.get(key) or 0.0) for r in measured)

    step = avg("timing/step_s") - avg("timing/checkpoint_s")
    out = {p: avg(f"timing/{p}_s") for p in PHASES}
    out["step"] = step
    out["outside_compute_share"] = 1.0 - sum(out[p] for p in COMPUTE_PHASES) / step if step else 0.0
    out["gen_batches"] = avg("anchor/gen_batches")
    return out


def print_table(results: dict[str, dict[str, float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    dapo = results["dapo"]["step"]
    table = Table(title="step time on configs/tiny_cpu.yaml (same B and G)")
    for col in (
        "variant",
        "step s",
        "x DAPO",
        *(f"{p} s" for p in PHASES),
        "gen batches",
        "outside compute",
    ):
        table.add_column(col, justify="right")
    for name, r in results.items():
        table.add_row(name, f"{r['step']:.2f}", f"{r['step'] / dapo:.2f}",
                      *(f"{r[p]:.2f}" for p in PHASES), f"{r['gen_batches']:.1f}",
                      f"{100 * r['outside_compute_share']:.1f}%")  # fmt: skip
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per variant (>= 2)")
    parser.add_argument(
        "--tiny", default=str(REPO / "artifacts" / "tiny"), help="`armor tiny` output"
    )
    parser.add_argument("overrides", nargs="*", help="extra dotted overrides for every variant")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is warm-up)")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        results = {
            name: summarize(run_variant(name, ov, args, Path(tmp))) for name, ov in VARIANTS.items()
        }
    print_table(results)
    for name in ("armor-generate", "armor-cache"):
        print(f"{name} / dapo step time: {results[name]['step'] / results['dapo']['step']:.2f}")


if __name__ == "__main__":
    main()
