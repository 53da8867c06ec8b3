"""The state of partial rollouts between steps (``orchestration.async_rollout: bounded``,
docs/orchestration.md "Bounded staleness"): the queries whose policy responses are still being
drawn, window after window, and the groups judged and accepted that wait for a step.

A query's ``n_on`` policy samples start together in one window; each decodes at most the
window's tokens per weight version (``algo.staleness.window_tokens``), and one that has not
ended goes on in the next window under the weights pushed since, from the tokens it has: its
tokens, log-probs and per-token versions are appended (:func:`extend_sample`). The query is
judged (scored, rule (a), its reference samples, rule (b)) once every one of its samples has
ended. Accepted groups wait in :attr:`PartialRollouts.ready`; a step takes the stalest first
and drops those past the bound (:meth:`PartialRollouts.take`); a reset drops them all
(their anchors are the old reference's). Everything here is decided from the samples alone,
so a resumed run (:meth:`PartialRollouts.state`) continues exactly.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from megatron_armor.algo.staleness import within_bound
from megatron_armor.rollout.protocol import GenerationOutput, PartialRequest
from megatron_armor.types import (
    Group,
    Sample,
    SampleSource,
    group_from_dict,
    sample_from_dict,
)

PARTIAL = "partial"
"""The finish reason of a response that has not ended (``GenerationOutput.finish_reason``)."""


def new_sample(item, version: int) -> Sample:
    """An empty policy response to ``item`` (a ``data.dataset.PromptItem``), to be drawn."""
    return Sample(query_id=item.query_id, prompt_ids=list(item.prompt_ids), response_ids=[],
                  source=SampleSource.POLICY, weight_version=version, finish_reason=PARTIAL,
                  ground_truth=item.ground_truth, data_source=item.data_source)  # fmt: skip


def extend_sample(sample: Sample, out: GenerationOutput) -> int:
    """Append one window's output to ``sample``: tokens, log-probs, each token's version
    (``out.token_versions``, else ``out.weight_version``); the sample's version becomes the
    window's and its finish reason the output's. Returns the tokens appended."""
    n = len(out.token_ids)
    sample.response_versions = sample.token_versions() + (
        list(out.token_versions) or [out.weight_version] * n
    )
    sample.response_ids = sample.response_ids + list(out.token_ids)
    sample.response_logprobs = sample.response_logprobs + list(out.logprobs)
    sample.weight_version, sample.finish_reason = out.weight_version, out.finish_reason
    return n


def tail_idle_seconds(seconds: list[float]) -> float:
    """The engine's idle time in the tail of one call whose responses ended ``seconds`` after
    its start: ``max(s) - mean(s)``, how long a response's slot waited, on average, for the
    slowest of the call (0 when they all end together; docs/metrics.md)."""
    return max(seconds) - sum(seconds) / len(seconds) if seconds else 0.0


def policy_oldest_version(group: Group) -> int:
    """The version of the oldest policy token of ``group`` (its anchor is the reference's)."""
    return min(s.oldest_version for s in group.samples if s.source == SampleSource.POLICY)


@dataclass
class InFlight:
    """One query whose policy samples are drawn across windows."""

    item: dict
    """The ``PromptItem`` fields (``dataclasses.asdict``), to judge and record it."""
    gen_batch: int
    """Its generation batch in the window that started it (the anchor file's ``gen_batch``)."""
    started: int
    """The step whose window started it."""
    index: int = -1
    """Its row in the training prompts (the sampler's index: retirement observes it)."""
    samples: list[Sample] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return all(s.finish_reason != PARTIAL for s in self.samples)

    def requests(self) -> list[tuple[Sample, PartialRequest]]:
        """Its samples that go on, with the request that continues each."""
        return [(s, PartialRequest(s.prompt_ids, s.response_ids)) for s in self.samples
                if s.finish_reason == PARTIAL]  # fmt: skip


@dataclass
class PartialRollouts:
    """The queries in flight and the accepted groups waiting for a step."""

    in_flight: list[InFlight] = field(default_factory=list)
    ready: list[Group] = field(default_factory=list)

    def requests(self) -> list[tuple[Sample, PartialRequest]]:
        """Every response in flight, in the order of the queries (a window's continue call)."""
        return [pair for query in self.in_flight for pair in query.requests()]

    def pop_ended(self) -> list[InFlight]:
        """The queries whose samples have all ended, in order, out of :attr:`in_flight`."""
        ended = [q for q in self.in_flight if q.ended]
        self.in_flight = [q for q in self.in_flight if not q.ended]
        return ended

    def take(self, need: int, trainer_version: int, max_staleness: int) -> tuple[list[Group], int]:
        """Up to ``need`` groups for a step whose ``old`` pass runs ``trainer_version``: the
        stalest first (oldest policy token, then the order they were accepted in), none older
        than ``max_staleness`` (those are dropped). Returns ``(groups, dropped)``; the rest
        keep waiting."""
        oldest = [policy_oldest_version(g) for g in self.ready]
        fresh = [g for g, v in zip(self.ready, oldest, strict=True)
                 if within_bound(v, trainer_version, max_staleness)]  # fmt: skip
        dropped = len(self.ready) - len(fresh)
        order = sorted(range(len(fresh)), key=lambda i: (policy_oldest_version(fresh[i]), i))
        chosen = set(order[:need])
        self.ready = [g for i, g in enumerate(fresh) if i not in chosen]
        return [fresh[i] for i in sorted(chosen, key=order.index)], dropped

    def drop_ready(self) -> int:
        """A reset: the waiting groups' anchors and rule (b) came from the old reference, so
        they go; the responses in flight (policy only) stay. Returns how many went."""
        dropped, self.ready = len(self.ready), []
        return dropped

    def state(self) -> dict:
        """In the types ``torch.load(weights_only=True)`` reads: JSON text (floats exact)."""
        return {"partial_rollouts": json.dumps(dataclasses.asdict(self))}

    @classmethod
    def from_state(cls, state: dict) -> PartialRollouts:
        """The inverse of :meth:`state` (``{}``: nothing in flight)."""
        if not state:
            return cls()
        saved = json.loads(state["partial_rollouts"])
        in_flight = [InFlight(**{**q, "samples": [sample_from_dict(x) for x in q["samples"]]})
                     for q in saved["in_flight"]]  # fmt: skip
        ready = [group_from_dict(g) for g in saved["ready"]]
        return cls(in_flight, ready)
