"""Driver-side weight sync (``orchestration/actors/weight_sync.py``): which calls each transport
makes on the trainer and rollout actors for a policy push, a reference push, a swap and the
recovery of dead SGLang servers, against recording stand-ins of the two handles (the handles'
Ray calls are exercised by the e2e tier; the trainer ranks' side by the dist and gpu tiers).

Every SGLang transport is checked to hand no tensor to or from the driver: the recording
stand-ins fail on any ``torch.Tensor`` in a call's arguments or answer, and on ``export_refs``
(the object-store path, which only the embedded engine uses)."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_armor.config.loader import load_config
from megatron_armor.orchestration.actors.weight_sync import (
    DiskSync,
    DistributedSync,
    InProcessSync,
    TensorSync,
    make_weight_sync,
)
from megatron_armor.trainer.weight_sync import ServerTarget

pytestmark = pytest.mark.unit


def tensors_in(value) -> bool:
    """Whether ``value`` holds a tensor anywhere (lists, tuples, dicts, dataclasses)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(tensors_in(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(tensors_in(v) for v in value)
    return hasattr(value, "__dict__") and tensors_in(vars(value))


class Recorder:
    """Records ``(method, *args)``; fails on tensors crossing the driver."""

    object_store = False  # whether export_refs (the object store) is allowed

    def __init__(self):
        self.calls = []

    def record(self, *call, answer=None):
        assert not tensors_in(call) and not tensors_in(answer), f"tensor through the driver: {call}"
        self.calls.append(call)
        return answer


class Trainer(Recorder):
    def export_refs(self, weights, if_changed=False):
        assert self.object_store, "weights through the object store"
        call = ("export", weights, "if_changed") if if_changed else ("export", weights)
        return self.record(*call, answer=[f"{weights}-tensors"])

    def push_weights(self, version, weights, pool, target):
        if isinstance(target, str):  # disk: the ranks write the directory
            os.makedirs(target)
        return self.record("push", version, weights, pool, target, answer=10)

    def drop_sender(self, pool):
        self.record("drop", pool)


class Rollout(Recorder):
    def __init__(self, restarted=(), has_ref_pool=True, misses=1):
        super().__init__()
        self.restarted, self.has_ref_pool, self.misses = list(restarted), has_ref_pool, misses
        self.versions = {"policy": 12, "ref": 8}

    def restart_dead_servers(self):
        return self.record("restart", answer=self.restarted)

    def pool_version(self, pool):
        return self.versions[pool]

    def weight_targets(self, pool="policy"):
        return [(0, f"http://{pool}-{i}", 1, i, "") for i in range(2)]  # one worker

    def set_weight_version(self, version, pool):
        self.record("version", version, pool)

    def begin_weight_update(self, pool, servers=None):
        self.record("begin", pool, servers)

    def end_weight_update(self, pool, servers=None):
        self.record("end", pool, servers)

    def load_from_disk(self, pool, path, version, servers=None):
        self.record("disk", pool, path.rsplit("/", 2)[-2:], version, servers)

    def reference_misses(self, items, n):
        return self.misses

    def rejoin(self, worker, pool, indices):
        self.record("rejoin", worker, pool, tuple(indices))

    def reference_in_place(self, version, reset):
        self.record("in_place", version, reset)

    def submit_update_weights(self, version, refs):
        return self.record("update", version, tuple(refs), answer=[f"loaded-{version}"])

    def wait_update_weights(self, loads):
        return self.record("wait", tuple(loads), answer=99)

    def load_reference(self, version, refs):
        self.record("load", version, tuple(refs))

    def reset_reference(self, version, refs):
        self.record("reset", version, tuple(refs))

    def reset_reference_from_policy(self, version):
        self.record("reset_from_policy", version)


def config(transport="tensor", strategy="dedicated", *extra, output_dir="/tmp"):
    # NCCL takes one rank per GPU: the distributed transport serves disaggregated servers
    layout = (["orchestration.layout=disaggregated", "orchestration.rollout_gpus=2",
               "orchestration.gpus_per_node=4"]
              if transport == "distributed"
              else ["orchestration.layout=colocated", "orchestration.gpus_per_node=2"])  # fmt: skip
    return load_config(None, ["rollout.backend=sglang", *layout,
                              "trainer.world_size=2", f"rollout.sglang.weight_transport={transport}",
                              f"rollout.ref_strategy={strategy}", f"run.output_dir={output_dir}",
                              *extra])  # fmt: skip


def test_the_transport_is_chosen_once_from_the_config():
    trainer, rollout = Trainer(), Rollout()
    kinds = {
        t: type(make_weight_sync(config(t), trainer, rollout))
        for t in ("tensor", "distributed", "disk")
    }
    assert kinds == {"tensor": TensorSync, "distributed": DistributedSync, "disk": DiskSync}
    embedded = load_config(None, ["rollout.backend=torch"])
    assert type(make_weight_sync(embedded, trainer, rollout)) is InProcessSync


def test_tensor_pushes_go_from_the_ranks_on_each_servers_gpus():
    trainer, rollout = Trainer(), Rollout([{"policy": [1]}])
    sync = make_weight_sync(config("tensor"), trainer, rollout)
    assert sync.push_policy(3) == 10
    sync.push_reference(2, reset=True)
    assert sync.heal() == 1
    full = [ServerTarget("http://policy-0", 1, 0), ServerTarget("http://policy-1", 1, 1)]
    ref = [ServerTarget("http://ref-0", 1, 0), ServerTarget("http://ref-1", 1, 1)]
    assert trainer.calls == [
        ("push", 3, "policy", "policy", full),
        ("push", 2, "ref", "ref", ref),
        ("push", 12, "policy", "policy", full[1:]),  # only the restarted server, at its version
    ]
    # every push inside the servers' weight-update session (SGLang 0.5.23 refuses one outside)
    assert rollout.calls == [
        ("begin", "policy", None), ("end", "policy", None), ("version", 3, "policy"),
        ("begin", "ref", None), ("end", "ref", None), ("version", 2, "ref"), ("in_place", 2, True),
        ("restart",), ("begin", "policy", {0: [1]}), ("end", "policy", {0: [1]}),
        ("rejoin", 0, "policy", (1,)),
    ]  # fmt: skip
    metrics = sync.pop_metrics()
    assert metrics["perf/weight_sync_tensor_pushes"] == 3.0
    assert metrics["perf/weight_sync_tensor_gb"] == pytest.approx(30 / 1e9)
    assert sync.pop_metrics() == {}


def test_streamed_pools_get_a_new_group_and_a_full_sync_at_their_version():
    trainer, rollout = Trainer(), Rollout([{"ref": [1]}, {"ref": [3]}])
    sync = make_weight_sync(config("distributed"), trainer, rollout)
    assert sync.heal() == 2
    targets = [ServerTarget("http://ref-0", 1), ServerTarget("http://ref-1", 1)]
    assert trainer.calls == [("drop", "ref"), ("push", 8, "ref", "ref", targets)]  # once
    assert rollout.calls[-2:] == [("rejoin", 0, "ref", (1,)), ("rejoin", 1, "ref", (3,))]


def test_nothing_dead_means_no_weight_traffic():
    trainer, rollout = Trainer(), Rollout([{}])
    assert make_weight_sync(config("distributed"), trainer, rollout).heal() == 0
    assert trainer.calls == [] and rollout.calls == [("restart",)]


def test_disk_pushes_are_written_by_the_ranks_loaded_by_path_and_pruned(tmp_path):
    trainer, rollout = Trainer(), Rollout([{"policy": [0]}])
    sync = make_weight_sync(config("disk", output_dir=str(tmp_path)), trainer, rollout)
    pool_dir = tmp_path / "armor" / "sglang_weights" / "policy"
    (pool_dir / "policy-v1").mkdir(parents=True)  # a half-written push of a crashed run
    (pool_dir / "policy-v1" / "partial.safetensors").touch()
    for version in (1, 2):
        sync.push_policy(version)
    assert sorted(p.name for p in pool_dir.iterdir()) == ["policy-v2"]  # the loaded one
    sync.heal()
    assert rollout.calls[-3:] == [("restart",), ("disk", "policy", ["policy", "policy-v12"], 12, {0: [0]}),
                                  ("rejoin", 0, "policy", (0,))]  # fmt: skip
    assert [c[4].endswith("policy/policy-v2") for c in trainer.calls[1:2]] == [True]


def test_swap_pushes_the_reference_into_the_policy_servers_and_back():
    trainer, rollout = Trainer(), Rollout(has_ref_pool=False)
    sync = make_weight_sync(config("tensor", "swap"), trainer, rollout)
    sync.push_policy(5)
    sync.push_reference(4, reset=True)  # nothing sent: swapped in when sampling
    with sync.reference_swapped(["item"], 2):
        trainer.record("sampling")
    pushed = [(c[1], c[2], c[3]) for c in trainer.calls if c[0] == "push"]
    assert pushed == [(5, "policy", "policy"), (4, "ref", "policy"), (5, "policy", "policy")]
    assert trainer.calls[2] == ("sampling",)
    rollout.misses, trainer.calls = 0, []  # every anchor cached: no swap
    cached = make_weight_sync(
        config("tensor", "swap", "algo.anchor_source=cache"), trainer, rollout
    )
    with cached.reference_swapped(["item"], 2):
        pass
    assert trainer.calls == []


def test_swap_sends_nothing_while_the_policy_servers_hold_the_reference():
    """A reset at the step whose policy the servers hold (``reset: every 1``: every step), or
    both at the start weights: the reference is already in the policy servers."""
    trainer, rollout = Trainer(), Rollout(has_ref_pool=False)
    sync = make_weight_sync(config("tensor", "swap"), trainer, rollout)
    with sync.reference_swapped(["item"], 2):  # version 0 both: the start weights
        trainer.record("sampling")
    sync.push_policy(5)
    sync.push_reference(5, reset=True)
    with sync.reference_swapped(["item"], 2):
        trainer.record("sampling")
    assert [c[:2] for c in trainer.calls] == [("sampling",), ("push", 5), ("sampling",)]
    sync.push_policy(6)  # the policy moves on: the reference is swapped in again
    trainer.calls = []
    with sync.reference_swapped(["item"], 2):
        pass
    pushed = [(c[1], c[2], c[3]) for c in trainer.calls if c[0] == "push"]
    assert pushed == [(5, "ref", "policy"), (6, "policy", "policy")]


def test_reference_pushes_without_anchors_send_nothing():
    trainer, rollout = Trainer(), Rollout()
    sync = make_weight_sync(config("tensor", "dedicated", "algo.anchor=none"), trainer, rollout)
    sync.push_reference(20, reset=True)
    assert trainer.calls == [] and rollout.calls == [("in_place", 20, True)]


def test_only_the_embedded_engine_takes_the_export_through_the_object_store():
    trainer, rollout = Trainer(), Rollout()
    trainer.object_store = True
    sync = make_weight_sync(load_config(None, ["rollout.backend=torch"]), trainer, rollout)
    assert sync.push_policy(3) == 99
    sync.push_reference(0)
    sync.push_reference(40, reset=True)
    assert rollout.calls == [("update", 3, ("policy-tensors",)), ("wait", ("loaded-3",)),
                             ("load", 0, ("ref-tensors",)), ("reset", 40, ("ref-tensors",))]  # fmt: skip
    assert sync.heal() == 0


def test_a_reset_to_the_pushed_policy_exports_nothing():
    """The embedded engine serves the policy of the step a reset happens at: the reference
    is taken from it (``reset_reference_from_policy``), nothing exported or sent."""
    trainer, rollout = Trainer(), Rollout()
    trainer.object_store = True
    sync = make_weight_sync(load_config(None, ["rollout.backend=torch"]), trainer, rollout)
    sync.push_policy(5)
    sync.push_reference(5, reset=True)
    assert trainer.calls == [("export", "policy")]
    assert rollout.calls[-1] == ("reset_from_policy", 5)
    assert sync.pop_metrics()["perf/weight_sync_inprocess_pushes"] == 2.0
    sync.push_reference(5)  # a load (resume) is sent as before
    assert trainer.calls[-1] == ("export", "ref") and rollout.calls[-1][0] == "load"


@pytest.mark.parametrize("extra, early", [
    ([], True),
    (["orchestration.layout=colocated"], False),  # the engines take their memory back first
    (["trainer.offload_train_state=true"], False),
])  # fmt: skip
def test_the_embedded_push_is_queued_behind_the_updates(extra, early):
    """``queue_policy_push`` (called with the step's updates queued) queues the export on the
    ranks and, where the engines hold their memory, the load behind it: ``push_policy`` only
    waits. Elsewhere the load is sent by ``push_policy``; a push of another version than the
    queued one exports afresh."""
    trainer, rollout = Trainer(), Rollout()
    trainer.object_store = True
    sync = make_weight_sync(load_config(None, ["rollout.backend=torch", *extra]), trainer, rollout)
    sync.queue_policy_push(7)
    queued = list(rollout.calls)
    assert trainer.calls == [("export", "policy", "if_changed")]
    assert queued == ([("update", 7, ("policy-tensors",))] if early else [])
    assert sync.push_policy(7) == 99
    assert trainer.calls == [("export", "policy", "if_changed")]  # not exported twice
    assert rollout.calls[len(queued) :] == [
        *([] if early else [("update", 7, ("policy-tensors",))]),
        ("wait", ("loaded-7",)),
    ]
    assert sync.pop_metrics()["perf/weight_sync_inprocess_pushes"] == 1.0
    sync.queue_policy_push(8)
    sync.push_policy(9)  # not what was queued: exported and loaded at 9
    assert trainer.calls[-1] == ("export", "policy") and len(trainer.calls) == 3
    assert rollout.calls[-2:] == [("update", 9, ("policy-tensors",)), ("wait", ("loaded-9",))]


@pytest.mark.parametrize("early", [True, False])
def test_a_step_without_an_applied_update_pushes_nothing(early):
    """Every update of the step skipped (non-finite): the queued export of the embedded
    engine is ``if_changed`` (empty, the engine loads nothing: ``RolloutWorker.update_weights``)
    and is only waited for; no version is recorded; disaggregated SGLang servers (which kept
    their weights) get nothing."""
    trainer, rollout = Trainer(), Rollout()
    trainer.object_store = True
    extra = [] if early else ["orchestration.layout=colocated"]
    sync = make_weight_sync(load_config(None, ["rollout.backend=torch", *extra]), trainer, rollout)
    sync.push_policy(3)
    sync.queue_policy_push(4)
    before = len(rollout.calls)
    assert sync.skip_policy_push() == 0
    assert rollout.calls[before:] == ([("wait", ("loaded-4",))] if early else [])
    assert sync.versions["policy"] == 3
    assert sync.pop_metrics()["perf/weight_sync_inprocess_pushes"] == 1.0  # the push at 3 only
    servers_trainer, servers_rollout = Trainer(), Rollout()
    served = make_weight_sync(config("distributed"), servers_trainer, servers_rollout)
    served.queue_policy_push(4)
    assert served.skip_policy_push() == 0
    assert servers_trainer.calls == [] and servers_rollout.calls == []


def test_worker_roles_follow_the_pools_on_each_node():
    from megatron_armor.orchestration.actors.actor_handles import worker_roles
    from megatron_armor.orchestration.actors.placement import RolloutHost

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
    from megatron_armor.rollout.backends import visible_index

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


@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_colocated_servers_get_the_current_policy_again_after_a_step_without_an_update(
    transport, tmp_path
):
    """The policy servers released their weights for the update (no host copy): a step whose
    updates were all skipped pushes the current policy again, at the version they had."""
    trainer, rollout = Trainer(), Rollout()
    sync = make_weight_sync(config(transport, output_dir=str(tmp_path)), trainer, rollout)
    sync.push_policy(4)
    assert sync.skip_policy_push() == 10
    assert [c[:4] for c in trainer.calls] == [("push", 4, "policy", "policy")] * 2
    assert rollout.calls[-1] == ("version", 4, "policy")


def test_disaggregated_servers_keep_their_weights_after_a_step_without_an_update():
    trainer, rollout = Trainer(), Rollout()
    sync = make_weight_sync(config("distributed"), trainer, rollout)
    sync.push_policy(4)
    assert sync.skip_policy_push() == 0
    assert len(trainer.calls) == 1


def test_a_failed_begin_still_closes_the_servers_sessions():
    """A begin that reached only some servers: the end goes to all of them."""

    class BeginFails(Rollout):
        def begin_weight_update(self, pool, servers=None):
            self.record("begin", pool, servers)
            raise RuntimeError("server 1 refused /begin_weight_update")

    trainer, rollout = Trainer(), BeginFails()
    sync = make_weight_sync(config("tensor"), trainer, rollout)
    with pytest.raises(RuntimeError, match="refused"):
        sync.push_policy(3)
    assert rollout.calls == [("begin", "policy", None), ("end", "policy", None)]
    assert trainer.calls == []
