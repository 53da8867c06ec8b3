"""Up-front check of a model directory's safetensors: readable headers, data that fits in each
file, and every tensor the architecture needs with the shape ``config.json`` implies.

Only the headers are read (8 bytes of length, then the JSON header; no tensor data), so a
multi-GB checkpoint is checked in milliseconds, before Ray starts. A truncated file (a
download or copy that stopped) shows as a header or a tensor that ends past the file's end;
a directory of another model (or an incomplete re-export) shows as missing tensors or shapes
that disagree with ``config.json``. The names are the Llama family's HF names, as the trainer
reads them (``trainer/hf_weights.py``: ``map_param``). Called by ``config/inputs.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from megatron_armor.config.moe import MoEShape, moe_shape

Problems = Iterator[str]
Shapes = dict[str, list[int]]

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024**2  # the safetensors format's own limit
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
"""Their row count may differ from ``vocab_size`` (padding): only the width is checked."""
SHOWN = 3  # missing / misshapen tensors named in one message


def _fix(key: str) -> str:
    return f"re-download or re-export the model ({key})"


def read_header(path: Path, key: str) -> Shapes | str:
    """``{tensor: shape}`` of the safetensors file ``path``, or the problem with it."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or length > min(size - 8, MAX_HEADER_BYTES):
            return (
                f"{path}: not a complete safetensors file ({size} bytes, header length "
                f"{length}): the file is truncated or not safetensors; {_fix(key)}"
            )
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return f"{path}: its safetensors header is not valid JSON ({e}); {_fix(key)}"
    if not isinstance(header, dict):
        return f"{path}: its safetensors header is not a JSON object; {_fix(key)}"
    return _tensor_shapes(path, header, size - 8 - length, key)


def _tensor_shapes(path: Path, header: dict, data_bytes: int, key: str) -> Shapes | str:
    """Each tensor's shape, after checking its bytes lie inside the file's ``data_bytes``."""
    shapes: Shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            shape, width = [int(d) for d in entry["shape"]], DTYPE_BYTES[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            return f"{path}: tensor {name!r} has an unreadable header entry {entry!r}; {_fix(key)}"
        if end > data_bytes:
            return (
                f"{path}: tensor {name!r} ends at byte {end} of the data but the file holds "
                f"{data_bytes}: the file is truncated; {_fix(key)}"
            )
        count = 1
        for d in shape:
            count *= d
        if end - begin != count * width:
            return (
                f"{path}: tensor {name!r} of shape {shape} ({entry['dtype']}) needs "
                f"{count * width} bytes, its header gives it {end - begin}; {_fix(key)}"
            )
        shapes[name] = shape
    return shapes


def weight_files(model_dir: Path, key: str) -> list[Path] | str:
    """The safetensors files of ``model_dir`` (those its index names, when it has one)."""
    index = model_dir / INDEX_FILE
    if not index.is_file():
        return sorted(model_dir.glob("*.safetensors"))
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        return f"{index}: not a safetensors index with a weight_map ({e}); {_fix(key)}"
    missing = [n for n in names if not (model_dir / n).is_file()]
    if missing:
        return f"{index} names {missing[:SHOWN]} which are not in {model_dir}; {_fix(key)}"
    return [model_dir / n for n in names]


def expected_shapes(cfg: dict) -> Shapes:
    """The HF tensors a Qwen2 / Qwen3 / Qwen3-MoE / Llama ``config.json`` implies, with their
    shapes."""
    h, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    kv, d = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
    out: Shapes = {"model.embed_tokens.weight": [-1, h], "model.norm.weight": [h]}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = [-1, h]
    bias = cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({
            f"{p}input_layernorm.weight": [h], f"{p}post_attention_layernorm.weight": [h],
            f"{p}self_attn.q_proj.weight": [heads * d, h], f"{p}self_attn.k_proj.weight": [kv * d, h],
            f"{p}self_attn.v_proj.weight": [kv * d, h], f"{p}self_attn.o_proj.weight": [h, heads * d],
            f"{p}mlp.gate_proj.weight": [inter, h], f"{p}mlp.up_proj.weight": [inter, h],
            f"{p}mlp.down_proj.weight": [h, inter],
        })  # fmt: skip
        if bias:
            out.update({f"{p}self_attn.q_proj.bias": [heads * d],
                        f"{p}self_attn.k_proj.bias": [kv * d], f"{p}self_attn.v_proj.bias": [kv * d]})  # fmt: skip
        if cfg.get("model_type") in ("qwen3", "qwen3_moe"):
            out.update({f"{p}self_attn.q_norm.weight": [d], f"{p}self_attn.k_norm.weight": [d]})
    moe = moe_shape(cfg)
    if moe is not None:
        swap_in_experts(out, moe, h)
    return out


def swap_in_experts(out: Shapes, moe: MoEShape, hidden: int) -> None:
    """In ``out``, a MoE model's sparse layers get the router and each expert's MLP in place
    of the dense MLP (``config/moe.py``)."""
    e, inter = moe.num_experts, moe.expert_ffn
    for i, sparse in enumerate(moe.sparse_layers):
        if not sparse:
            continue
        p = f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            out.pop(f"{p}{name}.weight")
        out[f"{p}gate.weight"] = [e, hidden]
        for x in range(e):
            out.update({f"{p}experts.{x}.gate_proj.weight": [inter, hidden],
                        f"{p}experts.{x}.up_proj.weight": [inter, hidden],
                        f"{p}experts.{x}.down_proj.weight": [hidden, inter]})  # fmt: skip


def _fits(want: list[int], got: list[int]) -> bool:
    return len(want) == len(got) and all(w in (-1, g) for w, g in zip(want, got, strict=True))


def coverage_problems(key: str, model_dir: Path, cfg: dict, found: Shapes) -> Problems:
    """Tensors ``config.json`` needs that the files lack, or hold in another shape."""
    want = expected_shapes(cfg)
    missing = [n for n in want if n not in found]
    where = f"{key}={str(model_dir)!r}"
    layers = cfg["num_hidden_layers"]
    if missing:
        yield (
            f"{where}: its safetensors lack {len(missing)} of the {len(want)} tensors its "
            f"config.json needs ({cfg.get('model_type')}, {layers} layers), e.g. "
            f"{', '.join(missing[:SHOWN])}: an incomplete download or export, or config.json of "
            f"another model; {_fix(key)}"
        )
    wrong = [n for n in want if n in found and not _fits(want[n], found[n])]
    if wrong:
        shown = ", ".join(f"{n} {found[n]} (config.json: {want[n]})" for n in wrong[:SHOWN])
        yield (
            f"{where}: {len(wrong)} tensor(s) have another shape than its config.json implies, "
            f"e.g. {shown} (-1: any); the weights and config.json are of different models"
        )


def weights_problems(key: str, model_dir: Path, cfg: dict) -> Problems:
    """Headers, sizes and coverage of ``model_dir``'s safetensors (``cfg``: its config.json)."""
    files = weight_files(model_dir, key)
    if isinstance(files, str):
        yield files
        return
    if not files:
        bins = sorted(p.name for p in model_dir.glob("*.bin"))
        also = f" (only {bins[:SHOWN]}: convert them to safetensors)" if bins else ""
        yield f"{key}={str(model_dir)!r}: no weights (*.safetensors){also}"
        return
    found: Shapes = {}
    for path in files:
        shapes = read_header(path, key)
        if isinstance(shapes, str):
            yield shapes
            return
        found.update(shapes)
    try:
        yield from coverage_problems(key, model_dir, cfg, found)
    except (KeyError, TypeError) as e:  # config.json without the sizes: the trainer names it
        yield f"{model_dir}/config.json: no usable {e} for the model's shape ({key})"
