"""Driver-side weight sync (``orchestration/actors/weight_sync.py``): which calls each transport
makes on the trainer ranks and the rollout workers for a policy push, a reference push, a swap
and the recovery of dead SGLang servers (``rollout_fleet.ServerHealth``), against a recording
stand-in of the trainer handle and recording workers behind the real fleet, called in process
(``tests/inprocess_actors.py``; the Ray calls are exercised by the e2e tier, the trainer ranks'
side by the dist and gpu tiers).

Every SGLang transport is checked to hand no tensor to or from the driver: the recording
stand-ins fail on any ``torch.Tensor`` in a call's arguments or answer, and on ``export``
(the object-store path, which only the embedded engine uses)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from megatron_armor.config.loader import load_config
from megatron_armor.orchestration.actors.call_kinds import CallKind
from megatron_armor.orchestration.actors.pending import Pending
from megatron_armor.orchestration.actors.rollout_fleet import ServerHealth
from megatron_armor.orchestration.actors.weight_sync import (
    DiskSync,
    DistributedSync,
    InProcessSync,
    TensorSync,
    make_weight_sync,
)
from megatron_armor.trainer.weight_sync import ServerTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inprocess_actors import InstantWatch, local_fleet  # noqa: E402

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
    """Records ``(method, *args)`` into ``calls``; fails on tensors crossing the driver."""

    object_store = False  # whether export (the object store) is allowed

    def __init__(self, calls: list | None = None):
        self.calls = [] if calls is None else calls

    def record(self, *call, answer=None):
        assert not tensors_in(call) and not tensors_in(answer), f"tensor through the driver: {call}"
        self.calls.append(call)
        return answer


class Trainer(Recorder):
    """The trainer ranks' handle (``actor_handles.TrainerActors``)."""

    def export(self, weights, if_changed=False):
        assert self.object_store, "weights through the object store"
        call = ("export", weights, "if_changed") if if_changed else ("export", weights)
        self.record(*call)
        return Pending(InstantWatch(), [f"{weights}-tensors"], CallKind.WEIGHT_PUSH, "export")

    def push_weights(self, version, weights, pool, target):
        if isinstance(target, str):  # disk: the ranks write the directory
            os.makedirs(target)
        return self.record("push", version, weights, pool, target, answer=10)

    def drop_sender(self, pool):
        self.record("drop", pool)


class Worker(Recorder):
    """One rollout worker's weight, reference and health methods (``rollout_services.py``),
    recorded; ``restarted``: the servers its health check restarts; two servers per pool."""

    def __init__(self, calls, index=0, restarted=None):
        super().__init__(calls)
        self.index, self.restarted = index, restarted or {}
        self.versions = {"policy": 12, "ref": 8}

    def restart_dead_servers(self):
        return self.record("restart", answer=self.restarted)

    def pool_version(self, pool):
        return self.versions[pool]

    def weight_targets(self, pool="policy"):
        first = 2 * self.index
        return [(f"http://{pool}-{first + i}", 1, first + i, "") for i in range(2)]

    def set_weight_version(self, version, pool):
        self.record("version", version, pool)

    def begin_weight_update(self, pool, indices=None):
        self.record("begin", pool, indices)

    def end_weight_update(self, pool, indices=None):
        self.record("end", pool, indices)

    def load_from_disk(self, pool, path, version, indices=None):
        self.record("disk", pool, path.rsplit("/", 2)[-2:], version, indices)

    def rejoin(self, pool, indices):
        self.record("rejoin", self.index, pool, tuple(indices))

    def reference_in_place(self, version, reset):
        self.record("in_place", version, reset)

    def update_weights(self, version, *shards):
        return self.record("update", version, shards, answer=99)

    def load_reference(self, version, *shards):
        self.record("load", version, shards)

    def reset_reference(self, version, *shards):
        self.record("reset", version, shards)

    def reset_reference_from_policy(self, version):
        self.record("reset_from_policy", version)


class Rollout:
    """The rollout workers behind the real fleet: ``restarted`` per worker; ``calls`` of all."""

    def __init__(self, restarted=({},), has_ref_pool=True, worker=Worker):
        self.calls, self.watch = [], InstantWatch()
        self.workers = [worker(self.calls, i, r) for i, r in enumerate(restarted)]
        self.fleet = local_fleet(self.workers, has_ref_pool=has_ref_pool, watch=self.watch)

    def heal(self, sync) -> int:
        return ServerHealth(self.fleet, sync.resync).heal()


def needs(misses: int):
    """``needs_fresh`` of a reference call whose items have ``misses`` uncached."""
    return lambda: misses > 0


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
        t: type(make_weight_sync(config(t), trainer, rollout.fleet))
        for t in ("tensor", "distributed", "disk")
    }
    assert kinds == {"tensor": TensorSync, "distributed": DistributedSync, "disk": DiskSync}
    embedded = load_config(None, ["rollout.backend=torch"])
    assert type(make_weight_sync(embedded, trainer, rollout.fleet)) is InProcessSync


def test_tensor_pushes_go_from_the_ranks_on_each_servers_gpus():
    trainer, rollout = Trainer(), Rollout([{"policy": [1]}])
    sync = make_weight_sync(config("tensor"), trainer, rollout.fleet)
    assert sync.push_policy(3) == 10
    sync.push_reference(2, reset=True)
    assert rollout.heal(sync) == 1
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
        ("restart",), ("begin", "policy", [1]), ("end", "policy", [1]),
        ("rejoin", 0, "policy", (1,)),
    ]  # fmt: skip
    metrics = sync.pop_metrics()
    assert metrics["perf/weight_sync_tensor_pushes"] == 3.0
    assert metrics["perf/weight_sync_tensor_gb"] == pytest.approx(30 / 1e9)
    assert sync.pop_metrics() == {}


def test_streamed_pools_get_a_new_group_and_a_full_sync_at_their_version():
    trainer, rollout = Trainer(), Rollout([{"ref": [1]}, {"ref": [3]}])
    sync = make_weight_sync(config("distributed"), trainer, rollout.fleet)
    assert rollout.heal(sync) == 2
    targets = [ServerTarget(f"http://ref-{i}", 1) for i in range(4)]  # both workers' servers
    assert trainer.calls == [("drop", "ref"), ("push", 8, "ref", "ref", targets)]  # once
    assert rollout.calls[-2:] == [("rejoin", 0, "ref", (1,)), ("rejoin", 1, "ref", (3,))]


def test_nothing_dead_means_no_weight_traffic():
    trainer, rollout = Trainer(), Rollout([{}])
    assert rollout.heal(make_weight_sync(config("distributed"), trainer, rollout.fleet)) == 0
    assert trainer.calls == [] and rollout.calls == [("restart",)]


def test_disk_pushes_are_written_by_the_ranks_loaded_by_path_and_pruned(tmp_path):
    trainer, rollout = Trainer(), Rollout([{"policy": [0]}])
    sync = make_weight_sync(config("disk", output_dir=str(tmp_path)), trainer, rollout.fleet)
    pool_dir = tmp_path / "armor" / "sglang_weights" / "policy"
    (pool_dir / "policy-v1").mkdir(parents=True)  # a half-written push of a crashed run
    (pool_dir / "policy-v1" / "partial.safetensors").touch()
    for version in (1, 2):
        sync.push_policy(version)
    assert sorted(p.name for p in pool_dir.iterdir()) == ["policy-v2"]  # the loaded one
    rollout.heal(sync)
    reload = ("disk", "policy", ["policy", "policy-v12"], 12, [0])
    assert rollout.calls[-3:] == [("restart",), reload, ("rejoin", 0, "policy", (0,))]
    assert [c[4].endswith("policy/policy-v2") for c in trainer.calls[1:2]] == [True]


def test_swap_pushes_the_reference_into_the_policy_servers_and_back():
    trainer, rollout = Trainer(), Rollout(has_ref_pool=False)
    sync = make_weight_sync(config("tensor", "swap"), trainer, rollout.fleet)
    sync.push_policy(5)
    sync.push_reference(4, reset=True)  # nothing sent: swapped in when sampling
    with sync.reference_swapped(needs(1)):
        trainer.record("sampling")
    pushed = [(c[1], c[2], c[3]) for c in trainer.calls if c[0] == "push"]
    assert pushed == [(5, "policy", "policy"), (4, "ref", "policy"), (5, "policy", "policy")]
    assert trainer.calls[2] == ("sampling",)
    trainer.calls = []  # every anchor cached: no swap
    with sync.reference_swapped(needs(0)):
        pass
    assert trainer.calls == []


def test_swap_sends_nothing_while_the_policy_servers_hold_the_reference():
    """A reset at the step whose policy the servers hold (``reset: every 1``: every step), or
    both at the start weights: the reference is already in the policy servers."""
    trainer, rollout = Trainer(), Rollout(has_ref_pool=False)
    sync = make_weight_sync(config("tensor", "swap"), trainer, rollout.fleet)
    with sync.reference_swapped(needs(1)):  # version 0 both: the start weights
        trainer.record("sampling")
    sync.push_policy(5)
    sync.push_reference(5, reset=True)
    with sync.reference_swapped(needs(1)):
        trainer.record("sampling")
    assert [c[:2] for c in trainer.calls] == [("sampling",), ("push", 5), ("sampling",)]
    sync.push_policy(6)  # the policy moves on: the reference is swapped in again
    trainer.calls = []
    with sync.reference_swapped(needs(1)):
        pass
    pushed = [(c[1], c[2], c[3]) for c in trainer.calls if c[0] == "push"]
    assert pushed == [(5, "ref", "policy"), (6, "policy", "policy")]


def test_reference_pushes_without_anchors_send_nothing():
    trainer, rollout = Trainer(), Rollout()
    sync = make_weight_sync(config("tensor", "dedicated", "algo.anchor=none"), trainer,
                            rollout.fleet)  # fmt: skip
    sync.push_reference(20, reset=True)
    assert trainer.calls == [] and rollout.calls == [("in_place", 20, True)]


def test_only_the_embedded_engine_takes_the_export_through_the_object_store():
    trainer, rollout = Trainer(), Rollout()
    trainer.object_store = True
    sync = make_weight_sync(load_config(None, ["rollout.backend=torch"]), trainer, rollout.fleet)
    assert sync.push_policy(3) == 99
    sync.push_reference(0)
    sync.push_reference(40, reset=True)
    assert rollout.calls == [("update", 3, ("policy-tensors",)), ("load", 0, ("ref-tensors",)),
                             ("reset", 40, ("ref-tensors",))]  # fmt: skip
    assert [kind for kind, _ in rollout.watch.waits] == [
        CallKind.WEIGHT_PUSH, CallKind.REFERENCE_LOAD, CallKind.RESET]  # fmt: skip


def test_a_reset_to_the_pushed_policy_exports_nothing():
    """The embedded engine serves the policy of the step a reset happens at: the reference
    is taken from it (``reset_reference_from_policy``), nothing exported or sent."""
    trainer, rollout = Trainer(), Rollout()
    trainer.object_store = True
    sync = make_weight_sync(load_config(None, ["rollout.backend=torch"]), trainer, rollout.fleet)
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
    sync = make_weight_sync(load_config(None, ["rollout.backend=torch", *extra]), trainer,
                            rollout.fleet)  # fmt: skip
    sync.queue_policy_push(7)
    queued = list(rollout.calls)
    assert trainer.calls == [("export", "policy", "if_changed")]
    assert queued == ([("update", 7, ("policy-tensors",))] if early else [])
    assert rollout.watch.waits == []  # nothing waited for until the push
    assert sync.push_policy(7) == 99
    assert trainer.calls == [("export", "policy", "if_changed")]  # not exported twice
    assert rollout.calls[len(queued) :] == ([] if early else [("update", 7, ("policy-tensors",))])
    assert rollout.watch.waits == [(CallKind.WEIGHT_PUSH, "weight sync")]
    assert sync.pop_metrics()["perf/weight_sync_inprocess_pushes"] == 1.0
    sync.queue_policy_push(8)
    sync.push_policy(9)  # not what was queued: exported and loaded at 9
    assert trainer.calls[-1] == ("export", "policy") and len(trainer.calls) == 3
    assert rollout.calls[-1] == ("update", 9, ("policy-tensors",))


@pytest.mark.parametrize("early", [True, False])
def test_a_step_without_an_applied_update_pushes_nothing(early):
    """Every update of the step skipped (non-finite): the queued export of the embedded
    engine is ``if_changed`` (empty, the engine loads nothing: ``RolloutWorker.update_weights``)
    and is only waited for; no version is recorded; disaggregated SGLang servers (which kept
    their weights) get nothing."""
    trainer, rollout = Trainer(), Rollout()
    trainer.object_store = True
    extra = [] if early else ["orchestration.layout=colocated"]
    sync = make_weight_sync(load_config(None, ["rollout.backend=torch", *extra]), trainer,
                            rollout.fleet)  # fmt: skip
    sync.push_policy(3)
    sync.queue_policy_push(4)
    before, waits = len(rollout.calls), len(rollout.watch.waits)
    assert sync.skip_policy_push() == 0
    assert rollout.calls[before:] == []  # the queued load (if sent) is only waited for
    assert len(rollout.watch.waits) - waits == (1 if early else 0)
    assert sync.versions["policy"] == 3
    assert sync.pop_metrics()["perf/weight_sync_inprocess_pushes"] == 1.0  # the push at 3 only
    servers_trainer, servers_rollout = Trainer(), Rollout()
    served = make_weight_sync(config("distributed"), servers_trainer, servers_rollout.fleet)
    served.queue_policy_push(4)
    assert served.skip_policy_push() == 0
    assert servers_trainer.calls == [] and servers_rollout.calls == []


def test_worker_roles_follow_the_pools_on_each_node():
    from megatron_armor.orchestration.actors.placement import RolloutHost
    from megatron_armor.orchestration.actors.rollout_fleet import worker_roles

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
    sync = make_weight_sync(config(transport, output_dir=str(tmp_path)), trainer, rollout.fleet)
    sync.push_policy(4)
    assert sync.skip_policy_push() == 10
    assert [c[:4] for c in trainer.calls] == [("push", 4, "policy", "policy")] * 2
    assert rollout.calls[-1] == ("version", 4, "policy")


def test_disaggregated_servers_keep_their_weights_after_a_step_without_an_update():
    trainer, rollout = Trainer(), Rollout()
    sync = make_weight_sync(config("distributed"), trainer, rollout.fleet)
    sync.push_policy(4)
    assert sync.skip_policy_push() == 0
    assert len(trainer.calls) == 1


def test_a_failed_begin_still_closes_the_servers_sessions():
    """A begin that reached only some servers: the end goes to all of them."""

    class BeginFails(Worker):
        def begin_weight_update(self, pool, indices=None):
            self.record("begin", pool, indices)
            raise RuntimeError("server 1 refused /begin_weight_update")

    trainer, rollout = Trainer(), Rollout(worker=BeginFails)
    sync = make_weight_sync(config("tensor"), trainer, rollout.fleet)
    with pytest.raises(RuntimeError, match="refused"):
        sync.push_policy(3)
    assert rollout.calls == [("begin", "policy", None), ("end", "policy", None)]
    assert trainer.calls == []
