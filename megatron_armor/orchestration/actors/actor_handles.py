"""Driver-side handles on the Ray actors: each method is one verb of the RL loop.

:class:`TrainerActors` fans a call out to every trainer rank and combines the answers
(per-token tensors are summed over reporting ranks, see ``trainer/interface.py``);
:class:`RolloutActors` shards prompts over the engines; :class:`RewardActors` shards samples
over the scoring workers. Every wait is bounded by a deadline learned from the run's own
calls (``call_watch.py``; start-up by ``orchestration.ray_init_timeout_s``), so a dead or
stuck actor is named and handled instead of hanging the run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import torch

from megatron_armor.algo.registry import get_anchor_mode
from megatron_armor.config.rollout_traits import reference_strategy
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.config.sglang_pools import uses_ref_pool
from megatron_armor.orchestration.actors.call_watch import WATCH, kill_on_node, start_actor
from megatron_armor.orchestration.actors.placement import (
    LayoutPlan,
    RolloutHost,
    actor_options,
    server_owner_options,
    trainer_runtime_env,
)
from megatron_armor.orchestration.actors.workers import (
    RewardWorker,
    RolloutWorker,
    TrainerWorker,
    shard,
)
from megatron_armor.reward.scorer import answers_of
from megatron_armor.rollout.backends import backend_of
from megatron_armor.rollout.protocol import GenerationOutput, RolloutEngine, SamplingParams
from megatron_armor.types import Sample, TrainBatch


def call_timeout() -> float:
    """The longest any call waits (``ARMOR_CALL_TIMEOUT_S``, else ``call_deadline_cap_s``)."""
    return WATCH.cap()


def wait(refs, what: str, timeout: float | None = None, work: float = 1.0):
    """``ray.get`` within the deadline of ``what``'s call kind for ``work`` units (``timeout``:
    a fixed bound instead); a stuck actor is named and killed and the error names it
    (:class:`~megatron_armor.orchestration.actors.call_watch.StuckCallError`)."""
    return WATCH.get(refs, what, timeout, work)


def query_worker(query_id: str, workers: int) -> int:
    """The worker (of ``workers``) that serves ``query_id``'s anchor-cache entry: a hash of
    the id that is the same in every process and run (unlike Python's salted ``hash``)."""
    digest = hashlib.blake2b(query_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % workers


def worker_params(params: SamplingParams, worker: int) -> SamplingParams:
    """``params`` for rollout worker ``worker`` of a fanned-out call: seed ``params.seed +
    worker`` (unseeded stays unseeded)."""
    seed = None if params.seed is None else params.seed + worker
    return dataclasses.replace(params, seed=seed)


def _scatter(actors: list, parts: list[list[int]], items: list, call, what: str) -> list:
    """``call(i, actor, [items of part i])`` on every worker with a non-empty part (the ref of
    one row per item), waited on; the rows back in ``items`` order."""
    refs, served = [], []
    for i, (actor, part) in enumerate(zip(actors, parts, strict=True)):
        if part:
            refs.append(call(i, actor, [items[j] for j in part]))
            served.append(part)
    out: list = [None] * len(items)
    for part, rows in zip(served, wait(refs, what, work=len(items)), strict=True):
        for j, row in zip(part, rows, strict=True):
            out[j] = row
    return out


def assign_scores(samples: list[Sample], scores: list, stats: list[dict]) -> dict[str, float]:
    """Write ``scores`` (``[(score, acc)]``, one per sample) into ``samples`` in order; returns
    the scoring workers' ``stats`` merged."""
    for sample, (score, acc) in zip(samples, scores, strict=True):
        sample.score, sample.acc = score, acc
    merged: dict[str, float] = {}
    for part in stats:
        merged = merge_reward_stats(merged, part)
    return merged


class ScoredRows:
    """One generation call of :meth:`RolloutActors.submit_scored` with its scoring chained to
    it: each rollout worker returns its rows and, as objects of their own, the answers of their
    samples not already ``scored`` in one part per scoring worker; scoring worker ``k`` takes
    part ``k`` of every rollout worker as object refs, so scoring starts as generation ends,
    with no round trip through the driver and each answer sent once.
    :meth:`rows` waits for the samples, :meth:`score` for their rewards (set in place)."""

    def __init__(self, row_refs: list, served: list[list[int]], size: int, score_refs: list,
                 what: str):  # fmt: skip
        self.row_refs, self.served, self.size = row_refs, served, size
        self.score_refs, self.what = score_refs, what
        self._rows: list | None = None
        self._parts: list | None = None

    def rows(self) -> list[list[Sample]]:
        """``[item][sample]`` in the items' order."""
        if self._rows is None:
            out: list = [None] * self.size
            parts = wait(self.row_refs, self.what, work=self.size)
            for part, rows in zip(self.served, parts, strict=True):
                for j, row in zip(part, rows, strict=True):
                    out[j] = row
            self._rows, self._parts = out, parts
        return self._rows

    def score(self) -> dict[str, float]:
        """Set ``score`` and ``acc`` of the samples that were not ``scored`` (per rollout worker,
        its items' and samples' order, the scoring workers' parts one after another); the
        ``reward/*`` stats."""
        self.rows()
        # [(scores per rollout worker, stats)]
        results = wait(self.score_refs, "reward scoring", work=self.size)
        samples, scores = [], []
        for w, rows in enumerate(self._parts):
            samples += [s for row in rows for s in row if not s.scored]
            scores += [sa for per_worker, _ in results for sa in per_worker[w]]
        return assign_scores(samples, scores, [stats for _, stats in results])


def merge_reward_stats(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Combine two scorers' stats: counters add up, means/fractions are weighted by ``reward/n``."""
    na, nb = a.get("reward/n", 0.0), b.get("reward/n", 0.0)
    out = {}
    for key in set(a) | set(b):
        va, vb = float(a.get(key, 0.0)), float(b.get(key, 0.0))
        if key.endswith(("_mean", "_frac", "/acc")):
            out[key] = (va * na + vb * nb) / (na + nb) if na + nb else 0.0
        else:
            out[key] = va + vb
    return out


def close_actors(handles: list, budget_s: float = 30.0) -> None:
    """Close each handle's actors (trainer, rollout: its SGLang servers, reward) within
    ``budget_s`` in all, then kill them with every process they started (a stuck actor, the
    checkpoint writer's helpers: nothing of the run outlives it); best effort, so a failing
    close never hides the error that ended the run."""
    import ray

    end = time.monotonic() + budget_s
    for handle in handles:
        left = end - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError(f"no time left of orchestration.shutdown_timeout_s={budget_s:g}")
            handle.close(left)
        except Exception as err:  # noqa: BLE001 - report and keep shutting down
            print(f"warning: closing {type(handle).__name__} failed: {err}", flush=True)
    kill_run_processes([a for handle in handles for a in handle.actors])
    for handle in handles:
        for actor in handle.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - gone with its node already
                pass
            WATCH.forget(actor)


def kill_run_processes(actors: list) -> None:
    """SIGKILL the processes of ``actors`` (those whose pid is known) and their descendants,
    per node (``call_watch.kill_on_node``)."""
    per_node: dict[str, list[int]] = {}
    for actor in actors:
        entry = WATCH.actors.get(actor._actor_id.hex())
        if entry is not None and entry.pid:
            per_node.setdefault(entry.node_id, []).append(entry.pid)
    for node_id, pids in per_node.items():
        kill_on_node(node_id, pids)


def max_peak(peaks: list[tuple[float, ...] | None]) -> tuple[float, ...] | None:
    """The largest of the actors' peaks, entry by entry (allocated, reserved; ``None`` when
    none of them has a GPU)."""
    known = [p for p in peaks if p is not None]
    return tuple(max(entry) for entry in zip(*known, strict=True)) if known else None


class TrainerActors:
    """All trainer ranks (``trainer.world_size``)."""

    def __init__(
        self, config: ArmorConfig, plan: LayoutPlan, pg=None, order=None, profile_dir: str = ""
    ):
        self.actors = []
        for rank in range(plan.trainer_ranks):
            bundle = plan.trainer_bundles[rank] if plan.trainer_bundles else None
            opts = actor_options(plan, pg, order or [], bundle, plan.trainer_gpus)
            opts.update(trainer_runtime_env(config, rank))
            args = (config, rank, plan.trainer_ranks, plan.threads, profile_dir)
            self.actors.append(start_actor(TrainerWorker, opts, *args))
        self.init_timeout = config.orchestration.ray_init_timeout_s
        self.profiling = config.logging.profile != "none"
        self.info: dict = {}

    def init(self) -> None:
        """Build the model on every rank; rank 0's node and a free port host the rendezvous."""
        first = self.actors[0].node_info.remote()
        self.info = wait(first, "trainer rank 0 start-up", self.init_timeout)
        addr = "127.0.0.1" if len(self.actors) == 1 else self.info["ip"]
        refs = [a.init.remote(addr, self.info["free_port"]) for a in self.actors]
        wait(refs, "trainer model initialization", max(self.init_timeout, 600.0))

    def profile_begin(self, step: int) -> None:
        """Start the step profiler on the ranks in ``logging.profile_ranks`` (no-op when off)."""
        if self.profiling:
            wait([a.profile_begin.remote(step) for a in self.actors], "profiler begin")

    def profile_end(self, step: int) -> None:
        if self.profiling:
            wait([a.profile_end.remote(step) for a in self.actors], "profiler end")

    def compute_intervals(self) -> list[tuple[float, float]]:
        """Every rank's model-compute intervals since the last call (:class:`ComputeClock`)."""
        per_rank = wait([a.compute_intervals.remote() for a in self.actors], "compute intervals")
        return [interval for intervals in per_rank for interval in intervals]

    def offload_train_state(self) -> None:
        """Optimizer state to CPU, gradient buffers freed until the next update."""
        wait([a.offload_train_state.remote() for a in self.actors], "trainer offload")

    def hand_over_memory(self) -> None:
        """Every rank: the update state out when ``trainer.offload_train_state``, then its
        cached blocks back to CUDA (``trainer/offload.py``); returns once all ranks did, so
        colocated engines resume into free memory."""
        wait([a.hand_over_memory.remote() for a in self.actors], "trainer memory hand-off")

    def submit_logprobs(
        self,
        batch: TrainBatch,
        with_ref: bool,
        kl_mask: torch.Tensor | None = None,
        old_weights: str = "policy",
    ) -> list:
        """One call per step, queued on every rank without waiting: old log-probs (under
        ``old_weights``), reference log-probs (``with_ref``) ``[total]`` and the exact-KL
        diagnostic at ``kl_mask``. The batch goes into the object store once: every rank
        keeps it, with both log-probs filled in, for :meth:`submit_updates`.
        :meth:`logprobs_result` waits."""
        import ray

        ref = ray.put(batch)
        return [a.step_logprobs.remote(ref, with_ref, kl_mask, old_weights) for a in self.actors]

    def submit_snapshot_behavior(self) -> list:
        """Queue :meth:`TrainerWorker.snapshot_behavior` on every rank (behind the calls queued
        before it, ahead of the updates queued after it)."""
        return [a.snapshot_behavior.remote() for a in self.actors]

    def logprobs_result(
        self, refs: list
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """``(old, ref, exact_kl)`` of a :meth:`submit_logprobs`."""
        return wait(refs, "step log-probs")[0]  # global rank 0 returns the whole log-probs

    def submit_updates(self, minibatches: list[list[int]]) -> list[list]:
        """Queue one optimizer update per mini-batch (its sample ids in the batch every rank
        kept from :meth:`step_logprobs`) on every rank without waiting: a rank runs its calls
        in the order queued, so the updates follow each other with no driver round trip and
        no copy of the batch between them (nor a wait for the log-probs: the updates may be
        queued right after :meth:`submit_logprobs`); the last one frees the kept batch.
        :meth:`train_result` waits for each."""
        last = len(minibatches) - 1
        return [[a.train_step.remote(None, 1, ids, i == last) for a in self.actors]
                for i, ids in enumerate(minibatches)]  # fmt: skip

    def train_result(self, refs: list) -> dict[str, float]:
        """The metrics of one update of :meth:`submit_updates`, of the rank that reported the
        most."""
        return max(wait(refs, "train step"), key=len)

    def reset_reference(self) -> None:
        wait([a.reset_reference.remote() for a in self.actors], "trainer reference reset")

    def export_refs(self, weights: str = "policy", if_changed: bool = False) -> list:
        """Object refs of every rank's exported HF tensors (non-exporting ranks give []); with
        ``if_changed``, ``None`` from every rank when no update was applied since the last
        export of the policy (``TrainerWorker.export_weights``)."""
        return [a.export_weights.remote(weights, if_changed) for a in self.actors]

    def push_weights(self, version: int, weights: str, pool: str, target) -> int:
        """Every rank's part of a weight push into ``pool``'s servers ``target`` (the
        transport's address of them, ``orchestration/actors/weight_sync.py``); the bytes sent."""
        refs = [a.push_weights.remote(version, weights, pool, target) for a in self.actors]
        return sum(wait(refs, f"weight sync ({weights} into the {pool} servers)"))

    def drop_sender(self, pool: str) -> None:
        """Forget the weight-sync groups into ``pool`` (one of its servers restarted)."""
        wait([a.drop_sender.remote(pool) for a in self.actors], "weight-sync group reset")

    def peak_gpu_memory_gb(self) -> tuple[float, ...] | None:
        """The largest per-rank peaks of GPU memory (allocated, reserved) since the last call
        (``None`` on CPU)."""
        return max_peak(wait([a.peak_gpu_memory_gb.remote() for a in self.actors], "GPU memory"))

    def save_checkpoint(self, path: str, run_state: dict) -> None:
        wait(
            [a.save_checkpoint.remote(path, run_state) for a in self.actors],
            "trainer checkpoint save",
        )

    def load_checkpoint(self, path: str) -> dict:
        return wait(
            [a.load_checkpoint.remote(path) for a in self.actors], "trainer checkpoint load"
        )[0]

    def close(self, timeout: float = 120.0) -> None:
        wait([a.close.remote() for a in self.actors], "trainer close", min(timeout, 120.0))


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


class RolloutActors:
    """All rollout workers; prompts are split contiguously, worker ``i`` seeded ``seed + i``.

    With the embedded engine every worker serves both the policy and the reference. With
    SGLang there is one worker per node with servers (``placement.rollout_hosts``); a worker
    serves the pools that have servers on its node, so policy generation is split over the
    workers with policy servers and reference sampling over those with reference servers (the
    policy workers themselves for ``swap``).
    """

    _unsettled: tuple = ()  # refs of remember_reference_scores calls not waited for yet

    def __init__(
        self,
        config: ArmorConfig,
        plan: LayoutPlan,
        pg=None,
        order=None,
        hosts: list[RolloutHost] | None = None,
    ):
        self.actors = []
        self.specs: list[tuple[dict, tuple]] = []  # embedded engine: (options, args) per worker
        self.has_ref_pool = uses_ref_pool(config)
        served = reference_strategy(config.rollout.ref_strategy, config.algo.anchor_source)
        anchors = get_anchor_mode(config.algo.anchor).draws_reference
        self.caches_anchors = anchors and served.caches_anchors
        self.weight_sync = None  # set by the session (orchestration/actors/weight_sync.py)
        if hosts:
            for i, host in enumerate(hosts):
                opts = server_owner_options(actor_options(plan, pg, order or [], host.bundle, 0.0))
                args = (config, i, plan.threads, host.servers)
                self.actors.append(start_actor(RolloutWorker, opts, *args))
            policy, reference = worker_roles(hosts, self.has_ref_pool)
            self.policy_actors = [self.actors[i] for i in policy]
            self.reference_actors = [self.actors[i] for i in reference]
        else:
            for i in range(plan.rollout_engines):
                bundle = plan.rollout_bundles[i] if plan.rollout_bundles else None
                opts = actor_options(plan, pg, order or [], bundle, plan.rollout_gpus)
                self.specs.append((opts, (config, i, plan.threads)))  # a replacement's recipe
                self.actors.append(start_actor(RolloutWorker, opts, *self.specs[-1][1]))
            self.policy_actors = self.reference_actors = list(self.actors)
        startup = config.orchestration.ray_init_timeout_s
        if backend_of(config).serves_over_http:  # the worker waits for every server's health
            startup = max(startup, 2 * config.rollout.sglang.startup_timeout_s)
        self.startup_timeout = startup
        try:
            wait([a.health.remote() for a in self.actors], "rollout engine start-up", startup)
        except BaseException:
            self._close_started()  # the workers that did start stop their servers
            raise

    def _close_started(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.get(actor.close.remote(), timeout=300)
            except Exception:  # noqa: BLE001 - a worker that failed to start has nothing to stop
                pass
            ray.kill(actor)

    def _fan_out(
        self,
        actors: list,
        method: str,
        items: list,
        *args,
        params: SamplingParams,
        parts: list[list[int]] | None = None,
        **kwargs,
    ):
        """``method(part, *args, params, **kwargs)`` on each worker's part of ``items``
        (``parts``: the indices of each worker's items, default contiguous; worker ``i`` seeded
        ``params.seed + i``); rows in ``items`` order."""
        if parts is None:
            parts = shard(list(range(len(items))), len(actors))

        def call(i: int, actor, part: list):
            return getattr(actor, method).remote(part, *args, worker_params(params, i), **kwargs)

        return _scatter(actors, parts, items, call, f"rollout {method}")

    def reference_parts(self, items: list) -> list[list[int]]:
        """The indices of ``items`` each reference worker serves. With the anchor cache a query
        always goes to the worker holding its cache entry (:func:`query_worker` of its id), so
        a recurring query hits whatever batch it comes in; otherwise contiguous parts."""
        workers = len(self.reference_actors)
        if not self.caches_anchors or workers == 1:
            return shard(list(range(len(items))), workers)
        parts: list[list[int]] = [[] for _ in range(workers)]
        for j, item in enumerate(items):
            parts[query_worker(item.query_id, workers)].append(j)
        return parts

    def submit_scored(
        self,
        method: str,
        items: list,
        n: int,
        params: SamplingParams,
        reward: RewardActors,
        wait_rows: bool = True,
    ) -> ScoredRows:
        """:meth:`generate` (``method="generate"``) or :meth:`sample_reference`
        (``"sample_reference"``) with ``reward``'s scoring chained to it (:class:`ScoredRows`):
        the same workers, parts and seeds as those calls. Returns once the rows are in (the
        scoring is under way); with the reference swapped into the policy servers around the
        sampling, before the policy is swapped back. ``wait_rows=False`` returns as soon as
        the calls are sent (an error where the reference is swapped into the policy servers:
        the policy must not go back before the rows are in)."""
        if method == "generate":
            actors, swapped = self.policy_actors, nullcontext()
            parts = shard(list(range(len(items))), len(actors))
        elif method == "sample_reference":
            if not wait_rows and self.weight_sync and self.weight_sync.swaps_into_policy_servers():
                raise ValueError("submit_scored: the reference is swapped into the policy "
                                 "servers around this call; it must wait for its rows")  # fmt: skip
            actors, parts = self.reference_actors, self.reference_parts(items)
            swapped = (
                self.weight_sync.reference_swapped(items, n) if self.weight_sync else nullcontext()
            )
        else:
            raise ValueError(f"submit_scored: no generation call {method!r}")
        scorers = len(reward.actors)
        with swapped:
            row_refs, answer_refs, served = [], [], []
            for i, (actor, part) in enumerate(zip(actors, parts, strict=True)):
                if not part:
                    continue
                rows, *answers = getattr(actor, method).options(num_returns=1 + scorers).remote(
                    [items[j] for j in part], n, worker_params(params, i),
                    answers_for=reward.verifier, answer_parts=scorers,
                )  # fmt: skip
                row_refs.append(rows)
                answer_refs.append(answers)
                served.append(part)
            call = ScoredRows(row_refs, served, len(items), reward.submit_score(answer_refs),
                              f"rollout {method}")  # fmt: skip
            if wait_rows:
                call.rows()
        return call

    def compute_intervals(self) -> list[tuple[float, float]]:
        """Every worker's generation intervals since the last call (:class:`ComputeClock`)."""
        per_worker = wait([a.compute_intervals.remote() for a in self.actors],
                          "compute intervals")  # fmt: skip
        return [interval for intervals in per_worker for interval in intervals]

    def generate(self, items: list, n: int, params: SamplingParams) -> list[list[Sample]]:
        """``n`` policy samples per prompt item, ``[len(items)][n]``."""
        return self._fan_out(self.policy_actors, "generate", items, n, params=params)

    def sample_reference(self, items: list, n: int, params: SamplingParams) -> list[list[Sample]]:
        """``n`` reference samples per prompt item, in generation order (with the reference
        swapped into the policy servers around the call when :attr:`weight_sync` swaps)."""
        swapped = (
            self.weight_sync.reference_swapped(items, n) if self.weight_sync else nullcontext()
        )
        with swapped:
            return self._fan_out(
                self.reference_actors, "sample_reference", items, n, params=params,
                parts=self.reference_parts(items),
            )  # fmt: skip

    def remember_reference_scores(self, items: list, rows: list[list[Sample]]) -> None:
        """The anchor cache keeps the scores of ``rows``, the reference samples a
        :meth:`sample_reference` call just returned for the same ``items`` (each worker gets
        the rows of its own cache: :meth:`reference_parts`).

        Sent without waiting: a Ray actor runs one caller's calls in the order sent (these
        actors are single-threaded and never retry a call), so the worker's next cache call
        sees the scores; :meth:`reference_metrics` (once a step) and :meth:`state_dicts` wait
        for them, and raise what failed."""
        self._unsettled += tuple(
            actor.remember_reference_scores.remote(
                [items[j].query_id for j in part],
                [[(s.score, s.acc) for s in rows[j]] for j in part],
            )
            for actor, part in zip(self.reference_actors, self.reference_parts(items), strict=True)
            if part
        )

    def _settle(self) -> None:
        """Wait for the unwaited calls of :meth:`remember_reference_scores`."""
        refs, self._unsettled = self._unsettled, ()
        if refs:
            wait(list(refs), "rollout reference scores")

    def forget_unsettled(self) -> None:
        """Drop the unwaited calls of a step that a worker's death cut short (they may hold
        its error; the step is drawn again: ``orchestration/actors/recovery.py``)."""
        self._unsettled = ()

    def reference_unsolved(self, items: list, n: int) -> list[bool]:
        """Per item, whether the anchor cache already holds ``n`` scored reference samples of
        it, none correct: rule (b) rejects such a query whatever its on-policy samples are."""
        call = lambda i, actor, part: actor.reference_unsolved.remote(part, n)  # noqa: E731
        flags = _scatter(self.reference_actors, self.reference_parts(items), items, call,
                         "rollout reference cache")  # fmt: skip
        return [bool(f) for f in flags]

    def generate_window(
        self, requests: list, params: SamplingParams, window_tokens: int
    ) -> list[GenerationOutput]:
        """One window of a partial rollout over the policy workers (contiguous parts, worker
        ``i`` seeded ``params.seed + i``): each request's new tokens, in ``requests`` order."""
        return self._fan_out(self.policy_actors, "generate_window", requests, params=params,
                             window_tokens=window_tokens)  # fmt: skip

    def generate_raw(self, prompts, n, params, weights="policy") -> list[list[GenerationOutput]]:
        return self._fan_out(
            self.policy_actors, "generate_raw", prompts, n, params=params, weights=weights
        )

    def submit_update_weights(self, version: int, export_refs: list) -> list:
        """Embedded engine: every policy worker loads the trainer's exported tensors at
        ``version`` (``orchestration/actors/weight_sync.InProcessSync``), queued without waiting;
        :meth:`wait_update_weights` waits."""
        return [a.update_weights.remote(version, *export_refs) for a in self.policy_actors]

    def wait_update_weights(self, refs: list) -> int:
        """The bytes per worker of a :meth:`submit_update_weights`, once every worker loaded."""
        return wait(refs, "weight sync")[0]

    def _pool_actors(self, pool: str) -> list:
        return self.policy_actors if pool == "policy" else self.reference_actors

    def weight_targets(self, pool: str = "policy") -> list[tuple[int, str, int, int, str]]:
        """``[(worker, server_url, tp, server index, API key)]`` of the SGLang servers of ``pool``,
        ``worker`` the position in :attr:`actors`."""
        actors = self._pool_actors(pool)
        parts = wait([a.weight_targets.remote(pool) for a in actors], "rollout weight targets")
        workers = [self.actors.index(a) for a in actors]
        return [(w, *t) for w, part in zip(workers, parts, strict=True) for t in part]

    def set_weight_version(self, version: int, pool: str = "policy") -> None:
        """Record ``version`` on the workers of ``pool`` after the trainer pushed the weights."""
        wait(
            [a.set_weight_version.remote(version, pool) for a in self._pool_actors(pool)],
            "rollout weight version",
        )

    def load_from_disk(
        self, pool: str, path: str, version: int, servers: dict[int, list[int]] | None = None
    ) -> None:
        """``pool``'s servers (all, or ``{worker: [server index]}``) load the HF dir ``path``."""
        if servers is None:
            refs = [a.load_from_disk.remote(pool, path, version) for a in self._pool_actors(pool)]
        else:
            refs = [self.actors[w].load_from_disk.remote(pool, path, version, indices)
                    for w, indices in servers.items()]  # fmt: skip
        wait(refs, f"{pool} servers loading {path}")

    def begin_weight_update(self, pool: str, servers: dict[int, list[int]] | None = None) -> None:
        """Open the weight-update session of ``pool``'s servers (all, or ``{worker: [server
        index]}``) before the trainer ranks stream into them (``weight_sync.SessionSync``)."""
        self._on_servers(pool, servers, "begin_weight_update", "opening the weight update")

    def end_weight_update(self, pool: str, servers: dict[int, list[int]] | None = None) -> None:
        """Close what :meth:`begin_weight_update` opened (and flush the servers' caches)."""
        self._on_servers(pool, servers, "end_weight_update", "closing the weight update")

    def _on_servers(self, pool: str, servers: dict[int, list[int]] | None, verb: str, what: str):
        if servers is None:
            refs = [getattr(a, verb).remote(pool) for a in self._pool_actors(pool)]
        else:
            refs = [getattr(self.actors[w], verb).remote(pool, indices)
                    for w, indices in servers.items()]  # fmt: skip
        wait(refs, f"{pool} servers {what}")

    def reference_misses(self, items: list, n: int) -> int:
        """How many of ``items`` the reference workers must sample afresh (not cached)."""
        parts = self.reference_parts(items)
        refs = [
            a.reference_misses.remote([items[j] for j in p], n)
            for a, p in zip(self.reference_actors, parts, strict=True)
            if p
        ]
        return sum(wait(refs, "rollout reference cache"))

    def reference_in_place(self, version: int, reset: bool) -> None:
        """Record reference ``version`` without sending weights: the trainer pushed them into
        the reference pool, swaps them in when sampling, or the run draws no reference samples."""
        wait(
            [a.reference_in_place.remote(version, reset) for a in self.reference_actors],
            "rollout reference version",
        )

    def peak_gpu_memory_gb(self) -> tuple[float, ...] | None:
        """The largest per-worker peaks of GPU memory, allocated and reserved (embedded engines
        on GPUs; else ``None``)."""
        return max_peak(wait([a.peak_gpu_memory_gb.remote() for a in self.actors], "GPU memory"))

    def restart_dead_servers(self) -> list[dict[str, list[int]]]:
        """Per worker, ``{pool: [server index]}`` of the SGLang servers it restarted (out of
        rotation until :meth:`rejoin`)."""
        return wait(
            [a.restart_dead_servers.remote() for a in self.actors],
            "rollout health check",
            2 * call_timeout(),
        )

    def rejoin(self, worker: int, pool: str, indices: list[int]) -> None:
        wait(self.actors[worker].rejoin.remote(pool, indices), "rollout rejoin")

    def pool_version(self, pool: str) -> int:
        return wait(self._pool_actors(pool)[0].pool_version.remote(pool), "rollout pool version")

    def load_reference(self, version: int, export_refs: list) -> None:
        """Push the trainer's reference weights (start-up / resume; the anchor cache is kept)."""
        wait(
            [a.load_reference.remote(version, *export_refs) for a in self.reference_actors],
            "rollout reference load",
        )

    def submit_reference_metrics(self) -> list:
        """Queue the workers' read of their anchor-cache counters without waiting (right after
        a step's rollout, so it runs while the trainer works and ahead of anything queued on
        the workers later); :meth:`reference_metrics` waits for it. ``[]`` without the cache."""
        if not self.caches_anchors:
            return []
        return [a.reference_metrics.remote() for a in self.reference_actors]

    def reference_metrics(self, queued: list | None = None) -> dict[str, float]:
        """``anchor/cache_*`` summed over workers, of the read ``queued`` by
        :meth:`submit_reference_metrics` (else read now); empty, and no call to the workers,
        without the anchor cache. Waits for the scores :meth:`remember_reference_scores` sent."""
        self._settle()
        out: dict[str, float] = {}
        if not self.caches_anchors:
            return out
        if queued is None:
            queued = self.submit_reference_metrics()
        for m in wait(queued, "rollout reference metrics"):
            for k, v in m.items():
                out[k] = out.get(k, 0.0) + float(v)
        return out

    def reset_reference(self, version: int, export_refs: list) -> None:
        wait(
            [a.reset_reference.remote(version, *export_refs) for a in self.reference_actors],
            "rollout reference reset",
        )

    def reset_reference_from_policy(self, version: int) -> None:
        """A reset to the policy the engines serve at ``version``: each takes its own."""
        wait(
            [a.reset_reference_from_policy.remote(version) for a in self.reference_actors],
            "rollout reference reset",
        )

    def release_memory(self) -> None:
        wait([a.release_memory.remote() for a in self.actors], "rollout release_memory")

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take back the memory of ``tags`` (``weights``, ``kv_cache``; ``None``: all)."""
        wait([a.resume_memory.remote(tags) for a in self.actors], "rollout resume_memory")

    def weight_versions(self) -> list[dict[str, int]]:
        return wait(
            [a.weight_versions.remote() for a in self.policy_actors], "rollout weight versions"
        )

    def state_dicts(self) -> list[dict]:
        self._settle()
        return wait([a.state_dict.remote() for a in self.reference_actors], "rollout state")

    def close(self, timeout: float = 300.0) -> None:
        """Stop what the workers launched (SGLang servers and routers)."""
        wait([a.close.remote() for a in self.actors], "rollout close", min(timeout, 300.0))

    def load_state_dicts(self, states: list[dict]) -> None:
        actors = self.reference_actors
        if len(states) != len(actors):
            raise ValueError(
                f"checkpoint holds reference state of {len(states)} rollout workers, this run has "
                f"{len(actors)}; resume with the same rollout layout"
            )
        wait(
            [a.load_state_dict.remote(s) for a, s in zip(actors, states, strict=True)],
            "rollout state load",
        )


class RewardActors:
    """All scoring workers; :meth:`score` sets ``score`` and ``acc`` in place."""

    def __init__(self, config: ArmorConfig, plan: LayoutPlan):
        opts = actor_options(plan, None, [], None, 0.0)
        self.verifier = config.reward.verifier
        self.specs = [(opts, (config, plan.threads))] * max(plan.reward_workers, 1)
        self.actors = [start_actor(RewardWorker, o, *args) for o, args in self.specs]
        self.startup_timeout = config.orchestration.ray_init_timeout_s

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Score ``samples`` in place; returns the scorers' summed stats (``reward/*``). The
        workers get each sample's :class:`~megatron_armor.reward.scorer.Answer` only."""
        parts = shard(answers_of(samples, self.verifier), len(self.actors))
        refs = [a.score.remote(p) for a, p in zip(self.actors, parts, strict=True) if p]
        results = wait(refs, "reward scoring")
        return assign_scores(samples, [sa for scored, _ in results for sa in scored],
                             [stats for _, stats in results])  # fmt: skip

    def submit_score(self, answer_refs: list[list]) -> list:
        """Refs of the scores of ``answer_refs``: per rollout worker, the refs of its answers'
        parts, one per scoring worker (:func:`~megatron_armor.orchestration.actors.workers.with_answers`);
        worker ``k`` scores part ``k`` of each. Not waited for (:class:`ScoredRows`)."""
        return [a.score_parts.remote(*(parts[k] for parts in answer_refs))
                for k, a in enumerate(self.actors)]  # fmt: skip

    def close(self, timeout: float = 60.0) -> None:
        wait([a.close.remote() for a in self.actors], "reward close", min(timeout, 60.0))


class RemoteEngine(RolloutEngine):
    """A :class:`RolloutEngine` view of a :class:`RolloutActors` (for ``evaluation.evaluate``)."""

    def __init__(self, actors: RolloutActors, default_seed: int | None = None):
        self.actors, self.default_seed = actors, default_seed

    def generate(self, prompts, n, params: SamplingParams, weights: str = "policy"):
        if params.seed is None and self.default_seed is not None:
            params = dataclasses.replace(params, seed=self.default_seed)
        return self.actors.generate_raw(prompts, n, params, weights)

    def update_weights(
        self, named_tensors: Iterable, version: int, weights: str = "policy"
    ) -> None:
        raise NotImplementedError("RemoteEngine is read-only; sync weights through RolloutActors")

    def weight_version(self, weights: str = "policy") -> int:
        return self.actors.weight_versions()[0][weights]

    def health(self) -> bool:
        return True


class RemoteScorer:
    """A scorer view of a :class:`RewardActors` (``score`` in place, returns stats)."""

    def __init__(self, actors: RewardActors):
        self.actors = actors

    def score(self, samples: list[Sample]) -> dict[str, Any]:
        return self.actors.score(samples)
