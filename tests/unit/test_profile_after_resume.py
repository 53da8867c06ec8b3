"""Profiling a run that resumes: the profile steps at or before its resume step would never
run again (nothing captured, silently), so they move just after it, spaced as given, and the
run says so; steps after it stay. Tier: unit."""

from __future__ import annotations

import pytest

from megatron_armor.config import load_config
from megatron_armor.observability.profiler import profile_steps_after_resume
from megatron_armor.orchestration.run.run_state import RunState
from megatron_armor.orchestration.run.session import profile_after_resume

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "steps, resume, moved",
    [([2], 50, [51]), ([2, 3], 50, [51, 52]), ([2, 10], 5, [6, 14]), ([51, 52], 50, [51, 52]),
     ([3], 0, [3]), ([], 50, [])],
)  # fmt: skip
def test_steps_at_or_before_the_resume_step_move_after_it(steps, resume, moved):
    got, note = profile_steps_after_resume(steps, resume)
    assert got == moved
    assert bool(note) == (got != steps) and (not note or f"resume step {resume}" in note)


def test_a_resumed_run_profiles_after_its_checkpoint(tmp_path, capsys):
    checkpoint = tmp_path / "step_000050"
    checkpoint.mkdir()
    RunState(step=50).save(checkpoint)
    config = load_config(None, ["logging.profile=torch", "logging.profile_steps=[2]"])
    profile_after_resume(config, checkpoint)
    assert list(config.logging.profile_steps) == [51]
    assert "profiling steps [51] instead" in capsys.readouterr().out
    fresh = load_config(None, ["logging.profile=torch", "logging.profile_steps=[2]"])
    profile_after_resume(fresh, None)  # a fresh start runs step 2
    assert list(fresh.logging.profile_steps) == [2]
