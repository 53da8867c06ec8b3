"""What a rollout worker serves, one class per concern, inside the worker's process.

:class:`~megatron_armor.orchestration.actors.rollout_worker.RolloutWorker` (the Ray actor) is
the union of these classes; each is also a plain class, built from what it needs, so it is
used and tested without Ray:

===================  ========================================================================
class                owns
===================  ========================================================================
GenerationService    policy samples (as ``Sample`` rows, with the answers of chained
                     scoring) and validation's raw engine outputs
ReferenceService     reference samples and the anchor cache's bookkeeping: remembered
                     scores, cached verdicts, the counters, the sampler's state
WeightIntake         weights and versions into the engines: the trainer's exported tensors
                     (embedded engine), versions the trainer ranks pushed themselves, loads
                     from disk, SGLang's weight-update sessions, the servers' addresses, the
                     reference's weights and version
MemoryService        the engines' accelerator memory released and taken back (``colocated``)
HealthService        the SGLang servers: health, the dead restarted, the wedged killed, the
                     re-synced put back
===================  ========================================================================

They share what the worker built once: the engines (:class:`EnginePools`), the reference
sampler, the tokenizer and the compute clock; nothing is attached to them afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron_armor.observability.nvtx import nvtx_range
from megatron_armor.orchestration.actors.watched import WATCH_GROUP
from megatron_armor.orchestration.actors.workers import (
    ComputeClock,
    NamedTensors,
    shard,
)
from megatron_armor.rollout.protocol import GenerationOutput, RolloutEngine, SamplingParams
from megatron_armor.types import Sample, SampleSource

if TYPE_CHECKING:
    from megatron_armor.rollout.reference import ReferenceSampler

POOLS = ("policy", "ref")
"""The engine pools a worker can run: the policy servers (or the embedded engine) and a
reference pool."""


class EnginePools:
    """The engines of one rollout worker by pool (``policy``, ``ref``; a node may hold only
    one of them)."""

    def __init__(self, engines: dict[str, RolloutEngine], index: int) -> None:
        self.engines, self.index = engines, index

    @property
    def policy(self) -> RolloutEngine | None:
        return self.engines.get("policy")

    @property
    def ref(self) -> RolloutEngine | None:
        return self.engines.get("ref")

    def names(self) -> list[str]:
        """The pools with an engine here, in :data:`POOLS` order."""
        return [pool for pool in POOLS if pool in self.engines]

    def pool(self, name: str) -> RolloutEngine:
        engine = self.engines.get(name)
        if engine is None:
            raise ValueError(f"rollout worker {self.index} has no {name!r} engine pool")
        return engine

    def servers(self, pool: str, indices: list[int] | None) -> list | None:
        """The servers ``indices`` of ``pool`` (``None``: all)."""
        if indices is None:
            return None
        by_index = {s.index: s for s in self.pool(pool).servers}
        return [by_index[i] for i in indices]

    def close(self) -> None:
        """Stop the engines (SGLang servers and routers), the reference pool first."""
        for pool in reversed(self.names()):
            self.engines[pool].close()


class WeightCopies:
    """CPU copies of the last pushed policy and reference tensors, which the ``swap``
    reference sampler of the embedded engine loads around each reference call (``keep`` off:
    none are kept). Called as the sampler's ``weights_fn``."""

    def __init__(self, keep: bool, index: int) -> None:
        self.keep, self.index = keep, index
        self.copies: dict[str, NamedTensors] = {}

    def hold(self, which: str, tensors: NamedTensors) -> None:
        if self.keep:
            self.copies[which] = tensors

    def reference_from_policy(self) -> None:
        """A reset to the policy the engine serves: the reference copy is the policy's."""
        if self.keep:
            self.copies["ref"] = self.copies["policy"]

    def __call__(self, which: str) -> NamedTensors:
        if which not in self.copies:
            raise RuntimeError(f"rollout worker {self.index}: no {which!r} weights pushed yet")
        return self.copies[which]


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


def with_answers(rows: list[list[Sample]], verifier: str | None, parts: int = 1):
    """``rows``, or with a ``verifier`` ``(rows, *answer parts)``: the ``Answer`` of each
    sample not ``scored``, in row order, split into ``parts`` contiguous parts (one per scoring
    worker, :func:`~megatron_armor.orchestration.actors.workers.shard`), which a generation
    call returns as objects of their own so each scoring worker takes its part from the object
    store, with no driver in between and no answer sent twice (``rollout_draws.submit_scored``)."""
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


class GenerationService:
    """Policy samples and validation's outputs from the policy engine."""

    def __init__(self, pools: EnginePools, tokenizer, clock: ComputeClock) -> None:
        self.pools, self.tokenizer, self.clock = pools, tokenizer, clock

    def generate(self, items: list, n: int, params: SamplingParams,
                 answers_for: str | None = None, answer_parts: int = 1):  # fmt: skip
        """``n`` policy samples per item; with ``answers_for`` (a ``reward.verifier``) also
        their answers in ``answer_parts`` parts, for scoring chained to this call
        (:func:`with_answers`)."""
        engine = self.pools.pool("policy")
        with nvtx_range("rollout/policy"), self.clock.measure():
            outputs = engine.generate([it.prompt_ids for it in items], n, params, "policy")
        return with_answers(to_samples(items, outputs, SampleSource.POLICY, self.tokenizer),
                            answers_for, answer_parts)  # fmt: skip

    def generate_window(self, requests: list, params: SamplingParams, window_tokens: int):
        """One window of a partial rollout (``RolloutEngine.generate_window``): each request's
        new tokens, as the engine gives them (docs/orchestration.md, "Bounded staleness")."""
        engine = self.pools.pool("policy")
        with nvtx_range("rollout/policy"), self.clock.measure():
            return engine.generate_window(requests, params, window_tokens, "policy")

    def generate_raw(
        self, prompts: list[list[int]], n: int, params: SamplingParams, weights: str = "policy"
    ):
        """Engine outputs as they are (validation, through ``rollout_draws.RemoteEngine``)."""
        return self.pools.pool("policy").generate(prompts, n, params, weights)


class ReferenceService:
    """Reference samples and the anchor cache (``rollout/reference.py``): the sampler answers
    every question of the cache, with its base's answers where it keeps none."""

    def __init__(self, reference: ReferenceSampler | None, tokenizer, clock: ComputeClock):
        """``reference``: ``None`` on a node with only policy servers (it samples none)."""
        self.reference, self.tokenizer, self.clock = reference, tokenizer, clock
        self.counted: dict[str, float] = {}

    def sample_reference(self, items: list, n: int, params: SamplingParams,
                         answers_for: str | None = None, answer_parts: int = 1):  # fmt: skip
        """``n`` reference samples per item, in generation order (fresh or cached); cached
        samples whose reward the cache remembers come back ``scored``. ``answers_for`` and
        ``answer_parts``: as in ``GenerationService.generate`` (answers of the samples not
        ``scored``)."""
        query_ids = [it.query_id for it in items]
        with nvtx_range("rollout/reference"), self.clock.measure():
            outputs = self.reference.sample(query_ids, [it.prompt_ids for it in items], n, params)
        samples = to_samples(items, outputs, SampleSource.REFERENCE, self.tokenizer)
        set_remembered_scores(samples, self.reference.scores(query_ids, n))
        return with_answers(samples, answers_for, answer_parts)

    def remember_reference_scores(self, query_ids: list[str], scores: list[list]) -> None:
        """Keep the driver's ``(score, acc)`` of freshly cached reference samples."""
        self.reference.remember_scores(query_ids, scores)

    def reference_misses(self, items: list, n: int) -> int:
        """How many of ``items`` need fresh reference samples (the rest are cached anchors)."""
        return self.reference.uncached([it.query_id for it in items],
                                       [it.prompt_ids for it in items], n)  # fmt: skip

    def reference_unsolved(self, items: list, n: int) -> list[bool]:
        """Per item, whether the anchor cache holds ``n`` scored reference samples of it, none
        correct (``False`` for every item without the anchor cache)."""
        return self.reference.unsolved([it.query_id for it in items],
                                       [it.prompt_ids for it in items], n)  # fmt: skip

    def reference_metrics(self) -> dict[str, float]:
        """Anchor-cache hits and misses since the last call and the cache size (``{}``
        without the cache)."""
        out = dict(self.reference.metrics())
        for key in ("anchor/cache_hits", "anchor/cache_misses"):
            if key in out:
                total = out[key]
                out[key] = total - self.counted.get(key, 0.0)
                self.counted[key] = total
        return out

    def state_dict(self) -> dict:
        return self.reference.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """The reference sampler's state of a checkpoint or of a step's snapshot (a worker
        replaced in the run, ``orchestration/actors/recovery.py``); the anchor-cache counters
        restart from it, so the next ``anchor/cache_*`` read counts what came after."""
        self.reference.load_state_dict(state)
        self.counted = {}


class WeightIntake:
    """Weights and versions into this worker's engines, policy and reference."""

    def __init__(self, pools: EnginePools, copies: WeightCopies,
                 reference: ReferenceSampler | None) -> None:  # fmt: skip
        self.pools, self.copies, self.reference = pools, copies, reference

    def update_weights(self, version: int, *shards: NamedTensors) -> int:
        """Load the trainer's exported policy tensors (one list per exporting rank); returns
        bytes. Shards that are all ``None`` (an export ``if_changed`` after a step whose every
        update was skipped) load nothing: the engine keeps its weights and their version."""
        if all(part is None for part in shards):
            return 0
        tensors = [nt for part in shards for nt in part]
        self.pools.pool("policy").update_weights(tensors, version, "policy")
        self.copies.hold("policy", tensors)
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def load_reference(self, version: int, *shards: NamedTensors) -> None:
        """Serve ``shards`` as the reference at ``version`` (start-up / resume; cache kept)."""
        tensors = [nt for part in shards for nt in part]
        self.copies.hold("ref", tensors)
        self.reference.load_reference(version, lambda: iter(tensors))

    def reset_reference(self, version: int, *shards: NamedTensors) -> None:
        """A reset: the reference becomes ``shards`` (the policy at ``version``); cache dropped."""
        tensors = [nt for part in shards for nt in part]
        self.copies.hold("ref", tensors)
        self.reference.on_reset(version, lambda: iter(tensors))

    def reset_reference_from_policy(self, version: int) -> None:
        """A reset to the policy this worker's engine serves at ``version`` (pushed this
        step; embedded engine): the reference is copied from it, nothing is received."""
        engine, ref_engine = self.pools.pool("policy"), self.pools.ref
        held = engine.weight_version("policy")
        if held != version or ref_engine is not None:
            raise RuntimeError(
                f"rollout worker {self.pools.index}: a reset to the policy at version {version} "
                f"from the engine's own weights, but it serves version {held}"
                f"{' and its reference from another engine' if ref_engine else ''}; "
                "push the reference with reset_reference instead"
            )
        tensors = engine.state_tensors("policy")
        self.copies.reference_from_policy()
        self.reference.on_reset(version, lambda: iter(tensors))

    def reference_in_place(self, version: int, reset: bool) -> None:
        """Record reference ``version`` (on a ``reset`` also drop the anchor cache) without
        receiving weights: the trainer ranks streamed them into the reference pool, or the run
        draws no reference samples (``algo.anchor: none``)."""
        if self.pools.ref is not None:
            self.pools.ref.set_weight_version(version)
        if reset:
            self.reference.on_reset(version, None)
        else:
            self.reference.load_reference(version, None)

    def weight_targets(self, pool: str = "policy") -> list[tuple[str, int, int, str]]:
        """``[(server_url, tp, server index, API key)]`` of the SGLang servers of ``pool``
        (the key the trainer ranks send with their pushes; ``""`` when the servers need none)."""
        engine = self.pools.pool(pool)
        return [(s.url, s.tp, s.index, engine.api_key) for s in engine.servers]

    def set_weight_version(self, version: int, pool: str = "policy") -> None:
        """Record ``version`` after the trainer ranks pushed the weights themselves."""
        self.pools.pool(pool).set_weight_version(version)

    def load_from_disk(
        self, pool: str, path: str, version: int, indices: list[int] | None = None
    ) -> None:
        """``/update_weights_from_disk`` of the HF dir ``path`` the trainer ranks wrote, into
        ``pool``'s servers ``indices`` (default: all, which then serve ``version``)."""
        servers = self.pools.servers(pool, indices)
        self.pools.pool(pool).update_weights_from_disk(path, version, servers)

    def begin_weight_update(self, pool: str, indices: list[int] | None = None) -> None:
        """Open the weight-update session of ``pool``'s servers ``indices`` (default: all)."""
        self.pools.pool(pool).begin_weight_update(self.pools.servers(pool, indices))

    def end_weight_update(self, pool: str, indices: list[int] | None = None) -> None:
        """Close the session :meth:`begin_weight_update` opened."""
        self.pools.pool(pool).end_weight_update(self.pools.servers(pool, indices))

    def pool_version(self, pool: str) -> int:
        return self.pools.pool(pool).weight_version()

    def weight_versions(self) -> dict[str, int]:
        """``{pool or weight set: version}`` of what this worker serves."""
        versions, policy, ref = {}, self.pools.policy, self.pools.ref
        if policy is not None:
            versions["policy"] = policy.weight_version("policy")
            if policy.has_weights("ref"):
                versions["ref"] = policy.weight_version("ref")
        if ref is not None:
            versions["ref"] = ref.weight_version()
        return versions


class MemoryService:
    """The engines' accelerator memory (``colocated``: released while the trainer works)."""

    def __init__(self, pools: EnginePools) -> None:
        self.pools = pools

    def release_memory(self) -> None:
        for pool in self.pools.names():
            self.pools.pool(pool).release_memory()

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Every pool takes back the memory of ``tags`` (``None``: all)."""
        for pool in self.pools.names():
            self.pools.pool(pool).resume_memory(tags)


class HealthService:
    """The SGLang servers' health (an embedded engine has none: nothing to restart or kill)."""

    def __init__(self, pools: EnginePools) -> None:
        self.pools = pools

    def health(self) -> bool:
        return all(self.pools.pool(pool).health() for pool in self.pools.names())

    def restart_dead_servers(self) -> dict[str, list[int]]:
        """Restart every server that is dead or unhealthy; they stay out of rotation until
        :meth:`rejoin` (after the driver re-synced their weights). ``{pool: [server index]}``."""
        restarted: dict[str, list[int]] = {}
        for pool in self.pools.names():
            engine = self.pools.pool(pool)
            dead = [s for s in engine.servers if not engine.server_healthy(s)]
            for server in dead:
                engine.restart_server(server)
            if dead:
                restarted[pool] = [s.index for s in dead]
        return restarted

    def kill_wedged_servers(self, timeout_s: float) -> dict[str, Any]:
        """Kill every SGLang server of this worker whose ``/health_generate`` gives no 200
        within ``timeout_s`` (``RolloutEngine.wedged_servers``): ``{"killed": [{pool, index,
        url, pid}], "answered": servers that answered}``. Asked by the driver past a call
        deadline, from the ``watch`` group while a call may wait on the server here; the
        driver's heal restarts them with the current weights."""
        killed, answered = [], 0
        for pool in self.pools.names():
            engine = self.pools.pool(pool)
            wedged = engine.wedged_servers(timeout_s)
            answered += sum(1 for s in engine.servers if s.serving) - len(wedged)
            for server in wedged:
                pid = server.process.process.pid if server.process and server.process.process else 0
                engine.kill_server(server)
                killed.append({"pool": pool, "index": server.index, "url": server.url, "pid": pid})
        return {"killed": killed, "answered": answered}

    kill_wedged_servers.__ray_concurrency_group__ = WATCH_GROUP

    def rejoin(self, pool: str, indices: list[int]) -> None:
        """Put the re-synced servers ``indices`` of ``pool`` back into rotation."""
        engine = self.pools.pool(pool)
        for server in self.pools.servers(pool, indices):
            engine.rejoin(server)
