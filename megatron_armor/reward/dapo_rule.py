"""The DAPO math rule (docs/data_reward.md): last ``Answer:`` line, Minerva normalization, exact match.

1. Look only at the last ``TAIL_CHARS = 300`` characters of the response.
2. Take the last ``Answer: ...`` line (case-insensitive ``Answer\\s*:``); no such line is
   a wrong answer.
3. Normalize the extracted answer and the ground truth the same way
   (:func:`normalize_answer`) and compare the strings exactly.

The normalization follows the rule used by the DAPO recipe (the Minerva/lm-eval
``normalize_final_answer``), step by step, so rewards are comparable with that recipe:

- keep the text after the last ``=``;
- drop articles ("a ", "an "), ``\\$``, TeX spaces and all spaces; ``mbox`` -> ``text``;
  ``\\text{and}`` -> ``,``;
- remove unit words and decorations (:data:`REMOVED_EXPRESSIONS`: "dollars", "cm",
  ``^\\circ``, ``\\ldots``, ``{,}`` ...), by plain substring removal;
- keep the first ``$...$`` span; unwrap ``\\text{}``, ``\\textbf{}``, ``\\overline{}``,
  ``\\boxed{}``;
- fix shorthand: ``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt2`` -> ``\\sqrt{2}``; drop ``$``;
- a number with thousands separators loses its commas (``1,000`` -> ``1000``).

Known behaviour kept from the recipe (both sides are normalized alike, so these rarely
change a verdict): unit words are removed as substrings (``\\sigma`` loses its "gm"), and
"a " is removed before spaces are (``a + b`` becomes ``+b`` while ``a+b`` stays).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

TAIL_CHARS = 300
NORMALIZED_CACHE = 8192
"""Answers whose normalization :func:`normalize_answer` remembers (least recently used out)."""
ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip

UNWRAP_RULES = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # keep the first $...$ span
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
)
SHORTHAND_RULES = (
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),  # \sqrt2 -> \sqrt{2}
)


@dataclass(frozen=True)
class RuleResult:
    """Verdict of one response: ``correct``, the normalized prediction (``None`` = no answer)."""

    correct: bool
    prediction: str | None


def extract_answer(response: str) -> str | None:
    """The content of the last ``Answer:`` line in the response's last 300 chars, or ``None``."""
    matches = ANSWER_LINE.findall(response[-TAIL_CHARS:])
    return matches[-1] if matches else None


@lru_cache(maxsize=NORMALIZED_CACHE)
def normalize_answer(answer: str) -> str:
    """Minerva normalization of a final answer (see the module docstring for the steps).
    A pure function of the string, memoized: a batch repeats its ground truths (one per
    query, ``G`` samples each) and many of its answers."""
    text = answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        text = text.replace(before, after)
    for expression in REMOVED_EXPRESSIONS:
        text = text.replace(expression, "")
    for pattern, replacement in UNWRAP_RULES + SHORTHAND_RULES:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def score_dapo(response: str, ground_truth: str) -> RuleResult:
    """Apply the DAPO rule: extract, normalize both sides, compare exactly."""
    extracted = extract_answer(response)
    if extracted is None:
        return RuleResult(False, None)
    prediction = normalize_answer(extracted)
    return RuleResult(prediction == normalize_answer(ground_truth), prediction)
