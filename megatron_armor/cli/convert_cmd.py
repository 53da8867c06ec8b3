"""``armor convert --to-hf CKPT --model HF_DIR --out DIR``: a trainer checkpoint as an HF model.

``CKPT`` is a run checkpoint (``run_dir/checkpoints/step_XXXXXX``) or its ``trainer/``
directory; ``HF_DIR`` the HF model the run started from (architecture, tokenizer).
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert a trainer checkpoint to an HF model directory")
    p.add_argument("--to-hf", required=True, metavar="CKPT", help="checkpoint directory")
    p.add_argument("--model", required=True, help="HF model directory the run started from")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument(
        "--weights", default="policy", choices=("policy", "reference"), help="which weights"
    )
    p.add_argument(
        "--precision",
        default="bf16",
        choices=("bf16", "fp16", "fp32"),
        help="trainer.precision of the run (the dtype the weights were saved in)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_armor.trainer.convert import convert_to_hf

    try:
        n = convert_to_hf(args.to_hf, args.model, args.out, args.weights, args.precision)
    except (FileNotFoundError, ValueError) as e:
        print(f"armor convert: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} tensors to {args.out}")
    return 0
