"""A crafted checkpoint file, as an attacker with write access to a run directory would plant
it: shared by the unit and e2e tests of the safe loader."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

from megatron_armor.orchestration.run.checkpoints import write_manifest
from megatron_armor.orchestration.run.run_state import STATE_FILE


class _Exec:
    """Pickles to a call of ``os.system``: what a crafted checkpoint file would hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_crafted_pickle(checkpoint: Path, marker: Path, step: int) -> None:
    """Replace ``orchestrator.pt`` by a pickle that would create ``marker`` when loaded unsafely,
    and re-sign the manifest, so only the safe loader stands in its way."""
    with (checkpoint / STATE_FILE).open("wb") as f:
        pickle.dump({"step": _Exec(marker)}, f)
    write_manifest(checkpoint, step)


def write_checkpoint_of_model(checkpoint: Path, hf: dict, step: int) -> Path:
    """A complete checkpoint directory (manifest, ``orchestrator.pt``) whose trainer state holds
    the model tensors a megatron-core run of the HF config ``hf`` saves, as zeros in their
    global shapes (``trainer/dist``, torch_dist format; the layers stacked): what a run of
    that model size leaves, for resume checks that read the shapes before anything starts."""
    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_armor.orchestration.run.run_state import RunState

    h, layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    kv, ffn = hf.get("num_key_value_heads") or heads, hf["intermediate_size"]
    d = h // heads
    shapes = {
        "embedding.word_embeddings.weight": (hf["vocab_size"], h),
        "decoder.layers.self_attention.linear_qkv.weight": (layers, (heads + 2 * kv) * d, h),
        "decoder.layers.self_attention.linear_proj.weight": (layers, h, heads * d),
        "decoder.layers.mlp.linear_fc1.weight": (layers, 2 * ffn, h),
        "decoder.layers.mlp.linear_fc2.weight": (layers, h, ffn),
        "decoder.final_layernorm.weight": (h,),
        "output_layer.weight": (hf["vocab_size"], h),
    }
    state = {name: torch.zeros(shape) for name, shape in shapes.items()}
    dist_dir = checkpoint / "trainer" / "dist"
    dist_dir.mkdir(parents=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dist_dir)), no_dist=True)
    RunState(step=step, policy_version=step).save(checkpoint)
    (checkpoint / "meta.json").write_text(f'{{"step": {step}}}')
    write_manifest(checkpoint, step)
    return checkpoint


def plant_crafted_metadata(checkpoint: Path, marker: Path, step: int) -> None:
    """Replace the trainer's ``trainer/dist/.metadata`` by a pickle that would create
    ``marker`` when loaded unsafely (manifest re-signed)."""
    with (checkpoint / "trainer" / "dist" / ".metadata").open("wb") as f:
        pickle.dump(_Exec(marker), f)
    write_manifest(checkpoint, step)
