"""``armor data``: the paper's training set and benchmarks as files in the project's schemas.

Each source row is read in one of the layouts these datasets are published in:

- **messages** (DAPO-Math-17k, verl-preprocessed files such as BytedTsinghua-SIA/AIME-2024):
  ``prompt`` (chat messages) and ``reward_model.ground_truth``; open-r1's processed copy keeps
  the messages in ``source_prompt`` and the bare problem in ``prompt``;
- **problem** (HuggingFaceH4/aime_2024, Maxwell-Jia/AIME_2024, opencompass/AIME2025,
  math-ai/amc23, AI-MO/aimo-validation-amc, HuggingFaceH4/MATH-500): a problem column
  (``problem`` / ``question``, any case) and an answer column (``answer``, else the last
  ``\\boxed{}`` of ``solution``); integer answers stored as numbers (``142.0``) become ``142``.

The training set is written in the DAPO-Math schema (its messages as published: they carry
DAPO's instruction), a benchmark in the benchmark schema (``id``, ``problem``, ``answer``,
``data_source`` = its name), both described in docs/data_reward.md. Repeated rows are dropped
(same messages or problem, same answer): the hub's DAPO-Math-17k holds each of its problems
about 100 times, verl's AIME-2024 each 32 times.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_armor.data.schemas import last_boxed
from megatron_armor.data.sources import TARGETS, Target, open_hub, open_source, target
from megatron_armor.data.templates import format_dapo_prompt, strip_dapo_instruction

PROBLEM_COLUMNS = ("problem", "question")
ANSWER_COLUMNS = ("answer", "solution")
ID_COLUMNS = ("id", "unique_id", "problem_id")
MESSAGE_COLUMNS = ("prompt", "source_prompt")
READ_BATCH = 4096
LOGGED_BAD_ROWS = 5
TRAINING_SOURCE = "math_dapo"
"""``data_source`` of the training rows: the DAPO rule scores them (docs/data_reward.md)."""


@dataclass(frozen=True)
class Layout:
    """Which columns of a source hold the prompt, the answer and the row id."""

    kind: str  # "messages" | "problem"
    prompt_columns: tuple[str, ...]
    answer_column: str
    id_column: str | None


@dataclass
class Prepared:
    """What one target's preparation read and wrote."""

    name: str
    source: str
    path: Path
    rows: int = 0
    bad_rows: int = 0
    duplicates: int = 0
    bad_examples: list[str] = field(default_factory=list)
    written: int = 0
    warnings: list[str] = field(default_factory=list)
    """Skipped rows, an unexpected problem count: printed by ``armor data``."""

    def line(self) -> str:
        return (
            f"{self.name}: {self.written} rows from {self.source} -> {self.path} "
            f"(read {self.rows}, {self.duplicates} duplicates dropped, {self.bad_rows} bad rows)"
        )


def detect_layout(columns: list[str], source: str, name: str) -> Layout:
    """The layout of a source from its column names; an unknown one is refused naming the
    columns found and those needed."""
    by_lower = {c.lower(): c for c in columns}
    row_id = next((by_lower[c] for c in ID_COLUMNS if c in by_lower), None)
    if "reward_model" in by_lower:
        prompts = tuple(by_lower[c] for c in MESSAGE_COLUMNS if c in by_lower)
        if prompts:
            return Layout("messages", prompts, by_lower["reward_model"], row_id)
    problem = next((by_lower[c] for c in PROBLEM_COLUMNS if c in by_lower), None)
    answer = next((by_lower[c] for c in ANSWER_COLUMNS if c in by_lower), None)
    if problem is not None and answer is not None:
        return Layout("problem", (problem,), answer, row_id)
    raise ValueError(
        f"{source}: cannot read it as {name}: found columns {sorted(columns)}; needs 'prompt' "
        "(chat messages) + 'reward_model' (the DAPO-Math / verl layout), or a problem column "
        f"({' / '.join(PROBLEM_COLUMNS)}) + an answer column ('answer', or 'solution' ending in "
        "a \\boxed{} answer)"
    )


def answer_text(value: Any) -> str | None:
    """An answer as a non-empty string (``142.0`` -> ``142``), or ``None`` when missing."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def _messages(value: Any) -> list[dict[str, str]] | None:
    """Chat messages (role + string content, a non-empty user message) or ``None``."""
    if not isinstance(value, list) or not value:
        return None
    kept = [
        {"role": m["role"], "content": m["content"]}
        for m in value
        if isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str)
    ]
    if len(kept) != len(value) or not any(
        m["role"] == "user" and m["content"].strip() for m in kept
    ):
        return None
    return kept


def _prompt(row: dict[str, Any], layout: Layout) -> list[dict[str, str]] | str | None:
    """The row's chat messages, else its problem text, else ``None``."""
    for column in layout.prompt_columns:
        messages = _messages(row.get(column))
        if messages is not None:
            return messages
    text = row.get(layout.prompt_columns[0])
    return text.strip() if isinstance(text, str) and text.strip() else None


def _answer(row: dict[str, Any], layout: Layout) -> str | None:
    value = row.get(layout.answer_column)
    if layout.kind == "messages":
        return answer_text(value.get("ground_truth")) if isinstance(value, dict) else None
    if layout.answer_column.lower() == "solution" and isinstance(value, str):
        value = last_boxed(value)
    return answer_text(value)


def _row_id(row: dict[str, Any], layout: Layout, index: int) -> str:
    if layout.id_column is not None and row.get(layout.id_column) is not None:
        return str(row[layout.id_column])
    extra = row.get("extra_info")
    if isinstance(extra, dict) and extra.get("index") is not None:
        return str(extra["index"])
    return str(index)


def _problem_text(prompt: list[dict[str, str]] | str) -> str:
    """A benchmark's problem: the text, or the last user message without DAPO's wrapper."""
    if isinstance(prompt, str):
        return prompt
    user = [m["content"] for m in prompt if m["role"] == "user"][-1]
    return strip_dapo_instruction(user).strip()


def output_row(spec: Target, row_id: str, prompt: list | str, answer: str) -> dict[str, Any]:
    """A row of the project's schema: DAPO-Math for the training set, benchmark otherwise."""
    if spec.training:
        messages = prompt if isinstance(prompt, list) else [
            {"role": "user", "content": format_dapo_prompt(prompt)}
        ]  # fmt: skip
        return {
            "data_source": TRAINING_SOURCE,
            "prompt": messages,
            "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule"},
            "extra_info": {"index": row_id},
        }
    return {
        "id": row_id,
        "problem": _problem_text(prompt),
        "answer": answer,
        "data_source": spec.name,
    }


def _dedupe_key(row: dict[str, Any]) -> tuple:
    if "problem" in row:
        return (row["problem"], row["answer"])
    messages = tuple((m["role"], m["content"]) for m in row["prompt"])
    return (messages, row["reward_model"]["ground_truth"])


def _rows(table: Any) -> Iterator[dict[str, Any]]:
    """The rows of a ``datasets.Dataset``, read in column batches."""
    for batch in table.iter(batch_size=READ_BATCH):
        names = list(batch)
        for values in zip(*(batch[n] for n in names), strict=True):
            yield dict(zip(names, values, strict=True))


def convert(
    table: Any, spec: Target, source: str, dedupe: bool, out: Path
) -> tuple[list, Prepared]:
    """The output rows of ``table`` and the counts (bad rows skipped, repeats dropped)."""
    layout = detect_layout(list(table.column_names), source, spec.name)
    report, rows, seen = Prepared(spec.name, source, out), [], set()
    for index, row in enumerate(_rows(table)):
        report.rows += 1
        row_id, prompt, answer = (
            _row_id(row, layout, index),
            _prompt(row, layout),
            _answer(row, layout),
        )
        if prompt is None or answer is None:
            report.bad_rows += 1
            missing = "prompt/problem" if prompt is None else "answer"
            if len(report.bad_examples) < LOGGED_BAD_ROWS:
                report.bad_examples.append(f"{row_id} (no usable {missing})")
            continue
        converted = output_row(spec, row_id, prompt, answer)
        key = _dedupe_key(converted)
        if dedupe and key in seen:
            report.duplicates += 1
            continue
        seen.add(key)
        rows.append(converted)
    if not rows:
        raise ValueError(
            f"{source}: none of its {report.rows} rows is usable as {spec.name} ({layout.kind} "
            f"layout); first: {', '.join(report.bad_examples) or 'no rows'}"
        )
    return rows, report


def write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    """Write ``rows`` to ``path`` atomically (a crash never leaves half a file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)


def prepare_one(name: str, source: str | None, out_dir: Path, dedupe: bool = True) -> Prepared:
    """Read ``source`` (``None``: the hub copy) and write ``out_dir/<name>.parquet``."""
    from megatron_armor.data.dataset import check_data_file

    spec = target(name)
    table = open_hub(spec.hub) if source is None else open_source(source, spec.hub.split)
    path = out_dir / spec.file_name
    rows, report = convert(table, spec, source or str(spec.hub), dedupe, path)
    write_parquet(rows, path)
    report.written = len(rows)
    check_data_file(str(path))  # what the run's loader reads: a file it refuses is a bug here
    if report.bad_rows:
        first = ", ".join(report.bad_examples)
        report.warnings.append(
            f"{report.source}: skipped {report.bad_rows} bad rows; first: {first}"
        )
    if spec.expected_problems and report.written != spec.expected_problems:
        report.warnings.append(
            f"{name}: {report.written} problems where {spec.title} has {spec.expected_problems}; "
            "check that the source is that benchmark"
        )
    return report


def chosen_targets(names: list[str], sources: dict[str, str]) -> list[str]:
    """The targets to prepare, in order: ``names`` (``all``: every target) and those given a
    source; with neither, every target. Unknown names are refused before anything is read."""
    for name in [*names, *sources]:
        if name != "all":
            target(name)
    if "all" in names or not (names or sources):
        return list(TARGETS)
    return list(dict.fromkeys([*names, *sources]))


def prepare(
    names: list[str], sources: dict[str, str], out_dir: str | Path, dedupe: bool = True
) -> list[Prepared]:
    """Prepare the chosen targets (:func:`chosen_targets`) into ``out_dir``."""
    chosen = chosen_targets(names, sources)
    return [prepare_one(n, sources.get(n), Path(out_dir), dedupe) for n in chosen]
