"""``armor config show FILE [key=value ...]``: print the resolved, validated config."""

from __future__ import annotations

import argparse
import sys

from megatron_armor.config import ConfigError, load_config, to_yaml


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="inspect configs")
    actions = p.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="print the resolved config")
    show.add_argument("file", help="YAML config (may name one `base:` parent)")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.alpha=0.875")
    show.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file, args.overrides)
    except ConfigError as e:
        print(f"armor config: {e}", file=sys.stderr)
        return 2
    print(to_yaml(config), end="")
    return 0
