"""The warnings of a long run on synthetic metric streams: acceptance falling toward the error
(with the steps it projects), host memory growing, the run directory outgrowing its disk
(``observability/health.py``). Tier: unit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.observability.health import (
    AcceptanceLimits,
    AcceptanceWatch,
    DiskWatch,
    HealthWatch,
    MemoryWatch,
    steps_until,
)
from megatron_armor.observability.summary import step_line
from megatron_armor.observability.watchers import least_squares
from megatron_armor.orchestration.run.run_watch import RunWatch, acceptance_limits

pytestmark = pytest.mark.unit

# the tiny config's shape: 8 batches of 16 queries, B = 8, floor 4 (train_partial at 0.5)
LIMITS = AcceptanceLimits(capacity=128, need=8, floor=4, steps=1500)


def falling(step: int) -> float:
    """0.5 falling 0.05 per 100 steps, with +-0.02 alternating scatter."""
    return 0.5 - 0.0005 * step + (0.02 if step % 2 else -0.02)


def polyfit(points):
    """numpy's line through ``points``, the residual std over ``n - 2`` and the slope's
    standard error (the reference)."""
    x, y = np.array(points, dtype=float).T
    slope, intercept = np.polyfit(x, y, 1)
    sigma = float(np.sqrt(((y - slope * x - intercept) ** 2).sum() / (len(x) - 2)))
    return slope, intercept, sigma, sigma / float(np.sqrt(((x - x.mean()) ** 2).sum()))


def test_least_squares_recovers_slope_intercept_and_scatter():
    points = [[s, 3.0 - 0.5 * s + (-1) ** s] for s in range(40)]
    assert least_squares(points) == pytest.approx(polyfit(points), rel=1e-9)
    assert least_squares([[0, 1.0], [2, 2.0]]) == (0.5, 1.0, 0.0, 0.0)
    assert least_squares([[1, 2.0], [1, 3.0]]) is None
    assert steps_until(0.3, -0.001, 0.1) == pytest.approx(200) and steps_until(0.05, 0.0, 0.1) == 0
    assert steps_until(0.3, 0.001, 0.1) is None


def test_falling_acceptance_projects_the_steps_until_the_error():
    watch = AcceptanceWatch(LIMITS, window=100)
    out = [watch.observe(step, {"anchor/acceptance_rate": falling(step)}) for step in range(1, 301)]
    last = out[-1]
    slope, intercept, _, _ = polyfit([[s, falling(s)] for s in range(201, 301)])  # the window
    assert last["watch/acceptance_slope_per_100"] == pytest.approx(100 * slope, rel=1e-9)
    level = intercept + 300 * slope
    assert last["watch/acceptance_fit"] == pytest.approx(level, rel=1e-9)
    danger = last["watch/acceptance_error_rate"]  # 4 of 128 two binomial stds below the mean
    assert danger - 2 * (danger * (1 - danger) / 128) ** 0.5 == pytest.approx(4 / 128)
    assert last["watch/acceptance_steps_to_error"] == pytest.approx((level - danger) / -slope)
    assert last["watch/acceptance_steps_to_short"] < last["watch/acceptance_steps_to_error"]
    assert last["watch/acceptance_warning"] == 1.0  # step ~840 < run.steps = 1500
    assert "reaches 0.079 in ~" in watch.message and "data.retire_solved_after" in watch.message
    assert out[98] == {"watch/short_batches": 0.0, "watch/acceptance_warning": 0.0}  # 99 points
    assert "watch/acceptance_fit" in out[99]  # a full window
    shorter = AcceptanceWatch(AcceptanceLimits(128, 8, 4, steps=800), window=100)
    for step in range(1, 301):
        m = shorter.observe(step, {"anchor/acceptance_rate": falling(step)})
    assert m["watch/acceptance_warning"] == 0.0 and not shorter.message  # after the run's end


def test_steady_acceptance_warns_only_once_it_is_at_the_danger_rate():
    watch = AcceptanceWatch(LIMITS, window=50)
    for step in range(1, 101):
        m = watch.observe(step, {"anchor/acceptance_rate": 0.3 + (0.01 if step % 2 else -0.01),
                                 "anchor/short_batch": float(step % 10 == 0)})  # fmt: skip
    assert "watch/acceptance_steps_to_error" not in m or m["watch/acceptance_slope_per_100"] < 0
    assert m["watch/acceptance_warning"] == 0.0 and m["watch/short_batches"] == 10.0
    for step in range(101, 160):
        m = watch.observe(step, {"anchor/acceptance_rate": 0.02})
    assert m["watch/acceptance_steps_to_error"] == 0 and "reaches 0.079 now" in watch.message


def test_the_acceptance_watch_resumes_exactly():
    rates = [(step, {"anchor/acceptance_rate": falling(step)}) for step in range(1, 201)]
    whole = AcceptanceWatch(LIMITS, 100)
    expected = [whole.observe(s, m) for s, m in rates]
    first = AcceptanceWatch(LIMITS, 100)
    logged = [first.observe(s, m) for s, m in rates[:120]]
    resumed = AcceptanceWatch(LIMITS, 100)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    logged += [resumed.observe(s, m) for s, m in rates[120:]]
    assert logged == expected


def test_host_memory_growth_above_the_threshold_warns_after_a_full_window():
    watch = MemoryWatch(window=50, growth_gb_per_100=1.0)
    grow = lambda s: {"mem/run_gb": 2.0 + 0.02 * s, "mem/node0_available_gb": 10.0}  # noqa: E731
    first = [watch.observe(step, grow(step)) for step in range(1, 50)]
    assert all(m == {"watch/memory_warning": 0.0} for m in first)  # not a full window yet
    m = watch.observe(50, grow(50))
    assert m["watch/memory_growth_gb_per_100"] == pytest.approx(2.0)
    assert m["watch/memory_warning"] == 1.0 and m["watch/memory_steps_to_full"] == pytest.approx(
        500
    )
    assert "grows 2.00 GB per 100 steps" in watch.message
    flat = MemoryWatch(window=50, growth_gb_per_100=1.0)
    for step in range(1, 80):
        m = flat.observe(step, {"mem/run_gb": 2.0 + 0.005 * step})
    assert m["watch/memory_warning"] == 0.0 and not flat.message


def test_a_run_dir_growing_past_the_free_space_warns_until_the_next_checkpoint():
    watch = DiskWatch(steps=1000)
    assert watch.observe(50, {}) == {}  # no checkpoint step yet
    ckpt = lambda s, free: {"disk/run_dir_gb": 1.0 + 0.01 * s, "disk/free_gb": free,  # noqa: E731
                            "disk/checkpoint_gb": 0.5}  # fmt: skip
    assert watch.observe(100, ckpt(100, 20.0))["watch/disk_warning"] == 0.0  # one point
    m = watch.observe(200, ckpt(200, 20.0))
    assert m["watch/disk_growth_gb_per_100"] == pytest.approx(1.0)
    assert m["watch/disk_projected_gb"] == pytest.approx(0.01 * 800 + 0.5)
    assert m["watch/disk_warning"] == 0.0
    assert watch.observe(300, ckpt(300, 5.0))["watch/disk_warning"] == 1.0  # 7.5 GB > 5 free
    assert (
        watch.observe(301, {}) == {"watch/disk_warning": 1.0}
        and "5.00 GB are free" in watch.message
    )
    resumed = DiskWatch(steps=1000)
    resumed.load_state_dict(json.loads(json.dumps(watch.state_dict())))
    assert resumed.observe(302, {}) == {"watch/disk_warning": 1.0}


def test_a_decline_within_the_noise_projects_nothing():
    """-0.005 per 100 steps under +-0.05 scatter is no trend (slope + 2 se >= 0); -0.2 is."""
    for drop, projected in ((0.00005, False), (0.002, True)):
        watch = AcceptanceWatch(LIMITS, window=100)
        for step in range(1, 101):
            m = watch.observe(step, {"anchor/acceptance_rate": 0.6 - drop * step
                                     + (0.05 if step % 2 else -0.05)})  # fmt: skip
        falling = m["watch/acceptance_slope_per_100"] + 2 * m["watch/acceptance_slope_se_per_100"]
        assert (falling < 0) == projected
        assert ("watch/acceptance_steps_to_error" in m) == projected


def test_console_lines_when_a_warning_turns_on_and_every_repeat_while_on():
    """Memory flat, then growing 10 GB per 100 steps from step 20 to 40, then flat again."""
    health = HealthWatch(LIMITS, window=10, growth_gb=1.0, repeat=5)
    used = lambda s: 2.0 + 0.1 * (min(max(s, 20), 40) - 20)  # noqa: E731
    warned, printed = [], []
    for step in range(1, 61):
        m = health.observe(step, {"mem/run_gb": used(step)})
        warned += [step] if m["watch/memory_warning"] else []
        printed += [step] if health.lines else []
        assert all("host memory of the run (mem/run_gb) grows" in line for line in health.lines)
    assert warned == list(range(warned[0], warned[-1] + 1)) and 21 <= warned[0] <= 23
    assert 40 <= warned[-1] <= 49  # the window slides past the growth
    assert printed == list(range(warned[0], warned[-1] + 1, 5))  # on, then every 5 steps


def test_a_flickering_warning_prints_at_most_every_repeat_steps():
    health = HealthWatch(LIMITS, window=10, growth_gb=1.0, repeat=5)
    printed, warned = [], 0
    for step in range(1, 41):  # +0.1 GB every other step: 5 GB per 100 steps, fitted in zigzag
        m = health.observe(step, {"mem/run_gb": 2.0 + 0.1 * (step // 2)})
        warned += int(m["watch/memory_warning"])
        printed += [step] if health.lines else []
    assert warned > len(printed) >= 2
    assert all(b - a >= 5 for a, b in zip(printed, printed[1:], strict=False))


def test_the_run_watch_reads_its_limits_from_the_config_and_the_step_line_shows_them():
    cfg = ArmorConfig()
    cfg.rollout.batch, cfg.rollout.gen_batch, cfg.algo.max_gen_batches = 8, 16, 8
    cfg.trainer.ppo_mini_batch, cfg.run.steps = 4, 1500
    assert acceptance_limits(cfg) == LIMITS
    cfg.algo.on_short_batch = "error"
    assert acceptance_limits(cfg).floor == 8
    watch = RunWatch(cfg)
    m = watch.observe(3, {"anchor/acceptance_rate": 0.4, "mem/run_gb": 2.5})
    assert m == {"watch/short_batches": 0.0, "watch/acceptance_warning": 0.0,
                 "watch/memory_warning": 0.0}  # fmt: skip
    assert set(watch.state_dict()["health"]) == {"acceptance", "disk"}
    line = step_line(3, 10, {**m, "mem/run_gb": 2.5, "watch/disk_warning": 1.0,
                             "anchor/short_batch": 1.0, "anchor/kept": 5.0})  # fmt: skip
    assert "mem 2.50G" in line and "WARN disk" in line and "SHORT batch of 5" in line


def test_without_a_floor_falling_acceptance_projects_short_steps_but_never_an_error():
    watch = AcceptanceWatch(AcceptanceLimits(capacity=128, need=8, floor=0, steps=1500), 100)
    for step in range(1, 301):
        m = watch.observe(step, {"anchor/acceptance_rate": falling(step)})
    assert "watch/acceptance_steps_to_short" in m and "watch/acceptance_steps_to_error" not in m
    assert m["watch/acceptance_warning"] == 0.0 and "watch/acceptance_error_rate" not in m
