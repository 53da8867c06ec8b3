"""``armor tiny --out DIR``: tiny arithmetic data + a warm-started tiny Qwen2 model
(``--moe``: a tiny Qwen3-MoE, 4 experts, top-2, warm-started the same way; ``--task
long_tail``: a few problems need answers three times as long, docs/tiny.md).

Writes DIR/data/{train,val}.parquet and DIR/model, then prints the warm-started accuracy
(DAPO rule, sampling at T = 1.0 and greedy). A complete DIR is left alone unless --force.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

MOE_EXPERTS = 4
"""Experts per layer of ``armor tiny --moe`` (top-2: half of them active per token)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    from megatron_armor.tiny.task import TASKS

    p = sub.add_parser("tiny", help="make the tiny CPU task and warm-started model")
    p.add_argument("--out", default="artifacts/tiny", help="output directory")
    p.add_argument("--force", action="store_true", help="rebuild even if DIR is complete")
    p.add_argument("--seed", type=int, default=0, help="data seed")
    p.add_argument(
        "--task",
        default="arith",
        choices=sorted(TASKS),
        help="long_tail: a tenth of the problems need answers ~3x as long (docs/tiny.md)",
    )
    p.add_argument("--n-train", type=int, default=2048, help="training rows")
    p.add_argument("--n-val", type=int, default=256, help="validation rows")
    p.add_argument(
        "--target-accuracy", type=float, default=None, help="warm start stops at this accuracy"
    )
    p.add_argument("--max-steps", type=int, default=None, help="warm-start step limit")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the warm start")
    p.add_argument(
        "--moe",
        action="store_true",
        help=f"a Qwen3-MoE model ({MOE_EXPERTS} experts, top-2) instead of the dense Qwen2",
    )
    p.set_defaults(run=run)


def build_config(args: argparse.Namespace):
    """The ``TinyBuildConfig`` for the command-line settings."""
    from megatron_armor.tiny.build import TinyBuildConfig

    cfg = TinyBuildConfig(n_train=args.n_train, n_val=args.n_val, seed=args.seed, task=args.task)
    if args.moe:
        cfg = replace(cfg, model=replace(cfg.model, num_experts=MOE_EXPERTS))
    changes = {
        "target_accuracy": args.target_accuracy,
        "max_steps": args.max_steps,
        "num_threads": args.threads,
    }
    changes = {k: v for k, v in changes.items() if v is not None}
    return replace(cfg, warm_start=replace(cfg.warm_start, **changes))


def run(args: argparse.Namespace) -> int:
    from megatron_armor.tiny.build import build_tiny

    record = build_tiny(args.out, build_config(args), force=args.force)
    if record["skipped"]:
        print(f"armor tiny: {args.out} is already complete; use --force to rebuild")
    else:
        ws = record["warm_start"]
        print(
            f"warm start: {ws['steps']} steps, {ws['seconds']:.0f} s, "
            f"final loss {ws['final_loss']:.4f}"
        )
    for name, r in record["accuracy"].items():
        print(f"accuracy {name}: {r['summary']}")
    paths = record["paths"]
    print(f"model: {paths['model']}\ndata: {paths['train']} {paths['val']}")
    if not record["skipped"]:
        print(f"done in {record['seconds']:.0f} s")
    return 0
