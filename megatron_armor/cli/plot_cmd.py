"""``armor plot RUN_DIR [--out DIR]``: write PNG curves of a run (see observability/plot.py)."""

from __future__ import annotations

import argparse
import sys

from megatron_armor.observability.plot import plot_run


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="write PNG curves of a run directory")
    p.add_argument("run_dir", help="run directory holding metrics.jsonl")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        paths = plot_run(args.run_dir, args.out)
    except FileNotFoundError as e:
        print(f"armor plot: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
