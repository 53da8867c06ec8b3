"""Driver-side recovery of dead SGLang servers (``groups.heal_rollout``) and reference pushes
(``groups.push_reference``), against recording stand-ins of the trainer and rollout groups
(the groups' Ray calls are exercised by the e2e tier; the servers' side by
``test_rollout_sglang_dist.py``)."""

from __future__ import annotations

import pytest

from megatron_armor.orchestration.groups import heal_rollout, push_reference

pytestmark = pytest.mark.unit


class Trainer:
    def __init__(self):
        self.calls = []

    def export_refs(self, weights):
        self.calls.append(("export", weights))
        return [f"{weights}-tensors"]

    def stream_weights(self, version, targets, weights="policy", pool="policy"):
        self.calls.append(("stream", version, tuple(targets), weights, pool))
        return 10

    def drop_sender(self, pool):
        self.calls.append(("drop", pool))


class Rollout:
    def __init__(self, restarted, has_ref_pool=True):
        self.restarted, self.has_ref_pool = restarted, has_ref_pool
        self.calls = []
        self.versions = {"policy": 12, "ref": 8}

    def restart_dead_servers(self):
        self.calls.append(("restart",))
        return self.restarted

    def pool_version(self, pool):
        return self.versions[pool]

    def weight_targets(self, pool="policy"):
        return [(f"http://{pool}-{i}", 1) for i in range(2)]

    def resync_servers(self, engine, pool, indices, refs):
        self.calls.append(("resync", engine, pool, tuple(indices), tuple(refs)))

    def rejoin(self, engine, pool, indices):
        self.calls.append(("rejoin", engine, pool, tuple(indices)))

    def reference_in_place(self, version, reset):
        self.calls.append(("in_place", version, reset))

    def load_reference(self, version, refs):
        self.calls.append(("load", version, tuple(refs)))

    def reset_reference(self, version, refs):
        self.calls.append(("reset", version, tuple(refs)))


def test_restarted_servers_get_their_pools_weights_before_rejoining():
    trainer, rollout = Trainer(), Rollout([{"policy": [1], "ref": [0]}, {"policy": [4]}])
    assert heal_rollout(trainer, rollout, streamed=False) == 3
    assert trainer.calls == [("export", "policy"), ("export", "ref")]  # once per pool
    assert rollout.calls == [
        ("restart",),
        ("resync", 0, "policy", (1,), ("policy-tensors",)),
        ("rejoin", 0, "policy", (1,)),
        ("resync", 1, "policy", (4,), ("policy-tensors",)),
        ("rejoin", 1, "policy", (4,)),
        ("resync", 0, "ref", (0,), ("ref-tensors",)),
        ("rejoin", 0, "ref", (0,)),
    ]


def test_streamed_pools_get_a_new_group_and_a_full_sync_at_their_version():
    trainer, rollout = Trainer(), Rollout([{"ref": [1]}, {"ref": [3]}])
    assert heal_rollout(trainer, rollout, streamed=True) == 2
    targets = (("http://ref-0", 1), ("http://ref-1", 1))
    assert trainer.calls == [("drop", "ref"), ("stream", 8, targets, "ref", "ref")]  # once
    assert rollout.calls[-2:] == [("rejoin", 0, "ref", (1,)), ("rejoin", 1, "ref", (3,))]


def test_nothing_dead_means_no_weight_traffic():
    trainer, rollout = Trainer(), Rollout([{}])
    assert heal_rollout(trainer, rollout, streamed=True) == 0
    assert trainer.calls == [] and rollout.calls == [("restart",)]


def test_reference_pushes_stream_into_the_reference_pool_or_go_through_the_export():
    trainer, rollout = Trainer(), Rollout([])
    push_reference(trainer, rollout, 40, streamed=True, reset=True)
    targets = (("http://ref-0", 1), ("http://ref-1", 1))
    assert trainer.calls == [("stream", 40, targets, "ref", "ref")]
    assert rollout.calls == [("in_place", 40, True)]
    trainer, rollout = Trainer(), Rollout([], has_ref_pool=False)
    push_reference(trainer, rollout, 0, streamed=True, reset=False)  # no reference pool
    push_reference(trainer, rollout, 40, streamed=False, reset=True)
    assert trainer.calls == [("export", "ref"), ("export", "ref")]
    assert rollout.calls == [("load", 0, ("ref-tensors",)), ("reset", 40, ("ref-tensors",))]
    trainer, rollout = Trainer(), Rollout([])
    push_reference(trainer, rollout, 20, streamed=False, reset=True, anchors=False)
    assert trainer.calls == [] and rollout.calls == [("in_place", 20, True)]  # nothing sent


def test_worker_roles_follow_the_pools_on_each_node():
    from megatron_armor.orchestration.groups import worker_roles
    from megatron_armor.orchestration.placement import RolloutHost

    hosts = [
        RolloutHost(8, "10.0.0.2", {"policy": [(0, 0)]}),
        RolloutHost(10, "10.0.0.3", {"ref": [(0, 0)]}),
        RolloutHost(12, "10.0.0.4", {"policy": [(1, 0)], "ref": [(1, 1)]}),
    ]
    assert worker_roles(hosts, has_ref_pool=True) == ([0, 2], [1, 2])
    assert worker_roles(hosts[:1], has_ref_pool=False) == ([0], [0])  # swap: the policy servers
    with pytest.raises(ValueError, match="hold no ref servers"):
        worker_roles(hosts[:1], has_ref_pool=True)


def test_server_gpus_are_counted_within_the_visible_devices(monkeypatch):
    from megatron_armor.orchestration.workers import visible_index

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_index(5) == 5
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # a Slurm node's share of GPUs
    assert [visible_index(g) for g in (4, 7)] == [0, 3]
    with pytest.raises(RuntimeError, match="not in this node's CUDA_VISIBLE_DEVICES='4,5,6,7'"):
        visible_index(1)


def test_anchor_free_runs_keep_only_the_reference_version():
    from megatron_armor.rollout.reference import NoReferenceSampler, make_reference_sampler

    sampler = make_reference_sampler("none", engine=None)
    assert isinstance(sampler, NoReferenceSampler)
    sampler.load_reference(0, None)
    sampler.on_reset(20, lambda: pytest.fail("no reference weights are pushed"))
    assert sampler.state_dict() == {"ref_version": 20}
    with pytest.raises(RuntimeError, match="algo.anchor=none"):
        sampler.sample(["q"], [[1]], 1, None)
