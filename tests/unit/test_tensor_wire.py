"""Unit tier: CPU tensors cross processes as numpy arrays (``types.tensor_to_wire``).

A step's :class:`TrainBatch` and the exported weights (:class:`NamedTensorList`) pickle their
tensors as numpy arrays, which pickle protocol 5 (Ray's) hands over out of band. What comes
back must be the same tensors, in memory of their own (writable, even when the buffers were
the sender's read-only shared memory), and readable by a process that never pickled one.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

from megatron_armor.types import (
    Group,
    NamedTensorList,
    Sample,
    SampleSource,
    pack_groups,
    tensor_from_wire,
    tensor_to_wire,
)

pytestmark = pytest.mark.unit


def named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("fp32", torch.randn(3, 5, generator=g)),
        ("bf16", torch.randn(4, 2, generator=g).to(torch.bfloat16)),
        ("fp16", torch.randn(6, generator=g).half()),
        ("fp8", torch.randn(8, generator=g).to(torch.float8_e4m3fn)),
        ("int64", torch.arange(7)),
        ("bool", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 4)),
        ("transposed", torch.randn(3, 4, generator=g).t()),  # not contiguous
        ("grad", torch.randn(2, requires_grad=True)),
    ]


def batch():
    samples = [Sample("q", [1, 2], [3 + i, 4], score=float(i), source=SampleSource.POLICY)
               for i in range(3)]  # fmt: skip
    samples.append(Sample("q", [1, 2], [9], source=SampleSource.REFERENCE))
    b = pack_groups([Group("q", samples, anchor_index=3, advantages=[1.0, -1.0, 0.5, 0.0])])
    b.old_logprobs = -torch.rand(b.num_tokens) * b.loss_mask
    return b


def round_trip(obj, readonly: bool = False):
    """Pickle as Ray does (protocol 5, buffers out of band); ``readonly``: the buffers are
    read-only memory, as the object store maps them into the receiver."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    views = [memoryview(bytes(b.raw())) if readonly else b for b in buffers]
    return pickle.loads(data, buffers=views), len(buffers)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    want = want.detach()
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.is_floating_point():  # bit for bit: NaN entries too (and float8: no equal kernel)
        got, want = (t.contiguous().reshape(-1).view(torch.uint8) for t in (got, want))
    assert torch.equal(got, want)


@pytest.mark.parametrize("readonly", [False, True], ids=["own-memory", "read-only-buffers"])
def test_named_tensors_round_trip_out_of_band(readonly) -> None:
    tensors = named()
    got, buffers = round_trip(NamedTensorList(tensors), readonly)
    assert type(got) is list and [n for n, _ in got] == [n for n, _ in tensors]
    assert buffers == len(tensors)  # every tensor went out of band, none through torch.save
    for (_, g), (name, want) in zip(got, tensors, strict=True):
        assert_same(g, want)
        assert not g.requires_grad, name
    fp32, want = got[0][1], tensors[0][1] + 1.0
    fp32.add_(1.0)  # writable
    assert torch.equal(fp32, want)
    if readonly:  # copied out of the read-only memory, not written through it
        assert torch.equal(tensors[0][1] + 1.0, want)


def test_train_batch_round_trip() -> None:
    b = batch()
    for readonly in (False, True):
        got, buffers = round_trip(b, readonly)
        assert buffers == 4 + len(b.token_data)
        for field in ("tokens", "position_ids", "cu_seqlens", "sample_index"):
            assert_same(getattr(got, field), getattr(b, field))
        assert sorted(got.token_data) == sorted(b.token_data)
        for key, value in b.token_data.items():
            assert_same(got.token_data[key], value)
        got.old_logprobs.mul_(2.0)  # the loop writes into a received batch's data
        assert torch.equal(got.select([1, 3]).tokens, b.select([1, 3]).tokens)
        assert got.num_response_tokens == b.num_response_tokens


def test_a_batch_s_routes_stay_in_the_shared_memory_they_arrive_in() -> None:
    """The engines' routes of a MoE batch (its largest entry, read-only for the trainer) are
    not copied out of the object store's read-only memory: the ranks of a node share it."""
    import numpy as np

    from megatron_armor.types import ROUTES_KEY, RoutedExperts

    ids = np.arange(2 * 3 * 2).reshape(2, 3, 2) % 7
    samples = [Sample("q", [1, 2], [3], routed_experts=RoutedExperts.from_array(ids))]
    b = pack_groups([Group("q", samples, advantages=[1.0])])
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    shared = [memoryview(bytes(x.raw())) for x in buffers]  # read-only, as Ray maps them
    got = pickle.loads(data, buffers=shared)
    routes = got.token_data[ROUTES_KEY]
    assert_same(routes, b.token_data[ROUTES_KEY])
    assert any(np.shares_memory(routes.numpy(), np.asarray(m)) for m in shared)
    assert not any(np.shares_memory(got.loss_mask.numpy(), np.asarray(m)) for m in shared)
    assert torch.equal(got.select([0]).token_data[ROUTES_KEY], routes)  # read into copies


def test_a_non_cpu_tensor_is_left_to_torch() -> None:
    meta = torch.empty(3, device="meta")
    array, dtype = tensor_to_wire(meta)
    assert isinstance(array, torch.Tensor) and array.device.type == "meta" and dtype is None
    assert tensor_from_wire(array, dtype) is array


READER = """
import pickle, sys, torch
named, b = pickle.loads(sys.stdin.buffer.read())
print(sorted((n, str(t.dtype), round(float(t.float().sum()), 4)) for n, t in named))
print(b.tokens.tolist(), round(float(b.old_logprobs.sum()), 4))
"""


def test_another_process_reads_them() -> None:
    """A fresh interpreter (no project code run before, as a Ray worker receiving them)."""
    tensors, b = named(), batch()
    data = pickle.dumps((NamedTensorList(tensors), b), protocol=5)
    done = subprocess.run([sys.executable, "-c", READER], input=data, capture_output=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    want = sorted((n, str(t.dtype), round(float(t.detach().float().sum()), 4)) for n, t in tensors)
    assert done.stdout.decode().splitlines() == [
        str(want),
        f"{b.tokens.tolist()} {round(float(b.old_logprobs.sum()), 4)}",
    ]


@pytest.mark.gpu
def test_tensors_stay_on_their_device(device) -> None:
    t = torch.randn(4, device=device)
    got, _ = round_trip(NamedTensorList([("w", t)]))
    assert got[0][1].device == t.device and torch.equal(got[0][1], t)
