"""``trainer.model_overrides`` resolved once into the form every reader of the model agrees on.

The overrides are ``config.json`` fields the recipe trains *and* serves with (docs/weight-sync.md,
"One model, one config"): the trainer reads them on top of ``config.json``
(``trainer/model.py``), the embedded engine passes them to transformers, and the SGLang servers
get them as ``--json-model-override-args``.

RoPE is the field where the three can silently disagree. transformers 5 reads the base and the
scaling from ``rope_parameters``; a ``config.json`` written by transformers 4 keeps
``rope_theta`` / ``rope_scaling`` flat, and transformers 5 folds them into ``rope_parameters``
when it loads the file. SGLang applies its override arguments to the *loaded* config with
``setattr`` (merging a ``rope_parameters`` dict into the one there), so a flat ``rope_theta``
override lands on an attribute its Qwen2 model no longer reads: the servers would sample with the
model's own base while the trainer scores with the override. :func:`resolve_model_overrides`
therefore moves every RoPE override into one ``rope_parameters`` dict (the model's own, from
either layout, updated with the override), and all three readers get that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")
DEFAULT_ROPE_THETA = 10000.0


def read_hf_config(model_path: str) -> dict | None:
    """``model_path/config.json`` as a dict, or ``None`` when there is none (yet)."""
    if not model_path:
        return None
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # named by the input check (config/inputs.py)
    if not isinstance(cfg, dict):
        return None
    return cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg


def _scaling(value: dict) -> dict:
    """A ``rope_scaling`` dict in ``rope_parameters`` spelling (``type`` -> ``rope_type``)."""
    out = dict(value)
    kind = out.pop("type", None)
    if kind is not None:
        out.setdefault("rope_type", kind)
    return out


def model_rope_parameters(hf_config: dict) -> dict:
    """The model's own RoPE settings as a ``rope_parameters`` dict, from either layout of
    ``config.json`` (``rope_parameters``, or flat ``rope_theta`` + ``rope_scaling``)."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and params:
        return dict(params)
    out = _scaling(hf_config.get("rope_scaling") or {"rope_type": "default"})
    out["rope_theta"] = float(hf_config.get("rope_theta", DEFAULT_ROPE_THETA))
    return out


def resolve_model_overrides(hf_config: dict, overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` with every RoPE key (:data:`ROPE_KEYS`) folded into one complete
    ``rope_parameters``: the model's own (:func:`model_rope_parameters`) updated with the
    override's ``rope_scaling``, then ``rope_parameters``, then ``rope_theta``. Other keys are
    kept as they are; without a RoPE override nothing is added."""
    out = {k: v for k, v in overrides.items() if k not in ROPE_KEYS}
    if not any(k in overrides for k in ROPE_KEYS):
        return out
    params = model_rope_parameters(hf_config)
    if isinstance(overrides.get("rope_scaling"), dict):
        params.update(_scaling(overrides["rope_scaling"]))
    if isinstance(overrides.get("rope_parameters"), dict):
        params.update(overrides["rope_parameters"])
    if "rope_theta" in overrides:
        params["rope_theta"] = float(overrides["rope_theta"])
    out["rope_parameters"] = params
    return out


def merged_hf_config(hf_config: dict, overrides: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` as the trainer and the engines see it: ``hf_config`` with
    :func:`resolve_model_overrides` on top."""
    return {**hf_config, **resolve_model_overrides(hf_config, overrides)}
