"""``armor compare SPEC.yaml``: named variants over seeds, side by side, with a report.

Without options: run every unfinished ``(variant, seed)`` locally, one after another
(finished runs are skipped, interrupted ones resume), then write the report. ``--report``:
only the report, from whatever the runs logged. ``--status``: the runs and where they stand.
``--slurm``: submit the unfinished runs as one Slurm array job (``slurm/compare_array.sbatch``;
extra ``sbatch`` options after ``--``, ``--max-parallel N`` tasks at once; task ``I`` runs
``slurm_tasks/I.args`` under the run root).
See docs/compare.md.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from megatron_armor.compare.spec import SpecError, load_spec, run_config, run_status


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="seeded side-by-side runs of named variants + a report")
    p.add_argument("spec", help="comparison spec YAML (docs/compare.md)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--report", action="store_true", help="only write the report")
    mode.add_argument("--status", action="store_true", help="list the runs and their state")
    mode.add_argument("--slurm", action="store_true", help="submit unfinished runs as an array")
    p.add_argument("--out", default=None, help="report folder (default: <run root>/report)")
    p.add_argument("--max-parallel", type=int, default=0, metavar="N",
                   help="--slurm: at most N array tasks at once (sbatch --array=...%%N; 0 = no limit)")  # fmt: skip
    # `armor compare SPEC --slurm -- -N 2 ...`: everything after `--` (cli/__init__.py)
    p.set_defaults(run=run, sbatch_args=[])


def _status(spec) -> int:
    for i, r in enumerate(spec.runs):
        print(f"{i:3d}  {r.label:32s} {run_status(r, run_config(r).run.steps):8s} {r.run_dir}")
    return 0


def _slurm(spec, sbatch_args: list[str], max_parallel: int) -> int:
    from megatron_armor.compare.runner import slurm_command

    cmd = slurm_command(spec, sbatch_args, max_parallel)
    if cmd is None:
        print("armor compare: every run is done; nothing to submit")
        return 0
    print(f"armor compare: {shlex.join(cmd)}")
    return subprocess.run(cmd).returncode


def _report(spec, args) -> int:
    from megatron_armor.compare.report import write_report

    command = "armor compare " + shlex.join(
        sys.argv[2:] if sys.argv[1:2] == ["compare"] else [args.spec]
    )
    out = write_report(spec, command, Path(args.out) if args.out else None)
    print(f"armor compare: report in {out}/report.md")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec, check_configs=not args.report)
    except SpecError as e:
        print(f"armor compare: {e}", file=sys.stderr)
        return 2
    if args.status:
        return _status(spec)
    if args.slurm:
        if args.max_parallel < 0:
            print(f"armor compare: --max-parallel={args.max_parallel}: must be >= 0 (0 = no "
                  "limit)", file=sys.stderr)  # fmt: skip
            return 2
        return _slurm(spec, args.sbatch_args, args.max_parallel)
    if not args.report:
        from megatron_armor.compare.runner import run_local

        code = run_local(spec)
        if code != 0:
            return code
    return _report(spec, args)
