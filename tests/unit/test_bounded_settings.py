"""``orchestration.async_rollout: bounded`` settings, checked at load (unit tier): the
decoupled objective needs a rollout correction, and what partial rollouts cannot follow is
refused with the setting to change (docs/orchestration.md, "Bounded staleness")."""

from __future__ import annotations

import pytest

from megatron_armor.config import ConfigError, load_config
from megatron_armor.config.validate import (
    overlaps_rollout,
    runs_async_rollout,
    runs_bounded_staleness,
    runs_concurrent_reference,
)

pytestmark = pytest.mark.unit

BOUNDED = ("orchestration.async_rollout=bounded", "algo.rollout_correction.mode=token_tis")


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    return str(info.value)


def test_bounded_overlaps_like_one_step_and_has_its_own_loop():
    config = load_config(None, list(BOUNDED))
    assert runs_bounded_staleness(config) and overlaps_rollout(config)
    assert not runs_async_rollout(config)  # one_step's pipeline is not this one
    assert config.orchestration.max_staleness == 2 and config.orchestration.partial_rollout
    assert not runs_concurrent_reference(config)  # auto: the engine's core generates meanwhile
    msg = _error(*BOUNDED, "orchestration.layout=colocated")
    assert "orchestration.async_rollout=bounded with orchestration.layout='colocated'" in msg


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["algo.rollout_correction.mode=none"], "set algo.rollout_correction.mode=token_tis"),
        (["orchestration.max_staleness=0"], "orchestration.max_staleness=0: must be >= 1"),
        (["algo.anchor_source=cache"], "set algo.anchor_source=generate"),
        (["rollout.reference_first=true"], "rollout.reference_first=auto (policy first here)"),
        (["rollout.reference_parts=2"], "rollout.reference_parts=2"),
        (["trainer.moe.routing_replay=r3"], "set trainer.moe.routing_replay=r2"),
    ],
)
def test_what_bounded_cannot_follow_is_refused_with_the_fix(overrides, named):
    assert named in _error(*BOUNDED, *overrides)
