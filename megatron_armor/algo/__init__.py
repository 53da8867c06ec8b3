"""The ARMOR algorithm as pure torch math (docs/algorithm.md).

Imports only torch, the standard library and ``megatron_armor.types``: no torch.distributed,
Megatron, Ray, SGLang or the config tree. Anything global (token counts across ranks) is an
argument. Config names resolve to implementations in :mod:`megatron_armor.algo.registry`.
"""

from megatron_armor.algo.advantages import assign_advantages, compute_advantages
from megatron_armor.algo.anchors import AcceptanceStats, select_group
from megatron_armor.algo.losses import (
    METRIC_COUNTS,
    LossSettings,
    compute_policy_loss,
    count_units,
    finalize_metrics,
)
from megatron_armor.algo.ratios import resolve_alpha
from megatron_armor.algo.reset import ResetSchedule

__all__ = [
    "METRIC_COUNTS",
    "AcceptanceStats",
    "LossSettings",
    "ResetSchedule",
    "assign_advantages",
    "compute_advantages",
    "compute_policy_loss",
    "count_units",
    "finalize_metrics",
    "resolve_alpha",
    "select_group",
]
