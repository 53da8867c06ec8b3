"""What a ``rollout.backend`` and a ``rollout.ref_strategy`` are, without how they are built.

Validation, the SGLang pool arithmetic (``config/sglang_pools.py``) and the planner ask only
these traits: whether a backend serves over HTTP, and per reference strategy which strategy
draws its fresh samples and whether it caches anchors or swaps the reference into the policy
engine. ``rollout/backends.py`` and ``rollout/reference.py`` give each name here its builder
(and ``tests/unit/test_rollout_traits.py`` checks that both sides name the same set), so
config never imports rollout and the code asks a trait, never a name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from megatron_armor.algo.registry import get_anchor_source, lookup


@dataclass(frozen=True)
class BackendTraits:
    """One ``rollout.backend``: what it runs.

    ``serves_over_http``: the engine is a pool of server processes on their own GPUs, reached
    over HTTP (``rollout.sglang.*``): the placement reserves GPU bundles for the servers, the
    trainer ranks push weights to them (``rollout.sglang.weight_transport``), dead servers are
    restarted (``health_check_every``), a reference pool may be started, and start-up waits
    for every server's health. ``False``: the engine lives in the worker's process and takes
    weights through it.
    """

    name: str
    serves_over_http: bool


BACKEND_TRAITS: dict[str, BackendTraits] = {
    "torch": BackendTraits("torch", serves_over_http=False),
    "sglang": BackendTraits("sglang", serves_over_http=True),
}
"""``rollout.backend`` (docs/rollout.md); the builders: ``rollout/backends.py`` ``BACKENDS``."""


def backend_traits(name: str) -> BackendTraits:
    """The traits of ``rollout.backend`` ``name``; an unknown name names the choices."""
    return lookup(BACKEND_TRAITS, name, "rollout.backend")


@dataclass(frozen=True)
class ReferenceTraits:
    """One ``rollout.ref_strategy`` (or ``none``, no anchors): what it asks of the weights.

    ``fill``: the strategy that draws fresh reference samples (itself, or the anchor cache's
    inner sampler); ``caches_anchors``: samples are reused until the next reset;
    ``swaps_into_policy``: the reference is loaded into the policy engine around each call
    (two weight loads per step, no second weight set).
    """

    name: str
    fill: str
    caches_anchors: bool = False
    swaps_into_policy: bool = False


REFERENCE_TRAITS: dict[str, ReferenceTraits] = {
    "none": ReferenceTraits("none", fill="none"),
    "swap": ReferenceTraits("swap", fill="swap", swaps_into_policy=True),
    "dedicated": ReferenceTraits("dedicated", fill="dedicated"),
    "cache": ReferenceTraits("cache", fill="dedicated", caches_anchors=True),
}
"""Every reference sampler (the builders: ``rollout/reference.py`` ``REFERENCE_STRATEGIES``);
all but ``none`` are ``rollout.ref_strategy`` names (:data:`STRATEGIES`)."""

STRATEGIES = tuple(name for name in REFERENCE_TRAITS if name != "none")
"""The ``rollout.ref_strategy`` names (``none``: no anchors, versions only)."""


class ReferencePlan(NamedTuple):
    """``rollout.ref_strategy`` with ``algo.anchor_source`` resolved: the sampler to build
    (``strategy``) and the one drawing its fresh samples (``cache_fill``)."""

    strategy: str
    cache_fill: str

    @property
    def caches_anchors(self) -> bool:
        """Whether anchors are drawn once per reference period and reused (the anchor cache)."""
        return REFERENCE_TRAITS[self.strategy].caches_anchors

    @property
    def swaps_into_policy(self) -> bool:
        """Whether fresh reference samples come from the policy engine with the reference
        swapped in (``swap``), rather than from a weight set of their own (``dedicated``)."""
        return REFERENCE_TRAITS[self.cache_fill].swaps_into_policy


def reference_strategy(ref_strategy: str, anchor_source: str) -> ReferencePlan:
    """The :class:`ReferencePlan` of the two settings: ``algo.anchor_source: cache`` wraps
    ``rollout.ref_strategy`` (``swap`` | ``dedicated``) in the anchor cache; ``ref_strategy:
    cache`` fills misses with ``dedicated`` (docs/algorithm.md, anchor rollout)."""
    served = lookup(REFERENCE_TRAITS, ref_strategy, "rollout.ref_strategy")
    if get_anchor_source(anchor_source).reuses_anchors or served.caches_anchors:
        return ReferencePlan("cache", served.fill)
    return ReferencePlan(ref_strategy, served.fill)
