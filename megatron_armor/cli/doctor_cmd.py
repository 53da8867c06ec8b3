"""``armor doctor [CONFIG] [key=value ...] [--json PATH]``: pre-flight of one node.

Versions, GPUs, the pinned GPU stack, a TE FP8 GEMM under the configured recipe, CUDA IPC and
an NCCL all-reduce between independent processes, an SGLang server with one weight update
through the configured transport checked against the trainer's log-probs, one trainer step.
Prints a table (and JSON with ``--json``); exit code 1 when any check failed, 2 on a config
error. On a CPU machine the GPU checks are listed as ``n/a`` with the reason (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_armor.config import ConfigError, load_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check this node's GPU stack before a long job")
    p.add_argument("file", nargs="?", default=None, help="YAML config (default: the defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.fp8.enabled=true")
    p.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_armor.doctor.report import exit_code, render, write_json
    from megatron_armor.doctor.run import run_all

    file, overrides = args.file, list(args.overrides or [])
    if file is not None and "=" in file and not os.path.exists(file):
        file, overrides = None, [file, *overrides]  # `armor doctor a.b=1`: no config file
    try:
        config = load_config(file, overrides)
    except (ConfigError, ValueError) as e:
        print(f"armor doctor: {e}", file=sys.stderr)
        return 2
    results = run_all(config)
    render(results)
    if args.json_path:
        write_json(results, args.json_path)
    return exit_code(results)
