"""Rewards: the DAPO rule, math-verify, the overlong penalty, and a time-bounded scoring pool."""

from megatron_armor.reward.dapo_rule import normalize_answer, score_dapo
from megatron_armor.reward.math_verify_rule import score_math_verify
from megatron_armor.reward.overlong import overlong_penalty
from megatron_armor.reward.scorer import RewardScorer
from megatron_armor.reward.verifiers import auto_verifier, resolve_verifier

__all__ = [
    "RewardScorer",
    "auto_verifier",
    "normalize_answer",
    "overlong_penalty",
    "resolve_verifier",
    "score_dapo",
    "score_math_verify",
]
