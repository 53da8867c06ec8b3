"""``armor report RUN_DIR [--out DIR] [--gather DIR ...]``: the run's throughput page and
figures (``observability/report.py``; docs/profiling.md)."""

from __future__ import annotations

import argparse
import sys

from megatron_armor.observability.report import write_report


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report", help="where a run's time went: a markdown page and PNGs, beside the peers'"
    )
    p.add_argument("run_dir", help="run directory (metrics.jsonl, report_facts.json, config.yaml)")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/report)")
    p.add_argument("--gather", action="append", default=[], metavar="DIR",
                   help="copy the Nsight Systems reports of DIR into RUN_DIR/profile first "
                   "(launch/profile.sh passes its --out)")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        paths = write_report(args.run_dir, args.out, args.gather)
    except FileNotFoundError as e:
        print(f"armor report: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
