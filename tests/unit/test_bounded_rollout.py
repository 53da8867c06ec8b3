"""``orchestration.async_rollout: bounded`` (unit tier; docs/orchestration.md, "Bounded
staleness"): its settings checked at load (the decoupled objective needs a rollout correction;
what partial rollouts cannot follow is refused with the setting to change), which checkpoints
resume with which mode, the anchor file's ``kept`` lines, and the faults a window in flight
cannot recover from in the run. The loop itself runs end to end in
``tests/e2e/test_bounded_e2e.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_armor.algo.anchors import AcceptanceStats
from megatron_armor.config import ConfigError, load_config
from megatron_armor.config.validate import (
    overlaps_rollout,
    runs_async_rollout,
    runs_bounded_staleness,
)
from megatron_armor.orchestration.actors.faults import Fault
from megatron_armor.orchestration.actors.recovery import UNSERVED, Recovery
from megatron_armor.orchestration.run.checkpoints import CheckpointError
from megatron_armor.orchestration.run.run_state import RunState
from megatron_armor.orchestration.run.session import check_resume_mode
from megatron_armor.orchestration.step.anchor_rollout import RolloutResult
from megatron_armor.orchestration.step.bounded_rollout import holds_next_rollout, mark_kept
from megatron_armor.orchestration.step.partial_rollout import PartialRollouts
from megatron_armor.types import Group, Sample

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
    assert not config.resolved.concurrent_reference  # auto: the engine generates meanwhile
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


def test_a_checkpoint_resumes_only_with_the_mode_that_wrote_it(tmp_path):
    """What is in flight decides: partial rollouts (bounded), the next step's batch
    (one_step), or nothing (any mode)."""
    bounded, one_step = load_config(None, list(BOUNDED)), load_config(None, [
        "orchestration.async_rollout=one_step"])  # fmt: skip
    off = load_config(None, [])
    partial = PartialRollouts(ready=[Group("q", [Sample("q", [1], [2])])]).state()
    for name, pending in (("partial", partial), ("batch", {"step": 3}), ("none", {})):
        (tmp_path / name).mkdir()
        RunState(step=2, pending=pending).save(tmp_path / name)
    check_resume_mode(bounded, tmp_path / "partial")
    with pytest.raises(CheckpointError, match="holds partial rollouts in flight"):
        check_resume_mode(off, tmp_path / "partial")
    with pytest.raises(CheckpointError, match="async_rollout=one_step"):
        check_resume_mode(bounded, tmp_path / "batch")
    check_resume_mode(one_step, tmp_path / "batch")
    for config in (off, one_step, bounded):
        check_resume_mode(config, tmp_path / "none")
    assert holds_next_rollout({"step": 3}) and holds_next_rollout({**partial, "window": {}})
    assert not holds_next_rollout(partial) and not holds_next_rollout({})


def test_the_anchor_file_marks_the_groups_the_step_trains():
    """The window's accepted records of trained groups are ``kept``; a trained group judged in
    an earlier window gets a ``waited`` line of its own."""
    result = RolloutResult(groups=[Group("a", []), Group("old", [])], stats=AcceptanceStats(),
                           records=[{"query_id": "a", "reason": "accepted", "kept": False},
                                    {"query_id": "b", "reason": "accepted", "kept": False},
                                    {"query_id": "c", "reason": "all_correct", "kept": False}])  # fmt: skip
    mark_kept(result)
    assert [r["kept"] for r in result.records[:3]] == [True, False, False]
    assert result.records[3] == {"query_id": "old", "reason": "accepted", "kept": True,
                                 "waited": True}  # fmt: skip


def test_a_rollout_worker_lost_while_a_window_is_drawn_is_a_requeue():
    """The engines serve weights the trainer no longer holds (no copy per version): a rollout
    worker or SGLang server that fails then is not replaced in the run (exit 75; the resume
    redraws the window); a reward worker is, and so is a rollout worker outside the window."""
    config = load_config(None, list(BOUNDED))
    worker = SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: "ab12"))
    s = SimpleNamespace(config=config, run_dir="r", trainer=SimpleNamespace(actors=[]),
                        reward=SimpleNamespace(actors=[]), rollout=SimpleNamespace(
                            fleet=SimpleNamespace(actors=[worker]),
                            reference=SimpleNamespace(caches_anchors=False)))  # fmt: skip
    recovery = Recovery(config)
    rollout, reward = Fault("rollout", 0, RuntimeError()), Fault("reward", 0, RuntimeError())
    assert recovery.unrecoverable(s, 2, "rollout", rollout) == ""
    recovery.served = None
    assert recovery.unrecoverable(s, 2, "rollout", rollout) == UNSERVED
    assert recovery.unrecoverable(s, 2, "rollout", reward) == ""
    from megatron_armor.orchestration.actors.call_watch import StuckServerError
    from megatron_armor.orchestration.actors.faults import RequeueError

    stuck = StuckServerError("SGLang policy server 0 ...", "ab12", [{"url": "u", "pid": 1}], [])
    with pytest.raises(RequeueError, match="bounded draws the next window"):
        recovery.heal_servers(s, 2, "rollout", stuck)
