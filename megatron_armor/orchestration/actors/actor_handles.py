"""Driver-side handles on the trainer ranks and the scoring workers: each method is one verb
of the RL loop.

:class:`TrainerActors` fans a call out to every trainer rank and combines the answers
(per-token tensors are summed over reporting ranks, see ``trainer/interface.py``);
:class:`RewardActors` shards samples over the scoring workers. The rollout workers have their
own handles, by concern (``rollout_fleet.py``). Every wait is bounded by a deadline learned
from the run's own calls (``call_watch.py``; start-up by ``orchestration.ray_init_timeout_s``),
so a dead or stuck actor is named and handled instead of hanging the run; a call sent now and
waited for later is a :class:`~megatron_armor.orchestration.actors.pending.Pending`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.orchestration.actors.call_kinds import CallKind
from megatron_armor.orchestration.actors.call_watch import CallWatch, start_actor
from megatron_armor.orchestration.actors.pending import Pending, values
from megatron_armor.orchestration.actors.placement import (
    LayoutPlan,
    actor_options,
    trainer_runtime_env,
)
from megatron_armor.orchestration.actors.process_trees import kill_on_node
from megatron_armor.orchestration.actors.workers import RewardWorker, TrainerWorker, shard
from megatron_armor.reward.scorer import answers_of
from megatron_armor.types import Sample, TrainBatch


def assign_scores(samples: list[Sample], scores: list, stats: list[dict]) -> dict[str, float]:
    """Write ``scores`` (``[(score, acc)]``, one per sample) into ``samples`` in order; returns
    the scoring workers' ``stats`` merged."""
    for sample, (score, acc) in zip(samples, scores, strict=True):
        sample.score, sample.acc = score, acc
    merged: dict[str, float] = {}
    for part in stats:
        merged = merge_reward_stats(merged, part)
    return merged


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


def close_actors(handles: list, watch: CallWatch, budget_s: float = 30.0) -> None:
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
    kill_run_processes([a for handle in handles for a in handle.actors], watch)
    for handle in handles:
        for actor in handle.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - gone with its node already
                pass
            watch.forget(actor)


def kill_run_processes(actors: list, watch: CallWatch) -> None:
    """SIGKILL the processes of ``actors`` (those whose pid ``watch`` knows) and their
    descendants, per node (``process_trees.kill_on_node``)."""
    per_node: dict[str, list[int]] = {}
    for actor in actors:
        entry = watch.actors.get(actor._actor_id.hex())
        if entry is not None and entry.pid:
            per_node.setdefault(entry.node_id, []).append(entry.pid)
    for node_id, pids in per_node.items():
        kill_on_node(node_id, pids)


def max_peak(peaks: list[tuple[float, ...] | None]) -> tuple[float, ...] | None:
    """The largest of the actors' peaks, entry by entry (allocated, reserved; ``None`` when
    none of them has a GPU)."""
    known = [p for p in peaks if p is not None]
    return tuple(max(entry) for entry in zip(*known, strict=True)) if known else None


def first(answers: list):
    """Global rank 0's answer (the one that returns whole results)."""
    return answers[0]


def fullest(answers: list[dict]) -> dict:
    """The answer of the rank that reported the most metrics."""
    return max(answers, key=len)


class TrainerActors:
    """All trainer ranks (``trainer.world_size``)."""

    def __init__(self, watch: CallWatch, actors: list, init_timeout: float = 0.0,
                 profiling: bool = False) -> None:  # fmt: skip
        self.watch, self.actors = watch, actors
        self.init_timeout, self.profiling = init_timeout, profiling
        self.info: dict = {}

    @classmethod
    def start(cls, config: ArmorConfig, plan: LayoutPlan, watch: CallWatch, pg=None, order=None,
              profile_dir: str = "") -> TrainerActors:  # fmt: skip
        """Start one actor per rank (their models are built by :meth:`init`)."""
        actors = []
        for rank in range(plan.trainer_ranks):
            bundle = plan.trainer_bundles[rank] if plan.trainer_bundles else None
            opts = actor_options(plan, pg, order or [], bundle, plan.trainer_gpus)
            opts.update(trainer_runtime_env(config, rank))
            args = (config, rank, plan.trainer_ranks, plan.threads, profile_dir)
            actors.append(start_actor(watch, TrainerWorker, opts, *args))
        return cls(watch, actors, config.orchestration.ray_init_timeout_s,
                   config.logging.profile != "none")  # fmt: skip

    def send(self, call: Callable, kind: CallKind, what: str, read: Callable = values,
             timeout: float | None = None) -> Pending:  # fmt: skip
        """``call(actor)`` on every rank, sent now (:class:`Pending`)."""
        return Pending(self.watch, [call(a) for a in self.actors], kind, what, read,
                       timeout=timeout)  # fmt: skip

    def init(self) -> None:
        """Build the model on every rank; rank 0's node and a free port host the rendezvous."""
        first_rank = [self.actors[0].node_info.remote()]
        (self.info,) = Pending(
            self.watch,
            first_rank,
            CallKind.STARTUP,
            "trainer rank 0 start-up",
            timeout=self.init_timeout,
        ).result()
        addr = "127.0.0.1" if len(self.actors) == 1 else self.info["ip"]
        self.send(
            lambda a: a.init.remote(addr, self.info["free_port"]),
            CallKind.STARTUP,
            "trainer model initialization",
            timeout=max(self.init_timeout, 600.0),
        ).result()

    def profile_begin(self, step: int) -> None:
        """Start the step profiler on the ranks in ``logging.profile_ranks`` (no-op when off)."""
        if self.profiling:
            self.send(lambda a: a.profile_begin.remote(step), CallKind.PROFILER,
                      "profiler begin").result()  # fmt: skip

    def profile_end(self, step: int) -> None:
        if self.profiling:
            self.send(lambda a: a.profile_end.remote(step), CallKind.PROFILER,
                      "profiler end").result()  # fmt: skip

    def compute_intervals(self) -> list[tuple[float, float]]:
        """Every rank's model-compute intervals since the last call (``ComputeClock``)."""
        per_rank = self.send(lambda a: a.compute_intervals.remote(), CallKind.COMPUTE_INTERVALS,
                             "compute intervals").result()  # fmt: skip
        return [interval for intervals in per_rank for interval in intervals]

    def offload_train_state(self) -> None:
        """Optimizer state to CPU, gradient buffers freed until the next update."""
        self.send(lambda a: a.offload_train_state.remote(), CallKind.TRAINER_OFFLOAD,
                  "trainer offload").result()  # fmt: skip

    def hand_over_memory(self) -> None:
        """Every rank: the update state out when ``trainer.offload_train_state``, then its
        cached blocks back to CUDA (``trainer/offload.py``); returns once all ranks did, so
        colocated engines resume into free memory."""
        self.send(lambda a: a.hand_over_memory.remote(), CallKind.MEMORY_HANDOFF,
                  "trainer memory hand-off").result()  # fmt: skip

    def submit_logprobs(
        self,
        batch: TrainBatch,
        with_ref: bool,
        kl_mask: torch.Tensor | None = None,
        old_weights: str = "policy",
    ) -> Pending[tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]]:
        """One call per step, sent to every rank now: ``(old, ref, exact_kl)``, old log-probs
        (under ``old_weights``), reference log-probs (``with_ref``) ``[total]`` and the
        exact-KL diagnostic at ``kl_mask``. The batch goes into the object store once: every
        rank keeps it, with both log-probs filled in, for :meth:`submit_updates`."""
        import ray

        ref = ray.put(batch)
        return self.send(lambda a: a.step_logprobs.remote(ref, with_ref, kl_mask, old_weights),
                         CallKind.LOGPROBS, "step log-probs", read=first)  # fmt: skip

    def submit_snapshot_behavior(self) -> Pending[list]:
        """``TrainerWorker.snapshot_behavior`` on every rank, sent now (behind the calls sent
        before it, ahead of the updates sent after it)."""
        return self.send(lambda a: a.snapshot_behavior.remote(), CallKind.BEHAVIOR_SNAPSHOT,
                         "behavior weights")  # fmt: skip

    def submit_updates(self, minibatches: list[list[int]]) -> list[Pending[dict[str, float]]]:
        """One optimizer update per mini-batch (its sample ids in the batch every rank kept
        from ``step_logprobs``), sent to every rank now: a rank runs its calls in the order
        sent, so the updates follow each other with no driver round trip and no copy of the
        batch between them (nor a wait for the log-probs: the updates may be sent right after
        :meth:`submit_logprobs`); the last one frees the kept batch. Each result is the
        metrics of the rank that reported the most."""
        last = len(minibatches) - 1
        return [self.send(lambda a, i=i, ids=ids: a.train_step.remote(None, 1, ids, i == last),
                          CallKind.UPDATES, "train step", read=fullest)
                for i, ids in enumerate(minibatches)]  # fmt: skip

    def reset_reference(self) -> None:
        self.send(lambda a: a.reset_reference.remote(), CallKind.RESET,
                  "trainer reference reset").result()  # fmt: skip

    def export(self, weights: str = "policy", if_changed: bool = False) -> Pending[list]:
        """Every rank's exported HF tensors of ``weights``, sent now; their refs go to the
        calls that load them (non-exporting ranks give []). With ``if_changed``, ``None`` from
        every rank when no update was applied since the last export of the policy
        (``TrainerWorker.export_weights``)."""
        return self.send(lambda a: a.export_weights.remote(weights, if_changed),
                         CallKind.WEIGHT_PUSH, f"{weights} weights export")  # fmt: skip

    def push_weights(self, version: int, weights: str, pool: str, target) -> int:
        """Every rank's part of a weight push into ``pool``'s servers ``target`` (the
        transport's address of them, ``orchestration/actors/weight_sync.py``); the bytes sent."""
        return self.send(lambda a: a.push_weights.remote(version, weights, pool, target),
                         CallKind.WEIGHT_PUSH, f"weight sync ({weights} into the {pool} servers)",
                         read=sum).result()  # fmt: skip

    def drop_sender(self, pool: str) -> None:
        """Forget the weight-sync groups into ``pool`` (one of its servers restarted)."""
        self.send(lambda a: a.drop_sender.remote(pool), CallKind.SENDER_RESET,
                  "weight-sync group reset").result()  # fmt: skip

    def peak_gpu_memory_gb(self) -> tuple[float, ...] | None:
        """The largest per-rank peaks of GPU memory (allocated, reserved) since the last call
        (``None`` on CPU)."""
        return self.send(lambda a: a.peak_gpu_memory_gb.remote(), CallKind.GPU_MEMORY,
                         "GPU memory", read=max_peak).result()  # fmt: skip

    def save_checkpoint(self, path: str, run_state: dict) -> None:
        self.send(lambda a: a.save_checkpoint.remote(path, run_state), CallKind.CHECKPOINT,
                  "trainer checkpoint save").result()  # fmt: skip

    def load_checkpoint(self, path: str) -> dict:
        return self.send(lambda a: a.load_checkpoint.remote(path), CallKind.CHECKPOINT,
                         "trainer checkpoint load", read=first).result()  # fmt: skip

    def close(self, timeout: float = 120.0) -> None:
        self.send(lambda a: a.close.remote(), CallKind.CLOSE, "trainer close",
                  timeout=min(timeout, 120.0)).result()  # fmt: skip


class RewardActors:
    """All scoring workers; :meth:`score` sets ``score`` and ``acc`` in place."""

    def __init__(self, watch: CallWatch, actors: list, verifier: str,
                 specs: list[tuple[dict, tuple]] | None = None,
                 startup_timeout: float = 0.0) -> None:  # fmt: skip
        """``specs``: the ``(options, args)`` a replacement of each worker is made with."""
        self.watch, self.actors, self.verifier = watch, actors, verifier
        self.specs, self.startup_timeout = specs or [], startup_timeout

    @classmethod
    def start(cls, config: ArmorConfig, plan: LayoutPlan, watch: CallWatch) -> RewardActors:
        opts = actor_options(plan, None, [], None, 0.0)
        specs = [(opts, (config, plan.threads))] * max(plan.reward_workers, 1)
        actors = [start_actor(watch, RewardWorker, o, *args) for o, args in specs]
        return cls(watch, actors, config.reward.verifier, specs,
                   config.orchestration.ray_init_timeout_s)  # fmt: skip

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Score ``samples`` in place; returns the scorers' summed stats (``reward/*``). The
        workers get each sample's :class:`~megatron_armor.reward.scorer.Answer` only."""
        parts = shard(answers_of(samples, self.verifier), len(self.actors))
        refs = [a.score.remote(p) for a, p in zip(self.actors, parts, strict=True) if p]
        results = Pending(self.watch, refs, CallKind.SCORE, "reward scoring").result()
        return assign_scores(samples, [sa for scored, _ in results for sa in scored],
                             [stats for _, stats in results])  # fmt: skip

    def submit_score(self, answer_refs: list[list]) -> list:
        """Refs of the scores of ``answer_refs``: per rollout worker, the refs of its answers'
        parts, one per scoring worker (``rollout_services.with_answers``); worker ``k`` scores
        part ``k`` of each. Not waited for (``rollout_draws.ScoredRows``)."""
        return [a.score_parts.remote(*(parts[k] for parts in answer_refs))
                for k, a in enumerate(self.actors)]  # fmt: skip

    def replace(self, index: int, new) -> None:
        """Worker ``index`` is ``new`` from now on."""
        self.actors[index] = new

    def close(self, timeout: float = 60.0) -> None:
        refs = [a.close.remote() for a in self.actors]
        Pending(
            self.watch, refs, CallKind.CLOSE, "reward close", timeout=min(timeout, 60.0)
        ).result()


class RemoteScorer:
    """A scorer view of a :class:`RewardActors` (``score`` in place, returns stats)."""

    def __init__(self, actors: RewardActors):
        self.actors = actors

    def score(self, samples: list[Sample]) -> dict[str, Any]:
        return self.actors.score(samples)
