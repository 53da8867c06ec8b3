"""The ``math_verify`` verifier: symbolic equivalence with HuggingFace ``math-verify``.

1. The prediction text: the content of the last ``Answer:`` line in the response's last
   300 characters (the line DAPO's prompt asks for); when there is none, the whole
   response, from which math-verify extracts the last ``\\boxed{}`` or final expression.
2. Bare answers (no ``$``, ``\\boxed``, ``\\(``, ``\\[``) are wrapped in ``$...$`` so that
   LaTeX such as ``\\frac{1}{2}`` or ``(1, 2]`` parses as LaTeX; the ground truth likewise.
3. ``math_verify.verify(gold, prediction)``: numbers within tolerance, symbolic equality,
   intervals, sets, equations such as ``x = 3`` against ``3``.

math-verify's own ``signal.alarm`` timeouts are switched off here: the scoring pool
(:mod:`megatron_armor.reward.pool`) bounds the time of every item instead, including
computations that hold the interpreter lock (``9^{9^{9^{9^9}}}``) where an alarm never fires.
"""

from __future__ import annotations

import logging

from megatron_armor.reward.dapo_rule import RuleResult, extract_answer

LATEX_DELIMITERS = ("$", "\\boxed", "\\(", "\\[")


def _as_latex(text: str) -> str:
    """``text`` wrapped in ``$...$`` unless it already carries a LaTeX delimiter."""
    if any(d in text for d in LATEX_DELIMITERS):
        return text
    return f"${text.strip()}$"


def quiet_math_verify() -> None:
    """Silence math-verify's per-call warnings (timeouts disabled, failed parses)."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def score_math_verify(response: str, ground_truth: str) -> RuleResult:
    """math-verify equivalence of the response's final answer and ``ground_truth``."""
    from math_verify import parse, verify

    line = extract_answer(response)
    prediction_text = _as_latex(line) if line is not None else response
    gold = parse(_as_latex(ground_truth), parsing_timeout=None)
    prediction = parse(prediction_text, parsing_timeout=None)
    if not gold or not prediction:
        return RuleResult(False, None if not prediction else str(prediction[-1]))
    correct = verify(gold, prediction, timeout_seconds=None)
    return RuleResult(bool(correct), str(prediction[-1]))
