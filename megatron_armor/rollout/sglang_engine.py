"""Short import path for the SGLang engine (``megatron_armor.rollout.sglang.engine``)."""

from megatron_armor.rollout.sglang.engine import HealthMonitor, SGLangEngine

__all__ = ["HealthMonitor", "SGLangEngine"]
