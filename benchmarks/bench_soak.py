"""Soak: the tiny config for many steps, and what a long run does to memory, disk, step time and
acceptance (docs/benchmarks.md, "Soak"). Not a timed test: one long run, then its report.

Runs ``armor train configs/tiny_cpu.yaml run.steps=N run.ckpt_every=100 validation.every=250``
(the issue's long-run command; ``key=value`` overrides after it) in a subprocess with its own
Ray temp dir, then reads the run's ``metrics.jsonl`` and reports:

- **finished**: the exit code, the last step logged of ``N``, the wall time;
- **memory**: ``mem/run_gb`` (every process of the run: ``orchestration/run/host_usage.py``) and
  the driver's, trainer rank 0's, rollout worker 0's and reward worker 0's RSS: first, last,
  and growth per 100 steps (least-squares slope x 100) over the whole run and over its second
  half (after the start-up growth);
- **disk**: the run directory at the checkpoint steps (``disk/run_dir_gb``): first, last,
  growth per 100 steps, the newest checkpoint's size, and the directory at the end;
- **step time**: ``timing/step_s`` less validation and checkpoint time, median per tenth of
  the run, and the drift (last tenth's median over the first's; slope per 100 steps);
- **acceptance**: per tenth of the run the mean ``anchor/acceptance_rate`` and generation
  batches, the short steps, the retired prompts at its end;
- **validation**: every ``val/*/avg@k`` and ``pass@k``; **warnings**: the steps each
  ``watch/*_warning`` was on, and the first.

    python benchmarks/bench_soak.py [--steps 2000] [--out DIR] [--name soak] [--json PATH] [key=value ...]
    python benchmarks/bench_soak.py --report RUN_DIR [--steps N] [--json PATH]   # an existing run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOAK = ["run.ckpt_every=100", "validation.every=250", "logging.progress=false"]
MEMORY_KEYS = ("mem/run_gb", "mem/driver_gb", "mem/trainer0_gb", "mem/rollout0_gb",
               "mem/reward0_gb")  # fmt: skip
WARNINGS = ("acceptance", "memory", "disk")
PARTS = 10


def series(records: list[dict], key: str) -> list[list[float]]:
    """``[step, value]`` of ``key`` over the records that have it."""
    return [[r["step"], float(r[key])] for r in records if r.get(key) is not None]


def growth_per_100(points: list[list[float]]) -> float | None:
    """The least-squares slope through ``points`` x 100 (``None`` with fewer than two)."""
    from megatron_armor.observability.watchers import least_squares

    fit = least_squares(points)
    return None if fit is None else 100 * fit[0]


def trend(points: list[list[float]]) -> dict:
    """First, last, and growth per 100 steps over all points and over the second half."""
    if not points:
        return {}
    half = [p for p in points if p[0] > (points[0][0] + points[-1][0]) / 2]
    return {"first": points[0][1], "last": points[-1][1], "max": max(v for _, v in points),
            "per_100": growth_per_100(points), "per_100_second_half": growth_per_100(half)}  # fmt: skip


def parts(records: list[dict], n: int = PARTS) -> list[list[dict]]:
    """The training-step records cut into ``n`` consecutive, nearly equal parts."""
    steps = [r for r in records if r["step"] > 0]
    cuts = [round(i * len(steps) / n) for i in range(n + 1)]
    return [steps[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def work_seconds(r: dict) -> float | None:
    """``timing/step_s`` less the step's validation and checkpoint seconds."""
    if r.get("timing/step_s") is None:
        return None
    extra = (r.get("timing/validate_s") or 0.0) + (r.get("timing/checkpoint_s") or 0.0)
    return r["timing/step_s"] - extra


def step_times(records: list[dict]) -> dict:
    """Median work seconds per part, the last part's over the first's, slope per 100 steps."""
    medians = []
    for part in parts(records):
        seconds = [s for s in map(work_seconds, part) if s is not None]
        medians.append(statistics.median(seconds) if seconds else None)
    points = [[r["step"], work_seconds(r)] for r in records if work_seconds(r) is not None]
    drift = medians[-1] / medians[0] if medians and medians[0] and medians[-1] else None
    return {"median_per_part": medians, "drift": drift, "per_100": growth_per_100(points)}


def acceptance(records: list[dict]) -> list[dict]:
    """Per part: its steps, mean acceptance rate and generation batches, short steps, retired."""
    out = []
    for part in parts(records):
        rates = [r["anchor/acceptance_rate"] for r in part if "anchor/acceptance_rate" in r]
        batches = [r["anchor/gen_batches"] for r in part if "anchor/gen_batches" in r]
        out.append({"steps": [part[0]["step"], part[-1]["step"]],
                    "acceptance": statistics.fmean(rates) if rates else None,
                    "gen_batches": statistics.fmean(batches) if batches else None,
                    "short": sum(int(bool(r.get("anchor/short_batch"))) for r in part),
                    "retired": part[-1].get("data/retired")})  # fmt: skip
    return out


def warnings(records: list[dict]) -> dict:
    """Per watcher: the steps its warning was on, and the first."""
    out = {}
    for name in WARNINGS:
        on = [r["step"] for r in records if r.get(f"watch/{name}_warning")]
        out[name] = {"steps_on": len(on), "first": on[0] if on else None}
    return out


def validations(records: list[dict]) -> dict[str, list[list[float]]]:
    keys = sorted({k for r in records for k in r if k.startswith("val/") and "@" in k
                   and ("avg@" in k or "pass@" in k)})  # fmt: skip
    return {k: series(records, k) for k in keys}


def report(records: list[dict], steps: int) -> dict:
    """Everything the soak reports of one run's metrics records (module docstring)."""
    last = max((r["step"] for r in records), default=0)
    checkpoints = [r for r in records if r.get("disk/run_dir_gb") is not None]
    return {
        "steps": steps, "last_step": last, "finished": last >= steps,
        "memory": {k: trend(series(records, k)) for k in MEMORY_KEYS},
        "disk": {**trend(series(checkpoints, "disk/run_dir_gb")),
                 "checkpoint_gb": checkpoints[-1].get("disk/checkpoint_gb") if checkpoints else None},
        "step_time": step_times(records), "acceptance": acceptance(records),
        "validation": validations(records), "warnings": warnings(records),
        "short_batches": sum(int(bool(r.get("anchor/short_batch"))) for r in records),
    }  # fmt: skip


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(rep: dict) -> str:
    """The report as the tables of docs/benchmarks.md."""
    lines = [f"finished: {rep['finished']} (last step {rep['last_step']} of {rep['steps']}; "
             f"exit {rep.get('exit_code', '-')}, {fmt(rep.get('wall_s'), '.0f')} s); "
             f"short batches: {rep['short_batches']}", "",
             "| memory (GB) | first | last | max | per 100 steps | per 100, 2nd half |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for key, t in rep["memory"].items():
        if t:
            lines.append(f"| `{key}` | {fmt(t['first'])} | {fmt(t['last'])} | {fmt(t['max'])} | "
                         f"{fmt(t['per_100'], '+.4f')} | {fmt(t['per_100_second_half'], '+.4f')} |")  # fmt: skip
    d = rep["disk"]
    lines += ["", f"run dir at checkpoints: {fmt(d.get('first'))} -> {fmt(d.get('last'))} GB, "
              f"{fmt(d.get('per_100'), '+.4f')} GB per 100 steps; newest checkpoint "
              f"{fmt(d.get('checkpoint_gb'))} GB; at the end {fmt(rep.get('run_dir_end_gb'))} GB", "",
              "| steps | acceptance | gen batches | short | retired | step s (median) |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for part, median in zip(rep["acceptance"], rep["step_time"]["median_per_part"], strict=True):
        lines.append(f"| {part['steps'][0]}-{part['steps'][1]} | {fmt(part['acceptance'])} | "
                     f"{fmt(part['gen_batches'], '.2f')} | {part['short']} | "
                     f"{fmt(part['retired'], '.0f')} | {fmt(median, '.2f')} |")  # fmt: skip
    t = rep["step_time"]
    lines += ["", f"step time drift (last tenth / first): {fmt(t['drift'], '.2f')}; "
              f"{fmt(t['per_100'], '+.4f')} s per 100 steps", ""]  # fmt: skip
    for key, points in rep["validation"].items():
        lines.append(f"{key}: " + ", ".join(f"{s:.0f}: {v:.3f}" for s, v in points))
    lines.append("warnings: " + "; ".join(f"{n} on {w['steps_on']} steps (first {w['first']})"
                                         for n, w in rep["warnings"].items()))  # fmt: skip
    return "\n".join(lines)


def run_soak(args) -> dict:
    """The soak run in a subprocess; its report with the exit code and wall time."""
    from megatron_armor.observability.metrics import read_metrics
    from megatron_armor.orchestration.run.checkpoints import directory_bytes

    out = Path(args.out or tempfile.mkdtemp(prefix="armor-soak-"))
    ray_tmp = tempfile.mkdtemp(prefix="soak", dir="/tmp")
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    cmd = [sys.executable, "-m", "megatron_armor.cli", "train", str(REPO / "configs" / "tiny_cpu.yaml"),
           f"run.steps={args.steps}", f"run.output_dir={out}", f"run.name={args.name}", *SOAK,
           *args.overrides]  # fmt: skip
    print("soak:", " ".join(cmd[3:]), flush=True)
    start = time.perf_counter()
    code = subprocess.run(cmd, cwd=REPO, env=env).returncode
    run_dir = out / args.name
    rep = report(read_metrics(run_dir), args.steps)
    rep.update(exit_code=code, wall_s=time.perf_counter() - start, run_dir=str(run_dir),
               run_dir_end_gb=directory_bytes(run_dir) / 1e9)  # fmt: skip
    return rep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--out", default="", help="parent of the run directory (default: a temp dir)")
    p.add_argument("--name", default="soak")
    p.add_argument("--report", default="", help="report on this finished run directory only")
    p.add_argument("--json", default="", help="also write the report here")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the run")
    args = p.parse_args()
    if args.report:
        from megatron_armor.observability.metrics import read_metrics

        rep = report(read_metrics(args.report), args.steps)  # finished: reached --steps
    else:
        rep = run_soak(args)
    print(markdown(rep), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
