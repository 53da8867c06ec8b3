"""The colocated hand-off around a step's weight sync (``orchestration/step/phases.py``): the
order of calls on a recording trainer handle and a recording rollout worker (behind the real
fleet, called in process: ``tests/inprocess_actors.py``) behind the real weight-sync class of
each transport (``orchestration/actors/weight_sync.py``). Tier: unit (no Ray, no GPU; the
CUDA side of the hand-off, ``trainer/offload.return_cached_blocks``, is a ``gpu`` test)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_armor.algo.reset import ResetSchedule
from megatron_armor.config.loader import load_config
from megatron_armor.observability.throughput import ThroughputMeter
from megatron_armor.observability.timers import PhaseTimers
from megatron_armor.orchestration.actors.rollout_fleet import RolloutMemory
from megatron_armor.orchestration.actors.weight_sync import make_weight_sync
from megatron_armor.orchestration.step.phases import sync_and_maybe_reset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inprocess_actors import local_fleet  # noqa: E402

pytestmark = pytest.mark.unit


class Calls(list):
    """One list of ``(handle, verb, *args)`` shared by the trainer and the rollout."""

    def handle(self, name: str, answers: dict | None = None):
        calls, answers = self, answers or {}

        class Handle:
            def __getattr__(self, verb):
                def call(*args, **kwargs):
                    calls.append((name, verb, *args))
                    return answers.get(verb)

                return call

        return Handle()


def session(*overrides: str, reset_every: int = 0) -> tuple[SimpleNamespace, Calls]:
    config = load_config(None, ["rollout.backend=sglang", "trainer.world_size=2", *overrides])
    calls = Calls()
    trainer = calls.handle("trainer", {"push_weights": 8})
    worker = calls.handle("rollout", {"weight_targets": [("http://policy-0", 1, 0, "")]})
    fleet = local_fleet([worker], has_ref_pool=True)
    sync = make_weight_sync(config, trainer, fleet)
    rollout = SimpleNamespace(memory=RolloutMemory(fleet))
    schedule = ResetSchedule("every", reset_every) if reset_every else ResetSchedule()
    s = SimpleNamespace(
        config=config, trainer=trainer, rollout=rollout, weight_sync=sync,
        timers=PhaseTimers(), meter=ThroughputMeter(), schedule=schedule,
        state=SimpleNamespace(policy_version=3, ref_version=0),
        recovery=SimpleNamespace(guard=lambda s, step, what, fn: fn()),
        push_policy=sync.push_policy, push_reference=sync.push_reference,
    )  # fmt: skip
    sync.versions["policy"] = 3
    return s, calls


def verbs(calls: Calls) -> list[tuple]:
    """The calls that move memory or weights, in order (not the session's bookkeeping)."""
    keep = {"hand_over_memory", "resume_memory", "push_weights", "begin_weight_update",
            "end_weight_update", "reset_reference"}  # fmt: skip
    return [c[:3] for c in calls if c[1] in keep]  # a push: its version


COLOCATED = ["orchestration.layout=colocated", "orchestration.gpus_per_node=2",
             "rollout.sglang.weight_transport=tensor"]  # fmt: skip


def test_the_trainer_hands_over_its_memory_before_the_engines_resume_their_weights():
    s, calls = session(*COLOCATED)
    sync_and_maybe_reset(s, 4, updated=True)
    assert verbs(calls) == [
        ("trainer", "hand_over_memory"),
        ("rollout", "resume_memory", ["weights"]),
        ("rollout", "begin_weight_update", "policy"),
        ("trainer", "push_weights", 4),
        ("rollout", "end_weight_update", "policy"),
        ("rollout", "resume_memory", ["kv_cache"]),
    ]
    assert s.state.policy_version == 4


def test_a_step_without_an_update_pushes_the_current_weights_into_the_resumed_servers():
    """Colocated policy servers released their weights without a host copy: the step that
    applied no update pushes the weights they had, at their version, before the KV cache."""
    s, calls = session(*COLOCATED)
    sync_and_maybe_reset(s, 4, updated=False)
    assert verbs(calls) == [
        ("trainer", "hand_over_memory"),
        ("rollout", "resume_memory", ["weights"]),
        ("rollout", "begin_weight_update", "policy"),
        ("trainer", "push_weights", 3),
        ("rollout", "end_weight_update", "policy"),
        ("rollout", "resume_memory", ["kv_cache"]),
    ]
    assert s.state.policy_version == 3


def test_a_reset_pushes_the_reference_before_the_kv_cache_returns():
    s, calls = session(*COLOCATED, "rollout.ref_strategy=dedicated", reset_every=2)
    sync_and_maybe_reset(s, 4, updated=True)
    order = [c[1] for c in verbs(calls)]
    assert order.index("reset_reference") > order.index("push_weights")
    assert order[-1] == "resume_memory" and verbs(calls)[-1][2] == ["kv_cache"]


def test_disaggregated_engines_keep_their_memory_and_weights():
    s, calls = session("orchestration.layout=disaggregated", "orchestration.rollout_gpus=2",
                       "orchestration.gpus_per_node=4", "rollout.sglang.weight_transport=distributed")  # fmt: skip
    sync_and_maybe_reset(s, 4, updated=False)
    assert verbs(calls) == []
    sync_and_maybe_reset(s, 5, updated=True)
    assert [c[1] for c in verbs(calls)] == [
        "begin_weight_update",
        "push_weights",
        "end_weight_update",
    ]
