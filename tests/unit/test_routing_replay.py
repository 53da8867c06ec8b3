"""Routing replay of a mixture-of-experts policy (``trainer/routing_replay.py``; unit tier):
the routers' token order, replay / record / backward replay of one router, which routes each
pass of a step uses per mode and anchor rule, and the engines' routes in the packed batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megatron_armor.trainer import routing_replay as rr
from megatron_armor.trainer.batching import (
    build_micro_batch,
    build_packed_micro_batch,
    filler_micro_batch,
)
from megatron_armor.types import (
    OLD_ROUTES_KEY,
    ROUTES_KEY,
    Group,
    RoutedExperts,
    Sample,
    SampleSource,
    pack_groups,
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
    assert routes.shape == (batch.num_tokens, LAYERS, K) and routes.dtype == torch.int16
    bounds = batch.cu_seqlens.tolist()
    first = routes_of(5, 0).array()
    assert torch.equal(routes[: bounds[1] - 1], torch.from_numpy(first.astype(np.int16)))
    assert (routes[bounds[1] - 1] == -1).all()  # a sample's last token is never fed
    assert (routes[bounds[1] : bounds[2]] == -1).all()  # no routes for this sample
    assert (
        ROUTES_KEY
        not in pack_groups([Group("q", [Sample("q", [1], [2])], advantages=[0.0])]).token_data
    )
    picked = batch.select([2])
    assert torch.equal(picked.token_data[ROUTES_KEY], routes[bounds[2] :])


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
    routing = rr.PassRouting(LAYERS, EXPERTS, batch.num_tokens, targets=engine, compare=engine,
                             source=rr.sample_kinds(batch), record=True, training=True)  # fmt: skip
    replay = rr.RouteReplay(layer=1)
    routing.routers = [replay]
    scores = torch.randn(5, EXPERTS, requires_grad=True)
    routing.begin(mb)
    probs, chosen = run_router(replay, scores)
    want = engine[:4, 1].long()
    assert torch.equal(chosen[:4], want)  # replayed
    assert torch.equal(chosen[4], torch.topk(scores, K).indices[4])  # no route: its own
    assert torch.equal(probs, scores.gather(1, chosen))
    probs.sum().backward()
    assert scores.grad.abs().sum() > 0  # the gate values keep their gradient
    assert torch.equal(routing.recorded[:5, 1].long(), chosen)
    assert (routing.recorded[:, 0] == -1).all()  # another layer's router records layer 0
    free = torch.topk(scores, K).indices[:4].sort(1).values
    agree = float((free == want.sort(1).values).all(1).sum())
    assert routing.agree[:2].tolist() == [agree, 4.0]
    assert routing.load[1].sum() == 5 * K
    routing.forward_done()  # a recomputation in the backward takes what the forward chose
    assert replay.router_replay_action == RouterReplayAction.REPLAY_BACKWARD
    _, again = run_router(replay, torch.randn(5, EXPERTS))
    assert torch.equal(again, chosen) and replay.replay_backward_list == []
    routing.end()
    assert replay.routing is None
    _, own = run_router(replay, scores.detach())
    assert torch.equal(own, torch.topk(scores.detach(), K).indices)


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
        t = routing.targets
        return torch.zeros(batch.num_tokens, dtype=torch.bool) if t is None else (t[:, 0, 0] >= 0)

    has = engine[:, 0, 0] >= 0
    old = plan.old_pass(batch, [], single=False)
    assert old.record == (mode != "off")
    assert torch.equal(replayed(old) & ~anchor, has & ~anchor & (mode == "r3"))
    assert torch.equal(
        replayed(old) & anchor, has & anchor & (mode != "off" and anchors == "reference")
    )
    single = plan.old_pass(batch, [], single=True)  # the reference weights are the old ones
    anchor_single = mode != "off" and anchors in ("own", "reference")
    assert torch.equal(replayed(single) & anchor, has & anchor & anchor_single)
    ref = plan.ref_pass(batch, [])
    assert torch.equal(replayed(ref), has & anchor & (mode != "off" and anchors != "free"))
    batch.token_data[OLD_ROUTES_KEY] = torch.randint(0, EXPERTS, engine.shape, dtype=torch.int16)
    update = plan.update_pass(batch, [])
    assert update.training
    want = torch.ones_like(anchor) if mode != "off" else torch.zeros_like(anchor)
    if anchors == "free":
        want &= ~anchor
    assert torch.equal(replayed(update), want)


def test_routing_metrics_per_source_and_load():
    plan = rr.ReplayPlan("r3", "own", LAYERS, EXPERTS, K, (0,))
    p = rr.PassRouting(LAYERS, EXPERTS, 4)
    p.agree = torch.tensor([3.0, 4.0, 0.0, 0.0], dtype=torch.float64)
    p.load = torch.tensor([[4.0, 2.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
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
