"""Bounded staleness of partially generated samples (docs/algorithm.md, "Bounded staleness").

With ``orchestration.async_rollout: bounded`` a response may be generated across several
weight pushes: each push interrupts it, and it goes on under the new weights from the tokens it
has (a *partial rollout*). Every response token ``t`` then carries the version ``v_t`` of the
weights that drew it (``types.Sample.token_versions``). At a step whose trainer starts from
version ``V`` (the weights the step's ``old`` pass runs), token ``t`` is ``V - v_t`` versions
old: its *age*. A step trains only groups whose oldest policy token is at most
``max_staleness`` (``k``) versions old (:func:`within_bound`).

Generation runs in *windows*, one per weight version: between two pushes a request decodes at
most ``window_tokens`` tokens (:func:`window_tokens`), so a response of ``n`` tokens spans
``ceil(n / window_tokens)`` windows. The window of step ``s`` is drawn beside step ``s - 1``'s
updates on the weights the engines hold then (one version behind the trainer), so a token of
the first window of a sample is 1 version old at the step after its last window, a sample of
``j`` windows at most ``j``: ``window_tokens = ceil(max_new_tokens / k)`` keeps every sample
that is trained at the step after it ends within the bound. A group that waits longer (more
groups were accepted than a step trains) ages one version per step and is dropped past ``k``.

Pure Python: versions are ints, lists of ints per sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def window_tokens(max_new_tokens: int, max_staleness: int) -> int:
    """``ceil(max_new_tokens / k)``: the tokens a request decodes per weight version, so that
    the longest response (``max_new_tokens``) spans at most ``k`` windows (module docstring)."""
    if max_new_tokens < 1 or max_staleness < 1:
        raise ValueError(
            f"window_tokens(max_new_tokens={max_new_tokens}, max_staleness={max_staleness}): "
            "both must be >= 1"
        )
    return math.ceil(max_new_tokens / max_staleness)


def token_ages(versions: Sequence[int], trainer_version: int) -> list[int]:
    """``[V - v_t]`` per token: how many versions behind the trainer's ``V`` each token is."""
    return [trainer_version - v for v in versions]


def within_bound(oldest_version: int, trainer_version: int, max_staleness: int) -> bool:
    """Whether a group whose oldest policy token has ``oldest_version`` may be trained at a
    step starting from ``trainer_version``: ``V - v_min <= k``."""
    return trainer_version - oldest_version <= max_staleness


def staleness_metrics(
    versions: Sequence[Sequence[int]], trainer_version: int, max_staleness: int
) -> dict[str, float]:
    """The ages of a step's trained policy tokens (``versions``: per sample, its tokens'
    versions): ``staleness/age_mean``, ``staleness/age_max`` and, for every age ``a`` in
    ``0..k``, ``staleness/age_{a}_frac`` (the share of tokens ``a`` versions old; ages above
    ``k`` are never trained). Empty for a step without policy tokens."""
    ages = [a for sample in versions for a in token_ages(sample, trainer_version)]
    if not ages:
        return {}
    out = {"staleness/age_mean": sum(ages) / len(ages), "staleness/age_max": float(max(ages))}
    for age in range(max_staleness + 1):
        out[f"staleness/age_{age}_frac"] = sum(a == age for a in ages) / len(ages)
    return out


def spans_to_versions(spans: Sequence[tuple[int, int, int]], num_tokens: int) -> list[int]:
    """Per-token versions from ``(version, start, end)`` spans of a response of ``num_tokens``
    tokens (SGLang's ``meta_info.weight_versions``, ``[start, end)`` in output tokens, in
    order). The spans must cover every token exactly once."""
    out: list[int] = []
    for version, start, end in spans:
        if start != len(out) or end < start:
            raise ValueError(f"weight-version spans {list(spans)} are not contiguous from 0")
        out += [int(version)] * (end - start)
    if len(out) != num_tokens:
        raise ValueError(
            f"weight-version spans {list(spans)} cover {len(out)} tokens, the response has "
            f"{num_tokens}"
        )
    return out
