"""``armor convert --to-hf CKPT --model HF_DIR --out DIR``: a trainer checkpoint as an HF model.

``CKPT`` is a run checkpoint (``run_dir/checkpoints/step_XXXXXX``) or its ``trainer/``
directory; ``HF_DIR`` the HF model the run started from (architecture, tokenizer).
``armor convert --to-hf RUN_DIR best --out DIR`` names a checkpoint of a run instead: ``best``
(``run.keep_best``), ``latest`` or a step; ``--model`` and ``--precision`` then default to the
run's ``config.yaml``.
With a checkpoint path, ``--precision`` defaults to the ``trainer.precision`` in the
``config.yaml`` of the run above it; the written ``config.json`` names the tensors' dtype.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert a trainer checkpoint to an HF model directory")
    p.add_argument("--to-hf", required=True, metavar="CKPT|RUN_DIR",
                   help="checkpoint directory, or a run directory with NAME")  # fmt: skip
    p.add_argument("name", nargs="?", default=None,
                   help="with a run directory: best | latest | STEP")  # fmt: skip
    p.add_argument("--model", default=None,
                   help="HF model directory the run started from (default with NAME: the run's)")  # fmt: skip
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument(
        "--weights", default="policy", choices=("policy", "reference"), help="which weights"
    )
    p.add_argument(
        "--precision",
        default=None,
        choices=("bf16", "fp16", "fp32"),
        help="trainer.precision of the run (default: read from the run's config.yaml)",
    )
    p.set_defaults(run=run)


def resolve_source(args: argparse.Namespace) -> tuple[str, str, str]:
    """``(checkpoint, model_dir, precision)`` from the arguments (see module docstring)."""
    if args.name is None:
        if args.model is None:
            raise ValueError("--model HF_DIR is needed with a checkpoint path (or give a run "
                             "directory and a name: --to-hf RUN_DIR best)")  # fmt: skip
        return args.to_hf, args.model, args.precision or run_precision(args.to_hf)
    from omegaconf import OmegaConf

    from megatron_armor.orchestration.run.checkpoints import named_checkpoint

    checkpoint = named_checkpoint(args.to_hf, args.name)
    saved = Path(args.to_hf) / "config.yaml"
    trainer = OmegaConf.load(saved).trainer if saved.is_file() else {}
    model = args.model or trainer.get("model_path")
    if not model:
        raise ValueError(f"{saved} missing: pass --model HF_DIR (the model the run started from)")
    return str(checkpoint), model, args.precision or trainer.get("precision", "bf16")


def run_precision(checkpoint: str) -> str:
    """``trainer.precision`` from the ``config.yaml`` of the run that wrote ``checkpoint``."""
    from omegaconf import OmegaConf

    path = Path(checkpoint).resolve()
    for run_dir in (path.parent.parent, path.parent.parent.parent):  # step_X/ or step_X/trainer/
        if (run_dir / "config.yaml").is_file():
            return str(OmegaConf.load(run_dir / "config.yaml").trainer.precision)
    raise ValueError(
        f"--to-hf {checkpoint}: no config.yaml of its run found above it; pass --precision "
        "(the run's trainer.precision: bf16, fp16 or fp32)"
    )


def run(args: argparse.Namespace) -> int:
    from megatron_armor.trainer.convert import convert_to_hf

    try:
        checkpoint, model, precision = resolve_source(args)
        n = convert_to_hf(checkpoint, model, args.out, args.weights, precision)
    except (FileNotFoundError, ValueError) as e:
        print(f"armor convert: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} tensors from {checkpoint} to {args.out}")
    return 0
