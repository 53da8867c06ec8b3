"""DAPO's soft overlong penalty (docs/data_reward.md).

With ``expected = max_len - buffer``, a response of ``L`` tokens gets

    penalty(L) = min(-(L - expected) / buffer * factor, 0)

added to its score: 0 up to ``expected`` tokens, then a linear ramp down to ``-factor``
at ``L = max_len`` (the generation limit, ``rollout.max_new_tokens``).
"""

from __future__ import annotations


def check_overlong(max_len: int, buffer: int, factor: float) -> None:
    """Raise for settings that make the penalty meaningless."""
    if not 0 < buffer <= max_len:
        raise ValueError(
            f"reward.overlong.buffer={buffer}: must be in (0, max_new_tokens={max_len}]; "
            "lower it or set reward.overlong.enabled=false"
        )
    if factor < 0:
        raise ValueError(f"reward.overlong.factor={factor}: must be >= 0")


def overlong_penalty(length: int, max_len: int, buffer: int, factor: float) -> float:
    """``min(-(length - (max_len - buffer)) / buffer * factor, 0)``; see the module docstring."""
    excess = length - (max_len - buffer)
    return 0.0 if excess <= 0 else -excess / buffer * factor
