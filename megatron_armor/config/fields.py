"""Single-field checks of the config tree, one validator per section.

Each validator is ``config -> Iterator[str]`` and yields ``"<key>=<value>: <fix>"`` for every
setting of its section whose value is out of range on its own, or that the trainer does not
implement. Settings that depend on each other are checked in ``validate.py``, which runs these
validators first (:data:`SECTION_CHECKS`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from megatron_armor.config.schema import ArmorConfig

Problems = Iterator[str]

MAX_SEED = 2**31 - 1
"""Largest ``run.seed``: NumPy's generators refuse negative seeds, and the trainer's RNG
streams add offsets to it (a 31-bit seed leaves them room)."""


def bound(value, ok: bool, key: str, fix: str) -> Problems:
    """``"key=value: fix"`` unless ``ok``."""
    if not ok:
        yield f"{key}={value}: {fix}"


def at_least(
    section: object, prefix: str, keys: tuple[str, ...], low: int, fix: str = ""
) -> Problems:
    """Each of ``keys`` of ``section`` is ``>= low``."""
    for key in keys:
        value = getattr(section, key)
        yield from bound(value, value >= low, f"{prefix}.{key}", f"must be >= {low}{fix}")


def check_algo(config: ArmorConfig) -> Problems:
    """Group size, clip ranges and the other ``algo.*`` numbers."""
    a = config.algo
    yield from bound(
        a.group_size, a.group_size >= 2, "algo.group_size",
        "must be >= 2 (a group needs reward variance)",
    )  # fmt: skip
    yield from bound(
        a.clip_low, 0.0 < a.clip_low < 1.0, "algo.clip_low", "must lie in (0, 1), e.g. 0.2"
    )
    yield from bound(a.clip_high, a.clip_high > 0.0, "algo.clip_high", "must be > 0, e.g. 0.28")
    yield from bound(a.dual_clip_c, a.dual_clip_c > 1.0, "algo.dual_clip_c", "must be > 1, e.g. 10")
    yield from bound(
        a.log_ratio_clamp, a.log_ratio_clamp > 0, "algo.log_ratio_clamp", "must be > 0, e.g. 20"
    )
    yield from bound(a.kl_coef, a.kl_coef >= 0, "algo.kl_coef", "must be >= 0 (0 = no KL penalty)")
    yield from bound(
        a.qae_quantile, 0.0 <= a.qae_quantile <= 1.0, "algo.qae_quantile",
        "must lie in [0, 1], e.g. 0.45",
    )  # fmt: skip
    yield from at_least(a, "algo", ("max_gen_batches",), 1)
    yield from check_rollout_correction(a.rollout_correction)
    yield from bound(
        a.min_batch_fraction, 0.0 <= a.min_batch_fraction <= 1.0, "algo.min_batch_fraction",
        "must lie in [0, 1]: the share of rollout.batch a short batch needs, e.g. 0.5 (0: any)",
    )  # fmt: skip
    q = a.quatro
    yield from bound(q.delta, q.delta > 0, "algo.quatro.delta", "must be > 0, e.g. 0.1")
    yield from bound(
        f"{q.lambda_min}, lambda_max={q.lambda_max}",
        0 < q.lambda_min < q.lambda_max,
        "algo.quatro.lambda_min",
        "need 0 < lambda_min < lambda_max, e.g. 1e-3 and 1e4",
    )


def check_rollout_correction(c) -> Problems:
    """The truncation cap and the mask bounds of ``algo.rollout_correction`` (all modes: a
    value is checked even when the mode does not read it, so a later mode switch is safe)."""
    key = "algo.rollout_correction"
    yield from bound(c.cap, c.cap > 0, f"{key}.cap", "must be > 0, e.g. 2 (w = min(rho, cap))")
    yield from bound(
        f"{c.low}, high={c.high}", 0 <= c.low < c.high, f"{key}.low",
        "need 0 <= low < high, e.g. low=0.5 and high=2 (0 = no lower bound)",
    )  # fmt: skip


def check_trainer(config: ArmorConfig) -> Problems:
    """Parallel sizes (and the ones the trainer does not implement), LR, budgets."""
    t = config.trainer
    yield from at_least(t, "trainer", ("tp", "pp", "cp", "vpp", "ep"), 1)
    if not isinstance(t.world_size, str):  # a word: decided or named by config/resolve.py
        yield from at_least(t, "trainer", ("world_size",), 1)
    if isinstance(t.etp, str):
        if t.etp != "auto":
            yield f"trainer.etp={t.etp!r}: a number of ranks >= 1 or auto (docs/trainer.md)"
    else:
        yield from at_least(t, "trainer", ("etp",), 1)
    yield from bound(
        t.moe.aux_loss_coeff, t.moe.aux_loss_coeff >= 0, "trainer.moe.aux_loss_coeff",
        "must be >= 0 (0 = no load-balancing loss), e.g. 1e-3",
    )  # fmt: skip
    if t.cp > 1:
        yield (
            f"trainer.cp={t.cp}: context parallelism is not implemented by the trainer; set "
            "trainer.cp=1 (split long sequences' activations with trainer.tp and "
            "trainer.sequence_parallel=true, or lower trainer.micro_batch_tokens)"
        )
    if t.vpp > 1:
        yield (
            f"trainer.vpp={t.vpp}: virtual pipeline stages (interleaved 1F1B) are not "
            "implemented by the trainer; set trainer.vpp=1"
        )
    yield from bound(t.lr, t.lr > 0, "trainer.lr", "must be > 0, e.g. 1e-6")
    yield from bound(t.warmup_steps, t.warmup_steps >= 0, "trainer.warmup_steps", "must be >= 0")
    yield from at_least(t, "trainer", ("ppo_mini_batch",), 1, " query per update")
    yield from at_least(
        t, "trainer", ("micro_batch_tokens",), 1, " token per micro-batch, e.g. 4096"
    )
    yield from bound(t.grad_clip, t.grad_clip >= 0, "trainer.grad_clip", "must be >= 0 (0 = off)")
    yield from bound(
        t.adam_eps, t.adam_eps > 0, "trainer.adam_eps",
        "must be > 0, e.g. 1e-8 (with 0, Adam divides 0 by 0 for a parameter without "
        "gradient and the weights become NaN)",
    )  # fmt: skip
    yield from at_least(
        t, "trainer", ("max_skipped_updates",), 1,
        " (non-finite updates in a row before the run stops), e.g. 10",
    )  # fmt: skip


def check_rollout(config: ArmorConfig) -> Problems:
    """Batch size, sampling and the engine batch."""
    r, s = config.rollout, config.rollout.sampling
    yield from at_least(r, "rollout", ("batch",), 1, " accepted query per step")
    yield from bound(
        s.temperature, s.temperature > 0, "rollout.sampling.temperature", "must be > 0"
    )
    yield from bound(s.top_p, 0 < s.top_p <= 1, "rollout.sampling.top_p", "must lie in (0, 1]")
    yield from at_least(s, "rollout.sampling", ("max_new_tokens",), 1)
    yield from at_least(
        r, "rollout", ("engine_batch_size",), 1, " sequence decoded together, e.g. 64"
    )
    yield from at_least(
        r, "rollout", ("reference_parts",), 1, " part per generation batch (1 = one reference call)"
    )


def check_data(config: ArmorConfig) -> Problems:
    """Prompt length and the training-prompt limit."""
    d = config.data
    yield from at_least(d, "data", ("max_prompt_len",), 1)
    yield from bound(
        d.train_limit, d.train_limit >= 0, "data.train_limit", "must be >= 0 (0 = all prompts)"
    )
    yield from bound(
        d.retire_solved_after, d.retire_solved_after >= 0, "data.retire_solved_after",
        "must be >= 0 (0 = never retire solved prompts), e.g. 3",
    )  # fmt: skip
    yield from bound(
        d.retire_max_fraction, 0.0 < d.retire_max_fraction <= 1.0, "data.retire_max_fraction",
        "must lie in (0, 1]: the largest share of the prompts retirement takes out, e.g. 0.5",
    )  # fmt: skip


def check_reward(config: ArmorConfig) -> Problems:
    """Verifier time-out and worker count."""
    r = config.reward
    yield from bound(
        r.timeout_s, r.timeout_s > 0, "reward.timeout_s", "must be > 0 seconds, e.g. 5"
    )
    yield from at_least(r, "reward", ("num_workers",), 1, " process")


def check_validation(config: ArmorConfig) -> Problems:
    """Validation cadence and sampling."""
    v = config.validation
    yield from bound(v.every, v.every >= 0, "validation.every", "must be >= 0 (0 = off)")
    yield from at_least(v, "validation", ("n_samples",), 1)
    yield from bound(v.top_p, 0 < v.top_p <= 1, "validation.top_p", "must lie in (0, 1]")
    yield from bound(
        v.temperature, v.temperature > 0, "validation.temperature",
        "must be > 0 (sampling; 0 would silently decode greedily), e.g. 1.0",
    )  # fmt: skip


def check_logging(config: ArmorConfig) -> Problems:
    """The exact-KL diagnostic."""
    log = config.logging
    yield from bound(
        log.exact_kl_every,
        log.exact_kl_every >= 0,
        "logging.exact_kl_every",
        "must be >= 0 (0 = off)",
    )
    yield from at_least(log, "logging", ("exact_kl_samples", "exact_kl_positions"), 1)


def check_orchestration(config: ArmorConfig) -> Problems:
    """Node, GPU and worker counts."""
    o = config.orchestration
    yield from at_least(o, "orchestration", ("nodes", "gpus_per_node", "num_reward_workers"), 1)
    yield from at_least(o, "orchestration", ("rollout_gpus",), 0)
    yield from bound(
        o.threads_per_actor, o.threads_per_actor >= 0, "orchestration.threads_per_actor",
        "must be >= 0 (0 = auto)",
    )  # fmt: skip
    yield from call_deadline_bounds(o)


def call_deadline_bounds(o) -> Problems:
    """The learned call deadlines' settings (``orchestration/actors/call_watch.py``)."""
    yield from bound(o.call_deadline_multiple, o.call_deadline_multiple >= 1,
                     "orchestration.call_deadline_multiple", "must be >= 1 (10 = default)")  # fmt: skip
    yield from bound(o.call_deadline_quantile, 0 < o.call_deadline_quantile <= 1,
                     "orchestration.call_deadline_quantile", "must be in (0, 1] (0.9 = default)")  # fmt: skip
    yield from bound(o.call_deadline_floor_s, 0 < o.call_deadline_floor_s <= o.call_deadline_cap_s,
                     "orchestration.call_deadline_floor_s",
                     f"must be > 0 and <= orchestration.call_deadline_cap_s={o.call_deadline_cap_s}")  # fmt: skip
    for key in ("stop_wait_s", "shutdown_timeout_s"):
        value = getattr(o, key)
        yield from bound(value, value > 0, f"orchestration.{key}", "must be > 0 (seconds)")


def check_run(config: ArmorConfig) -> Problems:
    """Run length and checkpoint cadence."""
    run = config.run
    yield from bound(
        run.seed, 0 <= run.seed <= MAX_SEED, "run.seed",
        f"must be an integer in [0, {MAX_SEED}] (the data order, the sampling seeds and the "
        "trainer's RNG derive from it), e.g. 1",
    )  # fmt: skip
    yield from at_least(run, "run", ("steps",), 1)
    yield from bound(
        run.ckpt_every, run.ckpt_every >= 0, "run.ckpt_every", "must be >= 0 (0 = only on signals)"
    )
    yield from at_least(run, "run", ("keep_last",), 1)
    yield from at_least(run, "run", ("max_recoveries",), 0, " (0 = a dead worker stops the run)")
    yield from at_least(run, "run", ("recovery_window",), 1, " step")


def check_overopt(config: ArmorConfig) -> Problems:
    """The over-optimization detector's windows (when it is on)."""
    o = config.overopt
    if o.enabled:
        yield from at_least(o, "overopt", ("patience", "reward_window"), 1)


def check_watch(config: ArmorConfig) -> Problems:
    """The long-run watchers' window, growth threshold and console cadence."""
    w = config.watch
    yield from at_least(w, "watch", ("window",), 2, " steps to fit a trend through, e.g. 100")
    yield from at_least(w, "watch", ("repeat_every",), 1, " step, e.g. 100")
    yield from bound(
        w.memory_growth_gb, w.memory_growth_gb > 0, "watch.memory_growth_gb",
        "must be > 0 GB per 100 steps, e.g. 1.0",
    )  # fmt: skip


SECTION_CHECKS: list[Callable[[ArmorConfig], Problems]] = [
    check_algo,
    check_trainer,
    check_rollout,
    check_data,
    check_reward,
    check_validation,
    check_logging,
    check_orchestration,
    check_run,
    check_overopt,
    check_watch,
]
