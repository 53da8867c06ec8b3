"""Mixture-of-experts facts of an HF ``config.json`` and the checks of an expert-parallel
layout (docs/trainer.md, "Mixture of experts").

:func:`moe_shape` reads a Qwen3-MoE ``config.json`` (``model_type: qwen3_moe``) the way
transformers' ``Qwen3MoeDecoderLayer`` builds it: layer ``i`` is sparse unless it is listed in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; a sparse layer routes each
token to ``num_experts_per_tok`` of ``num_experts`` experts (softmax over the router logits,
top-k, renormalised when ``norm_topk_prob``), each expert a SwiGLU MLP of width
``moe_intermediate_size``; a dense layer is the usual MLP of width ``intermediate_size``.
The trainer (``trainer/moe.py``), the weights check (``weights_check.py``) and the config
validation (:func:`expert_layout_problems`) read the model through it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from megatron_armor.config.model_overrides import read_hf_config
from megatron_armor.config.rollout_traits import BACKEND_TRAITS

MOE_ARCHITECTURES = ("qwen3_moe",)
"""HF ``model_type`` values with mixture-of-experts layers that the trainer implements."""


@dataclass(frozen=True)
class MoEShape:
    """The routing and expert sizes of a mixture-of-experts model."""

    num_experts: int
    """Routed experts per sparse layer."""
    topk: int
    """Experts each token is routed to (``num_experts_per_tok``)."""
    expert_ffn: int
    """Width of one expert's MLP (``moe_intermediate_size``)."""
    norm_topk_prob: bool
    """The top-k probabilities are renormalised to sum to 1."""
    sparse_layers: tuple[bool, ...]
    """Per layer: ``True`` for a mixture-of-experts layer, ``False`` for a dense MLP."""

    @property
    def layer_pattern(self) -> list[int]:
        """megatron-core's ``moe_layer_freq`` list (1: MoE layer, 0: dense)."""
        return [1 if sparse else 0 for sparse in self.sparse_layers]


def num_experts_of(cfg: dict) -> int:
    """The expert count of ``cfg``: ``num_experts`` (Qwen's own files) or
    ``num_local_experts`` (what transformers 5 writes on save)."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def moe_shape(cfg: dict) -> MoEShape | None:
    """The :class:`MoEShape` of an HF ``config.json`` dict; ``None`` for a dense model."""
    if cfg.get("model_type") not in MOE_ARCHITECTURES:
        return None
    experts, layers = num_experts_of(cfg), int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(
        experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(layers)
    )
    return MoEShape(
        num_experts=experts,
        topk=int(cfg.get("num_experts_per_tok", 1)),
        expert_ffn=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )


def expert_tp_size(trainer) -> int:
    """``trainer.etp`` of ``trainer`` (its ``tp``, ``ep``, ``etp``) as a number: ``auto`` is
    1 with expert parallelism (``ep > 1``, the Qwen3-MoE recipes' layout) and ``tp`` without
    (the one expert TP size megatron-core 0.16.1 reduces right at ``ep = 1``:
    :func:`expert_layout_problems`). A run reads its decision from ``config.resolved.etp``
    (``config/resolve.py``)."""
    if trainer.etp == "auto":
        return 1 if trainer.ep > 1 else trainer.tp
    return trainer.etp if isinstance(trainer.etp, int) else 1  # another word: named at load


def expert_groups_span_dp(tp: int, cp: int, ep: int, etp: int) -> bool:
    """The expert layers' model-parallel group holds ranks of more than one data-parallel
    rank. megatron-core 0.16.1 numbers ranks ``tp-cp-ep-dp-pp``: a DP rank's model-parallel
    ranks are ``tp * cp`` consecutive ranks and an expert group ``etp * ep`` consecutive ones,
    so the second lies within the first exactly when it divides it. When it does not, every
    MoE layer's all-to-all pairs micro-batches of different DP ranks, which must then run
    as many micro-batches each (``trainer/batching.py``: ``plan_micro_batches``)."""
    return (tp * cp) % (ep * etp) != 0


def expert_layout_problems(trainer, world_size: int, etp: int, hf: dict | None,
                           where: str) -> Iterator[str]:  # fmt: skip
    """``trainer.ep`` / ``trainer.etp`` (decided: ``etp``) against the model (``hf``: its
    ``config.json``, ``None`` = unknown) and the world (``world_size`` ranks), as megatron-core
    0.16.1 builds them:

    - ``parallel_state.initialize_model_parallel`` factors the world twice, ``tp * cp * dp *
      pp`` for attention and ``etp * ep * expert-dp * pp`` for the expert layers
      (``world_size % (etp * ep * pp)``, RuntimeError otherwise);
    - ``MoELayer`` splits the experts evenly over the EP ranks (``num_experts % ep``) and each
      expert's MLP over the ETP ranks (``moe_intermediate_size % etp``);
    - ``MoELayer.forward`` refuses to train with ``tp > 1`` without sequence parallelism;
    - expert weights are marked expert-parallel (gradients reduced over the expert
      data-parallel group) only when ``ep > 1``; at ``ep = 1`` they are reduced over the dense
      data-parallel group, which holds other shards of the same expert when ``etp > tp`` and
      misses copies when ``etp < tp``: ``etp != tp`` needs ``ep > 1``.
    """
    t = trainer
    if (isinstance(t.etp, str) and t.etp != "auto") or min(t.ep, etp) < 1:
        return  # named by the trainer section's check
    shape = moe_shape(hf) if hf is not None else None
    sparse = shape is not None and any(shape.sparse_layers)
    if hf is not None and not sparse:
        yield from _dense_model_problems(t, hf, where)
        return
    expert_parallel = etp * t.ep * t.pp
    if world_size < expert_parallel:
        yield (
            f"trainer.world_size={world_size}: fewer ranks than the expert layers' "
            f"model-parallel size etp*ep*pp={etp}*{t.ep}*{t.pp}={expert_parallel}; lower "
            "trainer.ep, trainer.etp or trainer.pp, or add GPUs"
        )
    elif world_size % expert_parallel:
        yield (
            f"trainer.world_size={world_size}: must be divisible by etp*ep*pp="
            f"{etp}*{t.ep}*{t.pp}={expert_parallel} (the expert layers' model-parallel "
            "size); change world_size, trainer.ep, trainer.etp or trainer.pp"
        )
    if t.ep == 1 and etp != t.tp:
        yield (
            f"trainer.etp={etp} with trainer.ep=1 and trainer.tp={t.tp}: megatron-core "
            "0.16.1 reduces expert gradients over the expert data-parallel group only when "
            "ep > 1; at ep=1 they are reduced like the dense weights, which is right only for "
            f"etp = tp; set trainer.etp={t.tp} or trainer.ep > 1"
        )
    if t.tp > 1 and not t.sequence_parallel and (sparse or t.ep > 1):
        yield (
            f"trainer.tp={t.tp} with a mixture-of-experts model: megatron-core trains its "
            "expert layers under tensor parallelism only with sequence parallelism; set "
            "trainer.sequence_parallel=true"
        )
    if shape is None:
        return
    if shape.num_experts % t.ep:
        fits = [d for d in range(1, shape.num_experts + 1) if shape.num_experts % d == 0]
        yield (
            f"trainer.ep={t.ep}: must divide num_experts={shape.num_experts} of {where} "
            f"(each EP rank holds num_experts / ep experts); use ep in {fits}"
        )
    if shape.expert_ffn % etp:
        yield (
            f"trainer.etp={etp}: must divide moe_intermediate_size={shape.expert_ffn} of "
            f"{where} (each expert's MLP is split over etp ranks); use etp=1 (and ep > 1)"
        )


def _dense_model_problems(t, hf: dict, where: str) -> Iterator[str]:
    """``ep`` / ``etp`` above 1 name experts a dense model does not have."""
    for key in ("ep", "etp"):
        if getattr(t, key) != "auto" and getattr(t, key) > 1:
            yield (
                f"trainer.{key}={getattr(t, key)}: {where} is a dense model (model_type="
                f"{hf.get('model_type')!r}) with no experts to split; set trainer.{key}=1"
            )


ENGINE_ROUTES_REPLAY = ("r3",)
"""``trainer.moe.routing_replay`` settings whose trainer passes replay the experts the rollout
engines chose (R3); ``r2`` replays the trainer's own ``old`` pass and ``off`` replays none."""


def wants_engine_routes(config) -> bool:
    """Whether the rollout engines are asked for each token's experts: the policy has experts
    and ``trainer.moe.routing_replay`` replays the engine's routes. Asking costs the engines a
    copy of ``[tokens, layers, k]`` ids per sample (SGLang: ``--enable-return-routed-experts``),
    so a run that does not replay them does not ask."""
    if config.trainer.moe.routing_replay not in ENGINE_ROUTES_REPLAY:
        return False
    return route_shape(config.trainer.model_path) is not None


def route_shape(model_path: str) -> tuple[int, int] | None:
    """``(layers, k)`` of the routes an engine returns for the model at ``model_path`` (every
    hidden layer, a dense one's rows zero, as SGLang sends them); ``None``: no experts."""
    shape = moe_shape(read_hf_config(model_path) or {})
    if shape is None or not any(shape.sparse_layers):
        return None
    return len(shape.sparse_layers), shape.topk


def engine_route_problems(config) -> Iterator[str]:
    """Routes asked of SGLang servers on CPU (``orchestration.layout: cpu``): SGLang 0.5.23
    registers the host buffer of ``--enable-return-routed-experts`` with CUDA
    (``cudaHostRegister``), so such a server exits at start-up without a GPU; refused at load
    instead (docs/rollout.md, "Routed experts")."""
    backend = BACKEND_TRAITS.get(config.rollout.backend)
    if backend is None or not backend.serves_over_http or config.orchestration.layout != "cpu":
        return  # an unknown backend is named by the names check
    if wants_engine_routes(config):
        yield (
            f"trainer.moe.routing_replay={config.trainer.moe.routing_replay} with "
            "rollout.backend=sglang on orchestration.layout=cpu: SGLang returns the routed "
            "experts only on a GPU (--enable-return-routed-experts registers its host buffer "
            "with CUDA); use rollout.backend=torch on CPU, routing_replay r2 or off, or a GPU "
            "layout"
        )


def dense_model_warnings(config) -> Iterator[str]:
    """``trainer.moe`` settings away from their defaults on a dense model: valid, but they
    change nothing (the trainer reads them only for a model with experts). Said at load, once
    per load (``config/ranges.py``); nothing for a model directory that cannot be read yet."""
    moe, path = config.trainer.moe, config.trainer.model_path
    hf = read_hf_config(path)
    if hf is None or route_shape(path) is not None:
        return
    defaults = type(moe)()
    changed = [f"trainer.moe.{key}={getattr(moe, key)!r}" for key in vars(defaults)
               if getattr(moe, key) != getattr(defaults, key)]  # fmt: skip
    if changed:
        yield (
            f"{', '.join(changed)} change nothing: {path} is a dense model (model_type="
            f"{hf.get('model_type')!r}, no experts); these settings apply to mixture-of-experts "
            "models only (docs/trainer.md, 'Mixture of experts'): remove them"
        )
