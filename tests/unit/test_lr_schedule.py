"""The LR schedule in the paper's units (arXiv 2607.10481, App. B: lr 1e-6, 10-step warm-up,
16 updates per RL step). Tier: unit.

The official code is built on verl, whose actor scheduler is
``LambdaLR(lambda s: min(1, s / warmup))`` stepped once per RL step after the updates, so RL
step ``s`` (from 0) trains with ``lr * min(1, s / 10)``; the reference below is that schedule.
"""

from __future__ import annotations

import pytest
import torch

from megatron_armor.config.schema import TrainerConfig
from megatron_armor.trainer.optim import (
    advance_lr_schedule,
    build_lr_scheduler,
    lr_schedule_position,
)

pytestmark = pytest.mark.unit

PAPER = TrainerConfig(lr=1e-6, warmup_steps=10, lr_unit="rl_steps")
UPDATES_PER_STEP = 16  # 512 queries / 32 per mini-batch


def official_lrs(rl_steps: int, warmup: int = 10, lr: float = 1e-6) -> list[float]:
    """The LR each RL step trains with under verl's constant-with-warm-up scheduler."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / max(1, warmup)))
    out = []
    for _ in range(rl_steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # the step's updates
        scheduler.step()  # once per RL step, after them
    return out


def our_lrs(trainer: TrainerConfig, rl_steps: int, updates_per_step: int) -> list[list[float]]:
    """The LR of every update of every RL step, as ``MegatronTrainer._update`` sets it."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=trainer.lr)
    scheduler = build_lr_scheduler(optimizer, trainer)
    done, out = 0, []
    for _ in range(rl_steps):
        step = []
        for _ in range(updates_per_step):
            advance_lr_schedule(scheduler, done, updates_per_step, trainer.lr_unit)
            step.append(optimizer.param_groups[0]["lr"])
            done += 1
        out.append(step)
    return out


def test_paper_warmup_matches_the_official_schedule_at_steps_0_5_10_11():
    official = official_lrs(12)
    ours = our_lrs(PAPER, 12, UPDATES_PER_STEP)
    for s, expected in ((0, 0.0), (5, 0.5e-6), (10, 1e-6), (11, 1e-6)):
        assert official[s] == pytest.approx(expected, abs=1e-15)
        assert ours[s] == [pytest.approx(official[s], abs=1e-15)] * UPDATES_PER_STEP
    assert [u[0] for u in ours] == pytest.approx(official, abs=1e-15)


def test_updates_unit_ramps_inside_a_step():
    """``lr_unit: updates`` (the schedule before the paper's units): warm-up over 160 updates =
    the same 10 RL steps, but the LR moves every update (update k uses k / 160)."""
    ours = our_lrs(TrainerConfig(lr=1e-6, warmup_steps=160, lr_unit="updates"), 11, 16)
    flat = [lr for step in ours for lr in step]
    assert flat[0] == pytest.approx(1e-6 / 160)
    assert flat[79] == pytest.approx(0.5e-6)
    assert flat[159:] == [pytest.approx(1e-6)] * (len(flat) - 159)


def test_resume_continues_the_schedule_exactly():
    """The scheduler state (megatron's ``state_dict``) plus the update counter resume it."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-6)
    scheduler = build_lr_scheduler(optimizer, PAPER)
    for done in range(5 * UPDATES_PER_STEP):
        advance_lr_schedule(scheduler, done, UPDATES_PER_STEP, "rl_steps")
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-6)
    resumed = build_lr_scheduler(fresh, PAPER)
    resumed.load_state_dict(scheduler.state_dict())
    advance_lr_schedule(resumed, 5 * UPDATES_PER_STEP, UPDATES_PER_STEP, "rl_steps")
    assert fresh.param_groups[0]["lr"] == pytest.approx(official_lrs(6)[5], abs=1e-15)


def test_cosine_decay_in_rl_steps():
    trainer = TrainerConfig(lr=1e-6, min_lr=1e-7, warmup_steps=2, lr_unit="rl_steps",
                            lr_decay_style="cosine", lr_decay_steps=12)  # fmt: skip
    lrs = [s[0] for s in our_lrs(trainer, 14, 4)]
    assert lrs[2] == pytest.approx(1e-6)
    assert lrs[7] == pytest.approx(1e-7 + 0.5 * 0.9e-6)  # half-way through the decay
    assert lrs[12] == pytest.approx(1e-7) and lrs[13] == pytest.approx(1e-7)


def test_unknown_unit_names_the_setting():
    with pytest.raises(ValueError, match="trainer.lr_unit='epochs'"):
        lr_schedule_position(0, 16, "epochs")
