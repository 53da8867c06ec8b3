"""The driver's side of the rollout workers: who they are and how every call reaches them.

:class:`RolloutFleet` starts the workers (``rollout_worker.RolloutWorker``), knows their roles
(the workers that generate policy samples and those that sample the reference) and sends every
call to them as a :class:`~megatron_armor.orchestration.actors.pending.Pending` bounded by the
run's call watch. What the driver does with the workers is split by concern, each class built
once from the fleet: generation and the reference samples (``rollout_draws.py``), the weights
(``weight_sync.py``), the engines' memory (:class:`RolloutMemory`) and the SGLang servers'
health (:class:`ServerHealth`); :class:`RolloutSide` holds them for the session.

With the embedded engine every worker serves both the policy and the reference. With SGLang
there is one worker per node with servers (``placement.rollout_hosts``); a worker serves the
pools that have servers on its node, so policy generation is split over the workers with
policy servers and reference sampling over those with reference servers (the policy workers
themselves for ``swap``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.config.sglang_pools import uses_ref_pool
from megatron_armor.orchestration.actors.call_kinds import CallKind
from megatron_armor.orchestration.actors.call_watch import CallWatch, start_actor
from megatron_armor.orchestration.actors.pending import Pending, values
from megatron_armor.orchestration.actors.placement import (
    LayoutPlan,
    RolloutHost,
    actor_options,
    server_owner_options,
)
from megatron_armor.orchestration.actors.rollout_worker import RolloutWorker
from megatron_armor.rollout.backends import backend_of

if TYPE_CHECKING:
    from megatron_armor.orchestration.actors.rollout_draws import PolicyDraws, ReferenceDraws

Servers = dict[int, list[int]]
"""``{rollout worker: [server index]}``: a subset of a pool's servers (a heal)."""


def worker_roles(hosts: list[RolloutHost], has_ref_pool: bool) -> tuple[list[int], list[int]]:
    """Indices of the SGLang rollout workers that generate policy samples and of those that
    sample the reference: the workers with reference servers, or with policy servers when the
    reference is swapped into them."""
    policy = [i for i, h in enumerate(hosts) if h.servers.get("policy")]
    pool = "ref" if has_ref_pool else "policy"
    reference = [i for i, h in enumerate(hosts) if h.servers.get(pool)]
    if not policy or not reference:
        missing = "policy" if not policy else pool
        raise ValueError(
            f"the SGLang rollout workers on {[h.ip for h in hosts]} hold no {missing} servers; "
            "check rollout.sglang.num_engines and ref_pool.num_engines"
        )
    return policy, reference


ROLLOUT_PROFILERS = ("torch", "nsys")
"""``logging.profile`` values the rollout workers take part in (docs/profiling.md)."""


class RolloutFleet:
    """All rollout workers of a run: started (:meth:`start`), sorted by role, called,
    replaced, closed."""

    def __init__(self, watch: CallWatch, actors: list, policy: list[int], reference: list[int],
                 has_ref_pool: bool, specs: list[tuple[dict, tuple]] | None = None,
                 startup_timeout: float = 0.0, profiling: bool = False):  # fmt: skip
        """The workers ``actors``, those of ``policy`` and ``reference`` (indices) in each
        role; ``specs``: the ``(options, args)`` a replacement of each is made with (the
        embedded engine's workers only); ``profiling``: the workers take part in
        ``logging.profile`` (:data:`ROLLOUT_PROFILERS`)."""
        self.watch, self.actors, self.has_ref_pool = watch, list(actors), has_ref_pool
        self.policy_actors = [self.actors[i] for i in policy]
        self.reference_actors = [self.actors[i] for i in reference]
        self.specs, self.startup_timeout = specs or [], startup_timeout
        self.profiling = profiling

    @classmethod
    def start(cls, config: ArmorConfig, plan: LayoutPlan, watch: CallWatch, pg=None,
              order=None, hosts: list[RolloutHost] | None = None) -> RolloutFleet:  # fmt: skip
        """Start the workers and wait until every engine serves (a failure stops the ones that
        started): with SGLang one per node with servers (``hosts``), else
        ``plan.rollout_engines``."""
        actors, specs = [], []
        if hosts:
            for i, host in enumerate(hosts):
                opts = server_owner_options(actor_options(plan, pg, order or [], host.bundle, 0.0))
                args = (config, i, plan.threads, host.servers)
                actors.append(start_actor(watch, RolloutWorker, opts, *args))
            policy, reference = worker_roles(hosts, uses_ref_pool(config))
        else:
            for i in range(plan.rollout_engines):
                bundle = plan.rollout_bundles[i] if plan.rollout_bundles else None
                opts = actor_options(plan, pg, order or [], bundle, plan.rollout_gpus)
                specs.append((opts, (config, i, plan.threads)))  # a replacement's recipe
                actors.append(start_actor(watch, RolloutWorker, opts, *specs[-1][1]))
            policy = reference = list(range(len(actors)))
        startup = config.orchestration.ray_init_timeout_s
        if backend_of(config).serves_over_http:  # the worker waits for every server's health
            startup = max(startup, 2 * config.rollout.sglang.startup_timeout_s)
        profiling = config.logging.profile in ROLLOUT_PROFILERS
        fleet = cls(watch, actors, policy, reference, uses_ref_pool(config), specs, startup,
                    profiling)  # fmt: skip
        try:
            fleet.send(actors, lambda a: a.health.remote(), CallKind.STARTUP,
                       "rollout engine start-up", timeout=startup).result()  # fmt: skip
        except BaseException:
            fleet._close_started()  # the workers that did start stop their servers
            raise
        return fleet

    def _close_started(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.get(actor.close.remote(), timeout=300)
            except Exception:  # noqa: BLE001 - a worker that failed to start has nothing to stop
                pass
            ray.kill(actor)

    # ------------------------------------------------------------------ calls
    def send(self, actors: list, call: Callable, kind: CallKind, what: str,
             read: Callable = values, work: float = 1.0,
             timeout: float | None = None) -> Pending:  # fmt: skip
        """``call(actor)`` (a ``.remote`` call) on each of ``actors``, sent now; the answers
        are read (``read``, in ``actors`` order) when the caller waits for them."""
        refs = [call(actor) for actor in actors]
        return Pending(self.watch, refs, kind, what, read, work, timeout)

    def pending(self, refs: list, kind: CallKind, what: str, read: Callable = values,
                work: float = 1.0, timeout: float | None = None) -> Pending:  # fmt: skip
        """Calls already sent (``refs``), to be waited for within the deadline of ``kind``."""
        return Pending(self.watch, refs, kind, what, read, work, timeout)

    def on_servers(self, pool: str, servers: Servers | None, call: Callable, kind: CallKind,
                   what: str) -> Pending:  # fmt: skip
        """``call(actor, indices)`` on the workers of ``pool``'s servers: every worker of the
        pool with ``indices=None`` (all its servers), or the workers of ``servers`` with
        theirs."""
        if servers is None:
            refs = [call(actor, None) for actor in self.pool_actors(pool)]
        else:
            refs = [call(self.actors[w], indices) for w, indices in servers.items()]
        return Pending(self.watch, refs, kind, what)

    def pool_actors(self, pool: str) -> list:
        """The workers serving ``pool`` (``policy`` | ``ref``)."""
        return self.policy_actors if pool == "policy" else self.reference_actors

    def position(self, actor) -> int:
        """``actor``'s index in :attr:`actors` (the worker index of ``Servers``)."""
        return self.actors.index(actor)

    def replace(self, index: int, new) -> None:
        """Worker ``index`` is ``new`` from now on, in every role the old one had."""
        old = self.actors[index]
        for group in (self.actors, self.policy_actors, self.reference_actors):
            group[:] = [new if a is old else a for a in group]

    def compute_intervals(self) -> list[tuple[float, float]]:
        """Every worker's generation intervals since the last call (``ComputeClock``)."""
        per_worker = self.send(
            self.actors,
            lambda a: a.compute_intervals.remote(),
            CallKind.COMPUTE_INTERVALS,
            "compute intervals",
        ).result()
        return [interval for intervals in per_worker for interval in intervals]

    def profile_begin(self, step: int) -> None:
        """Start the workers' capture of ``step`` where it is a chosen one
        (``RolloutWorker.profile_begin``; no call when nothing is profiled)."""
        if self.profiling:
            self.send(self.actors, lambda a: a.profile_begin.remote(step), CallKind.PROFILER,
                      "rollout profiler begin").result()  # fmt: skip

    def profile_end(self, step: int) -> None:
        if self.profiling:
            self.send(self.actors, lambda a: a.profile_end.remote(step), CallKind.PROFILER,
                      "rollout profiler end").result()  # fmt: skip

    def peak_gpu_memory(self) -> list[tuple[float, float] | None]:
        """Every worker's peak GPU memory (allocated, reserved) since the last call."""
        return self.send(self.actors, lambda a: a.peak_gpu_memory_gb.remote(),
                         CallKind.GPU_MEMORY, "GPU memory").result()  # fmt: skip

    def close(self, timeout: float = 300.0) -> None:
        """Stop what the workers launched (SGLang servers and routers)."""
        self.send(self.actors, lambda a: a.close.remote(), CallKind.CLOSE, "rollout close",
                  timeout=min(timeout, 300.0)).result()  # fmt: skip


class RolloutMemory:
    """The engines' accelerator memory on every worker: released while the trainer works
    (``colocated``), taken back in parts around the weight push (docs/weight-sync.md)."""

    def __init__(self, fleet: RolloutFleet) -> None:
        self.fleet = fleet

    def release(self) -> None:
        self.fleet.send(self.fleet.actors, lambda a: a.release_memory.remote(),
                        CallKind.RELEASE_MEMORY, "rollout release_memory").result()  # fmt: skip

    def resume(self, tags: list[str] | None = None) -> None:
        """Take back the memory of ``tags`` (``weights``, ``kv_cache``; ``None``: all)."""
        self.fleet.send(self.fleet.actors, lambda a: a.resume_memory.remote(tags),
                        CallKind.RESUME_MEMORY, "rollout resume_memory").result()  # fmt: skip


class ServerHealth:
    """Dead SGLang servers brought back: restarted by their workers (out of rotation), given
    their pool's current weights (``resync``: the weight sync's), then put back."""

    def __init__(self, fleet: RolloutFleet, resync: Callable[[str, int, Servers], None]):
        self.fleet, self.resync = fleet, resync

    def heal(self) -> int:
        """Restart the dead servers and re-sync them before they serve again; returns how
        many were restarted."""
        fleet = self.fleet
        restarted = fleet.send(fleet.actors, lambda a: a.restart_dead_servers.remote(),
                               CallKind.SERVER_HEALTH, "rollout health check",
                               timeout=2 * fleet.watch.cap()).result()  # fmt: skip
        count = 0
        for pool in sorted({pool for per_worker in restarted for pool in per_worker}):
            servers = {w: per[pool] for w, per in enumerate(restarted) if per.get(pool)}
            asked = [fleet.pool_actors(pool)[0].pool_version.remote(pool)]
            (version,) = fleet.pending(asked, CallKind.WEIGHT_VERSIONS,
                                      "rollout pool version").result()  # fmt: skip
            self.resync(pool, version, servers)
            for worker, indices in servers.items():
                rejoined = [fleet.actors[worker].rejoin.remote(pool, indices)]
                fleet.pending(rejoined, CallKind.REJOIN, "rollout rejoin").result()
                print(f"rollout: restarted SGLang {pool} server(s) {indices} of worker {worker} "
                      f"and re-synced their weights (version {version})", flush=True)  # fmt: skip
                count += len(indices)
        return count


@dataclass(frozen=True)
class RolloutSide:
    """The driver's rollout side, by concern, as the session holds it."""

    fleet: RolloutFleet
    policy: PolicyDraws
    reference: ReferenceDraws
    memory: RolloutMemory
    health: ServerHealth
