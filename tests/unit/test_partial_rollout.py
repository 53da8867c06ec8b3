"""Partial rollouts' state between steps (``orchestration/step/partial_rollout.py``): responses
grown window by window with each token's version, queries judged once all their samples have
ended, the waiting groups taken stalest first within the staleness bound, dropped at a reset,
and the whole state through a checkpoint's JSON exactly. Tier: unit."""

from __future__ import annotations

import pytest
import torch

from megatron_armor.data.dataset import PromptItem
from megatron_armor.orchestration.run.run_state import RunState
from megatron_armor.orchestration.step.partial_rollout import (
    PARTIAL,
    InFlight,
    PartialRollouts,
    extend_sample,
    new_sample,
    policy_oldest_version,
    tail_idle_seconds,
)
from megatron_armor.rollout.protocol import GenerationOutput
from megatron_armor.types import Group, Sample, SampleSource

pytestmark = pytest.mark.unit

ITEM = PromptItem("q0", [5, 6], "5+6=?", "11", "tiny_arith")


def out(tokens, version, reason=PARTIAL, versions=()):
    return GenerationOutput(list(tokens), [-0.5] * len(tokens), reason, version,
                            token_versions=list(versions))  # fmt: skip


def test_a_response_grows_window_by_window_with_each_tokens_version():
    sample = new_sample(ITEM, version=3)
    assert (sample.response_ids, sample.finish_reason) == ([], PARTIAL)
    assert extend_sample(sample, out([7, 8], 3)) == 2
    assert extend_sample(sample, out([9], 4, "stop")) == 1
    assert sample.response_ids == [7, 8, 9] and sample.response_logprobs == [-0.5] * 3
    assert sample.token_versions() == [3, 3, 4] and sample.oldest_version == 3
    assert (sample.weight_version, sample.finish_reason) == (4, "stop")
    server = new_sample(ITEM, version=4)  # SGLang's spans: a push came while it ran
    extend_sample(server, out([1, 2, 3], 5, "length", versions=[4, 5, 5]))
    assert server.token_versions() == [4, 5, 5]


def test_a_query_is_judged_once_all_its_samples_have_ended():
    query = InFlight(item={"query_id": "q0"}, gen_batch=0, started=2,
                     samples=[new_sample(ITEM, 1), new_sample(ITEM, 1)])  # fmt: skip
    state = PartialRollouts(in_flight=[query])
    extend_sample(query.samples[0], out([1], 1, "stop"))
    extend_sample(query.samples[1], out([1, 2], 1))
    assert [s is query.samples[1] for s, _ in state.requests()] == [True]
    assert state.requests()[0][1].response_ids == [1, 2]
    assert state.pop_ended() == [] and state.in_flight == [query]
    extend_sample(query.samples[1], out([3], 2, "length"))
    assert state.pop_ended() == [query] and state.in_flight == []


def group(qid: str, oldest: int, newest: int, anchor: bool = True) -> Group:
    policy = Sample(qid, [1], [2, 3], weight_version=newest, response_versions=[oldest, newest])
    samples = [policy, Sample(qid, [1], [4], source=SampleSource.REFERENCE, weight_version=0)]
    return Group(qid, samples if anchor else samples[:1], 1 if anchor else None)


def test_a_step_takes_the_stalest_within_the_bound_and_drops_the_rest():
    """Trainer at version 5, k = 2: version 2 is too old (dropped); of the others the oldest
    first, then the order they were accepted in."""
    state = PartialRollouts(ready=[group("a", 4, 4), group("b", 2, 4), group("c", 3, 5),
                                   group("d", 4, 5), group("e", 3, 3)])  # fmt: skip
    assert policy_oldest_version(state.ready[1]) == 2  # the anchor's version 0 is not counted
    taken, dropped = state.take(3, trainer_version=5, max_staleness=2)
    assert [g.query_id for g in taken] == ["c", "e", "a"] and dropped == 1
    assert [g.query_id for g in state.ready] == ["d"]
    taken, dropped = state.take(3, trainer_version=5, max_staleness=2)
    assert [g.query_id for g in taken] == ["d"] and dropped == 0 and state.ready == []


def test_a_reset_drops_the_waiting_groups_and_keeps_the_responses_in_flight():
    query = InFlight(item={"query_id": "q9"}, gen_batch=1, started=4, samples=[new_sample(ITEM, 4)])
    state = PartialRollouts(in_flight=[query], ready=[group("a", 4, 4), group("b", 4, 4)])
    assert state.drop_ready() == 2 and state.ready == [] and state.in_flight == [query]


def test_the_state_survives_a_checkpoint_exactly(tmp_path):
    sample = new_sample(ITEM, 3)
    extend_sample(sample, out([7, 8], 3))
    sample.response_logprobs = [-0.1234567890123, -2.5e-17]  # floats round-trip exactly
    state = PartialRollouts(
        in_flight=[InFlight(item={"query_id": "q0", "prompt_ids": [5, 6]}, gen_batch=2,
                            started=7, samples=[sample])],
        ready=[group("a", 2, 3), group("n", 3, 3, anchor=False)],
    )  # fmt: skip
    RunState(step=7, pending=state.state()).save(tmp_path)
    back = PartialRollouts.from_state(RunState.load(tmp_path).pending)
    assert back == state
    assert back.in_flight[0].samples[0].token_versions() == [3, 3]
    assert PartialRollouts.from_state({}) == PartialRollouts()
    assert isinstance(torch.load(tmp_path / "orchestrator.pt", weights_only=True), dict)


def test_the_tail_is_the_slots_average_wait_for_the_slowest():
    assert tail_idle_seconds([1.0, 1.0, 4.0]) == pytest.approx(2.0)
    assert tail_idle_seconds([3.0, 3.0]) == 0.0 and tail_idle_seconds([]) == 0.0
