"""Divisibility and placement rules of a layout; each finding names the setting and the fix."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_armor.planner.model import ModelDims


@dataclass(frozen=True)
class Finding:
    """A rule outcome: ``error`` (cannot run) or ``warning`` (runs, but probably not as meant)."""

    level: str
    setting: str
    message: str

    def __str__(self) -> str:
        return f"{self.level.upper()}: {self.setting}: {self.message}"


@dataclass(frozen=True)
class LayoutSpec:
    """The settings the rules look at (taken from ``ArmorConfig`` by ``planner.plan``)."""

    dims: ModelDims
    tp: int
    pp: int
    cp: int
    vpp: int
    world_size: int
    sequence_parallel: bool
    layout: str
    nodes: int
    gpus_per_node: int
    rollout_gpus: int
    engine_tp: int
    num_engines: int
    batch: int
    gen_batch: int
    ppo_mini_batch: int
    group_size: int
    micro_batch_tokens: int
    seq_len: int
    ref_engine_gpus: int = 0
    """GPUs of the dedicated reference pool on their own (disaggregated) GPUs."""


def _model_rules(s: LayoutSpec) -> list[Finding]:
    d, out = s.dims, []
    if d.heads % s.tp:
        out.append(
            Finding(
                "error",
                "trainer.tp",
                f"{s.tp} does not divide the {d.heads} attention heads; use a divisor of {d.heads}",
            )
        )
    if d.kv_heads % s.tp:
        out.append(
            Finding(
                "error",
                "trainer.tp",
                f"{s.tp} does not divide the {d.kv_heads} key/value heads (GQA groups); use tp <= {d.kv_heads} dividing it",
            )
        )
    if d.ffn_hidden % s.tp:
        out.append(
            Finding("error", "trainer.tp", f"{s.tp} does not divide ffn_hidden={d.ffn_hidden}")
        )
    if d.layers % (s.pp * s.vpp):
        out.append(
            Finding(
                "error",
                "trainer.pp",
                f"pp * vpp = {s.pp * s.vpp} does not divide the {d.layers} layers",
            )
        )
    if s.vpp > 1 and s.pp == 1:
        out.append(
            Finding(
                "error",
                "trainer.vpp",
                f"{s.vpp} needs trainer.pp > 1 (interleaving splits pipeline stages)",
            )
        )
    if s.sequence_parallel and s.tp == 1:
        out.append(Finding("error", "trainer.sequence_parallel", "true needs trainer.tp > 1"))
    if s.tp > 1 and not s.sequence_parallel:
        out.append(
            Finding(
                "warning",
                "trainer.sequence_parallel",
                f"false at tp={s.tp}: activations of norms/dropout are replicated; set it true to divide them by tp",
            )
        )
    if s.cp > 1 and s.seq_len % (2 * s.cp):
        out.append(
            Finding(
                "warning",
                "trainer.cp",
                f"sequences are padded to a multiple of 2*cp = {2 * s.cp} for load-balanced context parallelism",
            )
        )
    return out


def _parallel_rules(s: LayoutSpec) -> list[Finding]:
    out, model_parallel = [], s.tp * s.pp * s.cp
    if s.world_size % model_parallel:
        out.append(
            Finding(
                "error",
                "trainer.world_size",
                f"{s.world_size} is not a multiple of tp*pp*cp = {model_parallel}",
            )
        )
        return out
    dp = s.world_size // model_parallel
    if s.tp > s.gpus_per_node and s.layout != "cpu":
        out.append(
            Finding(
                "warning",
                "trainer.tp",
                f"{s.tp} > orchestration.gpus_per_node={s.gpus_per_node}: tensor parallelism across nodes is slow; use pp or cp across nodes",
            )
        )
    sequences = s.ppo_mini_batch * s.group_size
    if sequences < dp:
        out.append(
            Finding(
                "error",
                "trainer.ppo_mini_batch",
                f"{s.ppo_mini_batch} queries x {s.group_size} samples = {sequences} sequences per update < dp = {dp}; some DP ranks would get nothing",
            )
        )
    if s.batch % s.ppo_mini_batch:
        out.append(
            Finding(
                "error",
                "trainer.ppo_mini_batch",
                f"{s.ppo_mini_batch} does not divide rollout.batch={s.batch}",
            )
        )
    if s.gen_batch < s.batch:
        out.append(
            Finding(
                "error",
                "rollout.gen_batch",
                f"{s.gen_batch} < rollout.batch={s.batch}; a generation batch must offer at least B queries",
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
