"""Group-relative advantages (docs/algorithm.md, advantages; QUATRO in :mod:`megatron_armor.algo.quatro`).

Every estimator maps the rewards of ``Q`` groups of ``G`` (the anchor included, overlong
penalty included) to advantages, ``[Q, G] -> [Q, G]`` float64, keyword hyperparameters only:

- ``grpo`` (GRPO/DAPO): ``A_i = (R_i - mean(R)) / (std(R) + eps)``, unbiased std (``G - 1``).
- ``qae`` (quantile advantage estimation): ``A_i = (R_i - Q_k(R)) / (std(R) + eps)`` with
  ``Q_k`` the ``k``-quantile under linear interpolation (numpy's default); std unchanged.
- ``quatro``: ``A_i = (R_i - (lambda* + mu*)) / lambda*`` from the per-query KL trust region.

An estimator receives its own hyperparameters only (:meth:`AdvantageEstimator.hparams`):
those of the config keys its registry entry names (:data:`megatron_armor.algo.registry.ADVANTAGES`)
and ``algo.advantage_args``, checked by its ``params`` dataclass. Every response token of
sample ``i`` receives ``A_i`` (done by ``types.pack_groups``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_armor.types import Group


@dataclass(frozen=True)
class AdvantageEstimator:
    """One ``algo.advantage`` estimator: ``fn(scores[Q, G], **hparams) -> [Q, G]``.

    ``settings`` names the config keys (under ``algo.``) that supply hyperparameters,
    ``{kwarg: dotted key}``; ``algo.advantage_args`` supplies the fields of ``params``, a
    dataclass of ``fn``'s keyword hyperparameters that checks them (its ``__post_init__``
    validates values). Without ``params`` the estimator takes no ``advantage_args``.
    """

    fn: Callable[..., torch.Tensor]
    settings: dict[str, str] = field(default_factory=dict)
    params: type | None = None

    def hparams(self, algo_config: Any) -> dict[str, Any]:
        """``{kwarg: value}`` for ``fn`` from an ``algo`` config node (any object with the
        attributes; ``advantage_args`` optional). Unknown names raise a ``ValueError``."""
        values = {kwarg: _read(algo_config, key) for kwarg, key in self.settings.items()}
        extra = dict(getattr(algo_config, "advantage_args", None) or {})
        unknown = sorted(set(extra) - set(self.accepted()))
        if unknown:
            own_keys = "".join(f"; {k} is set by algo.{key}" for k, key in self.settings.items())
            raise ValueError(
                f"algo.advantage_args: {unknown} are not hyperparameters of "
                f"algo.advantage={getattr(algo_config, 'advantage', '?')!r}; "
                f"use {sorted(self.accepted())} or none{own_keys}"
            )
        values.update(extra)
        if self.params is None:
            return values
        return dataclasses.asdict(self.params(**values))

    def accepted(self) -> list[str]:
        """The hyperparameter names ``algo.advantage_args`` may set (``params``' fields that
        no ``settings`` key supplies)."""
        if self.params is None:
            return []
        return [f.name for f in dataclasses.fields(self.params) if f.name not in self.settings]


def _read(node: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def as_group_rows(scores: torch.Tensor) -> torch.Tensor:
    """``[G]`` or ``[Q, G]`` rewards as ``[Q, G]`` float64; needs ``G >= 2``."""
    scores = torch.as_tensor(scores)
    rows = scores.unsqueeze(0) if scores.dim() == 1 else scores
    if rows.dim() != 2 or rows.shape[-1] < 2:
        raise ValueError(
            f"advantages need groups of >= 2 rewards, got shape {tuple(scores.shape)}; "
            "set algo.group_size >= 2"
        )
    return rows.to(torch.float64)


def grpo_advantages(scores: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(R - mean(R)) / (std_unbiased(R) + eps)`` per row; ``[Q, G] -> [Q, G]`` float64."""
    r = as_group_rows(scores)
    return (r - r.mean(-1, keepdim=True)) / (r.std(-1, unbiased=True, keepdim=True) + eps)


def qae_advantages(scores: torch.Tensor, quantile: float = 0.45, eps: float = 1e-6) -> torch.Tensor:
    """``(R - Q_k(R)) / (std_unbiased(R) + eps)`` per row, linear-interpolation quantile ``k``."""
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"algo.qae_quantile={quantile}: must lie in [0, 1]")
    r = as_group_rows(scores)
    baseline = torch.quantile(r, quantile, dim=-1, keepdim=True, interpolation="linear")
    return (r - baseline) / (r.std(-1, unbiased=True, keepdim=True) + eps)


def compute_advantages(scores: torch.Tensor, method: str = "grpo", **hparams: Any) -> torch.Tensor:
    """Advantages (float32, the shape of ``scores``: ``[G]`` or ``[Q, G]``) with ``method``."""
    from megatron_armor.algo.registry import get_advantage  # registry imports this module

    scores = torch.as_tensor(scores)
    adv = get_advantage(method).fn(as_group_rows(scores), **hparams)
    return adv.reshape(scores.shape).to(torch.float32)


def assign_advantages(groups: list[Group], method: str = "grpo", **hparams: Any) -> None:
    """Set ``group.advantages`` (one float per sample, anchor included) for every group;
    groups of equal size go through the estimator together (one ``[Q, G]`` call)."""
    by_size: dict[int, list[Group]] = {}
    for group in groups:
        by_size.setdefault(len(group.scores), []).append(group)
    for same in by_size.values():
        scores = torch.tensor([g.scores for g in same], dtype=torch.float64)
        for group, row in zip(same, compute_advantages(scores, method, **hparams), strict=True):
            group.advantages = row.tolist()


def assign_configured_advantages(groups: list[Group], algo_config: Any) -> None:
    """:func:`assign_advantages` with the estimator ``algo.advantage`` and the hyperparameters
    it reads from ``algo_config`` (:meth:`AdvantageEstimator.hparams`)."""
    from megatron_armor.algo.registry import get_advantage  # registry imports this module

    estimator = get_advantage(algo_config.advantage)
    assign_advantages(groups, algo_config.advantage, **estimator.hparams(algo_config))
