"""Unit tier: the decisions behind a watched driver, without processes or Ray: the phase
deadlines the ``armor`` parent learns (``cli/driver_watch.py``), the end of a requeue loop
(``orchestration/run/requeue_history.py``), the control-plane probe's verdict
(``orchestration/run/control_plane.py``) and the naming of processes a SIGKILL left."""

from __future__ import annotations

import json
import os

import pytest

from megatron_armor.cli.driver_watch import DriverWatch
from megatron_armor.cli.supervise import left_behind, process_state
from megatron_armor.orchestration.run import requeue_history
from megatron_armor.orchestration.run.control_plane import (
    HEALTH_CHECKS,
    ProbeSettings,
    ProbeVerdict,
)

pytestmark = pytest.mark.unit

RULE = "10 0.9 30 3600 60"  # the defaults: multiple, quantile, floor, cap, stop_wait_s


def watch_after_steps(durations: list[float]) -> tuple[DriverWatch, float]:
    """A watch that saw the rule and one ``step`` phase of each duration (each followed by a
    1 s ``log`` phase); ``(watch, now)`` at the start of the next step."""
    watch, now = DriverWatch(0.0), 0.0
    watch.receive("rule", RULE, now)
    for step, seconds in enumerate(durations, 1):
        watch.receive("phase", f"{step} step", now)
        now += seconds
        watch.receive("phase", f"{step} log", now)
        now += 1.0
    watch.receive("phase", f"{len(durations) + 1} step", now)
    return watch, now


def test_a_phase_deadline_is_learned_from_the_runs_own_phases():
    watch, now = watch_after_steps([2.0, 3.0, 10.0])
    assert watch.deadline() == pytest.approx(10 * (3.0 + 0.8 * 7.0))  # 10 x p90 of 2, 3, 10
    assert watch.overdue(now + 80) is None
    stall = watch.overdue(now + 90)
    assert stall is not None and (stall.phase, stall.step) == ("step", 4)
    assert "made no progress for 90s in phase step of step 4, past its deadline of 86s" in (
        stall.describe(123)
    )
    assert stall.cause == "the driver stalled in phase step"
    quick, now = watch_after_steps([0.5, 0.5])
    assert quick.deadline() == 30.0  # the floor


def test_progress_and_heartbeats_keep_a_driver_alive_and_a_first_phase_waits_the_cap():
    watch, now = watch_after_steps([1.0])
    watch.receive("beat", "7", now + 25)  # the main loop moved: its count changed
    assert watch.overdue(now + 50) is None
    watch.receive("beat", "7", now + 60)  # alive, but the main loop did not move
    stall = watch.overdue(now + 56)
    assert stall is not None and "its heartbeat thread still answers" in stall.describe(1)
    watch.receive("phase", "2 checkpoint", now + 60)  # a phase never seen: the cap
    assert watch.deadline() == 3600.0 and watch.overdue(now + 3000) is None


def test_deadlines_are_logged_when_new_or_moved_and_nothing_is_watched_without_the_rule():
    watch = DriverWatch(0.0)
    assert watch.receive("phase", "0 start", 0.0) == []
    assert watch.overdue(10_000.0) is None  # no rule yet: the config is not loaded
    said = watch.receive("rule", RULE, 1.0)
    assert "10 x p90 of each phase's last 20 durations, within [30s, 3600s]" in said[0]
    assert watch.receive("phase", "1 step", 5.0) == ["driver deadline: start 50s"]
    assert watch.receive("phase", "1 log", 6.0) == ["driver deadline: step 30s"]
    assert watch.receive("phase", "2 step", 7.0) == ["driver deadline: log 30s"]
    assert watch.receive("phase", "2 log", 8.0) == []  # unchanged: not logged again
    watch.receive("phase", "2 -", 9.0)  # after the run: not watched
    assert watch.overdue(10_000.0) is None


def test_a_stop_signal_bounds_the_wait_by_stop_wait_s():
    watch, now = watch_after_steps([100.0, 100.0])  # deadline 1000 s
    watch.stop_signal("SIGTERM", now + 5)
    assert watch.overdue(now + 64) is None
    stall = watch.overdue(now + 66)
    assert stall is not None and stall.signal == "SIGTERM"
    assert "SIGTERM arrived and the driver did not move within orchestration.stop_wait_s=60s" in (
        stall.describe(1)
    )
    moving, now = watch_after_steps([100.0, 100.0])
    moving.stop_signal("SIGTERM", now)
    moving.receive("beat", "1", now + 50)  # it moves after the signal: it is checkpointing
    assert moving.overdue(now + 100) is None


def test_a_parent_that_was_stopped_itself_sees_no_stall():
    watch, now = watch_after_steps([1.0])
    watch.parent_was_stopped(now + 500)
    assert watch.overdue(now + 510) is None


def rows(*entries) -> list[dict]:
    return [{"step": s, "cause": c, "signal": sig, "time": t} for s, c, sig, t in entries]


def test_repeats_count_the_same_step_and_cause_in_a_row():
    died = "TrainerWorker 0 failed (ActorDiedError)"
    history = rows((3, died, False, 1), (3, died, False, 2), (3, died, False, 3))
    assert requeue_history.repeats(history, []) == 3
    assert requeue_history.repeats(history[:2] + rows((4, died, False, 3)), []) == 1
    assert requeue_history.repeats(history + rows((3, "signal", True, 4)), []) == 0
    broken = history[:1] + rows((3, "signal", True, 2)) + history[2:]
    assert requeue_history.repeats(broken, []) == 1  # a preemption in between
    changed = [{"step": 3, "time": 2.5, "changed": {"trainer.lr": [1e-6, 5e-7]}}]
    assert requeue_history.repeats(history, changed) == 1  # a new attempt after the change
    assert requeue_history.repeats(history, [{"step": 3, "time": 2.5, "changed": {}}]) == 3


def test_record_exit_appends_and_the_message_names_cause_count_and_file(tmp_path):
    counts = [requeue_history.record_exit(tmp_path, 2, "lost Ray's raylet", False)
              for _ in range(3)]  # fmt: skip
    assert counts == [1, 2, 3]
    lines = (tmp_path / requeue_history.HISTORY_FILE).read_text().splitlines()
    assert [json.loads(x)["cause"] for x in lines] == ["lost Ray's raylet"] * 3
    text = requeue_history.loop_message(tmp_path, 2, "lost Ray's raylet", 3, 3)
    assert "exit 75 at step 2 for the 3rd time in a row with the same cause" in text
    assert "exiting 70" in text and str(tmp_path / "requeues.jsonl") in text


def test_the_probe_loses_the_raylet_at_once_and_the_gcs_after_the_threshold():
    settings = ProbeSettings.from_environment({})
    assert settings == ProbeSettings(2.0, 3.0, 5) and HEALTH_CHECKS  # the tightened defaults
    verdict = ProbeVerdict(settings, "n1 at 127.0.0.1", "127.0.0.1:6379")
    assert verdict.observe(True) is None
    assert all(verdict.observe(None) is None for _ in range(4))
    assert verdict.observe(True) is None  # it answered again: the count starts over
    assert all(verdict.observe(None) is None for _ in range(4))
    part, text = verdict.observe(None)
    assert part == "GCS" and "answered none of 5 probes in a row (3s each, 2s apart)" in text
    part, text = ProbeVerdict(settings, "n1 at 127.0.0.1", "g").observe(False)
    assert part == "raylet" and "raylet of node n1 at 127.0.0.1: the GCS marked it dead" in text
    env = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "2"}
    assert ProbeSettings.from_environment(env) == ProbeSettings(0.5, 3.0, 2)


def test_processes_a_sigkill_left_are_named_by_state():
    lines = left_behind([(41, "D", "python"), (42, "R", "raylet")])
    assert "pid 41 (python) is still alive in uninterruptible sleep (state D" in lines[0]
    assert "pid 42 (raylet) is still alive (state R) after SIGKILL" in lines[1]
    assert process_state(os.getpid())[0] in "RS" and process_state(2**22 + 7) == ("X", "")


def test_a_faults_cause_names_its_actor_and_error_class_only():
    """What two exits compare (``requeue_history.repeats``): no pid, time or message."""
    from megatron_armor.orchestration.actors.faults import Fault
    from megatron_armor.orchestration.step.loop import requeue_cause

    err = TimeoutError("TrainerWorker 0 (pid 1234) waited 31s")
    assert requeue_cause(Fault("trainer", 0, err), err) == "TrainerWorker 0 failed (TimeoutError)"
    assert requeue_cause(None, RuntimeError("pid 99")) == "RuntimeError"


def test_a_malformed_message_is_dropped():
    watch, now = watch_after_steps([1.0])
    assert watch.receive("beat", "x", now) == [] and watch.receive("phase", "two step", now) == []
    assert watch.receive("rule", "10 0.9", now) == [] and watch.phase == "step"
