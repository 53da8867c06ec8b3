"""``armor config show FILE [key=value ...]``: print the resolved, validated config.

``armor config check FILE [FILE ...]`` validates several run files at once (e.g. ``configs/**``).
A pipeline file (``armor pipeline``) shows and checks both of its stages.
"""

from __future__ import annotations

import argparse
import sys

from megatron_armor.config import ConfigError, to_yaml
from megatron_armor.config.pipeline import load_any


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="inspect and validate configs")
    actions = p.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="print the resolved config")
    show.add_argument("file", help="YAML config (may name one `base:` parent)")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.alpha=0.875")
    show.set_defaults(run=run)
    check = actions.add_parser("check", help="validate config files; exit 2 if any is invalid")
    check.add_argument("files", nargs="+", help="YAML configs")
    check.set_defaults(run=run_check)


def run(args: argparse.Namespace) -> int:
    try:
        configs = load_any(args.file, args.overrides)
    except ConfigError as e:
        print(f"armor config: {e}", file=sys.stderr)
        return 2
    for label, config in configs.items():
        if len(configs) > 1:
            print(f"# --- {label}")
        print(to_yaml(config), end="")
    return 0


def run_check(args: argparse.Namespace) -> int:
    failed = 0
    for file in args.files:
        try:
            load_any(file)
        except ConfigError as e:
            failed += 1
            print(f"armor config: {e}", file=sys.stderr)
        else:
            print(f"ok {file}")
    return 2 if failed else 0
