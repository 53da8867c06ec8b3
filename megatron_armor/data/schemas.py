"""Row schemas: DAPO-Math-17K rows and benchmark (problem + answer) rows.

**DAPO-Math schema** (columns ``prompt``, ``reward_model``; optional ``data_source``,
``extra_info``)::

    prompt: [{"role": "user", "content": "Solve the following ... Answer:\"."}]
    reward_model: {"ground_truth": "34", "style": "rule"}
    data_source: "math_dapo"
    extra_info: {"index": "9a9b6eb4-..."}        # optional; the row id

**Benchmark schema** (AIME/AMC/MATH files as usually distributed): a problem column and
an answer column, optional ``data_source`` and ``id``:

- problem: ``problem``, else ``question``;
- answer: ``answer``, else ``solution``, from which the last ``\\boxed{...}`` is taken
  (the MATH convention); integer/float answers (AIME files often store ints) become strings;
- data_source: the ``data_source`` column, else the file's stem (``aime24.parquet`` ->
  ``aime24``); the row id: ``id``, else ``extra_info.index``, else the row number.

A row that breaks its schema (missing answer, empty or non-string prompt, wrong types) is
a :class:`BadRow`; the loader skips, counts and logs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

PROBLEM_COLUMNS = ("problem", "question")
ANSWER_COLUMNS = ("answer", "solution")


@dataclass(frozen=True)
class RawRow:
    """A valid row before templating: either chat ``messages`` or a bare ``problem``."""

    row_id: str
    ground_truth: str
    data_source: str
    messages: list[dict[str, str]] | None = None
    problem: str | None = None


@dataclass(frozen=True)
class BadRow:
    """A row that breaks its schema, with the reason."""

    row_id: str
    reason: str


@dataclass(frozen=True)
class Schema:
    """Which columns of a file hold what."""

    kind: str  # "dapo" | "benchmark"
    problem_column: str = "prompt"
    answer_column: str = "reward_model"


def detect_schema(columns: list[str], file: str) -> Schema:
    """The schema of a file from its column names; a clear error when neither fits."""
    if "prompt" in columns or "reward_model" in columns:
        for needed in ("prompt", "reward_model"):
            if needed not in columns:
                raise ValueError(
                    f"{file}: column {needed!r} is missing (DAPO-Math schema needs 'prompt' and "
                    f"'reward_model'; found {sorted(columns)})"
                )
        return Schema("dapo")
    problem = next((c for c in PROBLEM_COLUMNS if c in columns), None)
    answer = next((c for c in ANSWER_COLUMNS if c in columns), None)
    if problem is None or answer is None:
        missing = "problem" if problem is None else "answer"
        raise ValueError(
            f"{file}: column {missing!r} is missing; a data file needs the DAPO-Math schema "
            f"('prompt' + 'reward_model') or the benchmark schema ({'/'.join(PROBLEM_COLUMNS)} + "
            f"{'/'.join(ANSWER_COLUMNS)}); found {sorted(columns)}"
        )
    return Schema("benchmark", problem, answer)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (balanced braces), or ``None``."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def _answer_string(value: Any) -> str | None:
    """An answer value as a non-empty string: str as is, int/finite float converted, else
    ``None`` (a NaN/None answer — a missing cell — is never turned into the string "nan")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def _row_id(row: dict[str, Any], index: int) -> str:
    """``id`` column, else ``extra_info.index``, else the row number."""
    if row.get("id") is not None:
        return str(row["id"])
    extra = row.get("extra_info")
    if isinstance(extra, dict) and extra.get("index") is not None:
        return str(extra["index"])
    return str(index)


def _valid_messages(prompt: Any) -> list[dict[str, str]] | str:
    """The chat messages of a DAPO row, or the reason they are invalid."""
    if not isinstance(prompt, list) or not prompt:
        return "prompt is not a non-empty list of chat messages"
    messages = []
    for m in prompt:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return "prompt message without a string 'role'"
        if not isinstance(m.get("content"), str):
            return "prompt message content is not a string"
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        return "prompt has no non-empty user message"
    return messages


def _data_source(row: dict[str, Any], default: str) -> str | None:
    value = row.get("data_source", default)
    if value is None:
        return default
    return value if isinstance(value, str) and value else None


def parse_dapo_row(row: dict[str, Any], index: int, default_source: str) -> RawRow | BadRow:
    """One DAPO-Math-schema row."""
    row_id = _row_id(row, index)
    messages = _valid_messages(row.get("prompt"))
    if isinstance(messages, str):
        return BadRow(row_id, messages)
    reward = row.get("reward_model")
    if not isinstance(reward, dict):
        return BadRow(row_id, "reward_model is not a dict")
    answer = _answer_string(reward.get("ground_truth"))
    if answer is None:
        return BadRow(row_id, "reward_model.ground_truth is missing, NaN, empty or not a string")
    source = _data_source(row, default_source)
    if source is None:
        return BadRow(row_id, "data_source is not a non-empty string")
    return RawRow(row_id, answer, source, messages=messages)


def parse_benchmark_row(
    row: dict[str, Any], index: int, schema: Schema, default_source: str
) -> RawRow | BadRow:
    """One benchmark-schema row (problem + answer, or MATH-style problem + solution)."""
    row_id = _row_id(row, index)
    problem = row.get(schema.problem_column)
    if not isinstance(problem, str) or not problem.strip():
        return BadRow(row_id, f"{schema.problem_column} is empty or not a string")
    raw_answer = row.get(schema.answer_column)
    if schema.answer_column == "solution" and isinstance(raw_answer, str):
        raw_answer = last_boxed(raw_answer)
    answer = _answer_string(raw_answer)
    if answer is None:
        return BadRow(row_id, f"{schema.answer_column} is missing, NaN, empty or of the wrong type")
    source = _data_source(row, default_source)
    if source is None:
        return BadRow(row_id, "data_source is not a non-empty string")
    return RawRow(row_id, answer, source, problem=problem)


def parse_row(
    row: dict[str, Any], index: int, schema: Schema, default_source: str
) -> RawRow | BadRow:
    """Dispatch on the file's schema."""
    if schema.kind == "dapo":
        return parse_dapo_row(row, index, default_source)
    return parse_benchmark_row(row, index, schema, default_source)
