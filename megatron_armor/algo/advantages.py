"""Group-relative advantages (armor-spec §3).

For a group of ``G`` rewards ``R`` (the anchor included, overlong penalty included):

- ``grpo`` (GRPO/DAPO): ``A_i = (R_i - mean(R)) / (std(R) + eps)``, unbiased std (``G - 1``).
- ``qae`` (quantile advantage estimation): ``A_i = (R_i - Q_k(R)) / (std(R) + eps)`` with
  ``Q_k`` the ``k``-quantile under linear interpolation (numpy's default); std unchanged.

Every response token of sample ``i`` receives ``A_i`` (done by ``types.pack_groups``).
"""

from __future__ import annotations

import torch

from megatron_armor.types import Group


def _as_scores(scores: torch.Tensor) -> torch.Tensor:
    scores = torch.as_tensor(scores)
    if scores.dim() != 1 or scores.numel() < 2:
        raise ValueError(
            f"advantages need a 1-D group of >= 2 rewards, got shape {tuple(scores.shape)}; "
            "set algo.group_size >= 2"
        )
    return scores.to(torch.float64)


def grpo_advantages(
    scores: torch.Tensor, quantile: float = 0.45, eps: float = 1e-6
) -> torch.Tensor:
    """``(R - mean(R)) / (std_unbiased(R) + eps)``; ``[G] -> [G]`` float64. ``quantile`` is unused."""
    r = _as_scores(scores)
    return (r - r.mean()) / (r.std(unbiased=True) + eps)


def qae_advantages(scores: torch.Tensor, quantile: float = 0.45, eps: float = 1e-6) -> torch.Tensor:
    """``(R - Q_k(R)) / (std_unbiased(R) + eps)`` with linear-interpolation quantile ``k``; ``[G] -> [G]``."""
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"algo.qae_quantile={quantile}: must lie in [0, 1]")
    r = _as_scores(scores)
    baseline = torch.quantile(r, quantile, interpolation="linear")
    return (r - baseline) / (r.std(unbiased=True) + eps)


def compute_advantages(
    scores: torch.Tensor, method: str = "grpo", quantile: float = 0.45, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages ``[G]`` for one group's rewards ``[G]`` with the named ``method`` (float32)."""
    from megatron_armor.algo.registry import get_advantage

    return get_advantage(method)(scores, quantile=quantile, eps=eps).to(torch.float32)


def assign_advantages(groups: list[Group], method: str = "grpo", quantile: float = 0.45) -> None:
    """Set ``group.advantages`` (one float per sample, anchor included) for every group."""
    for group in groups:
        scores = torch.tensor(group.scores, dtype=torch.float64)
        group.advantages = compute_advantages(scores, method, quantile).tolist()
