"""Unit tier: which failures are faults of the machinery (``orchestration/actors/faults.py``), the
bound on in-run recoveries and the messages of a run that stops for a requeue or past the
bound. The recoveries themselves (``kill -9`` of each actor kind in a real run) are in
``tests/e2e/test_faults_e2e.py``."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, ObjectLostError, RayTaskError

from megatron_armor.orchestration.actors.faults import (
    Fault,
    RecoveryBudget,
    RecoveryLimitError,
    ray_fault,
    requeue_error,
)

pytestmark = pytest.mark.unit


def _task_error(cause: BaseException) -> RayTaskError:
    """What ``ray.get`` raises for an exception of an actor's method."""
    return RayTaskError("RolloutWorker.generate", "Traceback ...", cause)


def test_dead_actors_lost_objects_and_bounded_waits_are_faults():
    died = ActorDiedError()
    assert ray_fault(died) is died
    lost = ObjectLostError("ab" * 14, "owner", "call site")
    assert ray_fault(lost) is lost
    assert ray_fault(_task_error(died)) is died  # an argument from a dead actor
    timeout = TimeoutError("rollout generate did not finish within 3600s")
    assert ray_fault(timeout) is timeout
    try:
        raise RuntimeError("weight sync failed") from died
    except RuntimeError as wrapped:
        assert ray_fault(wrapped) is died


def test_errors_of_the_runs_own_code_are_not_faults():
    assert ray_fault(ValueError("a bad batch")) is None
    assert ray_fault(_task_error(KeyError("reference cache"))) is None
    init = ActorDiedError(_task_error(ImportError("no module named sglang")))
    assert init.actor_init_failed and ray_fault(init) is None  # __init__ raised: a bug to fix


def test_recoveries_are_bounded_within_a_window_of_steps(tmp_path):
    budget = RecoveryBudget(limit=2, window=10)
    fault = Fault("rollout", 0, ActorDiedError())
    assert budget.spend(3, fault, tmp_path) == 1
    assert budget.spend(7, fault, tmp_path) == 2
    with pytest.raises(RecoveryLimitError) as err:
        budget.spend(12, fault, tmp_path)  # steps 3 and 7 are within 10 steps of 12
    message = str(err.value)
    assert "RolloutWorker 0 failed at step 12" in message and "after 2 recoveries" in message
    assert "run.max_recoveries=2" in message and "run.recovery_window=10" in message
    assert "RolloutWorker 0 at step 3, RolloutWorker 0 at step 7" in message
    assert "--resume auto" in message and "none yet" in message
    assert budget.spend(13, fault, tmp_path) == 2  # step 3 left the window


def test_a_requeue_names_the_fault_the_newest_checkpoint_and_resume_auto(tmp_path):
    from megatron_armor.orchestration.run import checkpoints
    from megatron_armor.orchestration.run.run_state import RunState

    tmp = checkpoints.begin_checkpoint(tmp_path, 2)
    RunState(step=2).save(tmp)
    checkpoints.commit_checkpoint(tmp_path, tmp, 2, 2)
    fault = Fault("trainer", 0, ActorDiedError())
    message = str(requeue_error(tmp_path, fault, 3, "its state is gone"))
    assert message.startswith("fault at step 3: TrainerWorker 0 failed (ActorDiedError: The actor")
    assert "its state is gone: exiting 75 for a requeue" in message
    newest = tmp_path / "checkpoints" / "step_000002"
    assert f"Newest complete checkpoint: step 2 ({newest})" in message
    assert "`armor train CONFIG --resume auto` continues from it" in message


def test_named_errors_from_an_actor_print_without_the_remote_traceback(capsys):
    """A scoring pool that cannot keep its workers up raises in the reward actor: the driver
    prints the pool's own message (verifier, exit code) with its class, and exits 1."""
    from megatron_armor.cli.train_cmd import report_stop, stopping_errors
    from megatron_armor.reward.pool import RewardPoolError

    cause = RewardPoolError("reward.verifier='math_verify': a reward worker exited 5 times")
    raised = RayTaskError(
        "RewardWorker.score", "Traceback (remote) ...", cause
    ).as_instanceof_cause()
    assert isinstance(raised, stopping_errors())
    assert report_stop("armor train", raised) == 1
    err = capsys.readouterr().err
    assert err == f"armor train: RewardPoolError: {cause}\n", err


def test_a_stuck_sglang_server_is_restarted_and_the_phase_done_again(tmp_path, capsys):
    """``Recovery.guard`` on a :class:`StuckServerError` (the server killed past a call
    deadline): the heal restarts it (``ServerHealth.heal``), the phase is done again from its
    start (``redo``), the worker is kept, and the recovery is a ``stuck`` row naming the
    server; with ``run.max_recoveries=0`` the run stops for a requeue instead."""
    import json
    from types import SimpleNamespace

    from megatron_armor.orchestration.actors.call_watch import CallWatch, StuckServerError
    from megatron_armor.orchestration.actors.faults import RequeueError
    from megatron_armor.orchestration.actors.recovery import Recovery

    worker = SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: "ab12"))
    healed, redone, dropped = [], [], []
    rollout = SimpleNamespace(
        fleet=SimpleNamespace(actors=[worker], reference_actors=[worker]),
        reference=SimpleNamespace(caches_anchors=False, forget_unsettled=lambda: dropped.append(1)),
        health=SimpleNamespace(heal=lambda: healed.append(1) or 1),
    )

    def session(max_recoveries: int):
        run = SimpleNamespace(max_recoveries=max_recoveries, recovery_window=50)
        return SimpleNamespace(
            config=SimpleNamespace(run=run), run_dir=tmp_path, rollout=rollout,
            trainer=SimpleNamespace(actors=[]), reward=SimpleNamespace(actors=[]),
            call_watch=CallWatch(),
        )  # fmt: skip

    url = "http://127.0.0.1:30000"
    server = {"pool": "policy", "index": 0, "url": url, "pid": 4321, "worker": "ab12"}

    def draws():
        answers = iter([StuckServerError(f"SGLang policy server 0 at {url} ...", "ab12", [server],
                                         []), "the rollout"])  # fmt: skip

        def call():
            answer = next(answers)
            if isinstance(answer, Exception):
                raise answer
            return answer

        return call

    s = session(3)
    recovery = Recovery(s.config)
    got = recovery.guard(s, 2, "rollout", draws(), redo=lambda: redone.append(1))
    assert got == "the rollout" and healed == redone == dropped == [1]
    assert recovery.pop_servers_restarted() == 1 and recovery.pop_servers_restarted() == 0
    (row,) = [json.loads(x) for x in (tmp_path / "recoveries.jsonl").read_text().splitlines()]
    assert (row["step"], row["phase"], row["reason"]) == (2, "rollout", "stuck")
    assert row["actor"] == f"SGLang server {url}" and row["kind"] == "rollout"
    assert f"recovery: SGLang server {url} stuck during step 2 (rollout;" in capsys.readouterr().out
    with pytest.raises(RequeueError, match="run.max_recoveries=0"):
        Recovery(session(0).config).guard(session(0), 3, "rollout", draws())


def test_an_actor_killed_as_stuck_is_recorded_stuck_whichever_wait_sees_it_first():
    """Two waits on one actor: the one past its deadline kills it (``StuckCallError``), the
    other may see it die (``ActorDiedError``) and reach the recovery first; both are ``stuck``."""
    from types import SimpleNamespace

    import megatron_armor.orchestration.actors.recovery as recovery
    from megatron_armor.orchestration.actors.call_watch import CallWatch

    watch = CallWatch()
    died = SimpleNamespace(actor_id="cd34")  # what matters of an ActorDiedError here
    assert recovery.fault_reason(Fault("reward", 0, died), watch) == "died"
    watch.killed_stuck.add("cd34")
    assert recovery.fault_reason(Fault("reward", 0, died), watch) == "stuck"
