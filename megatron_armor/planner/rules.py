"""What the planner adds to the config rules: the model's shape from ``--model`` and the
placement of the trainer and the SGLang servers; each finding names the setting and the fix.

Everything load rejects is checked by ``config/validate.py`` alone (``armor plan`` plans only
configs that load); the model-shape rules are that module's :func:`model_shape_problems`, run
here on the planner's model, which may differ from ``trainer.model_path``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_armor.config.moe import expert_layout_problems, expert_tp_size
from megatron_armor.config.schema import TrainerConfig
from megatron_armor.config.validate import model_shape_problems
from megatron_armor.planner.model import ModelDims


@dataclass(frozen=True)
class Finding:
    """A rule outcome: ``error`` (cannot run) or ``warning`` (runs, but probably not as meant)."""

    level: str
    setting: str
    message: str

    def __str__(self) -> str:
        return f"{self.level.upper()}: {self.setting}: {self.message}"

    @classmethod
    def error(cls, problem: str) -> Finding:
        """An error from a config rule's ``"<key>=<value>...: <fix>"`` message."""
        head, _, fix = problem.partition(": ")
        return cls("error", head.split("=")[0], f"{head.partition('=')[2]}: {fix}")


@dataclass(frozen=True)
class LayoutSpec:
    """The settings the rules look at (taken from ``ArmorConfig`` by ``planner.plan``)."""

    dims: ModelDims
    tp: int
    pp: int
    vpp: int
    world_size: int
    sequence_parallel: bool
    layout: str
    nodes: int
    gpus_per_node: int
    rollout_gpus: int
    engine_tp: int
    num_engines: int
    micro_batch_tokens: int
    seq_len: int
    ref_engine_gpus: int = 0
    """GPUs of the dedicated reference pool on their own (disaggregated) GPUs."""
    ep: int = 1
    etp: int | str = "auto"


def _model_rules(s: LayoutSpec) -> list[Finding]:
    d = s.dims
    trainer = TrainerConfig(
        tp=s.tp, pp=s.pp, vpp=s.vpp, ep=s.ep, etp=s.etp, world_size=s.world_size,
        sequence_parallel=s.sequence_parallel,
    )  # fmt: skip
    shape = {
        "heads": d.heads,
        "kv_heads": d.kv_heads,
        "layers": d.layers,
        "ffn_hidden": d.ffn_hidden,
    }
    where = f"model {d.name}"
    out = [Finding.error(p) for p in model_shape_problems(trainer, shape, where)]
    layout = (s.world_size, expert_tp_size(trainer))
    out += [
        Finding.error(p) for p in expert_layout_problems(trainer, *layout, _moe_fields(d), where)
    ]
    if s.tp > 1 and not s.sequence_parallel:
        out.append(
            Finding(
                "warning",
                "trainer.sequence_parallel",
                f"false at tp={s.tp}: activations of norms/dropout are replicated; set it true to divide them by tp",
            )
        )
    return out


def _moe_fields(d: ModelDims) -> dict:
    """The ``config.json`` fields ``config/moe.py`` reads, for the planner's model (a preset
    has none): its experts, or a dense model type."""
    if not d.is_moe:
        return {"model_type": "dense decoder"}
    return {
        "model_type": "qwen3_moe", "num_hidden_layers": d.layers, "num_experts": d.num_experts,
        "num_experts_per_tok": d.topk, "moe_intermediate_size": d.expert_ffn,
        "mlp_only_layers": list(range(d.layers - d.moe_layers)),
    }  # fmt: skip


def _parallel_rules(s: LayoutSpec) -> list[Finding]:
    out = []
    if s.tp > s.gpus_per_node and s.layout != "cpu":
        out.append(
            Finding(
                "warning",
                "trainer.tp",
                f"{s.tp} > orchestration.gpus_per_node={s.gpus_per_node}: tensor parallelism across nodes is slow; use pp across nodes",
            )
        )
    if s.micro_batch_tokens < s.seq_len:
        out.append(
            Finding(
                "error",
                "trainer.micro_batch_tokens",
                f"{s.micro_batch_tokens} < the longest sequence (prompt + response = {s.seq_len} tokens); a sequence must fit one micro-batch: raise it to >= {s.seq_len}",
            )
        )
    return out


def _placement_rules(s: LayoutSpec) -> list[Finding]:
    out = []
    gpus = s.nodes * s.gpus_per_node
    engine_gpus = s.engine_tp * s.num_engines
    if s.engine_tp > s.gpus_per_node:
        out.append(
            Finding(
                "error",
                "rollout.sglang.tp",
                f"{s.engine_tp} > orchestration.gpus_per_node={s.gpus_per_node}; an engine must sit on one node",
            )
        )
    if s.layout == "colocated":
        # The orchestrator starts world_size / engine_tp engines, each beside engine_tp trainer ranks.
        if s.world_size % s.engine_tp:
            out.append(
                Finding(
                    "error",
                    "rollout.sglang.tp",
                    f"{s.engine_tp} does not divide trainer.world_size={s.world_size} (colocated engines sit on the trainer GPUs)",
                )
            )
        if s.world_size > gpus:
            out.append(
                Finding(
                    "error",
                    "trainer.world_size",
                    f"{s.world_size} > nodes*gpus_per_node = {gpus} GPUs",
                )
            )
        elif s.world_size < gpus:
            out.append(
                Finding(
                    "warning",
                    "trainer.world_size",
                    f"{s.world_size} < {gpus} GPUs: colocated training leaves {gpus - s.world_size} idle",
                )
            )
    elif s.layout == "disaggregated":
        if s.world_size + s.rollout_gpus > gpus:
            out.append(
                Finding(
                    "error",
                    "orchestration.rollout_gpus",
                    f"trainer {s.world_size} + rollout {s.rollout_gpus} GPUs > {gpus} available",
                )
            )
        if engine_gpus + s.ref_engine_gpus != s.rollout_gpus:
            ref = f" + reference pool {s.ref_engine_gpus}" if s.ref_engine_gpus else ""
            out.append(
                Finding(
                    "error",
                    "rollout.sglang.num_engines",
                    f"tp*num_engines = {engine_gpus}{ref} != orchestration.rollout_gpus={s.rollout_gpus}",
                )
            )
    return out


def check_layout(spec: LayoutSpec) -> list[Finding]:
    """Every rule finding for ``spec``: model divisibility, parallel sizes, placement."""
    return _model_rules(spec) + _parallel_rules(spec) + _placement_rules(spec)
