"""HF <-> megatron-core weights for the Llama family (Qwen2/2.5, Qwen3, Qwen3-MoE, Llama 3).

The name map (:func:`map_param`) says, for each megatron parameter of a ``GPTModel`` built
with the local or the Transformer Engine spec, which HF tensors it is made of and how it is
sharded over tensor parallelism:

===========  ==========================================  =====================================
kind         megatron layout of one TP shard             HF tensors
===========  ==========================================  =====================================
replicated   full copy                                   one (norms)
vocab        rows ``[r*Vp/tp, (r+1)*Vp/tp)`` of the      ``embed_tokens`` / ``lm_head``
             padded vocabulary (rows >= V are zero)
column       rows ``[r*n/tp, (r+1)*n/tp)``                -
row          columns ``[r*n/tp, (r+1)*n/tp)``             ``o_proj``, ``down_proj``
qkv          rows ``[r*n/tp, (r+1)*n/tp)`` of the fused  ``q_proj``, ``k_proj``, ``v_proj``
             ``[q heads of g; k_g; v_g]`` for each KV    (weight and bias)
             group g (GQA; part of one group when
             ``tp > num_key_value_heads``)
gate_up      ``[gate rows of r; up rows of r]``           ``gate_proj``, ``up_proj``
===========  ==========================================  =====================================

A mixture-of-experts model (Qwen3-MoE) adds its routers (replicated) and experts
(``gate_up`` / ``row`` over the expert-tensor-parallel group, each expert-parallel rank holding
its own experts): ``moe_weights.py`` names them; their export gathers every EP rank's experts.

Layer ``i`` of a pipeline stage is HF layer ``offset + i`` (``offset`` from the stage's first
``TransformerLayer.layer_number``). Loading reads only this rank's slices with safetensors
``get_slice``; exporting TP-gathers every parameter of the stage and yields full HF tensors.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import safe_open

from megatron_armor.trainer import parallel
from megatron_armor.trainer.model import HFModelSpec
from megatron_armor.trainer.moe_weights import gather_expert_parts, gather_over_ep, moe_hf_source

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# megatron suffix inside a layer -> (kind, HF suffixes inside ``model.layers.{i}.``)
_LAYER_MAP: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.linear_qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}


@dataclass(frozen=True)
class ParamMap:
    """How one megatron parameter is made of HF tensors."""

    kind: str
    hf_names: tuple[str, ...]
    expert: bool = False
    """An expert's weight: split over the expert-tensor-parallel group, one expert per slot of
    each expert-parallel rank (``moe_weights.py``)."""


def layer_offset(model) -> int:
    """Global index of this stage's first transformer layer."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def map_param(name: str, spec: HFModelSpec, offset: int) -> ParamMap | None:
    """The HF tensors behind megatron parameter ``name`` (``None``: not an HF weight)."""
    if name == "embedding.word_embeddings.weight":
        return ParamMap("vocab", ("model.embed_tokens.weight",))
    if name == "output_layer.weight":
        hf = "model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"
        return ParamMap("vocab", (hf,))
    if name == "decoder.final_layernorm.weight":
        return ParamMap("replicated", ("model.norm.weight",))
    match = _LAYER.match(name)
    if match is None or match.group(2) not in _LAYER_MAP:
        return map_moe_param(name, spec, offset) if spec.moe is not None else None
    kind, suffixes = _LAYER_MAP[match.group(2)]
    prefix = f"model.layers.{offset + int(match.group(1))}."
    return ParamMap(kind, tuple(prefix + s for s in suffixes))


def map_moe_param(
    name: str, spec: HFModelSpec, offset: int, ep_rank: int | None = None
) -> ParamMap | None:
    """:func:`map_param` of a router or expert parameter as held by expert-parallel rank
    ``ep_rank`` (default: this rank's)."""
    rank = parallel.ep_rank() if ep_rank is None else ep_rank
    found = moe_hf_source(name, spec.moe.num_experts, offset, rank, parallel.ep_size())
    return None if found is None else ParamMap(found[0], found[1], found[2])


def unwrap(model):
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


# --- loading ---------------------------------------------------------------------------------


class SafetensorsDir:
    """Lazy reader of an HF safetensors directory (single file or sharded with an index)."""

    def __init__(self, model_dir: str):
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        else:
            path = os.path.join(model_dir, "model.safetensors")
            with safe_open(path, "pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        self.dir = model_dir
        self.weight_map = weight_map
        self._handles: dict[str, object] = {}

    def slice(self, name: str):
        """A safetensors slice object for ``name`` (index it to read only those elements)."""
        if name not in self.weight_map:
            raise KeyError(f"{name!r} not found in the safetensors of {self.dir!r}")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(os.path.join(self.dir, file), "pt")
        return self._handles[file].get_slice(name)


def _rows(n: int, r: int, tp: int) -> slice:
    part = n // tp
    return slice(r * part, (r + 1) * part)


def _read_vocab(src: SafetensorsDir, name: str, shape: torch.Size, r: int) -> torch.Tensor:
    sl = src.slice(name)
    vocab = sl.get_shape()[0]
    lo = r * shape[0]
    hi = min(lo + shape[0], vocab)
    out = torch.zeros(shape, dtype=sl[0:1].dtype)
    if hi > lo:
        out[: hi - lo] = sl[lo:hi]
    return out


def _read_qkv(src: SafetensorsDir, names, spec: HFModelSpec, r: int, tp: int) -> torch.Tensor:
    """Rows ``[r*N/tp, (r+1)*N/tp)`` of the fused, group-interleaved QKV tensor
    ``[kv groups, q_per_group + 2, d, ...]`` (``N`` rows in all), as megatron-core's
    ``ColumnParallelLinear`` splits it. With ``tp <= num_kv_heads`` that is whole groups; with
    ``tp > num_kv_heads`` (megatron-core replicates KV heads: each rank holds a part of one
    group, all-gathers the group in the forward pass and keeps its own q heads,
    ``transformer/attention.py: get_query_key_value_tensors``) a part of one group."""
    d, q_per_group = spec.head_dim, spec.num_heads // spec.num_kv_heads
    group_rows = (q_per_group + 2) * d
    per_rank = spec.num_kv_heads * group_rows // tp
    lo, hi = r * per_rank, (r + 1) * per_rank
    g0, g1 = lo // group_rows, -(-hi // group_rows)  # the groups that hold rows [lo, hi)
    q = src.slice(names[0])[g0 * q_per_group * d : g1 * q_per_group * d]
    k = src.slice(names[1])[g0 * d : g1 * d]
    v = src.slice(names[2])[g0 * d : g1 * d]
    tail, groups = q.shape[1:], g1 - g0
    parts = [
        q.reshape(groups, q_per_group * d, *tail),
        k.reshape(groups, d, *tail),
        v.reshape(groups, d, *tail),
    ]
    fused = torch.cat(parts, dim=1).reshape(-1, *tail)
    return fused[lo - g0 * group_rows : hi - g0 * group_rows]


def read_shard(
    src: SafetensorsDir, pmap: ParamMap, shape: torch.Size, spec: HFModelSpec
) -> torch.Tensor:
    """This TP rank's part of the parameter described by ``pmap``."""
    r, tp = parallel.tp_rank(), parallel.tp_size()
    if pmap.expert:  # split over the expert-tensor-parallel group (moe_weights.py)
        r, tp = parallel.expert_tp_rank(), parallel.expert_tp_size()
    names = pmap.hf_names
    if pmap.kind == "replicated":
        return src.slice(names[0])[:]
    if pmap.kind == "vocab":
        return _read_vocab(src, names[0], shape, r)
    if pmap.kind == "row":
        sl = src.slice(names[0])
        return sl[:, _rows(sl.get_shape()[1], r, tp)]
    if pmap.kind == "qkv":
        return _read_qkv(src, names, spec, r, tp)
    if pmap.kind == "gate_up":
        gate, up = src.slice(names[0]), src.slice(names[1])
        rows = _rows(gate.get_shape()[0], r, tp)
        return torch.cat([gate[rows], up[rows]], dim=0)
    raise ValueError(f"unknown parameter kind {pmap.kind!r}")


def require_finite(tensor: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` when ``tensor`` holds a NaN or an infinity."""
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise ValueError(
            f"{what} holds {bad} non-finite value(s) (NaN or inf) of {tensor.numel()}: training "
            "from it would only produce NaN; repair or re-export these weights"
        )


def require_finite_source(src: SafetensorsDir, names: list[str], value: torch.Tensor) -> None:
    """:func:`require_finite` of a parameter read from ``names``, naming the HF tensor(s)
    among them that hold the non-finite values (read whole, on the error path only)."""
    if bool(torch.isfinite(value).all()):
        return
    bad = [n for n in names if not bool(torch.isfinite(src.slice(n)[:]).all())] or names
    for name in bad:
        require_finite(src.slice(name)[:], f"{src.dir}: HF tensor {name!r}")
    require_finite(value, f"{src.dir}: HF tensors {names}")


@torch.no_grad()
def load_hf_weights(model, model_dir: str, spec: HFModelSpec) -> int:
    """Copy this rank's slices of the HF checkpoint into ``model``; returns parameters loaded.

    Raises when a parameter has no HF source or a shape disagrees (wrong config/model pair),
    and when a tensor holds a NaN or an infinity (:func:`require_finite`: a run never starts
    from non-finite weights).
    """
    core = unwrap(model)
    src, offset, loaded = SafetensorsDir(model_dir), layer_offset(core), 0
    for name, param in core.named_parameters():
        if param.numel() == 0:  # TE can register empty placeholders (e.g. an unused bias)
            continue
        pmap = map_param(name, spec, offset)
        if pmap is None:
            raise KeyError(f"megatron parameter {name!r} has no HF mapping (hf_weights.py)")
        value = read_shard(src, pmap, param.shape, spec)
        if value.shape != param.shape:
            raise ValueError(
                f"{name}: HF tensors {pmap.hf_names} give shape {tuple(value.shape)} but the "
                f"model expects {tuple(param.shape)}; does config.json match the weights?"
            )
        require_finite_source(src, pmap.hf_names, value)
        param.data.copy_(value)
        loaded += 1
    return loaded


# --- exporting -------------------------------------------------------------------------------


def _gather_tp(tensor: torch.Tensor) -> list[torch.Tensor]:
    tp = parallel.tp_size()
    if tp == 1:
        return [tensor.detach()]
    dev = parallel.collective_device()
    local = tensor.detach().to(dev).contiguous()
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local, group=parallel.tp_group())
    return parts


def _split_qkv(parts: list[torch.Tensor], spec: HFModelSpec) -> list[torch.Tensor]:
    """``q_proj``, ``k_proj``, ``v_proj`` from the TP shards: their concatenation is the fused
    group-interleaved tensor for any ``tp`` (:func:`_read_qkv`, also when KV heads are
    replicated)."""
    d, q_per_group = spec.head_dim, spec.num_heads // spec.num_kv_heads
    full = torch.cat(parts, dim=0)
    tail = full.shape[1:]
    grouped = full.reshape(spec.num_kv_heads, q_per_group + 2, d, *tail)
    q = grouped[:, :q_per_group].reshape(-1, *tail)
    k = grouped[:, q_per_group].reshape(-1, *tail)
    v = grouped[:, q_per_group + 1].reshape(-1, *tail)
    return [q, k, v]


def merge_shards(
    pmap: ParamMap, parts: list[torch.Tensor], spec: HFModelSpec
) -> list[torch.Tensor]:
    """Full HF tensors (one per ``pmap.hf_names``) from the TP shards of one parameter."""
    if pmap.kind == "replicated":
        return [parts[0]]
    if pmap.kind == "vocab":
        return [torch.cat(parts, dim=0)[: spec.vocab_size]]
    if pmap.kind == "row":
        return [torch.cat(parts, dim=1)]
    if pmap.kind == "qkv":
        return _split_qkv(parts, spec)
    if pmap.kind == "gate_up":
        halves = [p.chunk(2, dim=0) for p in parts]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise ValueError(f"unknown parameter kind {pmap.kind!r}")


def export_hf_weights(
    model, spec: HFModelSpec, device: str | torch.device | None = "cpu", every_rank: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for this pipeline stage, as a copy on ``device``
    (``None``: the parameters' own device, the GPU on a cluster; no host copy).

    Collective over the TP group: every TP rank must iterate to the end; only export ranks
    (TP rank 0, DP rank 0) yield, or every rank with ``every_rank`` (each holds the gathered
    shards anyway; the CUDA-IPC transport serializes from every GPU). A tied output layer on
    the last stage is skipped (its HF tensor is ``embed_tokens``, exported by the first stage).
    """
    core = unwrap(model)
    offset, export = layer_offset(core), every_rank or parallel.is_export_rank()
    for name, param in core.named_parameters():
        pmap = map_param(name, spec, offset)
        if param.numel() == 0 or pmap is None:
            continue
        if name == "output_layer.weight" and spec.tie_embeddings:
            continue
        if pmap.expert:
            yield from _export_expert(name, param, pmap, spec, offset, export, device)
            continue
        parts = _gather_tp(param) if pmap.kind != "replicated" else [param.detach()]
        if not export:
            continue
        for hf_name, tensor in zip(pmap.hf_names, merge_shards(pmap, parts, spec), strict=True):
            # always a copy: a replicated tensor would otherwise alias the live parameter
            target = tensor.device if device is None else device
            yield hf_name, tensor.detach().to(target, copy=True).contiguous()


def _export_expert(name, param, pmap: ParamMap, spec: HFModelSpec, offset: int, export: bool,
                   device) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """The HF tensors of one local-expert slot of every expert-parallel rank (collective over
    the expert-TP and the EP groups; yielded on export ranks only)."""
    full = merge_shards(pmap, gather_expert_parts(param), spec)
    for rank, tensors in enumerate(gather_over_ep(full)):
        if not export:
            continue
        names = map_moe_param(name, spec, offset, rank).hf_names
        for hf_name, tensor in zip(names, tensors, strict=True):
            target = tensor.device if device is None else device
            yield hf_name, tensor.detach().to(target, copy=True).contiguous()
