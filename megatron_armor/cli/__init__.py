"""``armor`` command line: one module per subcommand, each with ``add_parser`` and ``run``.

Adding a subcommand is one module in this package plus one line in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "config": "megatron_armor.cli.config_cmd",
    "train": "megatron_armor.cli.train_cmd",
    "eval": "megatron_armor.cli.eval_cmd",
    "tiny": "megatron_armor.cli.tiny_cmd",
    "convert": "megatron_armor.cli.convert_cmd",
    "plan": "megatron_armor.cli.plan_cmd",
    "plot": "megatron_armor.cli.plot_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="armor", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # subcommand not shipped in this build
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
