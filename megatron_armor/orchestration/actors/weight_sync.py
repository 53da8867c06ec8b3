"""The weight sync as the driver runs it: one class per transport, chosen once at start-up.

:func:`make_weight_sync` reads ``rollout.backend`` and ``rollout.sglang.weight_transport``:

=================  ==========================================================================
class              what moves the weights
=================  ==========================================================================
InProcessSync      embedded engine (CPU runs): the trainer's exported CPU tensors go through
                   Ray's object store into the rollout worker, which loads them in-process.
TensorSync         ``tensor`` (colocated SGLang): the trainer ranks share CUDA-IPC handles
                   with the servers on their GPUs (``trainer/weight_sync.py``).
DistributedSync    ``distributed``: each PP stage's export rank broadcasts over NCCL.
DiskSync           ``disk``: the trainer ranks write safetensors shards; the rollout workers
                   tell their servers the directory.
=================  ==========================================================================

With SGLang no weight tensor reaches the driver or the object store: the driver sends
versions, URLs and paths. The reference goes the same way as the policy: into the reference
pool (``dedicated``), or swapped into the policy servers around each reference sampling
(``swap``, :meth:`WeightSync.reference_swapped`). Every push is timed and counted for
``perf/weight_sync_<transport>_{gb,s,pushes}`` (:meth:`WeightSync.pop_metrics`). The weight
sync talks to the trainer ranks through their handle and to the rollout workers through the
fleet (``rollout_fleet.RolloutFleet``): every call of a push is made here, in order.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator

from megatron_armor.algo.registry import get_anchor_mode
from megatron_armor.config.rollout_traits import reference_strategy
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.orchestration.actors.call_kinds import CallKind
from megatron_armor.orchestration.actors.pending import Pending
from megatron_armor.orchestration.actors.rollout_fleet import RolloutFleet, Servers
from megatron_armor.rollout.backends import backend_of


def weights_of(pool: str) -> str:
    """The weights a pool serves between pushes (``policy`` servers hold the policy)."""
    return "policy" if pool == "policy" else "ref"


def first(answers: list):
    """The answer of the first worker (every worker loaded the same)."""
    return answers[0]


class WeightSync:
    """Trainer -> rollout weight pushes of one run; subclasses implement :meth:`_send`."""

    transport = "inprocess"

    def __init__(self, config: ArmorConfig, trainer, fleet: RolloutFleet) -> None:
        self.config, self.trainer, self.fleet = config, trainer, fleet
        self.anchors = get_anchor_mode(config.algo.anchor).draws_reference
        self.versions = {"policy": 0, "ref": 0}
        self._gb = self._seconds = 0.0
        self._pushes = 0

    # ------------------------------------------------------------------ verbs of the loop
    def push_policy(self, version: int) -> int:
        """The policy at ``version`` into the policy servers; returns the bytes moved."""
        self.versions["policy"] = version
        return self.push(version, "policy", "policy")

    def push_reference(self, version: int, reset: bool = False) -> None:
        """Serve the trainer's reference at ``version`` (start-up, resume, or a ``reset``,
        which also drops the anchor cache). Without anchors only the version is recorded."""
        self.versions["ref"] = version
        if self.anchors and self.fleet.has_ref_pool:
            self.push(version, "ref", "ref")
        self.reference_in_place(version, reset)

    def reference_in_place(self, version: int, reset: bool) -> None:
        """Record reference ``version`` on the reference workers without sending weights (on a
        ``reset`` their anchor cache is dropped)."""
        self.fleet.send(
            self.fleet.reference_actors,
            lambda a: a.reference_in_place.remote(version, reset),
            CallKind.REFERENCE_VERSION,
            "rollout reference version",
        ).result()

    @contextlib.contextmanager
    def reference_swapped(self, needs_fresh: Callable[[], bool]) -> Iterator[None]:
        """``swap`` with SGLang: the reference in the policy servers for the block, the policy
        back after it; skipped when no item needs fresh samples (``needs_fresh()``: every
        item's anchors are cached), and while the servers' policy is the reference (the same
        version: a reset since the last policy push, as under ``reset: every 1`` at every
        step, or both the start weights)."""
        if self.versions["ref"] == self.versions["policy"]:
            yield
            return
        if not self.swaps_into_policy_servers() or not needs_fresh():
            yield
            return
        self.push(self.versions["ref"], "ref", "policy")
        try:
            yield
        finally:
            self.push(self.versions["policy"], "policy", "policy")

    def swaps_into_policy_servers(self) -> bool:
        """Whether :meth:`reference_swapped` loads the reference into the policy servers (the
        driver must then wait for a reference call before the policy goes back)."""
        if not self.anchors or self.fleet.has_ref_pool:
            return False
        served = reference_strategy(
            self.config.rollout.ref_strategy, self.config.algo.anchor_source
        )
        return served.swaps_into_policy

    def resync(self, pool: str, version: int, servers: Servers) -> None:
        """Restarted ``servers`` of ``pool`` get the weights the pool serves, at ``version``
        (``rollout_fleet.ServerHealth.heal``)."""
        self.push(version, weights_of(pool), pool, servers)

    # ------------------------------------------------------------------ one push
    def push(self, version: int, weights: str, pool: str, servers: Servers | None = None) -> int:
        """``weights`` (``policy`` | ``ref``) at ``version`` into ``pool``'s servers (all, or
        ``servers``); returns the bytes moved (the model's size, once)."""
        start = time.perf_counter()
        num_bytes = self._send(version, weights, pool, servers)
        if servers is None:
            self.set_version(version, pool)
        self._seconds += time.perf_counter() - start
        self._gb += num_bytes / 1e9
        self._pushes += 1
        return num_bytes

    def set_version(self, version: int, pool: str) -> None:
        """Record ``version`` on the workers of ``pool`` after the trainer pushed the weights."""
        self.fleet.send(self.fleet.pool_actors(pool),
                        lambda a: a.set_weight_version.remote(version, pool),
                        CallKind.WEIGHT_VERSIONS, "rollout weight version").result()  # fmt: skip

    def _send(self, version: int, weights: str, pool: str, servers: Servers | None) -> int:
        raise NotImplementedError

    def queue_policy_push(self, version: int, load_early: bool = True) -> None:
        """Called once a step's updates are queued on the trainer ranks, before the driver
        waits for them, with the version :meth:`push_policy` will push; a transport that can
        start the push then does (:class:`InProcessSync`), the others push in
        :meth:`push_policy`. ``load_early`` off: the engines must not load it before
        :meth:`push_policy` (they draw the next step meanwhile,
        ``orchestration/step/async_rollout.py``)."""

    def skip_policy_push(self) -> int:
        """Instead of :meth:`push_policy` after a step whose every update was skipped
        (non-finite loss or gradient norm): nothing is sent, the servers keep the weights and
        the version they have; returns the bytes moved (0)."""
        return 0

    def pop_metrics(self) -> dict[str, float]:
        """``perf/weight_sync_<transport>_{gb,s,pushes}`` of every push since the last call."""
        if not self._pushes:
            return {}
        key = f"perf/weight_sync_{self.transport}"
        out = {
            f"{key}_gb": self._gb,
            f"{key}_s": self._seconds,
            f"{key}_pushes": float(self._pushes),
        }
        self._gb = self._seconds = 0.0
        self._pushes = 0
        return out

    def close(self) -> None:
        """Nothing to release on the driver (the trainer ranks close their transports)."""


class InProcessSync(WeightSync):
    """The embedded engine (CPU runs): exported CPU tensors through the object store."""

    transport = "inprocess"

    def __init__(self, config: ArmorConfig, trainer, fleet: RolloutFleet) -> None:
        super().__init__(config, trainer, fleet)
        self._queued: tuple[int, Pending, Pending | None] | None = None

    def queue_policy_push(self, version: int, load_early: bool = True) -> None:
        """Queue the policy's export on the trainer ranks behind the updates just queued, and
        its load into the engines behind it: an actor runs its calls in order, so the export
        starts as the last update ends and the load as the export ends, while the driver is
        still reading the step's results; :meth:`push_policy` waits for them. The load waits
        for :meth:`push_policy` where the engines must take their memory back first
        (``colocated``, ``trainer.offload_train_state``) or draw the next step meanwhile
        (``load_early`` off). The export is ``if_changed``: after a step whose every update
        was skipped it is empty and the engines load nothing (:meth:`skip_policy_push`)."""
        export = self.trainer.export("policy", if_changed=True)
        early = (
            load_early
            and self.config.orchestration.layout != "colocated"
            and not (self.config.trainer.offload_train_state)
        )
        loads = self.load_policy(version, export) if early else None
        self._queued = (version, export, loads)

    def load_policy(self, version: int, export: Pending) -> Pending[int]:
        """Every policy worker loads the trainer's ``export`` at ``version``, sent now; the
        result is the bytes each loaded."""
        return self.fleet.send(self.fleet.policy_actors,
                               lambda a: a.update_weights.remote(version, *export.refs),
                               CallKind.WEIGHT_PUSH, "weight sync", read=first)  # fmt: skip

    def push_policy(self, version: int) -> int:
        self.versions["policy"] = version
        start = time.perf_counter()
        queued, self._queued = self._queued, None
        if queued is None or queued[0] != version:
            queued = (version, self.trainer.export("policy"), None)
        _, export, loads = queued
        if loads is None:
            loads = self.load_policy(version, export)
        num_bytes = loads.result()
        self._record(start, num_bytes)
        return num_bytes

    def skip_policy_push(self) -> int:
        """Wait for the push queued by :meth:`queue_policy_push`, whose export was empty (the
        step changed no weight): the engines loaded nothing and keep their version."""
        queued, self._queued = self._queued, None
        if queued is not None and queued[2] is not None:
            queued[2].result()
        return 0

    def push_reference(self, version: int, reset: bool = False) -> None:
        """The trainer's reference into the engines; a reset to the policy they were pushed at
        this version takes the engines' own policy weights instead (nothing exported)."""
        self.versions["ref"] = version
        if not self.anchors:
            self.reference_in_place(version, reset)
            return
        start = time.perf_counter()
        actors = self.fleet.reference_actors
        if reset and version == self.versions["policy"]:
            self.fleet.send(actors, lambda a: a.reset_reference_from_policy.remote(version),
                            CallKind.RESET, "rollout reference reset").result()  # fmt: skip
            self._record(start, 0)
            return
        export = self.trainer.export("ref")
        if reset:
            self.fleet.send(actors, lambda a: a.reset_reference.remote(version, *export.refs),
                            CallKind.RESET, "rollout reference reset").result()  # fmt: skip
        else:
            self.fleet.send(actors, lambda a: a.load_reference.remote(version, *export.refs),
                            CallKind.REFERENCE_LOAD, "rollout reference load").result()  # fmt: skip
        self._record(start, 0)

    def _record(self, start: float, num_bytes: int) -> None:
        self._seconds += time.perf_counter() - start
        self._gb += num_bytes / 1e9
        self._pushes += 1

    def reference_swapped(self, needs_fresh: Callable[[], bool]):
        return contextlib.nullcontext()  # the worker swaps its own copies in-process

    def swaps_into_policy_servers(self) -> bool:
        return False


class ServerSync(WeightSync):
    """A transport the trainer ranks run into SGLang servers (``TrainerWorker.push_weights``)."""

    def __init__(self, config: ArmorConfig, trainer, fleet: RolloutFleet) -> None:
        super().__init__(config, trainer, fleet)
        self._targets: dict[str, list[tuple[int, str, int, int, str]]] = {}

    def skip_policy_push(self) -> int:
        """A step without an applied update. Colocated policy servers released their weights
        for the update (kept without a host copy) and took back memory without contents: they
        get the current policy pushed again, at the version they had (docs/weight-sync.md,
        "A step without an update"). Elsewhere they kept their weights: nothing is sent."""
        if self.config.orchestration.layout != "colocated":
            return 0
        return self.push(self.versions["policy"], "policy", "policy")

    def targets(
        self, pool: str, servers: Servers | None = None
    ) -> list[tuple[int, str, int, int, str]]:
        """``[(worker, url, tp, server index, API key)]`` of ``pool`` (fixed for the run: a
        restarted server keeps its URL), or of ``servers`` only; ``worker`` is the position
        in the fleet."""
        if pool not in self._targets:
            actors = self.fleet.pool_actors(pool)
            parts = self.fleet.send(
                actors,
                lambda a: a.weight_targets.remote(pool),
                CallKind.WEIGHT_VERSIONS,
                "rollout weight targets",
            ).result()
            workers = [self.fleet.position(a) for a in actors]
            self._targets[pool] = [(w, *t) for w, part in zip(workers, parts, strict=True)
                                   for t in part]  # fmt: skip
        chosen = self._targets[pool]
        if servers is not None:
            chosen = [t for t in chosen if t[3] in servers.get(t[0], [])]
        return chosen


class SessionSync(ServerSync):
    """A transport whose requests SGLang takes only inside a weight-update session
    (``/begin_weight_update`` ... ``/end_weight_update``, SGLang >= 0.5.23): the rollout
    workers open it on the servers the push goes to, the trainer ranks stream, the workers
    close it (and flush the servers' caches) even when the push failed, so a retry or a heal
    finds no session left open."""

    def _send(self, version: int, weights: str, pool: str, servers: Servers | None) -> int:
        try:  # a begin that reached only some servers leaves none of them in a session
            self.fleet.on_servers(pool, servers,
                                  lambda a, indices: a.begin_weight_update.remote(pool, indices),
                                  CallKind.WEIGHT_PUSH,
                                  f"{pool} servers opening the weight update").result()  # fmt: skip
            return self._stream(version, weights, pool, servers)
        finally:
            self.fleet.on_servers(pool, servers,
                                  lambda a, indices: a.end_weight_update.remote(pool, indices),
                                  CallKind.WEIGHT_PUSH,
                                  f"{pool} servers closing the weight update").result()  # fmt: skip

    def _stream(self, version: int, weights: str, pool: str, servers: Servers | None) -> int:
        raise NotImplementedError


class TensorSync(SessionSync):
    """``tensor``: CUDA-IPC handles from the colocated trainer ranks (``TensorRankSync``)."""

    transport = "tensor"

    def _stream(self, version: int, weights: str, pool: str, servers: Servers | None) -> int:
        from megatron_armor.config.sglang_pools import pool_specs
        from megatron_armor.trainer.weight_sync import ServerTarget

        spec = pool_specs(self.config)[pool]
        offsets = spec.gpu_offsets()  # colocated: rollout GPU g is trainer rank g's GPU
        target = [ServerTarget(url, tp, offsets[index], key)
                  for _, url, tp, index, key in self.targets(pool, servers)]  # fmt: skip
        return self.trainer.push_weights(version, weights, pool, target)


class DistributedSync(SessionSync):
    """``distributed``: NCCL broadcasts from each PP stage's export rank into the pool."""

    transport = "distributed"

    def _stream(self, version: int, weights: str, pool: str, servers: Servers | None) -> int:
        from megatron_armor.trainer.weight_sync import ServerTarget

        target = [ServerTarget(url, tp, api_key=key) for _, url, tp, _, key in self.targets(pool)]
        return self.trainer.push_weights(version, weights, pool, target)

    def resync(self, pool: str, version: int, servers: Servers) -> None:
        """The pool's group lost a member: a new group with every server, and a full push."""
        self.trainer.drop_sender(pool)
        self.push(version, weights_of(pool), pool)


class DiskSync(ServerSync):
    """``disk``: the trainer ranks write ``sglang_weights/<pool>/<weights>-v<version>`` under
    the run dir (a filesystem every node reads); the servers load it; older pushes are
    deleted once the servers loaded the new one."""

    transport = "disk"

    def __init__(self, config: ArmorConfig, trainer, fleet: RolloutFleet) -> None:
        super().__init__(config, trainer, fleet)
        self.root = os.path.join(config.run.output_dir, config.run.name, "sglang_weights")

    def _send(self, version: int, weights: str, pool: str, servers: Servers | None) -> int:
        path = os.path.join(self.root, pool, f"{weights}-v{version}")
        shutil.rmtree(path, ignore_errors=True)  # a half-written push of a crashed run
        num_bytes = self.trainer.push_weights(version, weights, pool, path)

        def load(actor, indices):
            return actor.load_from_disk.remote(pool, path, version, indices)

        self.fleet.on_servers(pool, servers, load, CallKind.WEIGHT_PUSH,
                              f"{pool} servers loading {path}").result()  # fmt: skip
        if servers is None:
            prune_pushes(os.path.dirname(path), keep=path)
        return num_bytes


def prune_pushes(pool_dir: str, keep: str) -> None:
    """Delete every pushed directory of ``pool_dir`` but ``keep`` (the servers loaded it)."""
    for entry in os.scandir(pool_dir):
        if entry.is_dir() and entry.path != keep:
            shutil.rmtree(entry.path, ignore_errors=True)


TRANSPORTS = {"tensor": TensorSync, "distributed": DistributedSync, "disk": DiskSync}


def make_weight_sync(config: ArmorConfig, trainer, fleet: RolloutFleet) -> WeightSync:
    """The :class:`WeightSync` of ``rollout.backend`` / ``rollout.sglang.weight_transport``."""
    if not backend_of(config).serves_over_http:
        return InProcessSync(config, trainer, fleet)
    kind = config.rollout.sglang.weight_transport
    if kind not in TRANSPORTS:
        raise ValueError(
            f"rollout.sglang.weight_transport={kind!r} is not one of {sorted(TRANSPORTS)}"
        )
    return TRANSPORTS[kind](config, trainer, fleet)
