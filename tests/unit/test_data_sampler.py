"""ResumableSampler: deterministic epochs, and the same order after a restart.

Tier: unit (no devices).
"""

from __future__ import annotations

import json

import pytest

from megatron_armor.data import ResumableSampler, SamplerExhausted

pytestmark = pytest.mark.unit


def test_each_epoch_is_a_permutation_and_epochs_differ():
    sampler = ResumableSampler(10, seed=3)
    first, second = sampler.next_indices(10), sampler.next_indices(10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second
    assert sampler.epoch == 2 and sampler.position == 0


def test_same_seed_same_order_other_seed_other_order():
    a, b, c = ResumableSampler(50, 1), ResumableSampler(50, 1), ResumableSampler(50, 2)
    assert a.next_indices(120) == b.next_indices(120) != c.next_indices(120)


def test_no_shuffle_is_sequential_across_epochs():
    sampler = ResumableSampler(4, seed=0, shuffle=False)
    assert sampler.next_indices(6) == [0, 1, 2, 3, 0, 1]


def test_batches_cross_epoch_boundaries():
    whole = ResumableSampler(7, seed=5).next_indices(30)
    sampler = ResumableSampler(7, seed=5)
    pieces = [sampler.next_indices(k) for k in (3, 5, 0, 9, 13)]
    assert sum(pieces, []) == whole
    # every window of 7 aligned to epochs holds each index once
    for e in range(4):
        assert sorted(whole[7 * e : 7 * e + 7]) == list(range(7))


@pytest.mark.parametrize("consumed", [0, 4, 11, 23, 24, 50])
def test_restart_from_state_gives_the_same_continuation(consumed):
    original = ResumableSampler(12, seed=9)
    original.next_indices(consumed)
    state = json.loads(json.dumps(original.state_dict()))  # survives a checkpoint file
    restarted = ResumableSampler(12, seed=9)
    restarted.load_state_dict(state)
    assert restarted.next_indices(40) == original.next_indices(40)
    assert restarted.state_dict() == original.state_dict()


def test_resume_with_other_data_or_seed_is_an_error():
    state = ResumableSampler(12, seed=9).state_dict()
    with pytest.raises(ValueError, match="num_items=12 but this sampler has 13"):
        ResumableSampler(13, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=9 but this sampler has 1; resume with the same"):
        ResumableSampler(12, seed=1).load_state_dict(state)


def test_empty_dataset_is_an_error():
    with pytest.raises(ValueError, match="non-empty dataset"):
        ResumableSampler(0, seed=0)


def test_peek_returns_the_next_indices_without_advancing():
    sampler = ResumableSampler(7, seed=3)
    sampler.next_indices(5)
    state = sampler.state_dict()
    ahead = sampler.peek(6)  # crosses into the next epoch
    assert sampler.state_dict() == state
    assert ahead == sampler.next_indices(6)


def test_a_prompt_solved_k_draws_in_a_row_retires_and_is_never_drawn_again():
    sampler = ResumableSampler(6, seed=4, retire_after=2)
    first = sampler.next_indices(6)
    target = first[0]
    assert not sampler.observe(target, True)  # streak 1
    assert not sampler.observe(target, None)  # no policy samples drawn: streak kept
    assert sampler.observe(target, True)  # streak 2: retired
    other = first[1]
    sampler.observe(other, True)
    sampler.observe(other, False)  # reset
    assert not sampler.observe(other, True)
    later = sampler.next_indices(25)
    assert target not in later and sorted(set(later)) == sorted(set(range(6)) - {target})
    m = sampler.metrics()
    assert m["data/retired"] == 1.0 and m["data/retired_step"] == 1.0
    assert m["data/active_prompts"] == 5.0 and sampler.metrics()["data/retired_step"] == 0.0
    epochs_before = sampler.epoch
    sampler.next_indices(10)  # 10 of 5 left: two epochs' positions, the retired one passed over
    assert sampler.epoch == epochs_before + 2


@pytest.mark.parametrize("consumed", [0, 5, 13])
def test_retirement_survives_a_restart_exactly(consumed):
    original = ResumableSampler(9, seed=2, retire_after=1)
    for index in original.next_indices(consumed):
        original.observe(index, index % 3 == 0)
    state = json.loads(json.dumps(original.state_dict()))  # survives a checkpoint file
    restarted = ResumableSampler(9, seed=2, retire_after=1)
    restarted.load_state_dict(state)
    assert restarted.state_dict() == original.state_dict()
    assert restarted.next_indices(30) == original.next_indices(30)


def test_without_retirement_the_state_and_order_are_the_plain_samplers():
    plain, off = ResumableSampler(8, seed=1), ResumableSampler(8, seed=1, retire_after=0)
    assert not off.observe(3, True) and not off.retires
    assert off.next_indices(20) == plain.next_indices(20)
    assert off.state_dict() == plain.state_dict() and "retirement" not in off.state_dict()
    assert off.metrics() == {"data/epoch": 2.0}


def test_every_prompt_retired_is_a_named_error():
    sampler = ResumableSampler(2, seed=0, retire_after=1)
    for index in (0, 1):
        assert sampler.observe(index, True)
    assert sampler.next_indices(0) == []
    with pytest.raises(SamplerExhausted, match=r"all 2 training prompts are retired \(data.retire"):
        sampler.next_indices(1)


def test_retirement_stops_at_its_share_of_the_prompts_and_the_rest_stays_drawn():
    sampler = ResumableSampler(10, seed=6, retire_after=1, retire_max_fraction=0.3)
    retired = [i for i in range(10) if sampler.observe(i, True)]
    assert retired == [0, 1, 2] and sampler.metrics()["data/active_prompts"] == 7.0
    assert sampler.retirement.streaks == {i: 1 for i in range(3, 10)}  # solved, kept at K
    assert sorted(set(sampler.next_indices(30))) == list(range(3, 10))
    state = json.loads(json.dumps(sampler.state_dict()))
    restarted = ResumableSampler(10, seed=6, retire_after=1, retire_max_fraction=0.3)
    restarted.load_state_dict(state)
    assert not restarted.observe(5, True) and restarted.next_indices(7) == sampler.next_indices(7)
