"""``armor doctor [CONFIG] [key=value ...] [--json PATH] [--check NAME] [--all-nodes]``: pre-flight.

Versions, GPUs, the pinned GPU stack, a TE FP8 GEMM under the configured recipe, CUDA IPC and
an NCCL all-reduce between independent processes, an SGLang server with one weight update
through the configured transport checked against the trainer's log-probs, one trainer step.
Prints a table (and JSON with ``--json``); exit code 1 when any check failed, 2 on a config
error. On a CPU machine the GPU checks are listed as ``n/a`` with the reason (docs/gpu.md).
``--all-nodes`` under ``srun --ntasks-per-node=1`` adds a cross-node all-reduce with its
bandwidth and prints every node's table from rank 0 (``doctor/cluster.py``, docs/slurm.md).
``ARMOR_ENV=<preset>`` applies ``slurm/env/<preset>.sh`` first, as the sbatch files do.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_armor.config import ConfigError, load_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    from megatron_armor.doctor.cluster import ALL_REDUCE_TIMEOUT_S

    p = sub.add_parser("doctor", help="check this node's GPU stack before a long job")
    p.add_argument("file", nargs="?", default=None, help="YAML config (default: the defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.fp8.enabled=true")
    p.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    p.add_argument(
        "--check",
        action="append",
        default=None,
        metavar="NAME",
        help="run only the checks whose names start with NAME (repeatable), e.g. --check NCCL",
    )
    p.add_argument(
        "--all-nodes",
        action="store_true",
        help="under `srun --ntasks-per-node=1`: every node's checks plus a cross-node all-reduce",
    )
    p.add_argument(
        "--all-reduce-timeout-s",
        type=float,
        default=ALL_REDUCE_TIMEOUT_S,
        metavar="S",
        help="with --all-nodes: seconds for joining the group and the all-reduces "
        f"(default {ALL_REDUCE_TIMEOUT_S:g})",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_armor.doctor.preset import apply_env_preset
    from megatron_armor.doctor.report import exit_code, render, write_json
    from megatron_armor.doctor.run import run_all

    file, overrides = args.file, list(args.overrides or [])
    if file is not None and "=" in file and not os.path.exists(file):
        file, overrides = None, [file, *overrides]  # `armor doctor a.b=1`: no config file
    try:
        applied = apply_env_preset()  # ARMOR_ENV: the cluster preset's NCCL settings, as a job's
        if applied:
            print(f"armor doctor: {applied}", flush=True)
        config = load_config(file, overrides)
    except (ConfigError, ValueError) as e:
        print(f"armor doctor: {e}", file=sys.stderr)
        return 2
    try:
        if args.all_nodes:
            return run_all_nodes(config, args)
        results = run_all(config, args.check)
    except ValueError as e:
        print(f"armor doctor: {e}", file=sys.stderr)
        return 2
    render(results)
    if args.json_path:
        write_json(results, args.json_path)
    return exit_code(results)


def run_all_nodes(config, args: argparse.Namespace) -> int:
    """This node's checks, the cross-node all-reduce, and (rank 0) every node's table."""
    from megatron_armor.doctor.cluster import cross_node_reports, slurm_placement
    from megatron_armor.doctor.report import render, write_nodes_json
    from megatron_armor.doctor.run import run_all, selected

    place = slurm_placement()  # outside srun: ValueError, exit 2 before any check
    selected(config, args.check)  # a misspelt --check: exit 2 on every node, before the checks
    if args.all_reduce_timeout_s <= 0:
        raise ValueError(
            f"--all-reduce-timeout-s={args.all_reduce_timeout_s:g}: give a number of seconds > 0"
        )
    reports = cross_node_reports(place, run_all(config, args.check), args.all_reduce_timeout_s)
    for node in reports:
        render(
            node.checks, title=f"armor doctor: node {node.node_id} ({node.host}, rank {node.rank})"
        )
    if args.json_path and place.rank == 0:
        write_nodes_json(reports, args.json_path)
    if place.rank == 0:
        failed = [f"{n.host} (node {n.node_id})" for n in reports if not n.ok]
        print(f"armor doctor --all-nodes: {len(reports)} nodes, "
              f"{'failed: ' + ', '.join(failed) if failed else 'all ok'}", flush=True)  # fmt: skip
    return int(any(not n.ok for n in reports))
