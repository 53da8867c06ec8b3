"""``armor plan``: will this config fit the GPUs, and which term decides it?

    from megatron_armor.planner.plan import make_plan
    plan = make_plan(config, model="qwen3-8b", gpu_mem_gib=80)
    print(plan.report()); plan.fits

The config is valid (``load_config`` ran the one rule set, ``config/validate.py``); the plan
adds the placement and ``--model`` shape rules (``planner.rules``) and estimates per-GPU memory in each
phase (``planner.memory``): ``train`` (trainer state + activations + logits; a colocated engine
has released its memory) and ``rollout`` (trainer state — only the weights with
``trainer.offload_train_state`` — + the SGLang static shares when colocated). The verdict
compares the larger phase with ``usable_fraction`` of the GPU.

Colocated, the rollout phase holds only the trainer's resident state because every rank hands
its activation and logit blocks back to CUDA before the engines resume
(``trainer.hand_over_memory``, docs/weight-sync.md); ``armor train`` refuses a colocated
layout whose plan does not fit ``orchestration.gpu_memory_gib`` (:func:`colocated_memory_problem`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.config.sglang_pools import PoolSpec, pool_specs
from megatron_armor.config.validate import updates_per_step
from megatron_armor.planner.memory import (
    RUNTIME_BYTES,
    EngineShape,
    GiB,
    TrainerShape,
    param_bytes,
    route_host_bytes,
    stage_expert_params,
    stage_params,
    state_terms,
    trainer_train_terms,
)
from megatron_armor.planner.model import ModelDims, load_model_dims, with_padded_vocab
from megatron_armor.planner.rules import Finding, LayoutSpec, check_layout
from megatron_armor.rollout.backends import backend_of

USABLE_FRACTION = 0.95
"""Share of GPU memory a plan may use (allocator fragmentation, stray buffers)."""

ADVICE = {
    "activations": "set trainer.recompute=true, raise trainer.tp (with "
    "trainer.sequence_parallel=true), or lower trainer.micro_batch_tokens",
    "logits": "raise trainer.tp (the vocabulary is split over it) or lower trainer.logprob_chunk",
    "optimizer": "set trainer.use_distributed_optimizer=true and/or raise the data-parallel size",
    "grads": "raise trainer.tp or trainer.pp (a mixture-of-experts model: trainer.ep)",
    "weights": "raise trainer.tp or trainer.pp (a mixture-of-experts model: trainer.ep)",
    "moe_dispatch": "lower trainer.micro_batch_tokens or raise trainer.tp (with "
    "trainer.sequence_parallel=true)",
    "sglang_static": "set trainer.offload_train_state=true, lower "
    "rollout.sglang.mem_fraction_static, or use the disaggregated layout",
    "sglang_ref": "lower rollout.sglang.ref_pool.mem_fraction, serve the reference with "
    "rollout.ref_strategy=swap, or use the disaggregated layout",
    "runtime": "nothing to tune: this is the CUDA/NCCL runtime",
}


@dataclass
class Plan:
    """Memory per phase (bytes per GPU), rule findings and the verdict."""

    model: ModelDims
    layout: str
    gpu_bytes: float
    phases: dict[str, dict[str, float]]
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checkpoint_bytes: float = 0.0
    """One run checkpoint on disk (:func:`checkpoint_disk`)."""
    checkpoint_peak_bytes: float = 0.0
    """Checkpoints on disk while a save runs: ``run.keep_last`` complete ones plus the new one
    (rotation deletes only after it is complete)."""

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()))

    @property
    def peak_bytes(self) -> float:
        return sum(self.phases[self.peak_phase].values())

    @property
    def largest_term(self) -> tuple[str, float]:
        terms = self.phases[self.peak_phase]
        name = max(terms, key=terms.get)
        return name, terms[name]

    @property
    def fits_memory(self) -> bool:
        return self.layout == "cpu" or self.peak_bytes <= USABLE_FRACTION * self.gpu_bytes

    @property
    def fits(self) -> bool:
        """No rule errors and the peak phase within the usable memory."""
        return self.fits_memory and not any(f.level == "error" for f in self.findings)

    def verdict(self) -> str:
        name, size = self.largest_term
        peak, usable = self.peak_bytes / GiB, USABLE_FRACTION * self.gpu_bytes / GiB
        where = f"{self.peak_phase} phase; largest term: {name} {size / GiB:.2f} GiB"
        if self.layout == "cpu":
            return f"ESTIMATE ONLY (layout=cpu): {peak:.2f} GiB per trainer process ({where})"
        errors = sum(f.level == "error" for f in self.findings)
        if not self.fits_memory:
            return (
                f"DOES NOT FIT: {peak:.1f} GiB per GPU > {usable:.1f} GiB usable of "
                f"{self.gpu_bytes / GiB:.0f} GiB ({where}). Fix: {self.advice()}"
            )
        if errors:
            return f"INVALID LAYOUT: {errors} rule error(s) above; memory {peak:.1f} GiB ({where})"
        return f"FITS: {peak:.1f} GiB of {usable:.1f} GiB usable per GPU ({where})"

    def advice(self) -> str:
        """The fix for the peak phase: in the colocated rollout phase the trainer's resident
        state sits beside the engines' static share, so whichever term is largest, the fix is
        to offload the state or shrink the share; else the largest term's own fix."""
        if self.peak_phase == "rollout":
            return ADVICE["sglang_static"]
        return ADVICE[self.largest_term[0]]

    def report(self) -> str:
        """Human-readable table of the terms per phase, findings, notes and the verdict."""
        lines = [f"model {self.model.name}: {_count(self.model.total_params())} parameters"]
        if self.model.is_moe:
            m = self.model
            lines[0] += (
                f", {_count(m.active_params())} active ({m.num_experts} experts of width "
                f"{m.expert_ffn}, top-{m.topk}, in {m.moe_layers} of {m.layers} layers)"
            )
        unit = "trainer process" if self.layout == "cpu" else "GPU"
        for phase, terms in self.phases.items():
            total = sum(terms.values()) / GiB
            lines.append(f"{phase} phase: {total:.2f} GiB per {unit}")
            for name, size in sorted(terms.items(), key=lambda kv: -kv[1]):
                lines.append(f"  {name:<14} {size / GiB:8.2f} GiB")
        lines.append(
            f"checkpoints: {self.checkpoint_bytes / GiB:.1f} GiB each, "
            f"{self.checkpoint_peak_bytes / GiB:.1f} GiB on disk at the peak of a save"
        )
        lines += [str(f) for f in self.findings] + [f"note: {n}" for n in self.notes]
        lines.append(self.verdict())
        return "\n".join(lines)


def _count(params: int) -> str:
    return f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M"


def _dp(config: ArmorConfig) -> int:
    t = config.trainer
    return max(1, config.resolved.world_size // (t.tp * t.pp * t.cp))


def trainer_shape(config: ArmorConfig, dims: ModelDims) -> TrainerShape:
    """The trainer's memory-relevant settings; micro-batches per update from the worst length."""
    t, dp = config.trainer, _dp(config)
    seq_len = config.data.max_prompt_len + config.rollout.sampling.max_new_tokens
    per_rank_tokens = t.ppo_mini_batch * config.algo.group_size * seq_len / dp
    return TrainerShape(
        dims=dims,
        tp=t.tp,
        pp=t.pp,
        cp=t.cp,
        vpp=t.vpp,
        dp=dp,
        sequence_parallel=t.sequence_parallel,
        precision=t.precision,
        distributed_optimizer=t.use_distributed_optimizer,
        recompute=t.recompute,
        micro_batch_tokens=t.micro_batch_tokens,
        num_micro_batches=math.ceil(per_rank_tokens / t.micro_batch_tokens),
        logprob_chunk=t.logprob_chunk,
        ep=t.ep,
        etp=config.resolved.etp,
    )


def layout_spec(config: ArmorConfig, dims: ModelDims) -> LayoutSpec:
    """The settings the planner's rules read."""
    t, o, r = config.trainer, config.orchestration, config.rollout
    pools = pool_specs(config)
    ref_gpus = pools["ref"].gpus if "ref" in pools and o.layout == "disaggregated" else 0
    return LayoutSpec(
        dims=dims,
        tp=t.tp,
        pp=t.pp,
        vpp=t.vpp,
        world_size=config.resolved.world_size,
        sequence_parallel=t.sequence_parallel,
        layout=o.layout,
        nodes=o.nodes,
        gpus_per_node=o.gpus_per_node,
        rollout_gpus=o.rollout_gpus,
        engine_tp=r.sglang.tp,
        num_engines=pools["policy"].num_engines,
        micro_batch_tokens=t.micro_batch_tokens,
        seq_len=config.data.max_prompt_len + r.sampling.max_new_tokens,
        ref_engine_gpus=ref_gpus,
        ep=t.ep,
        etp=t.etp,
    )


def _worst_stage(shape: TrainerShape) -> dict[str, float]:
    stages = {0, shape.pp - 1}
    candidates = [trainer_train_terms(shape, s) for s in stages]
    return max(candidates, key=lambda terms: sum(terms.values()))


def _engine_notes(
    config: ArmorConfig, pool: PoolSpec, engine: EngineShape, seq_len: int
) -> list[Finding | str]:
    key = "rollout.sglang" if pool.name == "policy" else "rollout.sglang.ref_pool"
    share = f"{key}.mem_fraction_static" if pool.name == "policy" else f"{key}.mem_fraction"
    out: list[Finding | str] = []
    if engine.kv_pool_bytes() <= 0:
        out.append(
            Finding(
                "error",
                share,
                f"{engine.mem_fraction_static}: the {pool.name} server's share ({engine.static_bytes() / GiB:.1f} GiB) does not hold its weights ({engine.weight_bytes() / GiB:.1f} GiB); raise it or {key}.tp",
            )
        )
        return out
    tokens = engine.kv_tokens()
    if tokens < seq_len:
        out.append(
            Finding(
                "error",
                share,
                f"the {pool.name} server's KV cache holds {tokens} tokens < one sequence ({seq_len}); raise it or {key}.tp",
            )
        )
    a = config.algo
    per_query = a.group_size if pool.name == "policy" else a.ref_n
    sequences = config.rollout.gen_batch * per_query / max(1, pool.num_engines)
    out.append(
        f"SGLang {pool.name} KV cache per server: {tokens} tokens = {tokens / seq_len:.0f} full-length sequences (a generation batch has up to {sequences:.0f} per server)"
    )
    return out


def checkpoint_disk(config: ArmorConfig, dims: ModelDims) -> tuple[float, float]:
    """(bytes of one checkpoint, bytes on disk at the peak of a save).

    One checkpoint holds the policy and the reference weights (``trainer.precision`` bytes per
    parameter each) and the optimizer state (Adam moments, plus fp32 master weights unless the
    run is fp32: 12 or 8 bytes per parameter), ``P * (2 * w + adam)``; the orchestrator state
    (anchor cache, RNG) is small next to it. A save writes the new checkpoint before rotation
    deletes the oldest, so ``run.keep_last + 1`` are on disk at the peak."""
    params = dims.total_params()
    adam = 8 if config.trainer.precision == "fp32" else 12
    size = params * (2 * param_bytes(config.trainer.precision) + adam)
    return size, size * (config.run.keep_last + 1)


def make_plan(config: ArmorConfig, model: str | None = None, gpu_mem_gib: float = 80.0) -> Plan:
    """The plan for ``config``; ``model`` (preset / HF dir) defaults to ``trainer.model_path``."""
    source = model or config.trainer.model_path
    if not source:
        raise ValueError("no model: set trainer.model_path or pass --model (e.g. qwen3-8b)")
    dims = with_padded_vocab(load_model_dims(source), config.trainer.tp)
    shape = trainer_shape(config, dims)
    layout = config.orchestration.layout
    gpu_bytes = gpu_mem_gib * GiB
    train = _worst_stage(shape)
    if layout == "cpu":
        train.pop("runtime")  # no CUDA context on the CPU path
    phases = {"train": train}
    plan = Plan(model=dims, layout=layout, gpu_bytes=gpu_bytes, phases=phases)
    plan.checkpoint_bytes, plan.checkpoint_peak_bytes = checkpoint_disk(config, dims)
    plan.findings = check_layout(layout_spec(config, dims))
    seq_len = config.data.max_prompt_len + config.rollout.sampling.max_new_tokens
    engines = {}
    if layout in ("colocated", "disaggregated") and backend_of(config).serves_over_http:
        for name, pool in pool_specs(config).items():
            engines[name] = EngineShape(dims, pool.tp, pool.share, gpu_bytes)
            for item in _engine_notes(config, pool, engines[name], seq_len):
                (plan.findings if isinstance(item, Finding) else plan.notes).append(item)
    if layout == "colocated" and engines:
        resident = state_terms(shape, 0)
        if config.trainer.offload_train_state:  # only the weights stay during the rollout
            resident = {"weights": resident["weights"]}
        servers = len(engines)  # each released server keeps its CUDA context
        phases["rollout"] = {
            **resident,
            "sglang_static": engines["policy"].static_bytes(),
            "runtime": (1 + servers) * RUNTIME_BYTES,
        }
        if "ref" in engines:
            phases["rollout"]["sglang_ref"] = engines["ref"].static_bytes()
        train["runtime"] = (1 + servers) * RUNTIME_BYTES
        kept = "weights" if config.trainer.offload_train_state else "weights, grads, optimizer"
        plan.notes.append(
            f"colocated: the rollout phase counts the trainer's resident state ({kept}) beside "
            "the SGLang static share; the activation and logit blocks are handed back to CUDA "
            "before the engines resume (trainer.hand_over_memory)"
        )
    plan.notes.append(
        f"train micro-batch {shape.micro_batch_tokens} tokens, {shape.num_micro_batches} micro-batch(es) "
        f"per update per DP rank, dp={shape.dp}, recompute={shape.recompute}"
    )
    if dims.is_moe:
        plan.notes.append(_expert_note(shape))
        if config.trainer.moe.routing_replay != "off":
            plan.notes.append(_route_note(config, shape, seq_len))
    return plan


def _route_note(config: ArmorConfig, shape: TrainerShape, seq_len: int) -> str:
    """Routing replay's host memory at the longest step (every sample at
    ``max_prompt_len + max_new_tokens``; :func:`memory.route_host_bytes`)."""
    mode = config.trainer.moe.routing_replay
    tokens = config.rollout.batch * config.algo.group_size * seq_len
    sizes = route_host_bytes(shape.dims, tokens, shape.dp, shape.pp,
                             updates_per_step(config), mode == "r3")  # fmt: skip
    engine = ""
    if mode == "r3":
        engine = (
            f"the engines' routes in the batch {sizes['batch'] / GiB:.1f} GiB per node "
            "(one copy in the object store, read by its ranks); "
        )
    return (
        f"routing replay {mode}: host memory for a step of at most {tokens / 1e6:.1f}M tokens: "
        f"{engine}the old pass's routes of a rank's own samples {sizes['old'] / GiB:.2f} GiB "
        f"per rank; an update receives at most {sizes['update'] / 2**20:.0f} MiB of them "
        '(docs/trainer.md, "Routing replay")'
    )


def _expert_note(shape: TrainerShape) -> str:
    """Where a MoE model's experts live: per rank, and their share of the trainer state."""
    d = shape.dims
    local = d.num_experts // max(shape.ep, 1)
    experts = stage_expert_params(shape)
    return (
        f"experts: {local} of {d.num_experts} per EP rank (ep={shape.ep}, etp={shape.etp}, "
        f"expert data-parallel {shape.expert_dp}); {_count(int(experts))} expert parameters "
        f"per rank beside {_count(int(stage_params(shape, 0) - experts))} dense ones"
    )


def colocated_memory_problem(config: ArmorConfig) -> str | None:
    """Why a colocated SGLang layout does not fit ``orchestration.gpu_memory_gib`` (``None``:
    it fits, or the layout is not colocated, or ``trainer.model_path`` has no readable
    ``config.json`` yet, which the input checks report). ``armor train`` refuses such a
    config at load (exit 2) with the plan's fix."""
    if config.orchestration.layout != "colocated" or not backend_of(config).serves_over_http:
        return None
    try:
        plan = make_plan(config, gpu_mem_gib=config.orchestration.gpu_memory_gib)
    except (OSError, ValueError, KeyError):
        return None
    if plan.fits_memory:
        return None
    name, size = plan.largest_term
    terms = ", ".join(f"{k} {v / GiB:.1f}" for k, v in plan.phases[plan.peak_phase].items())
    return (
        f"orchestration.layout='colocated' does not fit orchestration.gpu_memory_gib="
        f"{config.orchestration.gpu_memory_gib:g}: the {plan.peak_phase} phase needs "
        f"{plan.peak_bytes / GiB:.1f} GiB per GPU > {USABLE_FRACTION * plan.gpu_bytes / GiB:.1f} "
        f"GiB usable ({terms} GiB; `armor plan` shows the terms); {plan.advice()}"
    )
