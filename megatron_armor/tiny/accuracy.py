"""Accuracy of an in-memory tiny model on arithmetic problems, scored by the DAPO rule.

Used by the warm start (to decide when to stop) and by ``armor tiny`` (to report the
warm-started accuracy). Sampling uses ``transformers``' ``generate`` on left-padded
prompts; correctness is :func:`megatron_armor.reward.dapo_rule.score_dapo` — the same rule
that scores ``tiny_arith`` rows during RL (docs/data_reward.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from megatron_armor.reward.dapo_rule import score_dapo
from megatron_armor.tiny.task import Problem, render_prompt


@dataclass
class AccuracyReport:
    """Fraction correct overall and per difficulty level, plus the raw responses."""

    accuracy: float
    by_level: dict[int, float]
    responses: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: overall and per-level accuracy."""
        levels = ", ".join(f"L{k} {v:.0%}" for k, v in sorted(self.by_level.items()))
        return f"{self.accuracy:.1%} ({levels})"


@torch.no_grad()
def sample_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    temperature: float = 1.0,
    max_new_tokens: int = 40,
    seed: int = 0,
    batch_size: int = 256,
) -> list[str]:
    """One response per prompt (``temperature == 0``: greedy), special tokens removed."""
    was_training = model.training
    model.eval()
    torch.manual_seed(seed)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    texts: list[str] = []
    for start in range(0, len(prompts), batch_size):
        ids = [tokenizer(p).input_ids for p in prompts[start : start + batch_size]]
        width = max(len(x) for x in ids)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = (torch.arange(width) >= torch.tensor([width - len(x) for x in ids])[:, None]).long()
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
        texts.extend(tokenizer.batch_decode(out[:, width:], skip_special_tokens=True))
    model.train(was_training)
    return texts


def score_responses(responses: Sequence[str], answers: Sequence[int | str]) -> list[bool]:
    """DAPO-rule correctness of each response against its ground-truth answer."""
    return [score_dapo(r, str(a)).correct for r, a in zip(responses, answers, strict=True)]


def measure_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    problems: Sequence[Problem],
    temperature: float = 1.0,
    max_new_tokens: int = 40,
    seed: int = 0,
) -> AccuracyReport:
    """Sample one response per problem and score it with the DAPO rule."""
    responses = sample_responses(
        model, tokenizer, [render_prompt(p) for p in problems], temperature, max_new_tokens, seed
    )
    correct = score_responses(responses, [p.answer for p in problems])
    levels: dict[int, list[bool]] = {}
    for problem, ok in zip(problems, correct, strict=True):
        levels.setdefault(problem.level, []).append(ok)
    return AccuracyReport(
        accuracy=sum(correct) / max(1, len(correct)),
        by_level={k: sum(v) / len(v) for k, v in levels.items()},
        responses=responses,
    )
