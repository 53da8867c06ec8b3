"""``armor train`` with a poisoned advantage estimator, for the e2e tier's fault tests.

``python -m nan_advantages train CONFIG ... algo.advantage=nan_grpo`` registers ``nan_grpo``
(GRPO advantages, with NaN in the first ``rows`` groups of the steps listed in ``steps``) in
the driver's registry (docs/architecture.md, an advantage estimator) and runs the CLI: the
poisoned groups reach the trainer ranks as a real batch, and the update holding them has a
NaN loss. ``algo.advantage_args.steps`` is a ``"-"``-separated list of 1-based calls (one call
per step), ``"all"`` for every step; ``rows: 0`` poisons every group.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from megatron_armor.algo import registry
from megatron_armor.algo.advantages import AdvantageEstimator, grpo_advantages
from megatron_armor.cli import main

CALLS = [0]


@dataclass(frozen=True)
class Poison:
    """Which steps (advantage calls) and how many groups get NaN advantages."""

    steps: str = "all"
    rows: int = 0


def nan_grpo(scores: torch.Tensor, steps: str = "all", rows: int = 0) -> torch.Tensor:
    """GRPO advantages; on a poisoned step the first ``rows`` groups (all with 0) are NaN."""
    CALLS[0] += 1
    adv = grpo_advantages(scores)
    wanted = str(steps)  # a single step comes from the command line as an int
    if wanted == "all" or str(CALLS[0]) in wanted.split("-"):
        adv[: rows or adv.shape[0]] = math.nan
    return adv


registry.ADVANTAGES["nan_grpo"] = AdvantageEstimator(nan_grpo, params=Poison)

if __name__ == "__main__":
    sys.exit(main())
