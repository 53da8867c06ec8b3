"""The processes of a run, as plain classes that ``placement.py`` turns into Ray actors.

- :class:`TrainerWorker` — one trainer rank; imports Megatron (``trainer.megatron_trainer``) lazily,
  inside its own process, so the orchestrator never does.
- :class:`RolloutWorker` — one rollout engine plus the reference sampler; turns engine
  outputs into :class:`~megatron_armor.types.Sample` objects (token ids + decoded text).
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

from megatron_armor.algo.registry import get_anchor_mode
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.net import free_port, node_ip
from megatron_armor.observability.nvtx import enable_nvtx, nvtx_range
from megatron_armor.observability.throughput import peak_gpu_memory_gb
from megatron_armor.orchestration.actors.call_watch import WATCH_GROUP, Watched, beating
from megatron_armor.orchestration.actors.ray_node import ignore_stop_signals
from megatron_armor.rollout.backends import backend_of
from megatron_armor.rollout.protocol import GenerationOutput, SamplingParams
from megatron_armor.types import NamedTensorList, Sample, SampleSource

if TYPE_CHECKING:
    from megatron_armor.config.rollout_traits import ReferencePlan
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
        mini-batch by its samples). ``release`` drops the kept batch afterwards (the step's
        last update)."""
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


def to_samples(
    items: list, outputs: list[list[GenerationOutput]], source: SampleSource, tokenizer
) -> list[list[Sample]]:
    """Engine outputs ``[len(items)][n]`` -> :class:`Sample` objects with decoded text."""
    result = []
    for item, outs in zip(items, outputs, strict=True):
        result.append(
            [
                Sample(
                    query_id=item.query_id,
                    prompt_ids=list(item.prompt_ids),
                    response_ids=list(o.token_ids),
                    response_logprobs=list(o.logprobs),
                    source=source,
                    weight_version=o.weight_version,
                    finish_reason=o.finish_reason,
                    response_text=tokenizer.decode(o.token_ids, skip_special_tokens=True),
                    ground_truth=item.ground_truth,
                    data_source=item.data_source,
                    routed_experts=o.routed_experts,
                )
                for o in outs
            ]
        )
    return result


def shard(items: list, parts: int) -> list[list]:
    """Split ``items`` into ``parts`` contiguous, nearly equal slices (order kept)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def with_answers(rows: list[list[Sample]], verifier: str | None, parts: int = 1):
    """``rows``, or with a ``verifier`` ``(rows, *answer parts)``: the :class:`Answer` of each
    sample not ``scored``, in row order, split into ``parts`` contiguous parts (one per scoring
    worker, :func:`shard`), which a generation call returns as objects of their own
    so each scoring worker takes its part from the object store, with no driver in between
    and no answer sent twice (``actor_handles.RolloutActors.submit_scored``)."""
    if verifier is None:
        return rows
    from megatron_armor.reward.scorer import answers_of

    answers = answers_of([s for row in rows for s in row if not s.scored], verifier)
    return (rows, *shard(answers, parts))


def set_remembered_scores(rows: list[list[Sample]], scores: list[list | None]) -> None:
    """Give each row's samples the anchor cache's ``(score, acc)`` and mark them ``scored``
    (rows whose scores are ``None`` stay unscored)."""
    for row, row_scores in zip(rows, scores, strict=True):
        if row_scores is not None:
            for sample, (score, acc) in zip(row, row_scores, strict=True):
                sample.score, sample.acc, sample.scored = score, acc, True


@beating
class RolloutWorker(Watched):
    """One rollout engine and its reference sampler (docs/algorithm.md, anchor rollout step 2).

    For ``rollout.ref_strategy: swap`` the worker keeps CPU copies of the last pushed policy
    and reference tensors, which the swap sampler loads around each reference generation.
    With SGLang and a dedicated reference (``config.sglang_pools``) the worker also owns the
    reference pool (``ref_engine``), launched once the policy servers are healthy.
    """

    def __init__(
        self,
        config: ArmorConfig,
        index: int,
        num_threads: int = 0,
        servers: dict[str, list[tuple[int, int]]] | None = None,
    ):
        """``servers``: with SGLang, ``{pool: [(server index, first GPU id)]}`` of the servers
        on this worker's node (``placement.rollout_hosts``); ``None`` runs every pool here."""
        set_threads(num_threads)
        ignore_stop_signals()  # the driver checkpoints on them; Ray must keep running
        enable_worker_nvtx(config)
        import ray

        from megatron_armor.config.sglang_pools import uses_ref_pool

        device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
        wanted_ref = uses_ref_pool(config)  # an SGLang reference pool
        pools = ["policy", "ref"] if wanted_ref else ["policy"]
        if servers is not None:
            pools = [p for p in pools if servers.get(p)]
        self.index = index
        self.clock = ComputeClock()
        self.engine = self.ref_engine = None
        try:  # whatever fails, the servers already started are stopped
            self._start(config, device, pools, servers, wanted_ref)
        except BaseException:
            self.close()
            raise
        freeze_heap()

    def _start(self, config, device: str, pools: list[str], servers, wanted_ref: bool) -> None:
        from megatron_armor.config.rollout_traits import ReferencePlan
        from megatron_armor.rollout.reference import make_reference_sampler

        backend = backend_of(config)
        for pool in pools:
            engine = backend.build(config, device, pool, (servers or {}).get(pool))
            if pool == "policy":
                self.engine = engine
            else:
                self.ref_engine = engine
        self.tokenizer = load_model_tokenizer(config.trainer.model_path)
        plan = reference_strategy(config)
        if not get_anchor_mode(config.algo.anchor).draws_reference:
            plan = ReferencePlan("none", "none")  # no reference samples: no reference weights
        ref_engine = self.ref_engine
        if backend.serves_over_http and plan.swaps_into_policy:
            # the trainer ranks swap the reference into the policy servers around each call
            # (orchestration/actors/weight_sync.py): the servers then serve it like a dedicated pool
            strategy = plan.strategy if plan.caches_anchors else "dedicated"
            plan, ref_engine = ReferencePlan(strategy, "dedicated"), self.engine
        self.keep_copies = plan.swaps_into_policy
        self.copies: dict[str, NamedTensors] = {}
        self.counted: dict[str, float] = {}
        self.reference = None  # a node with only policy servers samples no reference
        if self.ref_engine is not None or not wanted_ref:
            self.reference = make_reference_sampler(
                plan.strategy, self.engine, weights_fn=self._weights, ref_engine=ref_engine,
                cache_fill=plan.cache_fill,
            )  # fmt: skip

    def _weights(self, which: str) -> NamedTensors:
        if which not in self.copies:
            raise RuntimeError(f"rollout worker {self.index}: no {which!r} weights pushed yet")
        return self.copies[which]

    def _pool(self, pool: str):
        engine = self.engine if pool == "policy" else self.ref_engine
        if engine is None:
            raise ValueError(f"rollout worker {self.index} has no {pool!r} engine pool")
        return engine

    def generate(self, items: list, n: int, params: SamplingParams,
                 answers_for: str | None = None, answer_parts: int = 1):  # fmt: skip
        """``n`` policy samples per item; with ``answers_for`` (a ``reward.verifier``) also
        their :class:`~megatron_armor.reward.scorer.Answer` s in ``answer_parts`` parts, for
        scoring chained to this call (:func:`with_answers`)."""
        with nvtx_range("rollout/policy"), self.clock.measure():
            outputs = self.engine.generate([it.prompt_ids for it in items], n, params, "policy")
        return with_answers(to_samples(items, outputs, SampleSource.POLICY, self.tokenizer),
                            answers_for, answer_parts)  # fmt: skip

    def generate_window(self, requests: list, params: SamplingParams, window_tokens: int):
        """One window of a partial rollout (``RolloutEngine.generate_window``): each request's
        new tokens, as the engine gives them (docs/orchestration.md, "Bounded staleness")."""
        with nvtx_range("rollout/policy"), self.clock.measure():
            return self.engine.generate_window(requests, params, window_tokens, "policy")

    def generate_raw(
        self, prompts: list[list[int]], n: int, params: SamplingParams, weights: str = "policy"
    ):
        """Engine outputs as they are (used by validation through ``RemoteEngine``)."""
        return self.engine.generate(prompts, n, params, weights)

    def sample_reference(self, items: list, n: int, params: SamplingParams,
                         answers_for: str | None = None, answer_parts: int = 1):  # fmt: skip
        """``n`` reference samples per item, in generation order (fresh or cached); cached
        samples whose reward the cache remembers come back ``scored``. ``answers_for``: as in
        :meth:`generate` (answers of the samples not ``scored``), ``answer_parts`` likewise."""
        query_ids = [it.query_id for it in items]
        with nvtx_range("rollout/reference"), self.clock.measure():
            outputs = self.reference.sample(query_ids, [it.prompt_ids for it in items], n, params)
        samples = to_samples(items, outputs, SampleSource.REFERENCE, self.tokenizer)
        remembered = getattr(self.reference, "scores", None)  # the anchor cache
        if remembered is not None:
            set_remembered_scores(samples, remembered(query_ids, n))
        return with_answers(samples, answers_for, answer_parts)

    def remember_reference_scores(self, query_ids: list[str], scores: list[list]) -> None:
        """Keep the driver's ``(score, acc)`` of freshly cached reference samples (anchor cache)."""
        self.reference.remember_scores(query_ids, scores)

    def compute_intervals(self) -> list[tuple[float, float]]:
        """Engine generation (policy and reference) since the last call (:class:`ComputeClock`)."""
        return self.clock.pop()

    def update_weights(self, version: int, *shards: NamedTensors) -> int:
        """Load the trainer's exported policy tensors (one list per exporting rank); returns
        bytes. Shards that are all ``None`` (an export ``if_changed`` after a step whose every
        update was skipped) load nothing: the engine keeps its weights and their version."""
        if all(shard is None for shard in shards):
            return 0
        tensors = [nt for shard in shards for nt in shard]
        self.engine.update_weights(tensors, version, "policy")
        if self.keep_copies:
            self.copies["policy"] = tensors
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def load_reference(self, version: int, *shards: NamedTensors) -> None:
        """Serve ``shards`` as the reference at ``version`` (start-up / resume; cache kept)."""
        tensors = [nt for shard in shards for nt in shard]
        if self.keep_copies:
            self.copies["ref"] = tensors
        self.reference.load_reference(version, lambda: iter(tensors))

    def reset_reference(self, version: int, *shards: NamedTensors) -> None:
        """A reset: the reference becomes ``shards`` (the policy at ``version``); cache dropped."""
        tensors = [nt for shard in shards for nt in shard]
        if self.keep_copies:
            self.copies["ref"] = tensors
        self.reference.on_reset(version, lambda: iter(tensors))

    def reset_reference_from_policy(self, version: int) -> None:
        """A reset to the policy this worker's engine serves at ``version`` (pushed this
        step; embedded engine): the reference is copied from it, nothing is received."""
        held = self.engine.weight_version("policy")
        if held != version or self.ref_engine is not None:
            raise RuntimeError(
                f"rollout worker {self.index}: a reset to the policy at version {version} from "
                f"the engine's own weights, but it serves version {held}"
                f"{' and its reference from another engine' if self.ref_engine else ''}; "
                "push the reference with reset_reference instead"
            )
        tensors = self.engine.state_tensors("policy")
        if self.keep_copies:
            self.copies["ref"] = self.copies["policy"]
        self.reference.on_reset(version, lambda: iter(tensors))

    def reference_in_place(self, version: int, reset: bool) -> None:
        """Record reference ``version`` (on a ``reset`` also drop the anchor cache) without
        receiving weights: the trainer ranks streamed them into the reference pool (NCCL
        transport), or the run draws no reference samples (``algo.anchor: none``)."""
        if self.ref_engine is not None:
            self.ref_engine.set_weight_version(version)
        if reset:
            self.reference.on_reset(version, None)
        else:
            self.reference.load_reference(version, None)

    def reference_metrics(self) -> dict[str, float]:
        """Anchor-cache hits/misses since the last call and the cache size (cache strategy only)."""
        metrics = getattr(self.reference, "metrics", None)
        if metrics is None:
            return {}
        out = dict(metrics())
        for key in ("anchor/cache_hits", "anchor/cache_misses"):
            total = out.get(key, 0.0)
            out[key] = total - self.counted.get(key, 0.0)
            self.counted[key] = total
        return out

    def weight_targets(self, pool: str = "policy") -> list[tuple[str, int, int, str]]:
        """``[(server_url, tp, server index, API key)]`` of the SGLang servers of ``pool``
        (the key the trainer ranks send with their pushes; ``""`` when the servers need none)."""
        engine = self._pool(pool)
        return [(s.url, s.tp, s.index, engine.api_key) for s in engine.servers]

    def set_weight_version(self, version: int, pool: str = "policy") -> None:
        """Record ``version`` after the trainer ranks pushed the weights themselves."""
        self._pool(pool).set_weight_version(version)

    def load_from_disk(
        self, pool: str, path: str, version: int, indices: list[int] | None = None
    ) -> None:
        """``/update_weights_from_disk`` of the HF dir ``path`` the trainer ranks wrote, into
        ``pool``'s servers ``indices`` (default: all, which then serve ``version``)."""
        self._pool(pool).update_weights_from_disk(
            path, version, self._servers_or_all(pool, indices)
        )

    def reference_misses(self, items: list, n: int) -> int:
        """How many of ``items`` need fresh reference samples (the rest are cached anchors)."""
        uncached = getattr(self.reference, "uncached", None)  # the anchor cache
        if uncached is None:
            return len(items)
        return uncached([it.query_id for it in items], [it.prompt_ids for it in items], n)

    def reference_unsolved(self, items: list, n: int) -> list[bool]:
        """Per item, whether the anchor cache holds ``n`` scored reference samples of it, none
        correct (``False`` for every item without the anchor cache)."""
        unsolved = getattr(self.reference, "unsolved", None)  # the anchor cache
        if unsolved is None:
            return [False] * len(items)
        return unsolved([it.query_id for it in items], [it.prompt_ids for it in items], n)

    def peak_gpu_memory_gb(self) -> tuple[float, float] | None:
        """Peak GPU memory (allocated, reserved) of the embedded engine in this process (``None`` without CUDA;
        SGLang servers are separate processes)."""
        return peak_gpu_memory_gb()

    def node_info(self) -> dict[str, Any]:
        return node_info()

    def pools(self) -> list[str]:
        """The pools with servers (or the embedded engine) in this worker."""
        named = (("policy", self.engine), ("ref", self.ref_engine))
        return [pool for pool, engine in named if engine is not None]

    def release_memory(self) -> None:
        for pool in self.pools():
            self._pool(pool).release_memory()

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Every pool takes back the memory of ``tags`` (``None``: all)."""
        for pool in self.pools():
            self._pool(pool).resume_memory(tags)

    def begin_weight_update(self, pool: str, indices: list[int] | None = None) -> None:
        """Open the weight-update session of ``pool``'s servers ``indices`` (default: all)."""
        self._pool(pool).begin_weight_update(self._servers_or_all(pool, indices))

    def end_weight_update(self, pool: str, indices: list[int] | None = None) -> None:
        """Close the session :meth:`begin_weight_update` opened."""
        self._pool(pool).end_weight_update(self._servers_or_all(pool, indices))

    def _servers_or_all(self, pool: str, indices: list[int] | None):
        return None if indices is None else self._servers(pool, indices)

    # ------------------------------------------------------------------ health (SGLang)
    def restart_dead_servers(self) -> dict[str, list[int]]:
        """Restart every server that is dead or unhealthy; they stay out of rotation until
        :meth:`rejoin` (after the driver re-synced their weights). ``{pool: [server index]}``."""
        restarted: dict[str, list[int]] = {}
        for pool in self.pools():
            engine = self._pool(pool)
            dead = [s for s in engine.servers if not engine.server_healthy(s)]
            for server in dead:
                engine.restart_server(server)
            if dead:
                restarted[pool] = [s.index for s in dead]
        return restarted

    def kill_wedged_servers(self, timeout_s: float) -> dict[str, Any]:
        """Kill every SGLang server of this worker whose ``/health_generate`` gives no 200
        within ``timeout_s`` (``SGLangEngine.wedged_servers``): ``{"killed": [{pool, index,
        url, pid}], "answered": servers that answered}``. Asked by the driver past a call
        deadline, from the ``watch`` group while a call may wait on the server here; the
        driver's heal restarts them with the current weights."""
        killed, answered = [], 0
        for pool in self.pools():
            engine = self._pool(pool)
            if not hasattr(engine, "wedged_servers"):
                continue  # the embedded engine: no server
            wedged = engine.wedged_servers(timeout_s)
            answered += sum(1 for s in engine.servers if s.serving) - len(wedged)
            for server in wedged:
                pid = server.process.process.pid if server.process and server.process.process else 0
                engine.kill_server(server)
                killed.append({"pool": pool, "index": server.index, "url": server.url, "pid": pid})
        return {"killed": killed, "answered": answered}

    kill_wedged_servers.__ray_concurrency_group__ = WATCH_GROUP

    def _servers(self, pool: str, indices: list[int]) -> list:
        by_index = {s.index: s for s in self._pool(pool).servers}
        return [by_index[i] for i in indices]

    def rejoin(self, pool: str, indices: list[int]) -> None:
        """Put the re-synced servers ``indices`` of ``pool`` back into rotation."""
        engine = self._pool(pool)
        for server in self._servers(pool, indices):
            engine.rejoin(server)

    def pool_version(self, pool: str) -> int:
        return self._pool(pool).weight_version()

    def weight_versions(self) -> dict[str, int]:
        versions = {}
        if self.engine is not None:
            versions["policy"] = self.engine.weight_version("policy")
            if self.engine.has_weights("ref"):
                versions["ref"] = self.engine.weight_version("ref")
        if self.ref_engine is not None:
            versions["ref"] = self.ref_engine.weight_version()
        return versions

    def state_dict(self) -> dict:
        return self.reference.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """The reference sampler's state of a checkpoint or of a step's snapshot (a worker
        replaced in the run, ``orchestration/actors/recovery.py``); the anchor-cache counters restart
        from it, so the next ``anchor/cache_*`` read counts what came after."""
        self.reference.load_state_dict(state)
        self.counted = {}

    def health(self) -> bool:
        return all(self._pool(pool).health() for pool in self.pools())

    def close(self) -> None:
        """Stop the engines this worker launched (SGLang servers and routers)."""
        for engine in (self.ref_engine, self.engine):
            if engine is not None:
                engine.close()


def reference_strategy(config: ArmorConfig) -> ReferencePlan:
    """``(strategy, cache_fill)`` of ``rollout.ref_strategy`` and ``algo.anchor_source``
    (``config.rollout_traits.reference_strategy``)."""
    from megatron_armor.config.rollout_traits import reference_strategy as strategy_of

    return strategy_of(config.rollout.ref_strategy, config.algo.anchor_source)


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
        generation call (object refs that Ray resolves here; :func:`with_answers`), scored in
        one batch: ``[(score, acc)]`` per part, in order, and the scorer's stats."""
        scored, stats = self.scorer.score_answers([a for part in answer_parts for a in part])
        out, start = [], 0
        for part in answer_parts:
            out.append(scored[start : start + len(part)])
            start += len(part)
        return out, stats

    def close(self) -> None:
        self.scorer.close()
