"""Write HF-named tensors as an HF model directory (for ``update_weights_from_disk``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable

import torch
from safetensors.torch import save_file

CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "vocab.json", "merges.txt")  # fmt: skip


def save_hf_dir(
    named_tensors: Iterable[tuple[str, torch.Tensor]], src_model_dir: str, out_dir: str
) -> str:
    """Save tensors to ``out_dir/model.safetensors`` next to the config/tokenizer files of
    ``src_model_dir``. Written to a temp dir and renamed, so a reader never sees half a model."""
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in CONFIG_FILES:
        src = os.path.join(src_model_dir, name)
        if os.path.exists(src):
            shutil.copy2(src, tmp)
    # Tied weights share storage; safetensors needs distinct, contiguous CPU tensors.
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in named_tensors}
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir
