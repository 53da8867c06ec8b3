"""Routing replay of a mixture-of-experts policy (``trainer/routing_replay.py``; unit tier):
the routers' token order, replay / record / backward replay of one router, which routes each
pass of a step uses per mode and anchor rule, and the engines' routes in the packed batch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megatron_armor.trainer import routing_replay as rr
from megatron_armor.trainer.batching import (
    build_micro_batch,
    build_packed_micro_batch,
    filler_micro_batch,
    plan_micro_batches,
    shard_samples,
)
from megatron_armor.types import (
    NO_ROUTE_U8,
    ROUTES_KEY,
    Group,
    RoutedExperts,
    Sample,
    SampleSource,
    pack_groups,
    route_ids,
)

pytestmark = pytest.mark.unit

LAYERS, K, EXPERTS = 2, 2, 4


def routes_of(length: int, seed: int) -> RoutedExperts:
    """Distinct experts per token-layer for positions ``[0, length - 1)``."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(EXPERTS)[:K] for _ in range((length - 1) * LAYERS)])
    return RoutedExperts.from_array(ids.reshape(length - 1, LAYERS, K))


def batch_with_routes(with_routes=(True, True, True)):
    """One group: two policy samples and an anchor (the last), routes where asked."""
    lengths = [(2, 3), (3, 1), (2, 2)]
    samples = []
    for i, ((p, r), routed) in enumerate(zip(lengths, with_routes, strict=True)):
        samples.append(Sample(
            "q", list(range(1, p + 1)), list(range(10, 10 + r)),
            source=SampleSource.REFERENCE if i == 2 else SampleSource.POLICY,
            routed_experts=routes_of(p + r, i) if routed else None,
        ))  # fmt: skip
    return pack_groups([Group("q", samples, anchor_index=2, advantages=[1.0, -1.0, 0.5])])


def test_packed_routes_cover_every_position_but_the_last():
    batch = batch_with_routes((True, False, True))
    routes = batch.token_data[ROUTES_KEY]
    assert routes.shape == (batch.num_tokens, LAYERS, K) and routes.dtype == torch.uint8
    ids = route_ids(routes)
    bounds = batch.cu_seqlens.tolist()
    first = routes_of(5, 0).array()
    assert torch.equal(ids[: bounds[1] - 1], torch.from_numpy(first.astype(np.int32)))
    assert (routes[bounds[1] - 1] == NO_ROUTE_U8).all()  # a sample's last token is never fed
    assert (ids[bounds[1] : bounds[2]] == -1).all()  # no routes for this sample
    assert (
        ROUTES_KEY
        not in pack_groups([Group("q", [Sample("q", [1], [2])], advantages=[0.0])]).token_data
    )
    picked = batch.select([2])
    assert torch.equal(picked.token_data[ROUTES_KEY], routes[bounds[2] :])


def test_packed_routes_widen_to_int16_when_an_id_needs_the_none_byte():
    """Expert 255 (a 256-expert model) would read as "none" in ``uint8``: the batch is
    ``int16`` with ``-1`` then."""
    ids = np.full((2, 1, 2), 255, dtype=np.int64)
    sample = Sample("q", [1, 2], [3], routed_experts=RoutedExperts.from_array(ids))
    routes = pack_groups([Group("q", [sample], advantages=[0.0])]).token_data[ROUTES_KEY]
    assert routes.dtype == torch.int16
    assert route_ids(routes)[:, 0].tolist() == [[255, 255], [255, 255], [-1, -1]]


def test_route_dtype_is_one_byte_up_to_256_experts():
    assert rr.route_dtype(128) == torch.uint8 and rr.route_dtype(256) == torch.uint8
    assert rr.route_dtype(257) == torch.int16


def test_router_rows_are_sequence_major_and_split_for_sequence_parallelism():
    batch = batch_with_routes()
    mb = build_micro_batch(batch, [0, 2], pad_multiple=2)  # rows of 5 and 4 tokens, L = 6
    pos = rr.router_positions(mb)
    grid = pos.view(6, 2)  # [s, b]
    assert grid[:, 0].tolist() == [0, 1, 2, 3, 4, -1]
    assert grid[:, 1].tolist() == [9, 10, 11, 12, -1, -1]
    halves = [rr.router_positions(mb, r, 2) for r in range(2)]
    assert torch.equal(torch.cat(halves), pos)  # each TP rank holds its s-chunk
    packed = build_packed_micro_batch(batch, [1, 2], pad_multiple=4)
    assert rr.router_positions(packed).tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    filler = filler_micro_batch(batch, packed=False)  # stands in for a rank's micro-batch
    assert (rr.router_positions(filler) == -1).all()  # replays, records, counts nothing


def run_router(replay: rr.RouteReplay, scores: torch.Tensor):
    return replay.get_replay_topk(
        scores, K, default_compute_topk=lambda s, k, *a: torch.topk(s, k, dim=1)
    )


def test_one_router_replays_records_counts_and_replays_again_in_recompute():
    batch = batch_with_routes()
    mb = build_micro_batch(batch, [0])  # 5 tokens, one row
    engine = batch.token_data[ROUTES_KEY]
    spec = rr.PassSpec(LAYERS, EXPERTS, targets=rr.BatchRoutes(engine),
                       compare=rr.BatchRoutes(engine), source=rr.sample_kinds(batch),
                       record=True, training=True, recompute=True)  # fmt: skip
    replay = rr.RouteReplay(layer=1)
    routing = rr.PassRouting(spec, [replay])
    scores = torch.randn(5, EXPERTS, requires_grad=True)
    routing.begin(mb)
    probs, chosen = run_router(replay, scores)
    want = route_ids(engine[:4, 1]).long()
    assert torch.equal(chosen[:4], want)  # replayed
    assert torch.equal(chosen[4], torch.topk(scores, K).indices[4])  # no route: its own
    assert torch.equal(probs, scores.gather(1, chosen))
    probs.sum().backward()
    assert scores.grad.abs().sum() > 0  # the gate values keep their gradient
    free = torch.topk(scores, K).indices[:4].sort(1).values
    agree = float((free == want.sort(1).values).all(1).sum())
    counted = routing.agreement
    assert (counted.policy_agreeing, counted.policy_compared) == (agree, 4.0)
    assert routing.load[1].sum() == 5 * K
    routing.forward_done()  # the micro-batch's routes to the host; recomputation replays
    assert replay.router_replay_action == RouterReplayAction.REPLAY_BACKWARD
    _, again = run_router(replay, torch.randn(5, EXPERTS))
    assert torch.equal(again, chosen) and replay.replay_backward_list == []
    routing.end()
    assert replay.routing is None
    _, own = run_router(replay, scores.detach())
    assert torch.equal(own, torch.topk(scores.detach(), K).indices)
    held = routing.held(batch, [0], K)  # this router routes layer 1: one column
    assert held.layers == [1] and held.rows.dtype == torch.uint8
    assert held.rows.shape == (5, 1, K) and torch.equal(held.rows[:, 0].long(), chosen)


def test_the_old_pass_keeps_only_the_rows_of_the_samples_this_rank_ran():
    """Two data-parallel ranks over the batch's plan: each keeps its shard's rows (uint8); the
    rows of a micro-batch of other samples (a stand-in or filler micro-batch) are left out."""
    batch = batch_with_routes()
    lengths = batch.seq_lengths()
    shards = shard_samples(lengths, 2)
    for rank in range(2):
        routers = [rr.RouteReplay(layer=0), rr.RouteReplay(layer=1)]
        routing = rr.PassRouting(rr.PassSpec(LAYERS, EXPERTS, record=True), routers)
        mbs = plan_micro_batches(batch, rank, 2, 6) + [build_micro_batch(batch, shards[1 - rank])]
        truth = {}
        for mb in mbs:
            routing.begin(mb)
            for r in routing.routers:
                _, chosen = run_router(r, torch.randn(mb.valid.numel(), EXPERTS))
                pos = rr.router_positions(mb).tolist()
                truth.update({(p, r.layer): chosen[i] for i, p in enumerate(pos) if p >= 0})
            routing.forward_done()
        routing.end()
        old = rr.ReplayPlan("r2", "own", LAYERS, EXPERTS, K, (0, 1)).recorded(routing, batch,
                                                                              rank, 2)  # fmt: skip
        held = old.held
        assert held.samples == shards[rank] and held.layers == [0, 1]
        assert held.rows.shape == (sum(lengths[i] for i in shards[rank]), LAYERS, K)
        assert held.rows.dtype == torch.uint8
        bounds = batch.cu_seqlens.tolist()
        positions = [p for i in shards[rank] for p in range(bounds[i], bounds[i + 1])]
        for row, p in enumerate(positions):
            for layer in range(LAYERS):
                assert torch.equal(held.rows[row, layer].long(), truth[(p, layer)])
        assert old.owner == [next(r for r in range(2) if i in shards[r]) for i in range(3)]


def test_each_update_gets_exactly_its_shards_rows_from_their_holders(monkeypatch):
    """The all-to-all of :func:`update_routes` simulated over three data-parallel ranks: a
    mini-batch of some samples (one twice, as a short batch's cyclic mini-batches) gets, on
    each rank, the ``old`` rows of exactly its shard of the mini-batch; each rank sends and
    receives rows of its own tokens only."""
    batch = batch_with_routes()
    lengths, dp = batch.seq_lengths(), 3
    truth = torch.randint(0, EXPERTS, (batch.num_tokens, 1, K), dtype=torch.uint8)
    bounds = batch.cu_seqlens.tolist()
    rows_of = lambda i: truth[bounds[i] : bounds[i + 1]]  # noqa: E731
    shards = shard_samples(lengths, dp)
    owner = [next(r for r in range(dp) if i in shards[r]) for i in range(batch.num_samples)]
    olds = [
        rr.RecordedRoutes(rr.HeldRoutes(s, [lengths[i] for i in s], [1],
                          torch.cat([rows_of(i) for i in s]) if s else truth[:0]), owner)
        for s in shards
    ]  # fmt: skip
    picked = [2, 0, 2]
    minis = [batch.select(picked) for _ in range(dp)]
    assert minis[0].origin == picked  # the samples' ids in the recorded batch
    sent = []
    for rank in range(dp):
        send, _ = rr.exchange_plan(owner, picked, minis[rank].seq_lengths(), dp, rank)
        sent.append([olds[rank].held.of_samples([picked[j] for j in ids]) for ids in send])
    mini_shards = shard_samples(minis[0].seq_lengths(), dp)
    for rank in range(dp):
        monkeypatch.setattr(rr, "_all_to_all", lambda parts, sizes, like, group, r=rank: [
            sent[src][r] for src in range(dp)])  # fmt: skip
        held = rr.update_routes(olds[rank], minis[rank], rank, dp)
        assert held.samples == mini_shards[rank] and held.layers == [1]
        want = [rows_of(picked[j]) for j in mini_shards[rank]]
        assert torch.equal(held.rows, torch.cat(want) if want else truth[:0])
        received = sum(len(sent[src][rank]) for src in range(dp))
        assert received == sum(minis[0].seq_lengths()[j] for j in mini_shards[rank])
    assert rr.update_routes(None, batch.select(picked), 0, dp) is None  # nothing recorded


@pytest.mark.parametrize("mode", ["off", "r2", "r3"])
@pytest.mark.parametrize("anchors", ["own", "reference", "free"])
def test_which_routes_each_pass_replays(mode, anchors):
    """docs/algorithm.md's table: policy samples replay the policy engine's routes in ``old``
    under r3; anchors per the rule; the reference pass replays the reference engine's routes on
    anchors; the updates replay the ``old`` pass's routes."""
    batch = batch_with_routes()
    engine = batch.token_data[ROUTES_KEY]
    anchor = rr.sample_kinds(batch) == rr.ANCHOR
    plan = rr.ReplayPlan(mode, anchors, LAYERS, EXPERTS, K, (0, 1))

    def replayed(routing):
        t = routing.spec.targets
        if t is None:
            return torch.zeros(batch.num_tokens, dtype=torch.bool)
        return t.rows(torch.arange(batch.num_tokens))[:, 0, 0] >= 0

    has = route_ids(engine)[:, 0, 0] >= 0
    old = plan.old_pass(batch, [], single=False)
    assert old.spec.record == (mode != "off")
    assert torch.equal(replayed(old) & ~anchor, has & ~anchor & (mode == "r3"))
    assert torch.equal(
        replayed(old) & anchor, has & anchor & (mode != "off" and anchors == "reference")
    )
    single = plan.old_pass(batch, [], single=True)  # the reference weights are the old ones
    anchor_single = mode != "off" and anchors in ("own", "reference")
    assert torch.equal(replayed(single) & anchor, has & anchor & anchor_single)
    ref = plan.ref_pass(batch, [])
    assert torch.equal(replayed(ref), has & anchor & (mode != "off" and anchors != "free"))
    lengths = batch.seq_lengths()
    rows = torch.randint(0, EXPERTS, (batch.num_tokens, LAYERS, K), dtype=torch.uint8)
    held = rr.HeldRoutes([0, 1, 2], lengths, [0, 1], rows)
    update = plan.update_pass(batch, [], held)
    assert update.spec.training and not update.spec.recompute
    want = torch.ones_like(anchor) if mode != "off" else torch.zeros_like(anchor)
    if anchors == "free":
        want &= ~anchor
    assert torch.equal(replayed(update), want)
    if mode != "off":
        got = update.spec.compare.rows(torch.arange(batch.num_tokens))
        assert torch.equal(got, rows.to(torch.int16))


def test_routing_metrics_per_source_and_load():
    plan = rr.ReplayPlan("r3", "own", LAYERS, EXPERTS, K, (0,))
    p = rr.PassRouting(rr.PassSpec(LAYERS, EXPERTS), [])
    p.agreement = rr.Agreement(*(torch.tensor(x) for x in (3, 4, 0, 0)))
    p.load = torch.tensor([[4, 2, 1, 1], [0, 0, 0, 0]])
    got = plan.metrics([p], p, ("policy", "anchor"))
    assert got == {"policy": 0.75, "moe/expert_load_max_mean": 2.0}


def test_the_settings_load_and_bad_names_are_refused(tmp_path):
    """``trainer.moe.routing_replay`` / ``anchor_routes`` load (a bare YAML ``off`` too) and
    an unknown name is refused naming the setting and the choices."""
    from megatron_armor.config.loader import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  moe:\n    routing_replay: off\n    anchor_routes: free\n")
    cfg = load_config(path)
    assert (cfg.trainer.moe.routing_replay, cfg.trainer.moe.anchor_routes) == ("off", "free")
    assert load_config(None, ["trainer.moe.routing_replay=r3"]).trainer.moe.routing_replay == "r3"
    with pytest.raises(ConfigError, match=r"trainer.moe.routing_replay='r4'.*'off', 'r2', 'r3'"):
        load_config(None, ["trainer.moe.routing_replay=r4"])
    with pytest.raises(ConfigError, match="trainer.moe.anchor_routes='policy'"):
        load_config(None, ["trainer.moe.anchor_routes=policy"])


def test_sequence_parallel_rows_are_completed_by_a_sum_in_small_chunks(monkeypatch):
    """With sequence parallelism each TP rank recorded part of its shard's rows (zeros
    elsewhere): the sum over the TP group completes them, a few rows on the device at a time."""
    full = torch.randint(0, EXPERTS, (7, LAYERS, K), dtype=torch.uint8)
    mine, theirs = full.clone(), full.clone()
    mine[::2], theirs[1::2] = 0, 0  # each rank routed every other row
    seen = []

    def all_reduce(buf, group=None):  # the other rank's matching chunk arrives
        start = sum(len(c) for c in seen)
        seen.append(buf.clone())
        buf += theirs[start : start + len(buf)]

    monkeypatch.setattr(rr.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(rr, "COLLECTIVE_CHUNK_BYTES", 3 * LAYERS * K)
    rr.sum_in_chunks(mine, None)
    assert torch.equal(mine, full) and [len(c) for c in seen] == [3, 3, 1]


class HostReads:
    """Counts, while entered, the ops whose result needs a tensor's values on the host: a
    data-dependent shape (a boolean index, ``nonzero``, ``masked_select``, ``bincount``,
    ``unique``) or a scalar read (``item``, ``bool``). On a GPU each is a host-device
    synchronisation; here they are counted on CPU tensors, which run the same ops."""

    NAMES = ("nonzero", "masked_select", "_local_scalar_dense", "bincount", "unique")

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self.reads = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                boolean_index = name == "aten.index.Tensor" and any(
                    i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]
                )  # fmt: skip
                if boolean_index or any(n in name for n in HostReads.NAMES):
                    reads.append(name)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("recompute", [False, True])
def test_an_update_keeps_routes_only_to_recompute_and_reads_nothing_back_per_router_call(
    recompute,
):
    """An update's routers under ``r2`` (replaying the ``old`` pass's routes, counting the
    agreement and the load) over several micro-batches: without ``trainer.recompute`` no
    route is kept for a backward that never runs them again (0 bytes after every forward);
    with it one ``[rows, k]`` per micro-batch and router, taken again by the recomputation.
    No router call reads a value back from its device (0 host reads)."""
    batch = batch_with_routes()
    lengths = batch.seq_lengths()
    rows = torch.randint(0, EXPERTS, (batch.num_tokens, LAYERS, K), dtype=torch.uint8)
    held = rr.HeldRoutes([0, 1, 2], lengths, [0, 1], rows)
    plan = rr.ReplayPlan("r2", "own", LAYERS, EXPERTS, K, (0, 1), recompute=recompute)
    routers = [rr.RouteReplay(layer=0), rr.RouteReplay(layer=1)]
    routing = plan.update_pass(batch, routers, held)
    mbs = [build_micro_batch(batch, [i]) for i in range(batch.num_samples)]
    kept, reads = [], HostReads()
    for mb in mbs:
        routing.begin(mb)
        scores = [torch.randn(mb.valid.numel(), EXPERTS) for _ in routers]
        with reads:
            for router, s in zip(routers, scores, strict=True):
                run_router(router, s)
        routing.forward_done()
        kept.append(sum(t.numel() * t.element_size() for r in routers
                        for t in r.replay_backward_list))  # fmt: skip
    assert reads.reads == []
    if recompute:
        per_mb = [len(routers) * mb.valid.numel() * K * 8 for mb in mbs]  # int64 experts
        assert kept == list(itertools.accumulate(per_mb))
    else:
        assert kept == [0] * len(mbs)
    counted = routing.agreement
    assert counted.policy_compared + counted.anchor_compared == LAYERS * batch.num_tokens
    routing.end()
