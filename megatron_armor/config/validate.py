"""Cross-field checks of the config tree. Each error names the key, the value and the fix."""

from __future__ import annotations

from megatron_armor.config.schema import ArmorConfig


def validate(config: ArmorConfig) -> None:
    """Raise ``ValueError`` on the first inconsistent setting."""
    algo = config.algo
    if algo.group_size < 2:
        raise ValueError(f"algo.group_size={algo.group_size}: must be >= 2 (a group needs a variance)")
