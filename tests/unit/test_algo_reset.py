"""Reference reset schedules (docs/algorithm.md, reference reset). Tier: unit."""

from __future__ import annotations

import json

import pytest

from megatron_armor.algo.reset import ResetSchedule

pytestmark = pytest.mark.unit


def _resets(schedule: ResetSchedule, steps: int) -> list[int]:
    return [s for s in range(1, steps + 1) if schedule.should_reset(s)]


def test_schedules_fire_at_the_right_steps():
    assert _resets(ResetSchedule("none"), 50) == []
    assert _resets(ResetSchedule("every", every=3), 10) == [3, 6, 9]
    assert _resets(ResetSchedule("every", every=160), 400) == [160, 320]
    assert _resets(ResetSchedule("every-until", every=1, until=4), 8) == [1, 2, 3, 4]
    assert _resets(ResetSchedule("every-until", every=2, until=5), 10) == [2, 4]
    assert _resets(ResetSchedule("every-until", every=3, until=3), 10) == [3]
    assert _resets(ResetSchedule("log2"), 40) == [1, 2, 4, 8, 16, 32]


def test_qwen3_recipe_every_step_until_180():
    schedule = ResetSchedule("every-until", every=1, until=180)
    assert schedule.should_reset(180) and not schedule.should_reset(181)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="every", every=0), "algo.reset.every=0"),
        (dict(kind="every-until", every=0, until=5), "algo.reset.every=0"),
        (dict(kind="every-until", every=5, until=4), "algo.reset.until=4"),
        (dict(kind="sometimes"), "algo.reset.schedule='sometimes'"),
    ],
)
def test_bad_schedules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ResetSchedule(**kwargs)


def test_steps_are_one_based_and_resets_increase():
    schedule = ResetSchedule("every", every=2)
    with pytest.raises(ValueError, match="1-based"):
        schedule.should_reset(0)
    schedule.record_reset(2)
    with pytest.raises(ValueError, match="recorded after"):
        schedule.record_reset(2)


def test_state_round_trip_through_json():
    schedule = ResetSchedule("every-until", every=2, until=9)
    for step in range(1, 7):
        if schedule.should_reset(step):
            schedule.record_reset(step)
    assert schedule.resets == [2, 4, 6] and schedule.last_reset == 6
    restored = ResetSchedule("every-until", every=2, until=9)
    restored.load_state_dict(json.loads(json.dumps(schedule.state_dict())))
    assert restored.resets == [2, 4, 6] and restored.last_reset == 6
    assert restored.state_dict() == schedule.state_dict()
    assert ResetSchedule("log2").last_reset == 0


def test_restoring_into_a_different_schedule_is_an_error():
    state = ResetSchedule("every", every=4).state_dict()
    with pytest.raises(ValueError, match="differs from algo.reset"):
        ResetSchedule("every", every=5).load_state_dict(state)
