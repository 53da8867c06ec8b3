"""A projection of the rollout time partial rollouts save, from a run's own response lengths
(``armor plan CONFIG --lengths RUN_DIR``; docs/orchestration.md, "Bounded staleness").

A synchronous rollout batch is done when its longest sample is: an engine holding ``r``
requests of the batch decodes ``max(L_1 .. L_r)`` steps, fewer and fewer rows at a time in the
tail. With ``orchestration.async_rollout: bounded`` at staleness ``k``, a request decodes at
most ``W = ceil(M / k)`` tokens per weight version (``algo.staleness.window_tokens``, ``M`` =
``rollout.sampling.max_new_tokens``) and the rest of a long one goes on in the next window,
beside new requests: an engine's window lasts ``max(min(L_i, W))`` decode steps.

The projection prices a decode step the same whatever the rows in flight, which holds while
decoding is memory-bound (an H100 reads the weights once per step for the whole batch; the
rows' KV reads and the sampling grow with them). So it is an upper bound on what the windows
save in decode time, with everything else (prefill of continued requests, scoring, the
trainer) left out: a projection, not a measurement. The lengths are the run's (the per-query
``policy_lengths`` of its anchor files), scaled from its ``max_new_tokens`` to the config's:
the shape of the distribution, not its scale, carries over to another model.
"""

from __future__ import annotations

import gzip
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_armor.algo.staleness import window_tokens

DRAWS = 2000
"""Batches resampled from the lengths for each expectation."""


@dataclass(frozen=True)
class TailProjection:
    """Expected decode steps per rollout batch of one engine, synchronous and windowed."""

    requests_per_engine: int
    max_new_tokens: int
    samples: int
    """Response lengths the projection drew from."""
    synchronous: float
    """``E[max L]`` over ``requests_per_engine`` lengths."""
    windowed: dict[int, float]
    """``k -> E[max min(L, ceil(M / k))]``."""

    def saved(self, k: int) -> float:
        """The share of the synchronous decode steps the windows of staleness ``k`` save."""
        return 1.0 - self.windowed[k] / self.synchronous

    def report(self) -> str:
        lines = [
            f"PROJECTION (not a measurement) of rollout decode steps per batch, from "
            f"{self.samples} response lengths scaled to max_new_tokens={self.max_new_tokens}, "
            f"{self.requests_per_engine} requests per engine, a decode step priced alike "
            "whatever its rows (memory-bound decoding; docs/orchestration.md):",
            f"  synchronous (off / one_step): {self.synchronous:.0f} steps (the batch's longest)",
        ]
        for k, steps in sorted(self.windowed.items()):
            lines.append(
                f"  bounded, max_staleness={k} (window {window_tokens(self.max_new_tokens, k)} "
                f"tokens): {steps:.0f} steps, {self.saved(k):.0%} of the rollout's decode "
                "time saved"
            )
        return "\n".join(lines)


def expected_batch_max(
    lengths: Sequence[int], requests: int, cap: int | None = None, seed: int = 0
) -> float:
    """``E[max(min(L_1, cap) .. min(L_r, cap))]`` over ``r = requests`` lengths drawn with
    replacement from ``lengths`` (:data:`DRAWS` batches, a fixed seed: the same answer every
    time)."""
    if not lengths or requests < 1:
        raise ValueError(
            f"expected_batch_max: {len(lengths)} lengths and {requests} requests per engine; "
            "need at least one of each"
        )
    rng = random.Random(seed)
    clipped = [min(n, cap) if cap else n for n in lengths]
    return sum(max(rng.choices(clipped, k=requests)) for _ in range(DRAWS)) / DRAWS


def project_tail(
    lengths: Sequence[int],
    run_max_new_tokens: int,
    max_new_tokens: int,
    requests_per_engine: int,
    staleness: Sequence[int] = (2, 4),
) -> TailProjection:
    """The :class:`TailProjection` of ``lengths`` (drawn with ``run_max_new_tokens``), scaled
    to ``max_new_tokens``, for the staleness bounds ``staleness``."""
    scale = max_new_tokens / run_max_new_tokens
    scaled = [max(1, min(max_new_tokens, math.ceil(n * scale))) for n in lengths]
    windowed = {
        k: expected_batch_max(scaled, requests_per_engine, window_tokens(max_new_tokens, k))
        for k in staleness
    }
    return TailProjection(
        requests_per_engine, max_new_tokens, len(scaled),
        expected_batch_max(scaled, requests_per_engine), windowed,
    )  # fmt: skip


def requests_per_engine(config) -> int:
    """Policy requests an engine holds of one generation batch: ``rollout.gen_batch`` queries
    times their on-policy samples, over the policy pool's engines (``config/sglang_pools.py``:
    the rollout GPUs over ``rollout.sglang.tp``), at least one."""
    from megatron_armor.algo.registry import get_anchor_mode
    from megatron_armor.config.sglang_pools import pool_specs

    algo = config.algo
    n_on = get_anchor_mode(algo.anchor).policy_samples(algo.group_size, algo.filter_policy_samples)
    engines = pool_specs(config)["policy"].num_engines
    return max(1, math.ceil(config.rollout.gen_batch * n_on / engines))


def run_lengths(run_dir: str | Path) -> tuple[list[int], int]:
    """Every policy response length a run drew (``policy_lengths`` of the query lines of
    ``RUN_DIR/anchors/step_*.jsonl[.gz]``) and the run's ``rollout.sampling.max_new_tokens``
    (its ``config.yaml``); an error naming the directory when it has no lengths."""
    import yaml

    files = sorted(Path(run_dir, "anchors").glob("step_*.jsonl*"))
    lengths: list[int] = []
    for path in files:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            for line in f:
                lengths += json.loads(line).get("policy_lengths", [])
    if not lengths:
        raise ValueError(
            f"--lengths {run_dir}: no response lengths in {run_dir}/anchors (a run directory "
            "of `armor train` whose anchor files record policy_lengths)"
        )
    config = yaml.safe_load(Path(run_dir, "config.yaml").read_text())
    return lengths, int(config["rollout"]["sampling"]["max_new_tokens"])
