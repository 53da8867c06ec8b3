"""ResumableSampler: deterministic epochs, and the same order after a restart.

Tier: unit (no devices).
"""

from __future__ import annotations

import json

import pytest

from megatron_armor.data import ResumableSampler

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
