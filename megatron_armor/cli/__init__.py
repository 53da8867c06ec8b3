"""``armor`` command line: one module per subcommand, each with ``add_parser`` and ``run``.

Adding a subcommand is one module in this package plus one line in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from megatron_armor import env_settings
from megatron_armor.cli import supervise
from megatron_armor.supervisor_pipe import ENV, adopt_pipe, tell_supervisor

SUBCOMMANDS = {
    "config": "megatron_armor.cli.config_cmd",
    "train": "megatron_armor.cli.train_cmd",
    "eval": "megatron_armor.cli.eval_cmd",
    "tiny": "megatron_armor.cli.tiny_cmd",
    "convert": "megatron_armor.cli.convert_cmd",
    "plan": "megatron_armor.cli.plan_cmd",
    "plot": "megatron_armor.cli.plot_cmd",
    "report": "megatron_armor.cli.report_cmd",
    "pipeline": "megatron_armor.cli.pipeline_cmd",
    "compare": "megatron_armor.cli.compare_cmd",
    "doctor": "megatron_armor.cli.doctor_cmd",
    "data": "megatron_armor.cli.data_cmd",
    "status": "megatron_armor.cli.status_cmd",
}


CHECKPOINT_ON_SIGNAL = ("train", "pipeline")
"""Subcommands whose run checkpoints on SIGTERM/SIGINT/SIGUSR1 and exits 75: they hold those
signals from the first line (``ray_node.held_stop_signals``), so one that arrives while the
command imports torch and Ray reaches the run's handler instead of killing the process. Run
as a process (``armor train ...``), the driver is a child of that process, which names a loss
of Ray's control plane (``cli/supervise.py``)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="armor", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    checked = ENV in os.environ  # a driver: its armor parent checked the same environment
    if not checked and env_settings.report(os.environ, "armor"):  # every ARMOR_* setting
        return 2
    if supervise.wanted(argv, CHECKPOINT_ON_SIGNAL):
        return supervise.supervise(sys.argv[1:])  # the driver runs as its child
    command = (sys.argv[1:] if argv is None else argv)[:1]
    if command and command[0] in CHECKPOINT_ON_SIGNAL:
        from megatron_armor.orchestration.actors.ray_node import held_stop_signals

        with held_stop_signals():  # before any import starts a thread: every thread inherits it
            return run_driver(argv)
    return run_command(argv)


def run_driver(argv: list[str] | None) -> int:
    """``run_command`` of a training driver; under a supervising ``armor`` parent
    (``cli/supervise.py``) it dies with that parent and reports that it exits through Python
    (an exit Ray's C++ core forces does not)."""
    parent = adopt_pipe()
    if parent is not None:
        supervise.die_with_parent(parent)
    try:
        code = run_command(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        raise
    except BaseException:
        code = 1
        raise
    finally:
        tell_supervisor("exit", code)
    return code


def run_command(argv: list[str] | None) -> int:
    args = parse_command_line(list(sys.argv[1:] if argv is None else argv))
    return int(args.run(args) or 0)


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """``armor ARGV`` parsed as the command runs it (argparse exits 2 on a bad line)."""
    parser = build_parser()
    # Everything after `--` goes to a subcommand that passes it on (`armor compare SPEC
    # --slurm -- -N 2 ...`: its ``sbatch_args``), never to argparse.
    passed_on = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    args, extra = parser.parse_known_args(argv)
    if passed_on and not hasattr(args, "sbatch_args"):
        parser.error(f"unrecognized arguments: -- {' '.join(passed_on)}")
    if passed_on:
        args.sbatch_args = passed_on
    # Dotted overrides may follow options (`armor plan cfg --gpu-mem 80 a.b=1`).
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    unknown = [a for a in extra if a not in overrides]
    if unknown or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or overrides)}")
    if overrides:
        args.overrides = list(args.overrides or []) + overrides
    return args


if __name__ == "__main__":
    sys.exit(main())
