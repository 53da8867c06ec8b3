"""Before Ray starts: does the checkpoint a run resumes from hold a model of the configured
shape, and can its optimizer state be loaded in the configured parallel layout?

A checkpoint's trainer state is megatron-core ``dist_checkpointing`` (``torch_dist``): its
``trainer/dist/.metadata`` lists every saved tensor with its global shape. Resuming a
checkpoint of another model size would otherwise fail only after start-up, inside the trainer
("Global shape mismatch"). :func:`model_shape_problem` compares the shapes that do not depend
on the parallel layout (layers, hidden size, attention and MLP widths; the vocabulary rows are
padded per TP size, so only a checkpoint with fewer rows than ``vocab_size`` is a mismatch)
with ``trainer.model_path``'s ``config.json``.

The metadata is a pickle; it is read with an unpickler that builds only the checkpoint
metadata classes of ``torch.distributed.checkpoint`` and torch's sizes and dtypes, so a
crafted file is refused here, never run (as ``torch.load(weights_only=True)`` refuses one for
the other checkpoint files, docs/orchestration.md "Checkpoints and resume").

Whether the checkpoint's optimizer state loads at the configured parallel layout is
``config/resume_layout.py``'s decision (:func:`optimizer_layout_problem` applies it): a save
records its layout and optimizer format (``parallel_layout`` in ``trainer/dist/common.pt``, read
with ``torch.load(weights_only=True)``); today's saves resume at any layout the model admits,
a ``dp_reshardable`` one at its own TP, PP, EP and expert-TP sizes.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from megatron_armor.config.resume_layout import layout_problem, read_saved_layout

METADATA = Path("trainer") / "dist" / ".metadata"
_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
)
_ALSO = {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds ``torch.distributed.checkpoint`` metadata objects and nothing else."""

    def find_class(self, module: str, name: str):
        import torch

        if module in _DCP_MODULES and (name[:1].isupper() or name.startswith("_")):
            found = super().find_class(module, name)
            if isinstance(found, type):  # dataclasses and enums, never a function
                return found
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return getattr(torch, name)
        if (module, name) in _ALSO:  # a layout by its name; the saved checkpoint path
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


def checkpoint_shapes(checkpoint: Path) -> dict[str, list[int]]:
    """``{tensor: global shape}`` of the model tensors saved in ``checkpoint`` (not the
    reference copy, not the optimizer state)."""
    with (checkpoint / METADATA).open("rb") as f:
        metadata = _MetadataUnpickler(f).load()
    skip = ("reference.", "optimizer.")
    return {
        key: list(item.size)
        for key, item in metadata.state_dict_metadata.items()
        if hasattr(item, "size") and not key.startswith(skip)
    }


def expected_shapes(hf: dict) -> dict[str, list[int | None]]:
    """Global megatron shapes a Llama-family ``config.json`` implies (``None``: depends on the
    layout); the layers are stacked along the first dimension."""
    h, layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    kv, d = hf.get("num_key_value_heads") or heads, hf.get("head_dim") or h // heads
    ffn = hf["intermediate_size"]
    return {
        "embedding.word_embeddings.weight": [None, h],
        "decoder.layers.self_attention.linear_qkv.weight": [layers, (heads + 2 * kv) * d, h],
        "decoder.layers.self_attention.linear_proj.weight": [layers, h, heads * d],
        "decoder.layers.mlp.linear_fc1.weight": [layers, 2 * ffn, h],
        "decoder.layers.mlp.linear_fc2.weight": [layers, h, ffn],
        "decoder.final_layernorm.weight": [h],
    }


def _differs(want: list[int | None], got: list[int]) -> bool:
    if len(want) != len(got):
        return True
    return any(w is not None and w != g for w, g in zip(want, got, strict=True))


def model_shape_problem(checkpoint: Path, model_path: str) -> str | None:
    """Why ``checkpoint`` cannot be resumed with the model of ``model_path`` (``None``: the
    shapes agree, or there is nothing to compare: no metadata, no ``config.json``)."""
    config = Path(model_path) / "config.json"
    if not (checkpoint / METADATA).is_file() or not config.is_file():
        return None
    hf = json.loads(config.read_text())
    hf = hf.get("text_config", hf) if isinstance(hf.get("text_config"), dict) else hf
    saved, want = checkpoint_shapes(checkpoint), expected_shapes(hf)
    wrong = [f"{k} {saved[k]} in the checkpoint, {[w if w is not None else '*' for w in want[k]]} "
             "for the model" for k in want if k in saved and _differs(want[k], saved[k])]  # fmt: skip
    rows = saved.get("embedding.word_embeddings.weight", [hf["vocab_size"]])[0]
    if rows < hf["vocab_size"]:
        wrong.append(f"{rows} vocabulary rows in the checkpoint, vocab_size={hf['vocab_size']}")
    if not wrong:
        return None
    dims = ", ".join(f"{k}={hf.get(k)}" for k in ("num_hidden_layers", "hidden_size",
                                                  "intermediate_size", "num_attention_heads"))  # fmt: skip
    return (f"{checkpoint} holds a model of another shape than trainer.model_path={model_path!r} "
            f"({dims}): {'; '.join(wrong[:3])}")  # fmt: skip


def optimizer_layout_problem(checkpoint: Path, config) -> str | None:
    """Why the optimizer state of ``checkpoint`` cannot be loaded with ``config`` (``None``:
    it can, or the checkpoint does not record its layout):
    ``config/resume_layout.layout_problem``."""
    saved = read_saved_layout(checkpoint)
    return None if saved is None else layout_problem(saved, config, str(checkpoint))
