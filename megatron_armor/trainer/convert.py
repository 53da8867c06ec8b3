"""Megatron trainer checkpoint -> HF model directory (``armor convert --to-hf``).

Runs in one process (TP=1, PP=1 on gloo or one GPU): builds the model from the original HF
``config.json``, loads the ``model`` (or ``reference``) weights from the checkpoint's
``dist_checkpointing`` directory — which reshards from whatever TP/PP it was saved with — and
writes the exported HF tensors as ``model.safetensors`` next to a copy of the tokenizer files
and of ``config.json`` whose ``torch_dtype`` (``dtype``) names the dtype of those tensors and
which holds the run's ``trainer.model_overrides`` (:func:`write_hf_config`): the exported
directory is the model the run trained and served, for every reader of ``config.json``.
"""

from __future__ import annotations

import json
import os
import shutil

from megatron_armor.config.model_overrides import ROPE_KEYS, merged_hf_config
from megatron_armor.config.schema import TrainerConfig
from megatron_armor.net import free_port

HF_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_COPIED = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def dist_dir_of(checkpoint: str) -> str:
    """The ``dist/`` directory of a trainer checkpoint (or of a run checkpoint's ``trainer/``)."""
    for candidate in (
        os.path.join(checkpoint, "dist"),
        os.path.join(checkpoint, "trainer", "dist"),
    ):
        if os.path.isdir(candidate):
            return candidate
    raise FileNotFoundError(
        f"{checkpoint!r} is not a trainer checkpoint: neither dist/ nor trainer/dist/ exists"
    )


def convert_to_hf(
    checkpoint: str,
    model_dir: str,
    out_dir: str,
    weights: str = "policy",
    precision: str = "fp32",
    overrides: dict | None = None,
) -> int:
    """Write ``out_dir`` (HF format) from ``checkpoint``; returns the number of tensors written.

    ``model_dir`` is the HF directory the run started from (architecture and tokenizer);
    ``weights`` is ``policy`` or ``reference``; ``precision`` must match ``trainer.precision``
    of the run that wrote the checkpoint; ``overrides`` is its ``trainer.model_overrides``.
    """
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    from megatron_armor.trainer import parallel
    from megatron_armor.trainer.checkpoint import REFERENCE_PREFIX
    from megatron_armor.trainer.hf_weights import export_hf_weights
    from megatron_armor.trainer.model import build_model, read_hf_spec

    if weights not in ("policy", "reference"):
        raise ValueError(f"--weights {weights!r}: use policy or reference")
    source = dist_dir_of(checkpoint)
    parallel.init_parallel(parallel.ParallelLayout(), 0, 1, master_port=free_port())
    try:
        spec = read_hf_spec(model_dir, overrides)
        model = build_model(spec, TrainerConfig(precision=precision))
        prefix = REFERENCE_PREFIX if weights == "reference" else ""
        key = "reference" if weights == "reference" else "model"
        loaded = dist_checkpointing.load({key: model.sharded_state_dict(prefix=prefix)}, source)
        model.load_state_dict({k.removeprefix(prefix): v for k, v in loaded[key].items()})
        tensors = dict(export_hf_weights(model, spec))
    finally:
        parallel.destroy_parallel()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for name in _COPIED:
        if os.path.exists(os.path.join(model_dir, name)):
            shutil.copy(os.path.join(model_dir, name), os.path.join(out_dir, name))
    write_hf_config(model_dir, out_dir, HF_DTYPE_NAMES[precision], overrides)
    return len(tensors)


def exported_hf_config(hf_config: dict, overrides: dict | None) -> dict:
    """``hf_config`` under ``overrides`` as the trainer and the engines read it
    (``config/model_overrides.py``: RoPE in one ``rope_parameters``), with the flat
    ``rope_theta`` / ``rope_scaling`` of transformers 4 set to the same values, so that a
    reader of either layout (transformers 4 or 5, SGLang, vLLM) gets the trained RoPE: a stale
    flat ``rope_scaling`` would otherwise replace ``rope_parameters`` in transformers 5."""
    cfg = merged_hf_config(hf_config, overrides or {})
    params = cfg.get("rope_parameters")
    if any(k in (overrides or {}) for k in ROPE_KEYS) and isinstance(params, dict):
        cfg["rope_theta"] = params["rope_theta"]
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        cfg["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    return cfg


def write_hf_config(
    model_dir: str, out_dir: str, dtype: str, overrides: dict | None = None
) -> None:
    """``model_dir/config.json`` under the run's ``overrides`` (:func:`exported_hf_config`)
    with ``torch_dtype`` (and ``dtype``, its newer name) set to the dtype of the written
    tensors."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = exported_hf_config(json.load(f), overrides)
    cfg["torch_dtype"] = dtype
    if "dtype" in cfg:
        cfg["dtype"] = dtype
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
