"""A projection of the rollout time partial rollouts save, from a run's own response lengths
(``armor plan CONFIG --lengths RUN_DIR``; docs/orchestration.md, "Bounded staleness").

An engine decodes its share of a generation batch with at most ``S`` requests at a time (its KV
cache: ``S`` sequences of the prompt and the mean response), a new one starting when one ends
(continuous batching). Synchronously the step waits for the last: the makespan of the
requests' lengths over ``S`` slots, the longest ones decoding on few rows at the end. With
``orchestration.async_rollout: bounded`` at staleness ``k``, a request decodes at most ``W =
ceil(M / k)`` tokens per round of a window (``algo.staleness.window_tokens``, ``M`` =
``rollout.sampling.max_new_tokens``) and the rest goes on in the next window beside its new
requests, filling the slots the tail would leave idle: the makespan of ``min(L, W)``.

The projection prices a decode step the same whatever its rows, which holds while decoding is
memory-bound (an H100 reads the weights once per step for the whole batch), and leaves out the
prefill of continued requests, scoring and the trainer: a projection, not a measurement. The
lengths are the run's (the per-query ``policy_lengths`` of its anchor files), scaled from its
``max_new_tokens`` to the config's: the shape of the distribution, not its scale, carries over.
"""

from __future__ import annotations

import gzip
import heapq
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_armor.algo.staleness import window_tokens

DRAWS = 200
"""Batches resampled from the lengths for each expectation."""


@dataclass(frozen=True)
class TailProjection:
    """Expected decode steps of one engine's share of a generation batch, synchronous and
    windowed."""

    requests_per_engine: int
    slots: int
    """Requests an engine decodes at once (its KV cache's sequences)."""
    max_new_tokens: int
    samples: int
    """Response lengths the projection drew from."""
    synchronous: float
    """``E[makespan(L)]`` over ``slots``."""
    windowed: dict[int, float]
    """``k -> E[makespan(min(L, ceil(M / k)))]``."""

    def saved(self, k: int) -> float:
        """The share of the synchronous decode steps the windows of staleness ``k`` save."""
        return 1.0 - self.windowed[k] / self.synchronous

    def report(self) -> str:
        lines = [
            f"PROJECTION (not a measurement) of rollout decode steps per generation batch, "
            f"from {self.samples} response lengths scaled to max_new_tokens="
            f"{self.max_new_tokens}, {self.requests_per_engine} requests per engine, "
            f"{self.slots} at a time, a decode step priced alike whatever its rows "
            "(memory-bound decoding; docs/orchestration.md):",
            f"  synchronous (off / one_step): {self.synchronous:.0f} steps",
        ]
        for k, steps in sorted(self.windowed.items()):
            lines.append(
                f"  bounded, max_staleness={k} (window {window_tokens(self.max_new_tokens, k)} "
                f"tokens): {steps:.0f} steps, {self.saved(k):.0%} of the rollout's decode "
                "time saved"
            )
        return "\n".join(lines)


def makespan(lengths: Sequence[int], slots: int) -> int:
    """Decode steps until every request of ``lengths`` (in order) has ended, ``slots`` at a
    time, each next one starting in the first slot that frees (list scheduling)."""
    free = [0] * min(slots, len(lengths))
    for n in lengths:
        heapq.heappush(free, heapq.heappop(free) + n)
    return max(free, default=0)


def expected_makespan(
    lengths: Sequence[int], requests: int, slots: int, cap: int | None = None, seed: int = 0
) -> float:
    """``E[makespan(min(L_i, cap))]`` over ``requests`` lengths drawn with replacement from
    ``lengths`` (:data:`DRAWS` batches, a fixed seed: the same answer every time)."""
    if not lengths or requests < 1 or slots < 1:
        raise ValueError(
            f"expected_makespan: {len(lengths)} lengths, {requests} requests per engine, "
            f"{slots} slots; need at least one of each"
        )
    rng = random.Random(seed)
    clipped = [min(n, cap) if cap else n for n in lengths]
    return sum(makespan(rng.choices(clipped, k=requests), slots) for _ in range(DRAWS)) / DRAWS


def project_tail(
    lengths: Sequence[int],
    run_max_new_tokens: int,
    max_new_tokens: int,
    requests_per_engine: int,
    slots: int,
    staleness: Sequence[int] = (2, 4),
) -> TailProjection:
    """The :class:`TailProjection` of ``lengths`` (drawn with ``run_max_new_tokens``), scaled
    to ``max_new_tokens``, for the staleness bounds ``staleness``."""
    scale = max_new_tokens / run_max_new_tokens
    scaled = [max(1, min(max_new_tokens, math.ceil(n * scale))) for n in lengths]
    run = lambda cap=None: expected_makespan(scaled, requests_per_engine, slots, cap)  # noqa: E731
    windowed = {k: run(window_tokens(max_new_tokens, k)) for k in staleness}
    return TailProjection(requests_per_engine, slots, max_new_tokens, len(scaled), run(),
                          windowed)  # fmt: skip


def engine_slots(config, plan, lengths: Sequence[int], run_max_new_tokens: int) -> int:
    """Requests a policy engine decodes at once: its KV cache (``planner.memory.EngineShape``
    on the plan's model and GPU) over a prompt and the mean scaled response; every request of
    its share where no GPU engine is planned (the embedded engine, the cpu layout)."""
    from megatron_armor.config.sglang_pools import pool_specs
    from megatron_armor.planner.memory import EngineShape

    requests = requests_per_engine(config)
    if config.orchestration.layout == "cpu":
        return requests
    pool = pool_specs(config)["policy"]
    kv = EngineShape(plan.model, pool.tp, pool.share, plan.gpu_bytes).kv_tokens()
    scale = config.rollout.sampling.max_new_tokens / run_max_new_tokens
    sequence = config.data.max_prompt_len + scale * sum(lengths) / len(lengths)
    return max(1, min(requests, int(kv // sequence))) if kv > 0 else requests


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
