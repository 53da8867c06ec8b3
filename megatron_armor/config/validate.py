"""The one rule set of the config tree. Each problem names the key, the value and the fix.

:func:`validate` runs the single-field checks of every section (``fields.py``) and the
cross-field rules of :data:`RULES`, and raises one ``ValueError`` listing all problems found
(so a user fixes a config in one pass). A rule is a small function ``config -> Iterator[str]``
yielding messages. ``load_config`` runs it, ``armor plan`` plans only loaded configs (and
reuses :func:`model_shape_problems` for ``--model``), and the trainer trusts the loaded config
but for :func:`check_runtime` (the software of the machine it runs on). Algorithm names come
from ``megatron_armor.algo.registry`` (config may import algo; algo never imports config).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Iterator

from megatron_armor.algo import registry
from megatron_armor.algo.reset import check_schedule
from megatron_armor.config.benchmarks import check_benchmark_names, check_watched_metrics
from megatron_armor.config.fields import SECTION_CHECKS, bound
from megatron_armor.config.model_overrides import read_hf_config
from megatron_armor.config.moe import (
    engine_route_problems,
    expert_layout_problems,
)
from megatron_armor.config.names import named_settings
from megatron_armor.config.resolve import (
    concurrent_reference_setting,
    decidable,
    resolution_problems,
)
from megatron_armor.config.rollout_traits import (
    BACKEND_TRAITS,
    REFERENCE_TRAITS,
    STRATEGIES,
    reference_strategy,
)
from megatron_armor.config.schema import ArmorConfig, TrainerConfig
from megatron_armor.config.sglang_pools import pool_problems
from megatron_armor.config.world_size import world_size_problems

Problems = Iterator[str]

CHOICES: dict[str, tuple[str, ...]] = named_settings(ArmorConfig)
"""Names of settings without a registry of their own, read from their types in ``schema.py``
(the ``algo.*`` names come from ``algo/registry.py`` ALGO_CHOICES, the rollout ones from
:func:`rollout_choices`)."""


def rollout_choices() -> dict[str, tuple[str, ...]]:
    """``rollout.backend`` and ``rollout.ref_strategy`` names, read from their trait tables
    (``config/rollout_traits.py``; rollout maps the same names to builders)."""
    return {"rollout.backend": tuple(BACKEND_TRAITS), "rollout.ref_strategy": STRATEGIES}


def serves_over_http(config: ArmorConfig) -> bool:
    """Whether ``rollout.backend`` runs server pools (``rollout.sglang.*``); ``False`` for an
    unknown name (named by :func:`check_names`)."""
    backend = BACKEND_TRAITS.get(config.rollout.backend)
    return backend is not None and backend.serves_over_http


def get_key(config: ArmorConfig, key: str):
    """The value at dotted ``key`` (e.g. ``'trainer.fp8.format'``)."""
    node = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def check_names(config: ArmorConfig) -> Problems:
    """Every name-valued setting is one of its known names."""
    registries = {k: tuple(v) for k, v in registry.ALGO_CHOICES.items()}
    tables = {**CHOICES, **rollout_choices(), **registries}
    for key, names in tables.items():
        value = get_key(config, key)
        if value not in names:
            yield f"{key}={value!r}: unknown name; use one of {sorted(names)}"


def check_reference_samples(config: ArmorConfig) -> Problems:
    """An anchor needs reference samples to pick it from."""
    a = config.algo
    if a.anchor in registry.ANCHOR_MODES and draws_reference(config) and a.ref_n < 1:
        yield (
            f"algo.ref_n={a.ref_n}: anchor {a.anchor!r} needs >= 1 reference sample per "
            "query; set algo.ref_n >= 1 (the paper uses 4)"
        )


def draws_reference(config: ArmorConfig) -> bool:
    """Whether ``algo.anchor`` (a registered name) samples the reference."""
    return registry.get_anchor_mode(config.algo.anchor).draws_reference


def check_algo_combinations(config: ArmorConfig) -> Problems:
    """Switches that only make sense together (docs/algorithm.md, anchor rollout; docs/algorithm.md, mixed optimization)."""
    a = config.algo
    if a.anchor in registry.ANCHOR_MODES and a.ratio in registry.RATIO_MODES:
        yield from _anchor_mode_problems(config)
    if a.reset.schedule in registry.RESET_SCHEDULES:
        try:
            check_schedule(a.reset.schedule, a.reset.every, a.reset.until)
        except ValueError as e:
            yield str(e)


def _anchor_mode_problems(config: ArmorConfig) -> Problems:
    """What the ``algo.anchor`` mode's registry entry rules out (both names registered)."""
    a = config.algo
    mode, ratio = registry.get_anchor_mode(a.anchor), registry.RATIO_MODES[a.ratio]
    if a.weak_filter and not mode.needs_reference_correct:
        yield (
            "algo.weak_filter=true: keeps all-wrong groups only when the reference solved "
            "the query; set algo.anchor to 'armor' or 'filter_only', or weak_filter=false"
        )
    if ratio.differs_on_anchors_only and not mode.inserts_anchor:
        yield (
            f"algo.ratio={a.ratio!r}: differs from 'standard' only on anchor tokens, and "
            f"algo.anchor={a.anchor!r} inserts none; use algo.ratio=standard or algo.anchor=armor"
        )
    if mode.is_filter_control and ratio.mixes_reference:
        yield (
            f"algo.ratio={a.ratio!r} with algo.anchor={a.anchor!r}: the filter-only control "
            "trains with the standard ratio (docs/algorithm.md, anchor rollout); set "
            "algo.ratio=standard"
        )
    if a.filter_policy_samples != "G" and not mode.is_filter_control:
        yield (
            f"algo.filter_policy_samples={a.filter_policy_samples!r}: only applies to "
            f"algo.anchor='filter_only' (now {a.anchor!r}); remove it or set it to 'G'"
        )


def check_advantage_args(config: ArmorConfig) -> Problems:
    """``algo.advantage_args`` name hyperparameters of ``algo.advantage`` with values its
    ``params`` dataclass accepts (``AdvantageEstimator.hparams``, docs/config.md)."""
    a = config.algo
    if a.advantage not in registry.ADVANTAGES:
        return  # named by check_names
    try:
        registry.get_advantage(a.advantage).hparams(a)
    except ValueError as e:
        yield str(e)
    except TypeError as e:
        yield f"algo.advantage_args={a.advantage_args!r}: {e}; give values of the types it takes"


def check_batches(config: ArmorConfig) -> Problems:
    """Rollout and mini-batch sizes (docs/algorithm.md, anchor rollout; docs/paper_configs.md)."""
    r, t = config.rollout, config.trainer
    if r.batch < 1 or t.ppo_mini_batch < 1:
        return  # named by the section checks
    if r.gen_batch < r.batch:
        yield (
            f"rollout.gen_batch={r.gen_batch}: must be >= rollout.batch={r.batch} "
            f"(queries per generation batch, k * B; e.g. {3 * r.batch})"
        )
    if r.batch % t.ppo_mini_batch:
        yield (
            f"trainer.ppo_mini_batch={t.ppo_mini_batch}: must divide rollout.batch={r.batch} "
            f"(updates per step = batch / ppo_mini_batch); e.g. {_divisor_hint(r.batch, t.ppo_mini_batch)}"
        )
    ov, max_new = config.reward.overlong, r.sampling.max_new_tokens
    if ov.enabled and not 0 < ov.buffer < max_new:
        yield (
            f"reward.overlong.buffer={ov.buffer}: must lie in (0, rollout.sampling.max_new_tokens="
            f"{max_new}); or set reward.overlong.enabled=false"
        )


def updates_per_step(config: ArmorConfig) -> int:
    """Optimizer updates (mini-batches) per RL step, ``rollout.batch / trainer.ppo_mini_batch``
    (a valid config: :func:`check_batches` makes it whole)."""
    return config.rollout.batch // config.trainer.ppo_mini_batch


def data_parallel_size(config: ArmorConfig) -> int:
    """``trainer.world_size / (tp * pp * cp)`` (at least 1)."""
    t = config.trainer
    return max(config.resolved.world_size // max(t.tp * t.pp * t.cp, 1), 1)


def short_batch_floor(config: ArmorConfig) -> int:
    """The fewest accepted queries a step trains on (``algo.on_short_batch``,
    :class:`~megatron_armor.algo.anchors.ShortBatchPolicy`): ``rollout.batch`` with ``error``;
    with ``train_partial`` ``ceil(algo.min_batch_fraction * B)`` (0: a step trains on any
    number, none at all when it accepted nothing)."""
    a = config.algo
    policy = registry.get_short_batch_policy(a.on_short_batch)
    return policy.floor(config.rollout.batch, a.min_batch_fraction)


def groups_per_update(config: ArmorConfig) -> int:
    """The fewest groups one update holds, ``ceil(dp / G)``: every data-parallel rank gets a
    sequence (a short batch of fewer groups than ``U`` times this reuses them in turn)."""
    return math.ceil(data_parallel_size(config) / config.algo.group_size)


def _divisor_hint(n: int, near: int) -> int:
    """The divisor of ``n`` closest to ``near``."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - near), d))


def check_reference_serving(config: ArmorConfig) -> Problems:
    """``anchor_source`` and ``ref_strategy`` agree (docs/algorithm.md, anchor rollout)."""
    a, r = config.algo, config.rollout
    served = REFERENCE_TRAITS.get(r.ref_strategy)
    source = registry.ANCHOR_SOURCES.get(a.anchor_source)
    if a.anchor not in registry.ANCHOR_MODES or served is None or source is None:
        return  # named by check_names
    if draws_reference(config) and served.caches_anchors and not source.reuses_anchors:
        yield (
            f"rollout.ref_strategy='cache' with algo.anchor_source={a.anchor_source!r}: the "
            "cache serves reused anchors; set algo.anchor_source=cache, or ref_strategy "
            "to 'swap' or 'dedicated' for fresh anchors"
        )


def check_reference_first(config: ArmorConfig) -> Problems:
    """``rollout.reference_first`` is true, false or auto; ``true`` needs rule (b) and the
    one-call reference order (docs/algorithm.md, anchor rollout); ``auto`` falls back to
    policy first where ``true`` does not apply."""
    r = config.rollout
    if (
        config.resolved.reference_first is not True
        or config.algo.anchor not in registry.ANCHOR_MODES
    ):
        return
    if not registry.get_anchor_mode(config.algo.anchor).needs_reference_correct:
        yield (
            f"rollout.reference_first=true with algo.anchor={config.algo.anchor!r}: without rule "
            "(b) no reference sample decides acceptance; set algo.anchor to armor or "
            "filter_only, or rollout.reference_first=false"
        )
    if r.reference_parts != 1:
        yield (
            f"rollout.reference_first=true with rollout.reference_parts={r.reference_parts}: the "
            "parts overlap scoring with reference generation in the policy-first order; set "
            "rollout.reference_parts=1 or rollout.reference_first=false"
        )


def check_sglang_reference(config: ArmorConfig) -> Problems:
    """The SGLang pools (``config.sglang_pools``) fit the rollout GPUs, and the weight
    transport reaches the servers: ``tensor`` shares CUDA memory, so the servers must sit on
    the trainer's GPUs; ``distributed`` opens an NCCL group, which takes one rank per GPU, so
    the servers must not (docs/weight-sync.md). Every transport serves every reference strategy
    (the trainer ranks push the reference into the reference pool, or swap it into the policy
    servers)."""
    r = config.rollout
    if not serves_over_http(config):
        return
    yield from pool_problems(config)
    if r.sglang.weight_transport == "tensor" and config.orchestration.layout == "disaggregated":
        yield (
            "rollout.sglang.weight_transport='tensor' with orchestration.layout='disaggregated': "
            "CUDA-IPC handles only reach servers on the trainer's own GPUs; set "
            "weight_transport=distributed (NCCL) or layout=colocated"
        )
    if r.sglang.weight_transport == "distributed" and config.orchestration.layout == "colocated":
        yield (
            "rollout.sglang.weight_transport='distributed' with orchestration.layout='colocated': "
            "the NCCL group would hold a trainer rank and a server on the same GPU, which NCCL "
            "refuses ('Duplicate GPU detected') at the first push; set weight_transport=tensor "
            "(CUDA IPC on the shared GPU) or layout=disaggregated"
        )


def check_offload(config: ArmorConfig) -> Problems:
    """``trainer.offload_train_state`` frees trainer GPU memory for colocated engines."""
    if config.trainer.offload_train_state and config.orchestration.layout == "disaggregated":
        yield (
            "trainer.offload_train_state=true with orchestration.layout='disaggregated': the "
            "trainer has its GPUs to itself, so moving its state out and back every step only "
            "costs time; set trainer.offload_train_state=false (it is for the colocated layout)"
        )


def runs_async_rollout(config: ArmorConfig) -> bool:
    """Whether the next step's rollout overlaps this step's updates one step off
    (``orchestration.async_rollout: one_step``, ``orchestration/step/async_rollout.py``)."""
    return config.orchestration.async_rollout == "one_step"


def runs_bounded_staleness(config: ArmorConfig) -> bool:
    """Whether generation runs ahead of training by up to ``orchestration.max_staleness``
    versions (``orchestration.async_rollout: bounded``, docs/orchestration.md)."""
    return config.orchestration.async_rollout == "bounded"


def overlaps_rollout(config: ArmorConfig) -> bool:
    """Whether rollouts are drawn while the trainer updates (``one_step`` or ``bounded``)."""
    return runs_async_rollout(config) or runs_bounded_staleness(config)


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity; all cores where unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def swaps_reference_into_policy_servers(config: ArmorConfig) -> bool:
    """Whether reference samples come from the SGLang policy servers with the reference pushed
    into them around each reference call (``ref_strategy: swap`` without a reference pool;
    ``orchestration/actors/weight_sync.py``). ``False`` for an unknown name (:func:`check_names`)."""
    if not serves_over_http(config):
        return False
    try:
        anchors = registry.get_anchor_mode(config.algo.anchor).draws_reference
        served = reference_strategy(config.rollout.ref_strategy, config.algo.anchor_source)
    except (KeyError, ValueError):
        return False
    return anchors and served.swaps_into_policy


def check_async_rollout(config: ArmorConfig) -> Problems:
    """``orchestration.async_rollout: one_step`` or ``bounded`` needs engines that generate
    while the trainer updates: not on the trainer's GPUs (``colocated``) and, on CPU, a core
    for each."""
    if not overlaps_rollout(config):
        return
    orch = config.orchestration
    mode = f"orchestration.async_rollout={orch.async_rollout}"
    fix = "set orchestration.async_rollout=off"
    if orch.layout == "colocated":
        yield (
            f"{mode} with orchestration.layout='colocated': the "
            "engines share the trainer's GPUs and release their memory while it updates, so "
            f"nothing can overlap; use layout=disaggregated (rollout GPUs of their own) or {fix}"
        )
    if config.trainer.offload_train_state:
        yield (
            f"{mode} with trainer.offload_train_state=true: the "
            "offload frees the trainer's GPUs for colocated engines between updates; set "
            f"trainer.offload_train_state=false or {fix}"
        )
    if orch.layout == "cpu":
        cores, wanted = host_cores(), config.resolved.world_size + 1
        if cores < wanted:
            yield (
                f"{mode} on {cores} core(s): the cpu layout's "
                f"{config.resolved.world_size} trainer rank(s) and rollout engine need a core "
                f"each ({wanted}) to work at once; run on a machine with more cores or {fix}"
            )
    if swaps_reference_into_policy_servers(config):
        yield (
            f"{mode} with rollout.ref_strategy="
            f"{config.rollout.ref_strategy!r} on SGLang: the reference is swapped into the policy "
            "servers by trainer pushes, and the push back would load the updated policy in the "
            "middle of the next step's rollout; use rollout.ref_strategy=dedicated (a reference "
            f"pool) or {fix}"
        )
    if concurrent_reference_setting(config.trainer.concurrent_reference) is True:
        yield (
            f"trainer.concurrent_reference=true with {mode}: the "
            "concurrent reference pass borrows the rollout engine's core, which generates the "
            "next step meanwhile; set trainer.concurrent_reference=auto or false"
        )


def check_bounded_staleness(config: ArmorConfig) -> Problems:
    """``orchestration.async_rollout: bounded`` trains with the decoupled objective, whose
    behaviour weight is the rollout correction (docs/algorithm.md, "Bounded staleness"), and
    draws whole generation batches policy first, their reference samples fresh."""
    if not runs_bounded_staleness(config):
        return
    o, a, r = config.orchestration, config.algo, config.rollout
    mode = "orchestration.async_rollout=bounded"
    if o.max_staleness < 1:
        yield (
            f"orchestration.max_staleness={o.max_staleness}: must be >= 1 (the most weight "
            "versions a trained token may lag); one_step is the bound of 1 without partial "
            "rollouts"
        )
    if a.rollout_correction.mode == "none":
        yield (
            f"{mode} with algo.rollout_correction.mode='none': the samples come from older "
            "weights than the trainer's, and the decoupled objective weights each token by "
            "pi_prox / pi_behaviour; set algo.rollout_correction.mode=token_tis (truncated) "
            "or icepop (masked, AReaL's form with rollout_correction.low=0)"
        )
    if a.anchor_source == "cache" or r.ref_strategy == "cache":
        yield (
            f"{mode} with the anchor cache (algo.anchor_source / rollout.ref_strategy cache): "
            "groups are judged when their last member ends, across steps, which the cache's "
            "per-step verdicts do not follow; set algo.anchor_source=generate"
        )
    if config.resolved.reference_first is True or r.reference_parts != 1:
        yield (
            f"{mode} with rollout.reference_first=true or rollout.reference_parts="
            f"{r.reference_parts}: a group's reference samples are drawn once its policy samples "
            "have all ended; set rollout.reference_first=auto (policy first here) and "
            "rollout.reference_parts=1"
        )
    if o.partial_rollout and config.trainer.moe.routing_replay == "r3":
        yield (
            f"{mode} with orchestration.partial_rollout=true and trainer.moe.routing_replay="
            "'r3': a continued response's routes are recomputed under the new weights, not "
            "those that drew its first tokens; set trainer.moe.routing_replay=r2 or "
            "orchestration.partial_rollout=false"
        )


def check_concurrent_reference(config: ArmorConfig) -> Problems:
    """``trainer.concurrent_reference`` is true, false or auto; ``true`` needs CPU ranks and a
    forward pass without collectives (``trainer/reference_model.py``)."""
    if not config.resolved.concurrent_reference:
        return
    t, etp = config.trainer, config.resolved.etp
    if config.orchestration.layout != "cpu":
        yield (
            f"trainer.concurrent_reference=true with orchestration.layout="
            f"{config.orchestration.layout!r}: the concurrent reference pass is for CPU ranks "
            "(a GPU runs one pass at a time); set trainer.concurrent_reference=auto or false"
        )
    if max(t.tp, t.pp, t.cp, t.vpp, t.ep, etp) > 1:
        yield (
            f"trainer.concurrent_reference=true with tp={t.tp}, pp={t.pp}, cp={t.cp}, "
            f"vpp={t.vpp}, ep={t.ep}, etp={etp}: two passes at once would interleave their "
            "collectives differently "
            "on different ranks; set the parallel sizes to 1 or "
            "trainer.concurrent_reference=false"
        )


def check_parallel(config: ArmorConfig) -> Problems:
    """Parallel sizes divide the world size and the model's heads and layers; every
    data-parallel rank gets sequences."""
    t, world_size = config.trainer, config.resolved.world_size
    if min(t.tp, t.pp, t.cp, t.vpp, world_size) < 1:
        return  # named by the trainer section's check
    model_parallel = t.tp * t.pp * t.cp
    if world_size < model_parallel:
        yield (
            f"trainer.world_size={world_size}: fewer ranks than one model replica needs, "
            f"tp*pp*cp={t.tp}*{t.pp}*{t.cp}={model_parallel}; lower trainer.tp / trainer.pp "
            "(a checkpoint reshards to them: `armor plan CONFIG --checkpoint CKPT` lists the "
            "layouts it resumes at) or add GPUs"
        )
    elif world_size % model_parallel:
        yield (
            f"trainer.world_size={world_size}: must be divisible by tp*pp*cp="
            f"{t.tp}*{t.pp}*{t.cp}={model_parallel} (data-parallel size = world_size / "
            "that); change world_size or the parallel sizes"
        )
    elif t.ppo_mini_batch >= 1:
        dp, sequences = world_size // model_parallel, t.ppo_mini_batch * config.algo.group_size
        if sequences < dp:
            yield (
                f"trainer.ppo_mini_batch={t.ppo_mini_batch}: x algo.group_size="
                f"{config.algo.group_size} = {sequences} sequences per update < data-parallel "
                f"size {dp}, so some ranks would get none; raise ppo_mini_batch or lower dp"
            )
    if t.sequence_parallel and t.tp == 1:
        yield "trainer.sequence_parallel=true: needs trainer.tp > 1; set sequence_parallel=false"
    yield from check_model_shape(config)
    hf, where = read_hf_config(t.model_path), f"{t.model_path}/config.json"
    layout = (world_size, config.resolved.etp)
    yield from expert_layout_problems(t, *layout, hf, where)  # trainer.ep / etp (config/moe.py)


def check_model_shape(config: ArmorConfig) -> Problems:
    """The model of ``trainer.model_path`` (its ``config.json``) fits the parallel layout."""
    t = config.trainer
    hf = read_hf_config(t.model_path)
    if hf is None:
        return
    heads = hf.get("num_attention_heads")
    shape = {
        "heads": heads,
        "kv_heads": hf.get("num_key_value_heads") or heads,
        "layers": hf.get("num_hidden_layers"),
        "ffn_hidden": hf.get("intermediate_size"),
    }
    yield from model_shape_problems(t, shape, f"{t.model_path}/config.json")


def model_shape_problems(
    trainer: TrainerConfig, shape: dict[str, int | None], where: str
) -> Problems:
    """Heads and FFN width divisible by ``trainer.tp`` (KV heads: either way, megatron
    replicates them), layers by ``pp * vpp``; ``shape`` holds ``heads``, ``kv_heads``,
    ``layers``, ``ffn_hidden`` (``None`` = unknown), ``where`` names their source. Used by
    load (``trainer.model_path``) and by ``armor plan`` (``--model``)."""
    t, heads, kv = trainer, shape["heads"], shape["kv_heads"]
    if heads and heads % t.tp:
        yield (
            f"trainer.tp={t.tp}: must divide num_attention_heads={heads} of {where}; "
            f"use tp in {_divisors(heads)}"
        )
    if kv and kv % t.tp and t.tp % kv:
        yield (
            f"trainer.tp={t.tp}: num_key_value_heads={kv} of {where} must be divisible by "
            "tp (or tp by it, to replicate KV heads); pick another tp"
        )
    ffn = shape["ffn_hidden"]
    if ffn and ffn % t.tp:
        yield (
            f"trainer.tp={t.tp}: must divide intermediate_size={ffn} of {where}; use tp in "
            f"{_divisors(ffn)}"
        )
    stages, layers = t.pp * t.vpp, shape["layers"]
    if layers and layers % stages:
        yield (
            f"trainer.pp={t.pp} x trainer.vpp={t.vpp}: must divide num_hidden_layers={layers} "
            f"of {where}; use pp*vpp in {_divisors(layers)}"
        )


def check_context(config: ArmorConfig) -> Problems:
    """Prompt + response fit the model's positions (``config.json`` under
    ``trainer.model_overrides``) and the servers' ``rollout.sglang.context_length``."""
    t, r = config.trainer, config.rollout
    need = config.data.max_prompt_len + r.sampling.max_new_tokens
    lengths = f"data.max_prompt_len + rollout.sampling.max_new_tokens = {need}"
    positions = {**(read_hf_config(t.model_path) or {}), **t.model_overrides}.get(
        "max_position_embeddings"
    )
    if positions and need > positions:
        yield (
            f"{lengths} exceeds the model's max_position_embeddings={positions} "
            f"({t.model_path}/config.json with trainer.model_overrides): set "
            f"trainer.model_overrides.max_position_embeddings >= {need} (with the RoPE setting "
            "the model needs there, docs/weight-sync.md 'Context length'), or shorten the "
            "prompts / responses"
        )
    ctx = r.sglang.context_length if serves_over_http(config) else 0
    if ctx > 0 and need > ctx:
        yield (
            f"{lengths} exceeds rollout.sglang.context_length={ctx}: raise it to >= {need} "
            "(or 0 for the model's max_position_embeddings)"
        )
    if ctx > 0 and positions and ctx > positions:
        yield (
            f"rollout.sglang.context_length={ctx} exceeds the model's max_position_embeddings="
            f"{positions}: SGLang refuses it; raise trainer.model_overrides.max_position_embeddings "
            "so trainer and servers use the same positions"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_hardware(config: ArmorConfig) -> Problems:
    """FP8 needs Transformer Engine (a clear error at start-up, not a crash later); the GPU's
    memory is a positive size."""
    t = config.trainer
    gib = config.orchestration.gpu_memory_gib
    if not gib > 0:
        yield (
            f"orchestration.gpu_memory_gib={gib:g}: must be the memory of one GPU in GiB, > 0 "
            "(e.g. 80 for an H100, 141 for an H200)"
        )
    if t.fp8.enabled and t.transformer_impl != "te":
        yield (
            f"trainer.fp8.enabled=true with trainer.transformer_impl={t.transformer_impl!r}: "
            "FP8 needs Transformer Engine; set trainer.transformer_impl=te or fp8.enabled=false"
        )


def check_lr_schedule(config: ArmorConfig) -> Problems:
    """The LR floor and the decay length against the peak and the warm-up."""
    t = config.trainer
    yield from bound(
        t.min_lr, 0 <= t.min_lr <= t.lr, "trainer.min_lr", "must lie in [0, trainer.lr]"
    )
    if t.lr_decay_style != "constant" and t.lr_decay_steps <= t.warmup_steps:
        yield (
            f"trainer.lr_decay_steps={t.lr_decay_steps}: a {t.lr_decay_style} decay must end "
            f"after the warm-up; set it above trainer.warmup_steps={t.warmup_steps}"
        )


def check_watchers(config: ArmorConfig) -> Problems:
    """Keep-best and the over-optimization detector need the metrics they read."""
    o, best = config.overopt, config.run.keep_best
    watched = [("run.keep_best.metric", best.metric)] if best.metric else []
    if o.enabled:
        watched.append(("overopt.val_metric", o.val_metric))
    for key, metric in watched:
        if metric.startswith("val/") and config.validation.every <= 0:
            yield (
                f"{key}={metric!r} needs validation; set validation.every > 0 (steps between "
                "validations)"
            )


def transformer_engine_imports() -> bool:
    """Whether Transformer Engine imports here (it never does on a CPU build)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def check_runtime(config: ArmorConfig) -> Problems:
    """The software the trainer needs on this machine: Transformer Engine for
    ``transformer_impl=te`` (FP8 included), Apex for sequence parallelism with the local spec.
    Run by every trainer rank before it builds anything, and at load by ``armor train`` for
    ``orchestration.layout=cpu`` (where the driver's machine is the trainer's)."""
    t = config.trainer
    if t.transformer_impl == "te" and not transformer_engine_imports():
        yield (
            "trainer.transformer_impl='te': Transformer Engine does not import on this machine; "
            "install it (NGC PyTorch containers ship it) or set trainer.transformer_impl=local "
            "(and trainer.fp8.enabled=false)"
        )
    yield from check_fp8_recipe_hardware(config)
    local = t.transformer_impl == "local"
    if t.sequence_parallel and local and importlib.util.find_spec("apex") is None:
        yield (
            "trainer.sequence_parallel=true with trainer.transformer_impl='local' needs Apex "
            "(megatron's torch-norm fallback does not support it); set transformer_impl=te or "
            "sequence_parallel=false"
        )


MXFP8_CAPABILITY = (10, 0)
"""MXFP8 (block-scaled FP8) runs on Blackwell (compute capability 10.x) and later."""


def check_fp8_recipe_hardware(config: ArmorConfig) -> Problems:
    """``trainer.fp8.recipe=mxfp8`` on a GPU older than Blackwell (H100 is 9.0): TE has no
    kernels for it there. Checked on the trainer rank's own GPU, where one is visible."""
    import torch

    fp8 = config.trainer.fp8
    if not (fp8.enabled and fp8.recipe == "mxfp8" and torch.cuda.is_available()):
        return
    capability = torch.cuda.get_device_capability()
    if capability < MXFP8_CAPABILITY:
        name = torch.cuda.get_device_name()
        yield (
            f"trainer.fp8.recipe='mxfp8' needs a Blackwell GPU (compute capability >= 10.0); "
            f"this rank's {name} is {capability[0]}.{capability[1]}: use fp8.recipe=delayed "
            "or tensorwise (or blockwise) on Hopper"
        )


RULES: list[Callable[[ArmorConfig], Problems]] = [
    *SECTION_CHECKS,
    check_names,
    check_reference_samples,
    check_algo_combinations,
    check_advantage_args,
    check_batches,
    check_reference_serving,
    engine_route_problems,
    check_offload,
    check_context,
    check_hardware,
    check_lr_schedule,
    check_watchers,
    check_benchmark_names,
    check_watched_metrics,
]
DECIDED_RULES: list[Callable[[ArmorConfig], Problems]] = [
    world_size_problems,
    check_reference_first,
    check_sglang_reference,
    check_concurrent_reference,
    check_async_rollout,
    check_bounded_staleness,
    check_parallel,
]
"""The rules that read the decisions of ``config.resolved`` (``config/resolve.py``): they run
once every ``auto`` could be decided."""


def find_problems(config: ArmorConfig, inputs: bool = False) -> list[str]:
    """All problems of ``config`` (empty when it is valid); with ``inputs`` also those of the
    files it names (model directory, tokenizer, data: ``config/inputs.py``)."""
    from megatron_armor.config.inputs import check_inputs

    undecided = list(resolution_problems(config))
    rules = RULES + DECIDED_RULES if decidable(config) else RULES
    if inputs:
        rules = rules + [check_inputs]
    if inputs and config.orchestration.layout == "cpu":
        rules = rules + [check_runtime]
    return [msg for rule in rules for msg in rule(config)] + undecided


def validate(config: ArmorConfig, inputs: bool = False) -> None:
    """Raise ``ValueError`` listing every inconsistent setting of ``config`` (and, with
    ``inputs``, every unusable file it names)."""
    raise_problems(find_problems(config, inputs))


def validate_runtime(config: ArmorConfig) -> None:
    """Raise ``ValueError`` when this machine lacks software the trainer needs
    (:func:`check_runtime`)."""
    raise_problems(list(check_runtime(config)))


def raise_problems(problems: list[str]) -> None:
    """One ``ValueError`` naming every problem (none: return)."""
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError(f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))
