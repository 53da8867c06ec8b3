"""Anchor acceptance, group composition and acceptance statistics (docs/algorithm.md, anchor rollout). Tier: unit."""

from __future__ import annotations

import pytest

from megatron_armor.algo.anchors import AcceptanceStats, select_group
from megatron_armor.algo.registry import get_short_batch_policy
from megatron_armor.types import Sample, SampleSource, pack_groups

pytestmark = pytest.mark.unit


def _policy(*acc: bool) -> list[Sample]:
    return [
        Sample("q", [1, 2], [3] * (i + 1), acc=a, score=1.0 if a else -1.0)
        for i, a in enumerate(acc)
    ]


def _refs(*acc_len: tuple[bool, int]) -> list[Sample]:
    return [
        Sample("q", [1, 2], [4] * n, acc=a, score=1.0 if a else -1.0, source=SampleSource.REFERENCE)
        for a, n in acc_len
    ]


def test_armor_group_is_policy_plus_first_correct_reference():
    policy = _policy(*([True] * 5 + [False] * 10))  # n_on = 15
    refs = _refs((False, 3), (True, 5), (True, 7), (False, 2))
    group, reason = select_group("q", policy, refs, "armor", weak_filter=False)
    assert reason == "accepted"
    assert len(group.samples) == 16 and group.anchor_index == 15
    assert group.samples[:15] == policy
    assert group.samples[15] is refs[1]  # first correct in generation order, not the longer one
    batch = pack_groups([_with_adv(group)])
    assert int(batch.is_anchor.sum()) == 5  # the anchor's response tokens only


def _with_adv(group):
    group.advantages = [0.0] * len(group.samples)
    return group


@pytest.mark.parametrize("mode", ["none", "armor", "filter_only"])
@pytest.mark.parametrize("weak", [False, True])
def test_all_correct_is_always_rejected(mode, weak):
    group, reason = select_group("q", _policy(True, True, True), _refs((True, 1)), mode, weak)
    assert (group, reason) == (None, "all_correct")


@pytest.mark.parametrize("mode", ["none", "armor", "filter_only"])
def test_all_wrong_is_rejected_without_weak_filter(mode):
    group, reason = select_group("q", _policy(False, False), _refs((True, 1)), mode, False)
    assert (group, reason) == (None, "all_wrong")


def test_weak_filter_keeps_all_wrong_when_reference_solved_it():
    policy, refs = _policy(False, False, False), _refs((False, 1), (True, 4))
    group, reason = select_group("q", policy, refs, "armor", weak_filter=True)
    assert reason == "accepted" and group.anchor_index == 3 and group.samples[3] is refs[1]
    group, reason = select_group("q", policy, refs, "filter_only", weak_filter=True)
    assert reason == "accepted" and group.anchor_index is None and group.samples == policy


def test_weak_filter_all_wrong_without_correct_reference():
    group, reason = select_group("q", _policy(False, False), _refs((False, 1)), "armor", True)
    assert (group, reason) == (None, "no_reference_correct")


@pytest.mark.parametrize("mode", ["armor", "filter_only"])
def test_no_correct_reference_is_rejected(mode):
    refs = _refs((False, 2), (False, 3), (False, 1), (False, 1))
    group, reason = select_group("q", _policy(True, False), refs, mode, False)
    assert (group, reason) == (None, "no_reference_correct")


def test_none_mode_ignores_references():
    policy = _policy(True, False, False, True)
    group, reason = select_group("q", policy, [], "none", weak_filter=False)
    assert reason == "accepted" and group.samples == policy and group.anchor_index is None


def test_filter_only_inserts_nothing():
    policy = _policy(*([True] * 8 + [False] * 8))  # G = 16 on-policy
    group, reason = select_group("q", policy, _refs((True, 9)), "filter_only", False)
    assert reason == "accepted"
    assert len(group.samples) == 16 and group.anchor_index is None
    assert all(s.source == SampleSource.POLICY for s in group.samples)


def test_unknown_mode_and_empty_policy():
    with pytest.raises(ValueError, match="algo.anchor='anchor'"):
        select_group("q", _policy(True, False), [], "anchor", False)
    with pytest.raises(ValueError, match="no policy samples"):
        select_group("q", [], [], "armor", False)


def test_acceptance_stats_over_a_step():
    stats = AcceptanceStats()
    queries = {
        "a": (_policy(True, False), _refs((False, 2), (True, 6))),
        "b": (_policy(True, True), _refs((True, 1), (True, 1))),
        "c": (_policy(False, False), _refs((False, 1), (False, 1))),
        "d": (_policy(False, True), _refs((False, 3), (False, 3))),
        "e": (_policy(False, True), _refs((True, 10), (False, 1))),
    }
    stats.add_generation_batch()
    stats.add_generation_batch()
    for qid, (policy, refs) in queries.items():
        group, reason = select_group(qid, policy, refs, "armor", False)
        anchor = group.samples[group.anchor_index] if group else None
        stats.record(reason, refs, anchor, query_id=qid)
    assert stats.as_metrics() == {
        "anchor/gen_batches": 2.0,
        "anchor/queries_seen": 5.0,
        "anchor/accepted": 2.0,
        "anchor/rejected_all_correct": 1.0,
        "anchor/rejected_all_wrong": 1.0,
        "anchor/rejected_no_ref_correct": 1.0,
        "anchor/rejected_cached_no_ref_correct": 0.0,
        "anchor/acceptance_rate": 0.4,
        "anchor/ref_acc": 0.4,  # 4 correct of 10 reference samples
        "anchor/anchor_len_mean": 8.0,  # anchors of length 6 and 10
    }
    assert stats.accepted_ids == ["a", "e"]


def test_acceptance_stats_empty_and_bad_reason():
    metrics = AcceptanceStats().as_metrics()
    assert metrics["anchor/acceptance_rate"] == 0.0 and metrics["anchor/anchor_len_mean"] == 0.0
    with pytest.raises(ValueError, match="acceptance reason"):
        AcceptanceStats().record("maybe", [], None)
    with pytest.raises(ValueError, match="cached verdict"):
        AcceptanceStats().record("all_wrong", [], None, "q", cached_verdict=True)
    stats = AcceptanceStats()
    stats.record("no_reference_correct", [], None, "q", cached_verdict=True)
    assert (stats.rejected_no_ref_correct, stats.rejected_cached_no_ref_correct) == (1, 1)


@pytest.mark.parametrize(
    ("name", "fraction", "floor"),
    [
        ("error", 0.1, 10),  # the whole batch: a short step fails
        ("train_partial", 0.5, 5),
        ("train_partial", 0.3, 3),  # 0.3 * 10 is 3, not ceil(3.0000000000000004) = 4
        ("train_partial", 0.31, 4),
        ("train_partial", 0.01, 1),
        ("train_partial", 0.0, 0),  # no floor: any number, none at all included
        ("train_partial", 1.0, 10),
    ],
)
def test_short_batch_floor_rounds_up_the_decimal_share(name, fraction, floor):
    policy = get_short_batch_policy(name)
    assert policy.trains_partial == (name == "train_partial")
    assert policy.floor(10, fraction) == floor
