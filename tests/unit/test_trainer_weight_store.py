"""``WeightStore``: named copies of a model's parameters, swapped in bit-exactly, and which
copies are known to equal the live parameters (a reset until the next update)."""

from __future__ import annotations

import pytest
import torch

from megatron_armor.trainer.weight_store import WeightStore

pytestmark = pytest.mark.unit


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def values(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in m.named_parameters()}


def update(m: torch.nn.Module, store: WeightStore, step: float = 0.5) -> None:
    """What an optimizer update does to the live parameters, reported as the trainer does."""
    with torch.no_grad():
        for p in m.parameters():
            p.add_(step)
    store.live_changed()


def test_a_snapshot_equals_the_live_parameters_until_they_change() -> None:
    m = model()
    store = WeightStore(m)
    store.snapshot("ref")
    assert store.matches_live("ref") and store.equals_live("ref")
    update(m, store)
    assert not store.matches_live("ref") and not store.equals_live("ref")
    store.snapshot("ref")
    assert store.matches_live("ref")


def test_swapping_a_copy_runs_the_block_under_it_and_restores_the_live_values() -> None:
    m = model()
    store = WeightStore(m)
    store.snapshot("ref")
    ref = values(m)
    update(m, store)
    live = values(m)
    x = torch.randn(5, 4)
    with store.swapped("ref"):
        seen = values(m)
        out_ref = m(x)
    for k in ref:
        assert torch.equal(seen[k], ref[k])
        assert torch.equal(dict(m.named_parameters())[k].detach(), live[k])
    assert not torch.equal(out_ref, m(x))
    assert not store.matches_live("ref")  # swapping in and back is not a change


def test_a_copy_that_equals_the_live_parameters_is_not_copied_in(monkeypatch) -> None:
    m = model()
    store = WeightStore(m)
    store.snapshot("ref")
    copies: list[int] = []
    host_copy = WeightStore._host_copy
    monkeypatch.setattr(
        WeightStore, "_host_copy", staticmethod(lambda t: copies.append(1) or host_copy(t))
    )
    writes = [p._version for p in m.parameters()]
    with store.swapped("ref"):
        pass
    assert copies == [] and [p._version for p in m.parameters()] == writes
    update(m, store)
    with store.swapped("ref"):
        pass
    assert len(copies) == len(writes)  # the live values kept aside, then put back


def test_loaded_copies_and_marks() -> None:
    m = model()
    store = WeightStore(m)
    store.snapshot("ref")
    store.load_into("ref", values(m))  # the same values, but from elsewhere: not assumed equal
    assert not store.matches_live("ref") and store.equals_live("ref")
    store.mark_live("ref")
    assert store.matches_live("ref")
    with pytest.raises(KeyError, match="no stored weights named 'old'"):
        store.mark_live("old")
    with pytest.raises(KeyError, match="lack parameters"):
        store.load_into("ref", {})


def test_swaps_reuse_one_host_buffer_for_the_live_values(monkeypatch) -> None:
    """The live values go to one buffer allocated at the first swap (on a GPU: pinned, which
    is slow to allocate), each swap restores its own live values from it exactly."""
    m = model()
    store = WeightStore(m)
    store.snapshot("ref")
    update(m, store)
    allocations = []
    host_copy = store._host_copy
    monkeypatch.setattr(store, "_host_copy", lambda t: allocations.append(t.shape) or host_copy(t))
    for step in (0.25, 0.125):
        live = values(m)
        with store.swapped("ref"):
            pass
        for k, p in m.named_parameters():
            assert torch.equal(p.detach(), live[k])
        update(m, store, step)  # different live values for the next swap
    assert len(allocations) == len(live)  # one buffer per parameter, once


def test_a_snapshot_again_reuses_the_copy_held_under_its_name() -> None:
    """``behavior`` is taken every step: the second snapshot writes into the first's buffers."""
    model = torch.nn.Linear(3, 2)
    store = WeightStore(model)
    store.snapshot("behavior")
    first = {k: t.data_ptr() for k, t in store.get("behavior").items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    store.snapshot("behavior")
    again = store.get("behavior")
    assert {k: t.data_ptr() for k, t in again.items()} == first
    assert torch.equal(again["weight"], model.weight.detach())
    assert store.matches_live("behavior")
