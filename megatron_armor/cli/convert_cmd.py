"""``armor convert --to-hf CKPT --model HF_DIR --out DIR``: a trainer checkpoint as an HF model.

``CKPT`` is a run checkpoint (``run_dir/checkpoints/step_XXXXXX``) or its ``trainer/``
directory; ``HF_DIR`` the HF model the run started from (architecture, tokenizer).
``armor convert --to-hf RUN_DIR best --out DIR`` names a checkpoint of a run instead: ``best``
(``run.keep_best``), ``latest`` or a step; ``--model`` and ``--precision`` then default to the
run's ``config.yaml``.
With a checkpoint path, ``--precision`` defaults to the ``trainer.precision`` in the
``config.yaml`` of the run above it; the written ``config.json`` names the tensors' dtype and
holds the run's ``trainer.model_overrides`` (RoPE as ``rope_parameters`` and the flat
``rope_theta``, ``max_position_embeddings``), so transformers, SGLang and vLLM load the model
the run trained.
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


def resolve_source(args: argparse.Namespace) -> tuple[str, str, str, dict]:
    """``(checkpoint, model_dir, precision, model_overrides)`` from the arguments (see module
    docstring); the overrides are the run's ``trainer.model_overrides``."""
    if args.name is None:
        if args.model is None:
            raise ValueError("--model HF_DIR is needed with a checkpoint path (or give a run "
                             "directory and a name: --to-hf RUN_DIR best)")  # fmt: skip
        trainer = run_trainer_settings(args.to_hf)
        if trainer is None and args.precision is None:
            raise ValueError(
                f"--to-hf {args.to_hf}: no config.yaml of its run found above it; pass "
                "--precision (the run's trainer.precision: bf16, fp16 or fp32)"
            )
        trainer = trainer or {}
        precision = args.precision or str(trainer["precision"])
        return args.to_hf, args.model, precision, overrides_of(trainer)
    from omegaconf import OmegaConf

    from megatron_armor.orchestration.run.checkpoints import named_checkpoint

    checkpoint = named_checkpoint(args.to_hf, args.name)
    saved = Path(args.to_hf) / "config.yaml"
    trainer = OmegaConf.load(saved).trainer if saved.is_file() else {}
    model = args.model or trainer.get("model_path")
    if not model:
        raise ValueError(f"{saved} missing: pass --model HF_DIR (the model the run started from)")
    precision = args.precision or trainer.get("precision", "bf16")
    return str(checkpoint), model, precision, overrides_of(trainer)


def overrides_of(trainer) -> dict:
    """``trainer.model_overrides`` of a saved config's trainer section, as a plain dict."""
    from omegaconf import OmegaConf

    found = trainer.get("model_overrides") if trainer else None
    return OmegaConf.to_container(found) if OmegaConf.is_config(found) else dict(found or {})


def run_trainer_settings(checkpoint: str):
    """The ``trainer`` section of the ``config.yaml`` of the run that wrote ``checkpoint``
    (``None`` when there is none above it)."""
    from omegaconf import OmegaConf

    path = Path(checkpoint).resolve()
    for run_dir in (path.parent.parent, path.parent.parent.parent):  # step_X/ or step_X/trainer/
        if (run_dir / "config.yaml").is_file():
            return OmegaConf.load(run_dir / "config.yaml").trainer
    return None


def run(args: argparse.Namespace) -> int:
    from megatron_armor.trainer.convert import convert_to_hf

    try:
        checkpoint, model, precision, overrides = resolve_source(args)
        n = convert_to_hf(checkpoint, model, args.out, args.weights, precision, overrides)
    except (FileNotFoundError, ValueError) as e:
        print(f"armor convert: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} tensors from {checkpoint} to {args.out}")
    if overrides:
        print(f"config.json holds the run's trainer.model_overrides: {overrides}")
    return 0
