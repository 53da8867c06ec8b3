"""``armor data [NAME ...] [--source NAME=PATH ...] [--out DIR]``: the paper's data files.

Writes ``DIR/<name>.parquet`` (default ``data/``, the paths ``configs/base.yaml`` reads) for
the training set ``dapo-math-17k`` (deduplicated) and the benchmarks ``aime24``, ``aime25``,
``amc23``, ``math500``. A name without ``--source`` is loaded from the hub (needs network);
``--source NAME=PATH`` reads a local parquet/jsonl/json file, a directory of them or a
``save_to_disk`` directory (or another hub name). No name and no source: all five from the
hub; ``all`` names every one (docs/data_reward.md, "Preparing the paper's data").
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    from megatron_armor.data.sources import TARGETS

    listing = "\n".join(f"  {t.name:14} {t.title}; hub: {t.hub}" for t in TARGETS.values())
    p = sub.add_parser(
        "data",
        help="prepare DAPO-Math-17k, AIME24/25, AMC23, MATH-500 into data/*.parquet",
        description="Prepare the paper's training set and benchmarks as parquet files in the "
        "project's schemas (docs/data_reward.md).",
        epilog=f"datasets:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="datasets to prepare, or `all`")
    p.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="read NAME from a local file/directory (or hub name) instead of its hub copy",
    )
    p.add_argument("--out", default="data", help="output directory (default: data)")
    p.add_argument(
        "--keep-duplicates", action="store_true", help="keep repeated rows (default: drop them)"
    )
    p.set_defaults(run=run)


def parse_sources(values: list[str]) -> dict[str, str]:
    """``NAME=PATH`` pairs; a malformed or repeated one is an error naming it."""
    sources: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(
                f"--source {value!r}: expected NAME=PATH, e.g. aime24=raw/aime24.jsonl"
            )
        if name in sources:
            raise ValueError(f"--source: {name!r} given twice ({sources[name]!r}, {path!r})")
        sources[name] = path
    return sources


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_armor.data.prepare import chosen_targets, prepare_one

    try:
        sources = parse_sources(args.source)
        for name in chosen_targets(args.names, sources):  # each line as soon as its file is written
            report = prepare_one(name, sources.get(name), Path(args.out), not args.keep_duplicates)
            print(report.line(), flush=True)
            for warning in report.warnings:
                print(f"armor data: warning: {warning}", file=sys.stderr, flush=True)
    except (OSError, ValueError) as e:
        print(f"armor data: {e}", file=sys.stderr)
        return 2
    return 0
