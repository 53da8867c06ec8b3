"""Benchmark evaluation: ``k`` samples per problem -> avg@k, pass@k, maj@k per benchmark.

Used by ``armor eval`` and by in-training validation (``val/<bench>/<metric>``). For each
benchmark, the first ``max_problems`` prompts (all when 0) are sent to the engine with
``n = k``; the responses are decoded, scored by the reward scorer (which sets
``Sample.acc`` with the verifier chosen per ``data_source``) and reduced per problem with
:mod:`megatron_armor.evaluation.metrics`, then averaged over problems.

maj@k votes over the normalized final answer of each response (see
:func:`answer_key`); equivalent answers written differently (``1/2`` vs ``\\frac{1}{2}``)
vote separately — the verifier still decides whether the winning answer is correct.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from megatron_armor.evaluation.metrics import avg_at_k, maj_at_k, mean_over_problems, pass_at_k
from megatron_armor.reward.dapo_rule import extract_answer, normalize_answer
from megatron_armor.rollout.protocol import GenerationOutput, RolloutEngine, SamplingParams
from megatron_armor.types import Sample

METRIC_KEYS = ("avg@k", "pass@k", "maj@k", "n")
PROMPT_BATCH = 256
"""Prompts sent to the engine per ``generate`` call (bounds memory on large benchmarks)."""

_BOXED = re.compile(r"\\boxed\{")


class Scorer(Protocol):
    """What :func:`evaluate` needs from a scorer: set ``acc`` in place (``RewardScorer``)."""

    def score(self, samples: list[Sample]) -> dict[str, Any]: ...


class Decoder(Protocol):
    """What :func:`evaluate` needs from a tokenizer."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (balanced braces), or ``None``."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, begin = 1, starts[-1]
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None


def answer_key(response: str) -> str | None:
    """The vote key of a response for maj@k: its normalized final answer.

    The last ``Answer:`` line (DAPO rule, docs/data_reward.md), else the last ``\\boxed{}``,
    normalized with the DAPO normalization; ``None`` when the response states no answer.
    """
    answer = extract_answer(response)
    if answer is None:
        answer = last_boxed(response)
    if answer is None:
        return None
    key = normalize_answer(answer)
    return key or None


def to_eval_samples(
    item: Any, outputs: Sequence[GenerationOutput], decoder: Decoder
) -> list[Sample]:
    """One :class:`Sample` per output of ``item`` (a ``PromptItem``), with decoded text."""
    return [
        Sample(
            query_id=item.query_id,
            prompt_ids=list(item.prompt_ids),
            response_ids=list(o.token_ids),
            weight_version=o.weight_version,
            finish_reason=o.finish_reason,
            response_text=decoder.decode(list(o.token_ids), skip_special_tokens=True),
            ground_truth=item.ground_truth,
            data_source=item.data_source,
        )
        for o in outputs
    ]


def problem_metrics(samples: Sequence[Sample], k: int) -> dict[str, float]:
    """avg@k, pass@k and maj@k of one problem's ``k`` scored samples."""
    correct = [bool(s.acc) for s in samples]
    keys = [answer_key(s.response_text) for s in samples]
    return {
        "avg@k": avg_at_k(correct),
        "pass@k": pass_at_k(len(correct), sum(correct), k),
        "maj@k": maj_at_k(keys, correct),
    }


def evaluate_benchmark(
    engine: RolloutEngine,
    items: Sequence[Any],
    scorer: Scorer,
    k: int,
    params: SamplingParams,
    decoder: Decoder,
) -> dict[str, float]:
    """Metrics of one benchmark (``items``: ``PromptItem`` list), averaged over problems."""
    per_problem: list[dict[str, float]] = []
    for start in range(0, len(items), PROMPT_BATCH):
        chunk = items[start : start + PROMPT_BATCH]
        outputs = engine.generate([list(it.prompt_ids) for it in chunk], k, params)
        groups = [
            to_eval_samples(it, outs, decoder) for it, outs in zip(chunk, outputs, strict=True)
        ]
        scorer.score([s for g in groups for s in g])
        per_problem.extend(problem_metrics(g, k) for g in groups)
    result = {m: mean_over_problems([p[m] for p in per_problem]) for m in METRIC_KEYS[:3]}
    result["n"] = float(len(per_problem))
    return result


def evaluate(
    engine: RolloutEngine,
    datasets: Mapping[str, Any],
    scorer: Scorer,
    k: int,
    params: SamplingParams,
    max_problems: int = 0,
    tokenizer: Decoder | None = None,
    on_benchmark: Callable[[str, dict[str, float]], None] | None = None,
) -> dict[str, dict[str, float]]:
    """``{bench: {'avg@k', 'pass@k', 'maj@k', 'n'}}`` for each ``PromptDataset`` in ``datasets``.

    ``k`` samples are drawn per problem with ``params``; ``max_problems`` caps problems per
    benchmark (the first ones, so runs compare on the same problems; 0 = all).
    ``tokenizer`` decodes responses (required). ``on_benchmark`` is called after each
    benchmark (progress output).
    """
    if k < 1:
        raise ValueError(f"evaluate: k={k} samples per problem must be >= 1 (validation.n_samples)")
    if max_problems < 0:
        raise ValueError(f"evaluate: max_problems={max_problems} must be >= 0 (0 = all)")
    if tokenizer is None:
        raise ValueError(
            "evaluate: tokenizer=None; pass the model's tokenizer (load_model_tokenizer(model_dir)) "
            "so responses can be decoded for scoring"
        )
    results: dict[str, dict[str, float]] = {}
    for bench, dataset in datasets.items():
        count = len(dataset) if max_problems == 0 else min(max_problems, len(dataset))
        items = [dataset[i] for i in range(count)]
        results[bench] = evaluate_benchmark(engine, items, scorer, k, params, tokenizer)
        if on_benchmark is not None:
            on_benchmark(bench, results[bench])
    return results
