"""Serving the reference policy ``pi_ref`` for anchors (ARMOR Algorithm 1 line 9, docs/algorithm.md, anchor rollout).

Three strategies, chosen by ``rollout.ref_strategy``:

- ``swap``: one engine. Load the trainer's reference weights into the engine, sample the
  anchors, reload the policy weights: two weight syncs per step, no extra engine memory.
- ``dedicated``: the reference lives in its own weight set (the embedded engine's ``ref``
  set) or in a separate engine pool; it is synced only at a reset (and at start / resume).
- ``cache``: anchors for a query are generated once per reference period and reused until
  the next reset, which invalidates the cache (the review's replay idea). Misses are filled
  by an inner ``dedicated`` (default) or ``swap`` sampler. The cache also keeps the
  ``(score, acc)`` the driver gave its samples, so a hit is not scored again.

Every strategy returns :class:`GenerationOutput` objects whose ``weight_version`` is the
reference version (the step of the last reset). The reference version and the anchor cache
are in :meth:`ReferenceSampler.state_dict` so a resume does not silently revert them
(docs/algorithm.md, reference reset).

Start-up and resume: the caller pushes the reference once with
:meth:`ReferenceSampler.load_reference` (no cache invalidation); at a reset it calls
:meth:`ReferenceSampler.on_reset`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch

from megatron_armor.config.rollout_traits import REFERENCE_TRAITS, STRATEGIES, ReferenceTraits
from megatron_armor.rollout.protocol import GenerationOutput, RolloutEngine, SamplingParams
from megatron_armor.types import RoutedExperts

NamedTensors = Iterable[tuple[str, torch.Tensor]]
WeightsFn = Callable[[str], NamedTensors]
"""``weights_fn(which)`` streams the trainer's HF-named ``which`` weights (``policy`` | ``ref``),
e.g. ``trainer.export_weights``."""


Scores = list[tuple[float, bool]]
"""``(score, acc)`` of each cached reference sample, in generation order."""


class ReferenceSampler(ABC):
    """Draws reference samples; tracks the reference weight version. The questions a rollout
    worker asks the anchor cache (:meth:`scores`, :meth:`remember_scores`, :meth:`uncached`,
    :meth:`unsolved`, :meth:`metrics`) are declared here with the answers of a sampler that
    keeps no samples; :class:`CachedReferenceSampler` answers them from its cache."""

    def __init__(self, ref_version: int = 0) -> None:
        self.ref_version = ref_version

    @abstractmethod
    def sample(
        self, query_ids: list[str], prompts: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[GenerationOutput]]:
        """``n`` reference samples for each prompt; result ``[len(prompts)][n]``."""

    def load_reference(
        self, version: int, named_tensors_fn: Callable[[], NamedTensors] | None
    ) -> None:
        """Make the engine serve the reference weights ``named_tensors_fn()`` as ``version``
        (``None``: the trainer already streamed them into the engine; only record it)."""
        self.ref_version = version

    def on_reset(self, version: int, named_tensors_fn: Callable[[], NamedTensors] | None) -> None:
        """A reference reset (docs/algorithm.md, reference reset): the policy became the reference at ``version``."""
        self.load_reference(version, named_tensors_fn)

    def state_dict(self) -> dict:
        return {"ref_version": self.ref_version}

    def load_state_dict(self, state: dict) -> None:
        self.ref_version = int(state["ref_version"])

    # ---- what an anchor cache answers; a sampler that keeps no samples answers so
    def scores(self, query_ids: list[str], n: int) -> list[Scores | None]:
        """The remembered ``(score, acc)`` of each query's first ``n`` samples (``None``:
        none remembered); default: none kept."""
        return [None] * len(query_ids)

    def remember_scores(self, query_ids: list[str], scores: list[Scores]) -> None:
        """Keep the driver's ``(score, acc)`` of the samples a :meth:`sample` call returned;
        default: refused, a sampler that keeps no samples has nothing to attach them to."""
        raise ValueError(
            f"{type(self).__name__} keeps no reference samples: only the anchor cache "
            "(rollout.ref_strategy=cache or algo.anchor_source=cache) remembers their scores"
        )

    def uncached(self, query_ids: list[str], prompts: list[list[int]], n: int) -> int:
        """How many of the queries :meth:`sample` would generate afresh; default: all."""
        return len(query_ids)

    def unsolved(self, query_ids: list[str], prompts: list[list[int]], n: int) -> list[bool]:
        """Per query, whether rule (b) rejects it already (its ``n`` kept samples scored, none
        correct); default: no verdict kept."""
        return [False] * len(query_ids)

    def metrics(self) -> dict[str, float]:
        """``anchor/cache_*`` counters; default: none."""
        return {}


def _as_list(values) -> list:
    """A tensor (or, from older checkpoints, a list) as a Python list."""
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def _output_tensors(output: GenerationOutput) -> dict:
    saved = {
        "token_ids": torch.tensor(output.token_ids, dtype=torch.int32),
        "logprobs": torch.tensor(output.logprobs, dtype=torch.float64),
        "finish_reason": output.finish_reason,
        "weight_version": int(output.weight_version),
    }
    if output.routed_experts is not None:  # a cached anchor keeps the reference's routes
        saved["routed_experts"] = asdict(output.routed_experts)
    return saved


def _output_from(saved: dict) -> GenerationOutput:
    routes = saved.get("routed_experts")  # absent: a dense model, or routes not asked for
    return GenerationOutput(
        token_ids=_as_list(saved["token_ids"]),
        logprobs=_as_list(saved["logprobs"]),
        finish_reason=saved["finish_reason"],
        weight_version=int(saved["weight_version"]),
        routed_experts=RoutedExperts(**routes) if routes else None,
    )


class NoReferenceSampler(ReferenceSampler):
    """``algo.anchor: none``: the run draws no reference samples; the engines hold no
    reference weights and only the reference version (moved by resets) is tracked."""

    def sample(self, query_ids, prompts, n, params):
        raise RuntimeError(
            "reference samples were asked for with algo.anchor=none; set algo.anchor to "
            "'armor' or 'filter_only' to draw them"
        )


class SwapReferenceSampler(ReferenceSampler):
    """``swap``: load ``weights_fn('ref')`` into the engine, sample, reload ``weights_fn('policy')``.

    The trainer keeps ``theta_ref`` (pinned CPU copies on its ranks), so :meth:`load_reference`
    only records the version; the tensors are streamed by ``weights_fn`` at every :meth:`sample`.
    While the engine's policy is at the reference's version (a reset since the last policy
    push, or both at the start weights: versions name the trainer's weights after that step)
    the engine already serves the reference, and :meth:`sample` loads nothing.
    """

    def __init__(self, engine: RolloutEngine, weights_fn: WeightsFn, ref_version: int = 0) -> None:
        super().__init__(ref_version)
        self.engine = engine
        self.weights_fn = weights_fn

    def sample(self, query_ids, prompts, n, params):
        policy_version = self.engine.weight_version("policy")
        if policy_version == self.ref_version:
            return self.engine.generate(prompts, n, params)
        self.engine.update_weights(self.weights_fn("ref"), self.ref_version)
        try:
            return self.engine.generate(prompts, n, params)
        finally:
            self.engine.update_weights(self.weights_fn("policy"), policy_version)


class DedicatedReferenceSampler(ReferenceSampler):
    """``dedicated``: the reference stays loaded in weight set ``weights`` of ``engine``."""

    def __init__(self, engine: RolloutEngine, weights: str = "ref", ref_version: int = 0) -> None:
        super().__init__(ref_version)
        self.engine = engine
        self.weights = weights

    def load_reference(self, version, named_tensors_fn):
        if named_tensors_fn is not None:
            self.engine.update_weights(named_tensors_fn(), version, self.weights)
        super().load_reference(version, named_tensors_fn)

    def sample(self, query_ids, prompts, n, params):
        return self.engine.generate(prompts, n, params, weights=self.weights)


@dataclass
class CacheEntry:
    """One query's cached reference samples; ``scores`` once the driver scored them."""

    prompt: list[int]
    outputs: list[GenerationOutput]
    scores: Scores | None = None


def _entry_tensors(entry: CacheEntry) -> dict:
    saved = {"prompt": torch.tensor(entry.prompt, dtype=torch.int32),
             "outputs": [_output_tensors(o) for o in entry.outputs]}  # fmt: skip
    if entry.scores is not None:
        saved["score"] = torch.tensor([s for s, _ in entry.scores], dtype=torch.float64)
        saved["acc"] = torch.tensor([a for _, a in entry.scores], dtype=torch.bool)
    return saved


def _entry_from(saved: dict) -> CacheEntry:
    """A saved entry (checkpoints before the scores were kept have none: scored again)."""
    scores = None
    if "score" in saved:
        scores = list(zip(_as_list(saved["score"]), map(bool, _as_list(saved["acc"])), strict=True))
    return CacheEntry(
        _as_list(saved["prompt"]), [_output_from(o) for o in saved["outputs"]], scores
    )


class CachedReferenceSampler(ReferenceSampler):
    """``cache``: per query, the first ``n`` reference samples of this reference period.

    Cache entries are keyed by query id and remember the prompt (a different prompt under the
    same id is an error) and, once :meth:`remember_scores` recorded them, the samples'
    ``(score, acc)``: the reward of a response is fixed within a run, so a hit reuses them
    instead of scoring the same responses again (:meth:`scores`). ``hits``/``misses`` count
    queries for the logs.
    """

    def __init__(self, inner: ReferenceSampler) -> None:
        super().__init__(inner.ref_version)
        self.inner = inner
        self.cache: dict[str, CacheEntry] = {}
        self.hits = 0
        self.misses = 0

    def sample(self, query_ids, prompts, n, params):
        if len(query_ids) != len(prompts):
            raise ValueError(
                f"reference cache: {len(query_ids)} query ids for {len(prompts)} prompts"
            )
        missing = [i for i, q in enumerate(query_ids) if not self._cached(q, prompts[i], n)]
        if missing:
            fresh = self.inner.sample(
                [query_ids[i] for i in missing], [prompts[i] for i in missing], n, params
            )
            for i, outputs in zip(missing, fresh, strict=True):
                self.cache[query_ids[i]] = CacheEntry(list(prompts[i]), outputs)
        self.hits += len(query_ids) - len(missing)
        self.misses += len(missing)
        return [list(self.cache[q].outputs[:n]) for q in query_ids]

    def scores(self, query_ids: list[str], n: int) -> list[Scores | None]:
        """The remembered ``(score, acc)`` of each query's first ``n`` cached samples
        (``None``: not cached, or not scored yet)."""
        entries = [self.cache.get(q) for q in query_ids]
        return [e.scores[:n] if e is not None and e.scores is not None else None for e in entries]

    def remember_scores(self, query_ids: list[str], scores: list[Scores]) -> None:
        """Record the driver's ``(score, acc)`` of the cached samples of ``query_ids`` (the
        first ``len(row)`` of each entry), valid until the next reset drops the entry."""
        for q, row in zip(query_ids, scores, strict=True):
            entry = self.cache.get(q)
            if entry is None or len(entry.outputs) < len(row):
                held = 0 if entry is None else len(entry.outputs)
                raise KeyError(
                    f"reference cache: scores for {len(row)} samples of query_id {q!r}, which "
                    f"holds {held}; remember the scores of the rows a sample() call of this "
                    "cache returned, before the next reset"
                )
            entry.scores = [(float(s), bool(a)) for s, a in row]

    def unsolved(self, query_ids: list[str], prompts: list[list[int]], n: int) -> list[bool]:
        """Per query, whether its first ``n`` cached samples are all scored and none is
        correct: rule (b) rejects it until the next reset, whatever its on-policy samples."""
        out = []
        for q, p in zip(query_ids, prompts, strict=True):
            scores = self.cache[q].scores if self._cached(q, p, n) else None
            out.append(
                scores is not None and len(scores) >= n and not any(a for _, a in scores[:n])
            )
        return out

    def uncached(self, query_ids: list[str], prompts: list[list[int]], n: int) -> int:
        """How many of the queries :meth:`sample` would generate afresh (not cached)."""
        return sum(not self._cached(q, p, n) for q, p in zip(query_ids, prompts, strict=True))

    def _cached(self, query_id: str, prompt: list[int], n: int) -> bool:
        entry = self.cache.get(query_id)
        if entry is None:
            return False
        if entry.prompt != list(prompt):
            raise ValueError(
                f"reference cache: query_id {query_id!r} came with a different prompt than the "
                "cached one; query ids must identify prompts uniquely"
            )
        return len(entry.outputs) >= n

    def load_reference(self, version, named_tensors_fn):
        self.inner.load_reference(version, named_tensors_fn)
        super().load_reference(version, named_tensors_fn)

    def on_reset(self, version, named_tensors_fn):
        """Reset: load the new reference and drop every cached anchor (and its scores)."""
        self.inner.on_reset(version, named_tensors_fn)
        self.cache.clear()
        super().load_reference(version, named_tensors_fn)

    def state_dict(self) -> dict:
        """The cache as tensors (token ids int32 ``[len]``, log-probs float64 ``[len]`` — the
        Python floats exactly — and, once scored, ``score`` float64 / ``acc`` bool ``[n]``),
        so a checkpoint stores 4 / 8 bytes per token and loads with
        ``torch.load(weights_only=True)``."""
        cache = {q: _entry_tensors(e) for q, e in self.cache.items()}
        return {"ref_version": self.ref_version, "cache": cache, "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The cache of ``state``; the hit and miss counters restart at 0 (they are not part of
        the state: the counts after a load are those of the calls after it)."""
        super().load_state_dict(state)
        self.inner.load_state_dict(state["inner"])
        self.cache = {q: _entry_from(e) for q, e in state["cache"].items()}
        self.hits = self.misses = 0

    def metrics(self) -> dict[str, float]:
        """``anchor/cache_hits``, ``anchor/cache_misses``, ``anchor/cache_size`` so far."""
        return {
            "anchor/cache_hits": float(self.hits),
            "anchor/cache_misses": float(self.misses),
            "anchor/cache_size": float(len(self.cache)),
        }


@dataclass(frozen=True)
class ReferenceStrategy:
    """One ``rollout.ref_strategy`` (or ``none``, no anchors): how its sampler is built
    (``build``) and what it asks of the weights (``traits``,
    :class:`~megatron_armor.config.rollout_traits.ReferenceTraits`: ``fill``,
    ``caches_anchors``, ``swaps_into_policy``).

    ``build(engine, weights_fn, ref_engine, cache_fill, ref_version)`` makes the sampler.
    """

    traits: ReferenceTraits
    build: Callable[..., ReferenceSampler]


def _no_reference(engine, weights_fn, ref_engine, cache_fill, ref_version) -> ReferenceSampler:
    return NoReferenceSampler(ref_version)


def _swap(engine, weights_fn, ref_engine, cache_fill, ref_version) -> ReferenceSampler:
    if weights_fn is None:
        raise ValueError(
            "rollout.ref_strategy=swap needs weights_fn(which) streaming the trainer's "
            "'policy'/'ref' weights; pass it or use ref_strategy=dedicated"
        )
    return SwapReferenceSampler(engine, weights_fn, ref_version)


def _dedicated(engine, weights_fn, ref_engine, cache_fill, ref_version) -> ReferenceSampler:
    if ref_engine is not None:
        return DedicatedReferenceSampler(ref_engine, "policy", ref_version)
    return DedicatedReferenceSampler(engine, "ref", ref_version)


def _cache(engine, weights_fn, ref_engine, cache_fill, ref_version) -> ReferenceSampler:
    filled_by = REFERENCE_TRAITS.get(cache_fill)
    if filled_by is not None and filled_by.caches_anchors:
        raise ValueError(f"reference cache_fill must be 'swap' or 'dedicated', not {cache_fill!r}")
    inner = make_reference_sampler(
        cache_fill, engine, weights_fn=weights_fn, ref_engine=ref_engine, ref_version=ref_version
    )
    return CachedReferenceSampler(inner)


REFERENCE_STRATEGIES: dict[str, ReferenceStrategy] = {
    "none": ReferenceStrategy(REFERENCE_TRAITS["none"], _no_reference),
    "swap": ReferenceStrategy(REFERENCE_TRAITS["swap"], _swap),
    "dedicated": ReferenceStrategy(REFERENCE_TRAITS["dedicated"], _dedicated),
    "cache": ReferenceStrategy(REFERENCE_TRAITS["cache"], _cache),
}
"""Every sampler :func:`make_reference_sampler` builds: the names of ``REFERENCE_TRAITS``, each
with its builder; all but ``none`` are ``rollout.ref_strategy`` names (``STRATEGIES``)."""


def make_reference_sampler(
    strategy: str,
    engine: RolloutEngine,
    *,
    weights_fn: WeightsFn | None = None,
    ref_engine: RolloutEngine | None = None,
    cache_fill: str = "dedicated",
    ref_version: int = 0,
) -> ReferenceSampler:
    """Build the sampler for ``rollout.ref_strategy``.

    ``swap`` needs ``weights_fn``; ``dedicated`` uses ``ref_engine`` (its ``policy`` set) when
    given, else ``engine``'s ``ref`` set; ``cache`` wraps a ``cache_fill`` sampler; ``none``
    (``algo.anchor: none``) tracks the version only.
    """
    if strategy not in REFERENCE_STRATEGIES:
        raise ValueError(f"rollout.ref_strategy={strategy!r} is not one of {STRATEGIES}")
    build = REFERENCE_STRATEGIES[strategy].build
    return build(engine, weights_fn, ref_engine, cache_fill, ref_version)
