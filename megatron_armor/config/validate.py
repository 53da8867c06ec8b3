"""Cross-field checks of the config tree. Each problem names the key, the value and the fix.

:func:`validate` runs every rule in :data:`RULES` and raises one ``ValueError`` listing all
problems found (so a user fixes a config in one pass). A rule is a small function
``config -> Iterator[str]`` yielding messages. Algorithm names come from
``megatron_armor.algo.registry`` (config may import algo; algo never imports config).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from megatron_armor.algo import registry
from megatron_armor.algo.ratios import resolve_alpha
from megatron_armor.algo.reset import check_schedule
from megatron_armor.config.schema import ArmorConfig

Problems = Iterator[str]

# Names of settings outside algo/ (their implementations live in packages config must not import).
CHOICES: dict[str, tuple[str, ...]] = {
    "algo.anchor_source": ("generate", "cache"),
    "algo.filter_policy_samples": ("G", "G-1"),
    "rollout.backend": ("torch", "sglang"),
    "rollout.ref_strategy": ("swap", "dedicated", "cache"),
    "rollout.sglang.weight_transport": ("tensor", "distributed", "disk"),
    "trainer.precision": ("bf16", "fp16", "fp32"),
    "trainer.transformer_impl": ("local", "te"),
    "trainer.lr_unit": ("rl_steps", "updates"),
    "trainer.lr_decay_style": ("constant", "linear", "cosine"),
    "run.keep_best.mode": ("max", "min"),
    "trainer.fp8.format": ("e4m3", "hybrid"),
    "trainer.fp8.recipe": ("delayed", "tensorwise", "mxfp8", "blockwise"),
    "data.template": ("dapo", "chat", "plain"),
    "reward.verifier": ("auto", "dapo", "math_verify"),
    "orchestration.layout": ("cpu", "colocated", "disaggregated"),
    "logging.profile": ("none", "nsys", "torch", "dlprof"),
}

REGISTRY_CHOICES: dict[str, dict] = {
    "algo.anchor": registry.ANCHOR_MODES,
    "algo.ratio": registry.RATIO_MODES,
    "algo.advantage": registry.ADVANTAGES,
    "algo.loss_agg": registry.AGGREGATIONS,
    "algo.kl_estimator": registry.KL_ESTIMATORS,
    "algo.reset.schedule": registry.RESET_SCHEDULES,
}


def get_key(config: ArmorConfig, key: str):
    """The value at dotted ``key`` (e.g. ``'trainer.fp8.format'``)."""
    node = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def check_names(config: ArmorConfig) -> Problems:
    """Every name-valued setting is one of its known names."""
    tables = {**CHOICES, **{k: tuple(v) for k, v in REGISTRY_CHOICES.items()}}
    for key, names in tables.items():
        value = get_key(config, key)
        if value not in names:
            yield f"{key}={value!r}: unknown name; use one of {sorted(names)}"


def check_algo_numbers(config: ArmorConfig) -> Problems:
    """alpha, group size, reference samples, clip ranges and the other algo numbers."""
    a = config.algo
    if a.group_size < 2:
        yield f"algo.group_size={a.group_size}: must be >= 2 (a group needs reward variance)"
    else:
        try:
            resolve_alpha(a.alpha, a.group_size)
        except ValueError as e:
            yield str(e)
    if a.anchor != "none" and a.ref_n < 1:
        yield (
            f"algo.ref_n={a.ref_n}: anchor {a.anchor!r} needs >= 1 reference sample per "
            "query; set algo.ref_n >= 1 (the paper uses 4)"
        )
    yield from _bound(
        a.clip_low, 0.0 < a.clip_low < 1.0, "algo.clip_low", "must lie in (0, 1), e.g. 0.2"
    )
    yield from _bound(a.clip_high, a.clip_high > 0.0, "algo.clip_high", "must be > 0, e.g. 0.28")
    yield from _bound(
        a.dual_clip_c, a.dual_clip_c > 1.0, "algo.dual_clip_c", "must be > 1, e.g. 10"
    )
    yield from _bound(
        a.log_ratio_clamp, a.log_ratio_clamp > 0, "algo.log_ratio_clamp", "must be > 0, e.g. 20"
    )
    yield from _bound(a.kl_coef, a.kl_coef >= 0, "algo.kl_coef", "must be >= 0 (0 = no KL penalty)")
    yield from _bound(
        a.qae_quantile,
        0.0 <= a.qae_quantile <= 1.0,
        "algo.qae_quantile",
        "must lie in [0, 1], e.g. 0.45",
    )
    yield from _bound(
        a.max_gen_batches, a.max_gen_batches >= 1, "algo.max_gen_batches", "must be >= 1"
    )
    q = a.quatro
    yield from _bound(q.delta, q.delta > 0, "algo.quatro.delta", "must be > 0, e.g. 0.1")
    yield from _bound(
        f"{q.lambda_min}, lambda_max={q.lambda_max}",
        0 < q.lambda_min < q.lambda_max,
        "algo.quatro.lambda_min",
        "need 0 < lambda_min < lambda_max, e.g. 1e-3 and 1e4",
    )


def _bound(value, ok: bool, key: str, fix: str) -> Problems:
    if not ok:
        yield f"{key}={value}: {fix}"


def check_algo_combinations(config: ArmorConfig) -> Problems:
    """Switches that only make sense together (docs/algorithm.md, anchor rollout; docs/algorithm.md, mixed optimization)."""
    a = config.algo
    if a.weak_filter and a.anchor == "none":
        yield (
            "algo.weak_filter=true: keeps all-wrong groups only when the reference solved "
            "the query; set algo.anchor to 'armor' or 'filter_only', or weak_filter=false"
        )
    if a.ratio == "off_policy" and a.anchor != "armor":
        yield (
            f"algo.ratio='off_policy': differs from 'standard' only on anchor tokens, and "
            f"algo.anchor={a.anchor!r} inserts none; use algo.ratio=standard or algo.anchor=armor"
        )
    if a.anchor == "filter_only" and a.ratio == "mixed":
        yield (
            "algo.ratio='mixed' with algo.anchor='filter_only': the filter-only control trains "
            "with the standard ratio (docs/algorithm.md, anchor rollout); set algo.ratio=standard"
        )
    if a.filter_policy_samples != "G" and a.anchor != "filter_only":
        yield (
            f"algo.filter_policy_samples={a.filter_policy_samples!r}: only applies to "
            f"algo.anchor='filter_only' (now {a.anchor!r}); remove it or set it to 'G'"
        )
    if a.reset.schedule in registry.RESET_SCHEDULES:
        try:
            check_schedule(a.reset.schedule, a.reset.every, a.reset.until)
        except ValueError as e:
            yield str(e)


def check_batches(config: ArmorConfig) -> Problems:
    """Rollout and mini-batch sizes (docs/algorithm.md, anchor rollout; docs/paper_configs.md)."""
    r, t = config.rollout, config.trainer
    if r.batch < 1:
        yield f"rollout.batch={r.batch}: must be >= 1 accepted query per step"
        return
    if r.gen_batch < r.batch:
        yield (
            f"rollout.gen_batch={r.gen_batch}: must be >= rollout.batch={r.batch} "
            f"(queries per generation batch, k * B; e.g. {3 * r.batch})"
        )
    if t.ppo_mini_batch < 1:
        yield f"trainer.ppo_mini_batch={t.ppo_mini_batch}: must be >= 1 query per update"
    elif r.batch % t.ppo_mini_batch:
        yield (
            f"trainer.ppo_mini_batch={t.ppo_mini_batch}: must divide rollout.batch={r.batch} "
            f"(updates per step = batch / ppo_mini_batch); e.g. {_divisor_hint(r.batch, t.ppo_mini_batch)}"
        )
    s = r.sampling
    yield from _bound(
        s.temperature, s.temperature > 0, "rollout.sampling.temperature", "must be > 0"
    )
    yield from _bound(s.top_p, 0 < s.top_p <= 1, "rollout.sampling.top_p", "must lie in (0, 1]")
    yield from _bound(
        s.max_new_tokens, s.max_new_tokens >= 1, "rollout.sampling.max_new_tokens", "must be >= 1"
    )
    ov = config.reward.overlong
    if ov.enabled and not 0 < ov.buffer < s.max_new_tokens:
        yield (
            f"reward.overlong.buffer={ov.buffer}: must lie in (0, rollout.sampling.max_new_tokens="
            f"{s.max_new_tokens}); or set reward.overlong.enabled=false"
        )


def _divisor_hint(n: int, near: int) -> int:
    """The divisor of ``n`` closest to ``near``."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - near), d))


def check_reference_serving(config: ArmorConfig) -> Problems:
    """``anchor_source`` and ``ref_strategy`` agree (docs/algorithm.md, anchor rollout)."""
    a, r = config.algo, config.rollout
    if a.anchor != "none" and r.ref_strategy == "cache" and a.anchor_source != "cache":
        yield (
            f"rollout.ref_strategy='cache' with algo.anchor_source={a.anchor_source!r}: the "
            "cache serves reused anchors; set algo.anchor_source=cache, or ref_strategy "
            "to 'swap' or 'dedicated' for fresh anchors"
        )


def check_sglang_reference(config: ArmorConfig) -> Problems:
    """The SGLang pools (``rollout.sglang.pools``) fit the rollout GPUs, and the weight
    transport reaches the servers: ``tensor`` shares CUDA memory, so the servers must sit on
    the trainer's GPUs (docs/weight-sync.md). Every transport serves every reference strategy
    (the trainer ranks push the reference into the reference pool, or swap it into the policy
    servers)."""
    from megatron_armor.rollout.sglang.pools import pool_problems

    r = config.rollout
    if r.backend != "sglang":
        return
    yield from pool_problems(config)
    if r.sglang.weight_transport == "tensor" and config.orchestration.layout == "disaggregated":
        yield (
            "rollout.sglang.weight_transport='tensor' with orchestration.layout='disaggregated': "
            "CUDA-IPC handles only reach servers on the trainer's own GPUs; set "
            "weight_transport=distributed (NCCL) or layout=colocated"
        )


def check_offload(config: ArmorConfig) -> Problems:
    """``trainer.offload_train_state`` frees trainer GPU memory for colocated engines."""
    if config.trainer.offload_train_state and config.orchestration.layout == "disaggregated":
        yield (
            "trainer.offload_train_state=true with orchestration.layout='disaggregated': the "
            "trainer has its GPUs to itself, so moving its state out and back every step only "
            "costs time; set trainer.offload_train_state=false (it is for the colocated layout)"
        )


def check_parallel(config: ArmorConfig) -> Problems:
    """Parallel sizes divide the world size and the model's heads and layers."""
    t = config.trainer
    sizes = {"tp": t.tp, "pp": t.pp, "cp": t.cp, "vpp": t.vpp, "world_size": t.world_size}
    bad = [k for k, v in sizes.items() if v < 1]
    for key in bad:
        yield f"trainer.{key}={sizes[key]}: must be >= 1"
    if bad:
        return
    model_parallel = t.tp * t.pp * t.cp
    if t.world_size % model_parallel:
        yield (
            f"trainer.world_size={t.world_size}: must be divisible by tp*pp*cp="
            f"{t.tp}*{t.pp}*{t.cp}={model_parallel} (data-parallel size = world_size / "
            "that); change world_size or the parallel sizes"
        )
    if t.vpp > 1 and t.pp == 1:
        yield f"trainer.vpp={t.vpp}: virtual pipeline stages need trainer.pp > 1; set vpp=1"
    if t.sequence_parallel and t.tp == 1:
        yield "trainer.sequence_parallel=true: needs trainer.tp > 1; set sequence_parallel=false"
    yield from check_model_shape(config)


def read_hf_config(model_path: str) -> dict | None:
    """``model_path/config.json`` as a dict, or ``None`` when there is none (yet)."""
    if not model_path:
        return None
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # named by the input check (config/inputs.py)
    if not isinstance(cfg, dict):
        return None
    return cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg


def check_model_shape(config: ArmorConfig) -> Problems:
    """Heads divisible by tp (KV heads: either way), layers by pp * vpp."""
    t = config.trainer
    hf = read_hf_config(t.model_path)
    if hf is None:
        return
    where = f"{t.model_path}/config.json"
    heads = hf.get("num_attention_heads")
    kv = hf.get("num_key_value_heads") or heads
    layers = hf.get("num_hidden_layers")
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
    stages = t.pp * t.vpp
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
    ctx = r.sglang.context_length
    if r.backend == "sglang" and ctx > 0 and need > ctx:
        yield (
            f"{lengths} exceeds rollout.sglang.context_length={ctx}: raise it to >= {need} "
            "(or 0 for the model's max_position_embeddings)"
        )
    if r.backend == "sglang" and ctx > 0 and positions and ctx > positions:
        yield (
            f"rollout.sglang.context_length={ctx} exceeds the model's max_position_embeddings="
            f"{positions}: SGLang refuses it; raise trainer.model_overrides.max_position_embeddings "
            "so trainer and servers use the same positions"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_hardware(config: ArmorConfig) -> Problems:
    """FP8 needs Transformer Engine (a clear error at start-up, not a crash later)."""
    t = config.trainer
    if t.fp8.enabled and t.transformer_impl != "te":
        yield (
            f"trainer.fp8.enabled=true with trainer.transformer_impl={t.transformer_impl!r}: "
            "FP8 needs Transformer Engine; set trainer.transformer_impl=te or fp8.enabled=false"
        )


def check_run(config: ArmorConfig) -> Problems:
    """Run length, checkpoint cadence, validation sampling, the exact-KL diagnostic."""
    run, val = config.run, config.validation
    yield from _bound(run.steps, run.steps >= 1, "run.steps", "must be >= 1")
    yield from _bound(
        run.ckpt_every, run.ckpt_every >= 0, "run.ckpt_every", "must be >= 0 (0 = only on signals)"
    )
    yield from _bound(run.keep_last, run.keep_last >= 1, "run.keep_last", "must be >= 1")
    limit = config.data.train_limit
    yield from _bound(limit, limit >= 0, "data.train_limit", "must be >= 0 (0 = all prompts)")
    yield from _bound(val.every, val.every >= 0, "validation.every", "must be >= 0 (0 = off)")
    yield from _bound(val.n_samples, val.n_samples >= 1, "validation.n_samples", "must be >= 1")
    yield from _bound(val.top_p, 0 < val.top_p <= 1, "validation.top_p", "must lie in (0, 1]")
    yield from _bound(
        val.temperature,
        val.temperature > 0,
        "validation.temperature",
        "must be > 0 (sampling; 0 would silently decode greedily), e.g. 1.0",
    )
    log = config.logging
    yield from _bound(
        log.exact_kl_every,
        log.exact_kl_every >= 0,
        "logging.exact_kl_every",
        "must be >= 0 (0 = off)",
    )
    for key in ("exact_kl_samples", "exact_kl_positions"):
        value = getattr(log, key)
        yield from _bound(value, value >= 1, f"logging.{key}", "must be >= 1")
    threads = config.orchestration.threads_per_actor
    yield from _bound(
        threads, threads >= 0, "orchestration.threads_per_actor", "must be >= 0 (0 = auto)"
    )


def check_lr_schedule(config: ArmorConfig) -> Problems:
    """Warm-up and decay lengths (in ``trainer.lr_unit``)."""
    t = config.trainer
    yield from _bound(t.warmup_steps, t.warmup_steps >= 0, "trainer.warmup_steps", "must be >= 0")
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
        yield from _bound(o.patience, o.patience >= 1, "overopt.patience", "must be >= 1")
        yield from _bound(
            o.reward_window, o.reward_window >= 1, "overopt.reward_window", "must be >= 1"
        )
    for key, metric in watched:
        if metric.startswith("val/") and config.validation.every <= 0:
            yield (
                f"{key}={metric!r} needs validation; set validation.every > 0 (steps between "
                "validations)"
            )


def check_sizes(config: ArmorConfig) -> Problems:
    """Learning rate, budgets, worker counts and timeouts (each a positive number)."""
    t, r, o = config.trainer, config.reward, config.orchestration
    yield from _bound(t.lr, t.lr > 0, "trainer.lr", "must be > 0, e.g. 1e-6")
    yield from _bound(
        t.min_lr, 0 <= t.min_lr <= t.lr, "trainer.min_lr", "must lie in [0, trainer.lr]"
    )
    yield from _bound(
        t.micro_batch_tokens,
        t.micro_batch_tokens >= 1,
        "trainer.micro_batch_tokens",
        "must be >= 1 token per micro-batch, e.g. 4096",
    )
    yield from _bound(t.grad_clip, t.grad_clip >= 0, "trainer.grad_clip", "must be >= 0 (0 = off)")
    yield from _bound(
        config.rollout.engine_batch_size,
        config.rollout.engine_batch_size >= 1,
        "rollout.engine_batch_size",
        "must be >= 1 sequence decoded together, e.g. 64",
    )
    yield from _bound(
        config.rollout.reference_parts,
        config.rollout.reference_parts >= 1,
        "rollout.reference_parts",
        "must be >= 1 part per generation batch (1 = one reference call)",
    )
    yield from _bound(
        config.data.max_prompt_len,
        config.data.max_prompt_len >= 1,
        "data.max_prompt_len",
        "must be >= 1",
    )
    yield from _bound(
        r.timeout_s, r.timeout_s > 0, "reward.timeout_s", "must be > 0 seconds, e.g. 5"
    )
    yield from _bound(
        r.num_workers, r.num_workers >= 1, "reward.num_workers", "must be >= 1 process"
    )
    for key in ("nodes", "gpus_per_node", "num_reward_workers"):
        value = getattr(o, key)
        yield from _bound(value, value >= 1, f"orchestration.{key}", "must be >= 1")
    yield from _bound(
        o.rollout_gpus, o.rollout_gpus >= 0, "orchestration.rollout_gpus", "must be >= 0"
    )


RULES: list[Callable[[ArmorConfig], Problems]] = [
    check_names,
    check_algo_numbers,
    check_algo_combinations,
    check_batches,
    check_reference_serving,
    check_sglang_reference,
    check_offload,
    check_parallel,
    check_context,
    check_hardware,
    check_run,
    check_lr_schedule,
    check_watchers,
    check_sizes,
]


def find_problems(config: ArmorConfig, inputs: bool = False) -> list[str]:
    """All problems of ``config`` (empty when it is valid); with ``inputs`` also those of the
    files it names (model directory, tokenizer, data: ``config/inputs.py``)."""
    from megatron_armor.config.inputs import check_inputs

    rules = RULES + [check_inputs] if inputs else RULES
    return [msg for rule in rules for msg in rule(config)]


def validate(config: ArmorConfig, inputs: bool = False) -> None:
    """Raise ``ValueError`` listing every inconsistent setting of ``config`` (and, with
    ``inputs``, every unusable file it names)."""
    problems = find_problems(config, inputs)
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError(f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))
