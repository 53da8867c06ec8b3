"""The processes of a run, as plain classes that ``placement.py`` turns into Ray actors.

- :class:`TrainerWorker` — one trainer rank; imports Megatron (``trainer.megatron_trainer``) lazily,
  inside its own process, so the orchestrator never does.
- ``rollout_worker.RolloutWorker`` — the engines of one node and what they serve, one class
  per concern (``rollout_services.py``); this module holds what every worker shares.
- :class:`RewardWorker` — one :class:`~megatron_armor.reward.scorer.RewardScorer`.

Every method takes and returns picklable values (lists of tensors instead of iterators).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.net import free_port, node_ip
from megatron_armor.observability.nvtx import enable_nvtx, nvtx_range
from megatron_armor.observability.throughput import peak_gpu_memory_gb
from megatron_armor.orchestration.actors.ray_node import ignore_stop_signals
from megatron_armor.orchestration.actors.watched import Watched, beating
from megatron_armor.types import NamedTensorList

if TYPE_CHECKING:
    from megatron_armor.reward.scorer import Answer

NamedTensors = list[tuple[str, torch.Tensor]]


def load_model_tokenizer(model_dir: str):
    """The tokenizer stored in an HF model directory (offline).

    ``PreTrainedTokenizerFast`` reads a custom ``tokenizer.json`` where ``AutoTokenizer``
    would silently substitute the architecture's default.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (Path(model_dir) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def set_threads(num_threads: int) -> None:
    """Pin torch's intra-op threads (Ray sets OMP_NUM_THREADS to the actor's CPU count)."""
    if num_threads > 0:
        torch.set_num_threads(num_threads)


def freeze_heap() -> None:
    """Take every object alive now (imports, model, engine) out of the garbage collector's
    view (``gc.freeze``), after one last collection. A full collection walks every tracked
    object: in an actor that has imported torch, megatron-core and transformers it took
    about 0.09 s, once every few calls, wherever in a step the allocation count tripped it
    (megatron-core's ``--manual-gc`` exists for the same stalls). Objects made later are
    collected as usual."""
    gc.collect()
    gc.freeze()


class ComputeClock:
    """The intervals an actor spent in model compute (trainer forward/backward passes, engine
    generation) since the last :meth:`pop`, as ``(start, end)`` of ``time.monotonic()`` (one
    clock for every process of a node): ``benchmarks/bench_step.py`` takes their union over
    the actors, so compute that overlaps (the engine drawing while the trainer works) counts
    once against the step time. The latest :data:`KEPT` intervals are kept between pops."""

    KEPT = 4096

    def __init__(self) -> None:
        self.intervals: collections.deque = collections.deque(maxlen=self.KEPT)

    @contextlib.contextmanager
    def measure(self):
        start = time.monotonic()
        try:
            yield
        finally:
            self.intervals.append((start, time.monotonic()))

    def pop(self) -> list[tuple[float, float]]:
        intervals = list(self.intervals)
        self.intervals.clear()
        return intervals


def enable_worker_nvtx(config: ArmorConfig) -> None:
    """Mark this actor's phases for Nsight when the run is profiled with nsys/dlprof."""
    if config.logging.profile in ("nsys", "dlprof"):
        enable_nvtx("nvtx")


def node_info() -> dict[str, Any]:
    """Where this worker runs: node IP, Ray node id, hostname, visible GPU ids, a free TCP
    port, its pid."""
    import ray

    return {
        "ip": node_ip(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "host": socket.gethostname(),
        "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
        "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "free_port": free_port(),
        "pid": os.getpid(),
    }


@beating
class TrainerWorker(Watched):
    """One trainer rank: a thin picklable wrapper over ``MegatronTrainer``."""

    def __init__(
        self,
        config: ArmorConfig,
        rank: int,
        world_size: int,
        num_threads: int = 0,
        profile_dir: str = "",
    ):
        set_threads(num_threads)
        ignore_stop_signals()  # the driver checkpoints on them; Ray must keep running
        enable_worker_nvtx(config)
        self.config, self.rank, self.world_size = config, rank, world_size
        self.clock = ComputeClock()
        self.trainer = None
        self.sync = None  # this rank's end of the weight transport (made in init)
        self.step_batch = None  # the step's batch, kept from step_logprobs for its updates
        self.policy_changed = True  # an update applied since the policy was last exported
        self.profiler = None
        if profile_dir and config.logging.profile != "none":
            from megatron_armor.observability.profiler import profiler_from_config

            self.profiler = profiler_from_config(config.logging, rank, profile_dir)

    def profile_begin(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.begin_step(step)

    def profile_end(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.end_step(step)

    def node_info(self) -> dict[str, Any]:
        return node_info()

    def init(self, master_addr: str, master_port: int) -> int:
        """Build the Megatron model on this rank (joins the process group; blocks until all do)."""
        # Megatron is imported only in this process
        from megatron_armor.trainer.megatron_trainer import MegatronTrainer

        self.trainer = MegatronTrainer(
            self.config, rank=self.rank, world_size=self.world_size,
            master_addr=master_addr, master_port=master_port,
        )  # fmt: skip
        from megatron_armor.trainer.weight_sync import make_rank_sync

        self.sync = make_rank_sync(self.config, self.trainer)
        freeze_heap()
        return self.rank

    def compute_intervals(self) -> list[tuple[float, float]]:
        """The trainer's log-prob and update calls since the last call (:class:`ComputeClock`)."""
        return self.clock.pop()

    def offload_train_state(self) -> None:
        self.trainer.offload_train_state()

    def hand_over_memory(self) -> None:
        self.trainer.hand_over_memory()

    def step_logprobs(self, batch, with_ref: bool, kl_mask=None, old_weights: str = "policy"):
        """Old (+ reference) log-probs and the exact-KL diagnostic of a step, one call.

        Every rank gets the whole log-probs (``shared``) and keeps ``batch`` with them filled
        in for the step's updates (:meth:`train_step` without a batch), so the driver places
        the batch once. Global rank 0 returns the log-probs, the others ``None``.
        ``old_weights``: ``policy``, or ``behavior`` for a one-step-off batch
        (:meth:`snapshot_behavior`)."""
        with nvtx_range("logprobs/step"), self.clock.measure():
            old, ref, exact_kl = self.trainer.step_logprobs(
                batch, with_ref, kl_mask, shared=True, old_weights=old_weights
            )
        batch.old_logprobs = old
        if ref is not None:
            batch.ref_logprobs = ref
        self.step_batch = batch
        if self.rank != 0:
            return None, None, exact_kl
        return old, ref, exact_kl

    def train_step(
        self,
        batch,
        num_minibatches: int,
        sample_ids: list[int] | None = None,
        release: bool = False,
    ) -> dict[str, float]:
        """Updates on ``batch``, or with ``None`` on the batch kept by this step's
        :meth:`step_logprobs`; on its samples ``sample_ids`` when given (the driver names each
        mini-batch by its samples). ``release`` drops the kept batch, and what the trainer kept
        for the step's updates, afterwards (the step's last update)."""
        if batch is None:
            if self.step_batch is None:
                raise RuntimeError(
                    f"trainer rank {self.rank}: an update on the kept batch, but no step_logprobs "
                    "call since the last release (the driver calls step_logprobs first each step)"
                )
            batch = self.step_batch
        if release:
            self.step_batch = None
        if sample_ids is not None:
            batch = batch.select(sample_ids)
        with nvtx_range("train"), self.clock.measure():
            metrics = self.trainer.train_step(batch, num_minibatches)
        if release:
            self.trainer.end_step()
        self.policy_changed |= metrics.get("train/skipped", 0.0) < 1.0
        return metrics

    def reset_reference(self) -> None:
        with nvtx_range("reset"):
            self.trainer.reset_reference()

    def snapshot_behavior(self) -> None:
        """Keep the live weights as the next batch's behavior weights (``async_rollout``)."""
        self.trainer.snapshot_behavior()

    def export_weights(self, weights: str = "policy", if_changed: bool = False) -> NamedTensors:
        """This rank's exported HF tensors of ``weights``; with ``if_changed``, ``None`` when no
        update was applied since the policy was last exported (every one was skipped for a
        non-finite loss or gradient norm: the engines keep the weights and the version they
        have, ``RolloutWorker.update_weights``). Every rank decides alike (the skip is)."""
        if weights == "policy":
            if if_changed and not self.policy_changed:
                return None
            self.policy_changed = False
        with nvtx_range("weight_sync"):
            exported = self.trainer.export_weights(weights)
            return NamedTensorList((n, t.detach().cpu()) for n, t in exported)

    def push_weights(self, version: int, weights: str, pool: str, target) -> int:
        """This rank's part of a weight push (``trainer/weight_sync.py``, the transport chosen
        from the config): ``weights`` at ``version`` into ``pool``'s servers ``target``;
        returns the bytes this rank sent. Collective: every rank is called."""
        if self.sync is None:
            raise RuntimeError("push_weights needs rollout.backend=sglang (the embedded engine "
                               "takes export_weights through its worker)")  # fmt: skip
        with nvtx_range("weight_sync"):
            return self.sync.push(version, weights, pool, target)

    def drop_sender(self, pool: str) -> None:
        """Forget ``pool``'s weight-sync state (a server of it restarted: the next push makes
        a new NCCL group with every server of the pool)."""
        if self.sync is not None:
            self.sync.drop(pool)

    def peak_gpu_memory_gb(self) -> tuple[float, float] | None:
        """This rank's peak allocated and reserved GPU memory since the last call (``None`` on
        CPU)."""
        return peak_gpu_memory_gb()

    def save_checkpoint(self, path: str, run_state: dict) -> None:
        self.trainer.save_checkpoint(path, run_state)

    def load_checkpoint(self, path: str) -> dict:
        self.policy_changed = True
        return self.trainer.load_checkpoint(path)

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
        if self.sync is not None:
            self.sync.close()
        if self.trainer is not None and hasattr(self.trainer, "close"):
            self.trainer.close()
        self.trainer = None


def shard(items: list, parts: int) -> list[list]:
    """Split ``items`` into ``parts`` contiguous, nearly equal slices (order kept)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


@beating
class RewardWorker(Watched):
    """One scoring pool (docs/data_reward.md)."""

    def __init__(self, config: ArmorConfig, num_threads: int = 0):
        set_threads(num_threads)
        ignore_stop_signals()  # the driver checkpoints on them; Ray must keep running
        from megatron_armor.reward.scorer import RewardScorer

        self.scorer = RewardScorer.from_config(
            config.reward, config.rollout.sampling.max_new_tokens
        )
        freeze_heap()

    def node_info(self) -> dict[str, Any]:
        return node_info()

    def score(self, answers: list[Answer]) -> tuple[list[tuple[float, bool]], dict[str, float]]:
        """``[(score, acc)]`` per answer (same order) and the scorer's stats."""
        return self.scorer.score_answers(answers)

    def score_parts(
        self, *answer_parts: list[Answer]
    ) -> tuple[list[list[tuple[float, bool]]], dict[str, float]]:
        """:meth:`score` of this worker's part of each rollout worker's answers of one
        generation call (object refs that Ray resolves here; ``rollout_services.with_answers``),
        scored in one batch: ``[(score, acc)]`` per part, in order, and the scorer's stats."""
        scored, stats = self.scorer.score_answers([a for part in answer_parts for a in part])
        out, start = [], 0
        for part in answer_parts:
            out.append(scored[start : start + len(part)])
            start += len(part)
        return out, stats

    def close(self) -> None:
        self.scorer.close()
