"""The DAPO rule and the math-verify verifier on hand-labelled answer tables.

Tier: unit (in-process, no pool; the pool is tested in test_reward_scorer.py).
"""

from __future__ import annotations

import pytest

from megatron_armor.reward.dapo_rule import extract_answer, normalize_answer, score_dapo
from megatron_armor.reward.math_verify_rule import score_math_verify

pytestmark = pytest.mark.unit

# (response, ground truth, expected verdict of the DAPO rule)
DAPO_CASES = [
    # extraction: last "Answer:" line, case-insensitive, within the last 300 characters
    ("Answer: 34", "34", True),
    ("so the result follows.\nAnswer: 34\n", "34", True),
    ("answer: 34", "34", True),
    ("ANSWER:34", "34", True),
    ("Final Answer: 34", "34", True),
    ("Answer: 35", "34", False),
    ("The result is 34.", "34", False),  # "Answer:" missing
    ("The result is \\boxed{34}", "34", False),  # "Answer:" missing, \boxed alone is not read
    ("", "34", False),
    ("Answer:   ", "34", False),
    ("Answer: 3\nthen I checked again.\nAnswer: 4", "4", True),  # the last line counts
    ("Answer: 3\nthen I checked again.\nAnswer: 4", "3", False),
    ("Answer: 34\n" + "I am confident. " * 25, "34", False),  # beyond the last 300 chars
    ("Answer: 12\nThat is all.", "12", True),
    # \boxed, $, \text, \textbf
    ("Answer: \\boxed{34}", "34", True),
    ("Answer: $34$", "34", True),
    ("Answer: $\\boxed{34}$", "34", True),
    ("Answer: 12", "\\boxed{12}", True),
    ("Answer: \\text{Monday}", "Monday", True),
    ("Answer: \\textbf{7}", "7", True),
    # units and decorations
    ("Answer: 12 dollars", "12", True),
    ("Answer: 5 cm", "5", True),
    ("Answer: 12 \\text{ meters}", "12", True),
    ("Answer: \\text{5 inches}", "5", True),
    ("Answer: 5 \\text{ units}", "5", True),
    ("Answer: 3 hours", "3", True),
    ("Answer: 90^\\circ", "90", True),
    ("Answer: 90 degrees", "90", True),
    ("Answer: 10\\%", "10", False),  # "\%" is not a unit the rule removes
    # thousands separators
    ("Answer: 1,000", "1000", True),
    ("Answer: 1000", "1,000", True),
    ("Answer: 1,234,567", "1234567", True),
    ("Answer: 1{,}000", "1000", True),
    # negatives and decimals
    ("Answer: -7", "-7", True),
    ("Answer: - 7", "-7", True),
    ("Answer: -7", "7", False),
    ("Answer: 0.5", "0.5", True),
    ("Answer: 0.5", "\\frac{1}{2}", False),  # exact match: no numeric equivalence
    ("Answer: 34.", "34", False),  # a trailing period survives outside $...$
    ("Answer: $34.$", "34", True),
    # fractions and roots (shorthand fixed, no algebra)
    ("Answer: \\frac12", "\\frac{1}{2}", True),
    ("Answer: \\frac{1}{2}", "\\frac{1}{2}", True),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", False),
    ("Answer: 3/4", "\\frac{3}{4}", False),
    ("Answer: \\sqrt2", "\\sqrt{2}", True),
    ("Answer: 2\\sqrt3", "2\\sqrt{3}", True),
    ("Answer: $\\frac{\\sqrt{3}}{2}$", "\\frac{\\sqrt{3}}{2}", True),
    ("Answer: 2^{10}", "1024", False),
    ("Answer: 3\\pi", "3\\pi", True),
    # text after the last "="
    ("Answer: x = 5", "5", True),
    ("Answer: a = b = 12", "12", True),
    ("Answer: x = 5", "x=5", True),
    # intervals and sets
    ("Answer: (1, 2]", "(1,2]", True),
    ("Answer: [1, 2)", "(1,2)", False),
    ("Answer: (-\\infty, 3)", "(-\\infty,3)", True),
    ("Answer: \\{1, 2\\}", "\\{1,2\\}", True),
]


@pytest.mark.parametrize(("response", "truth", "expected"), DAPO_CASES)
def test_dapo_rule_table(response, truth, expected):
    result = score_dapo(response, truth)
    assert result.correct is expected, (response, truth, result.prediction)


def test_dapo_table_is_large_enough():
    assert len(DAPO_CASES) >= 40


def test_dapo_extraction_and_normalization_details():
    assert extract_answer("blah\nAnswer: \\boxed{7} \nmore") == "\\boxed{7} "
    assert extract_answer("no final line") is None
    assert score_dapo("nothing", "1").prediction is None
    assert normalize_answer("The answer is $x = \\frac34$") == "\\frac{3}{4}"
    assert normalize_answer("\\text{(A)}") == "(A)"
    assert normalize_answer(" 1,000 ") == "1000"


def test_normalization_is_memoized_per_string():
    """A batch repeats its ground truths and many answers: each string is normalized once."""
    normalize_answer.cache_clear()
    verdicts = [score_dapo(f"Answer: {a}", "1,000") for a in ("1000", "1,000", "1000", "$1000$")]
    assert [v.correct for v in verdicts] == [True, True, True, True]
    info = normalize_answer.cache_info()
    assert (info.misses, info.hits) == (3, 5)  # "1000", "1,000", "$1000$" once each


# (response, ground truth, expected verdict of math-verify)
MATH_VERIFY_CASES = [
    ("Answer: 0.5", "\\frac{1}{2}", True),
    ("Answer: \\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", True),
    ("Answer: \\dfrac{3}{4}", "0.75", True),
    ("Answer: \\sqrt{8}", "2\\sqrt{2}", True),
    ("Answer: 1,000", "1000", True),
    ("Answer: x = 3", "3", True),
    ("Answer: (1, 2]", "(1,2]", True),
    ("Answer: [1,2)", "(1,2)", False),
    ("Answer: \\{2, 1\\}", "\\{1,2\\}", True),
    ("Answer: (x+1)^2", "x^2+2x+1", True),
    ("Answer: 10\\%", "0.1", True),
    ("Answer: 2\\pi", "6.2832", False),
    ("Answer: -7", "7", False),
    ("Answer: - 7", "-7", True),
    ("Answer: 12 \\text{ dollars}", "12", True),
    ("Answer: 3 \\text{ cm}", "3", True),
    ("Answer: \\infty", "\\infty", True),
    ("Answer: \\text{(B)}", "B", True),
    ("Answer: 204", "204", True),
    ("Answer: 205", "204", False),
    ("The answer is \\boxed{42}.", "42", True),  # no "Answer:" line: math-verify extracts
    ("We get $x=5$, and finally \\boxed{6}", "6", True),
    ("no math here", "5", False),
]


@pytest.mark.parametrize(("response", "truth", "expected"), MATH_VERIFY_CASES)
def test_math_verify_table(response, truth, expected):
    result = score_math_verify(response, truth)
    assert result.correct is expected, (response, truth, result.prediction)
