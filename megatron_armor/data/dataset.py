"""Prompt datasets: read files with ``datasets``, validate rows, template, tokenize, filter.

``load_prompt_dataset(files, tokenizer, template, max_prompt_len)`` reads local parquet /
jsonl files (or hub datasets ``owner/name[:split]`` where a network exists), parses each
row by its file's schema (:mod:`megatron_armor.data.schemas`), renders it with a prompt
template (:mod:`megatron_armor.data.templates`), tokenizes it, and drops prompts longer
than ``max_prompt_len`` tokens. Bad rows and dropped prompts are counted in ``.stats`` and
logged with the first few row ids.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron_armor.data.schemas import BadRow, RawRow, Schema, detect_schema, parse_row
from megatron_armor.data.templates import (
    check_template,
    dataset_messages,
    problem_messages,
    render_messages,
    require_chat_template,
)

logger = logging.getLogger(__name__)

LOGGED_BAD_ROWS = 5
_REPORTED: set[tuple[str, int, int]] = set()
"""Files whose bad rows this process has reported (the input check at load and the dataset
load of the same run read a file twice; its skipped rows are one line)."""
TOKENIZE_BATCH = 1024
FILE_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+(:[\w.-]+)?")


@dataclass
class PromptItem:
    """One prompt ready for generation."""

    query_id: str
    prompt_ids: list[int]
    prompt_text: str
    ground_truth: str
    data_source: str


@dataclass
class _Columns:
    """Column-wise storage: token ids flat in one int32 array, ``offsets`` of length n + 1."""

    query_ids: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    ground_truths: list[str] = field(default_factory=list)
    data_sources: list[str] = field(default_factory=list)
    token_chunks: list[np.ndarray] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)


class PromptDataset:
    """Tokenized prompts (indexable), with ``stats``: rows, bad_rows, dropped_too_long, kept.

    Token ids are stored as one flat int32 array plus offsets, so a large training set
    (DAPO-Math-17K ships 1.79M rows) costs 4 bytes per token rather than a Python list each.
    """

    def __init__(self, columns: _Columns, stats: dict[str, int], name: str = ""):
        self.name = name
        self.stats = stats
        self._query_ids = columns.query_ids
        self._texts = columns.texts
        self._ground_truths = columns.ground_truths
        self._data_sources = columns.data_sources
        chunks = columns.token_chunks
        self._tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
        self._offsets = np.zeros(len(columns.lengths) + 1, dtype=np.int64)
        np.cumsum(columns.lengths, out=self._offsets[1:])

    def __len__(self) -> int:
        return len(self._query_ids)

    def __getitem__(self, index: int) -> PromptItem:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} prompts")
        index %= len(self)
        start, end = self._offsets[index], self._offsets[index + 1]
        return PromptItem(
            query_id=self._query_ids[index],
            prompt_ids=self._tokens[start:end].tolist(),
            prompt_text=self._texts[index],
            ground_truth=self._ground_truths[index],
            data_source=self._data_sources[index],
        )

    def __iter__(self) -> Iterator[PromptItem]:
        return (self[i] for i in range(len(self)))

    def prompt_lengths(self) -> np.ndarray:
        """Prompt lengths in tokens, ``[len(self)]``."""
        return np.diff(self._offsets)

    def report(self) -> str:
        """One line for logs: kept / rows, bad rows, prompts dropped by the length filter."""
        s = self.stats
        return (
            f"{self.name or 'dataset'}: kept {s['kept']} of {s['rows']} rows "
            f"({s['bad_rows']} bad, {s['dropped_too_long']} longer than max_prompt_len, "
            f"{s['duplicates']} duplicates removed)"
        )


def read_table(source: str) -> Any:
    """A ``datasets.Dataset`` from a local parquet/jsonl file or a hub name ``owner/name[:split]``."""
    import datasets

    path = Path(source)
    if path.exists():
        fmt = FILE_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise ValueError(
                f"{source}: unsupported file type {path.suffix!r}; use one of {sorted(FILE_FORMATS)}"
            )
        if path.stat().st_size == 0:
            raise ValueError(f"{source}: the file is empty")
        if fmt == "parquet" and _parquet_rows(path) == 0:
            raise ValueError(
                f"{source}: the file has no rows; point the setting at a file with data"
            )
        try:
            return datasets.load_dataset(fmt, data_files=str(path), split="train")
        except Exception as e:  # arrow/json errors come in many types; name the file
            where = bad_json_line(path) if path.suffix.lower() == ".jsonl" else ""
            raise ValueError(
                f"{source}: cannot be read as {fmt}{where} ({type(e).__name__}: {e})"
            ) from e
    if not HUB_NAME.fullmatch(source) or path.suffix.lower() in FILE_FORMATS:
        raise FileNotFoundError(f"{source}: data file not found")
    name, _, split = source.partition(":")
    try:
        return datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # hub errors come in many types; keep the cause
        raise FileNotFoundError(
            f"{source}: not a local file, and loading it as a hub dataset failed ({e}); "
            "pass a local parquet/jsonl path, or `owner/name[:split]` where a network exists"
        ) from e


def bad_json_line(path: Path) -> str:
    """``" (line N: <what>)"`` of the first line of a jsonl file that is not a JSON object
    (1-based, as an editor counts; blank lines are skipped as ``datasets`` skips them), or
    ``""`` when every line is one."""
    import json

    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return f" (line {number}: {e.msg})"
            if not isinstance(row, dict):
                return f" (line {number}: a JSON {type(row).__name__}, not an object)"
    return ""


def _parquet_rows(path: Path) -> int:
    """Row count from the parquet footer (``datasets`` fails obscurely on 0-row files)."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception as e:  # noqa: BLE001 - arrow raises many types; name the file
        raise ValueError(f"{path}: cannot be read as parquet ({type(e).__name__}: {e})") from e


def _source_stem(source: str) -> str:
    """The default data_source / query-id prefix of a file: its stem (``aime24.parquet`` -> ``aime24``)."""
    if Path(source).exists():
        return Path(source).stem
    return source.partition(":")[0].rsplit("/", 1)[-1]


def _parse_file(source: str) -> tuple[list[RawRow], list[BadRow], int]:
    """Read and validate one file: (valid rows, bad rows, number of rows)."""
    table = read_table(source)
    if len(table) == 0:
        raise ValueError(f"{source}: the file has no rows")
    schema: Schema = detect_schema(list(table.column_names), source)
    stem = _source_stem(source)
    good, bad = [], []
    index = 0
    for batch in table.iter(batch_size=TOKENIZE_BATCH):
        for row in _batch_rows(batch):
            parsed = parse_row(row, index, schema, default_source=stem)
            (good if isinstance(parsed, RawRow) else bad).append(parsed)
            index += 1
    if not good:
        reasons = Counter(b.reason for b in bad).most_common(3)
        first = ", ".join(f"row {b.row_id}: {b.reason}" for b in bad[:LOGGED_BAD_ROWS])
        raise ValueError(
            f"{source}: none of its {index} rows is usable ({schema.kind} schema); first: "
            f"{first}; most common problems: {reasons}; fix those rows or drop the file"
        )
    if bad:
        report_bad_rows(source, bad, index)
    return good, bad, index


def report_bad_rows(source: str, bad: list[BadRow], rows: int) -> None:
    """One warning per file and process naming the skipped rows (the first few)."""
    key = (str(Path(source).resolve()) if Path(source).exists() else source, len(bad), rows)
    if key in _REPORTED:
        return
    _REPORTED.add(key)
    first = ", ".join(f"{b.row_id} ({b.reason})" for b in bad[:LOGGED_BAD_ROWS])
    logger.warning("%s: skipped %d of %d bad rows; first: %s", source, len(bad), rows, first)


def check_data_file(source: str) -> int:
    """Read and validate ``source`` without tokenizing it (the up-front input check); returns
    the number of usable rows; raises ``ValueError``/``FileNotFoundError`` naming the file and
    the first bad rows when none is usable."""
    good, _, _ = _parse_file(source)
    return len(good)


def _batch_rows(batch: dict[str, list[Any]]) -> Iterator[dict[str, Any]]:
    """Rows of a column batch."""
    names = list(batch)
    for values in zip(*(batch[n] for n in names), strict=True):
        yield dict(zip(names, values, strict=True))


def _render(row: RawRow, template: str, tokenizer: Any) -> str:
    """The prompt text of a row under ``template``."""
    if row.messages is not None:
        messages = dataset_messages(row.messages, template)
    else:
        messages = problem_messages(row.problem or "", template)
    return render_messages(messages, template, tokenizer)


def _tokenize(texts: list[str], template: str, tokenizer: Any) -> list[list[int]]:
    """Token ids; a chat-templated text already holds its special tokens."""
    special = template != "chat"
    ids: list[list[int]] = []
    for i in range(0, len(texts), TOKENIZE_BATCH):
        ids.extend(
            tokenizer(texts[i : i + TOKENIZE_BATCH], add_special_tokens=special)["input_ids"]
        )
    return ids


def _unique_id(query_id: str, seen: set[str]) -> str:
    """``query_id``, suffixed ``#k`` when an earlier row already used it."""
    candidate, k = query_id, 1
    while candidate in seen:
        candidate, k = f"{query_id}#{k}", k + 1
    seen.add(candidate)
    return candidate


def _add_file(
    columns: _Columns,
    rows: list[RawRow],
    prefix: str,
    options: tuple[str, Any, int, bool],
    seen: tuple[set[str], set[tuple[str, str]]],
) -> tuple[int, int]:
    """Template, tokenize and length-filter one file's rows: (dropped too long, duplicates)."""
    template, tokenizer, max_prompt_len, dedupe = options
    seen_ids, seen_prompts = seen
    texts = [_render(r, template, tokenizer) for r in rows]
    too_long = duplicates = 0
    for row, text, ids in zip(rows, texts, _tokenize(texts, template, tokenizer), strict=True):
        if len(ids) > max_prompt_len:
            too_long += 1
            continue
        if dedupe:
            if (text, row.ground_truth) in seen_prompts:
                duplicates += 1
                continue
            seen_prompts.add((text, row.ground_truth))
        columns.query_ids.append(_unique_id(f"{prefix}/{row.row_id}", seen_ids))
        columns.texts.append(text)
        columns.ground_truths.append(row.ground_truth)
        columns.data_sources.append(row.data_source)
        columns.token_chunks.append(np.asarray(ids, dtype=np.int32))
        columns.lengths.append(len(ids))
    return too_long, duplicates


def load_prompt_dataset(
    files: list[str],
    tokenizer: Any,
    template: str,
    max_prompt_len: int,
    dedupe: bool = False,
    name: str = "",
) -> PromptDataset:
    """Load, validate, template, tokenize and length-filter ``files`` into one dataset.

    ``query_id`` is ``<file stem>/<row id>`` (``#k`` appended when a row id repeats).
    ``dedupe`` drops rows whose rendered prompt and ground truth equal an earlier row's
    (DAPO-Math-17K repeats each of its ~17.9k problems about 100 times).
    """
    check_template(template)
    if template == "chat":
        require_chat_template(tokenizer)
    if max_prompt_len <= 0:
        raise ValueError(f"data.max_prompt_len={max_prompt_len}: must be a positive token count")
    if not files:
        raise ValueError("no data files given; set data.train_files / data.val_files")
    columns = _Columns()
    stats = {"files": len(files), "rows": 0, "bad_rows": 0, "dropped_too_long": 0, "duplicates": 0}
    seen: tuple[set[str], set[tuple[str, str]]] = (set(), set())
    for source in files:
        rows, bad, total = _parse_file(source)
        options = (template, tokenizer, max_prompt_len, dedupe)
        too_long, dup = _add_file(columns, rows, _source_stem(source), options, seen)
        if too_long:
            logger.warning(
                "%s: dropped %d of %d prompts longer than max_prompt_len=%d tokens",
                source, too_long, len(rows), max_prompt_len,
            )  # fmt: skip
        stats["rows"] += total
        stats["bad_rows"] += len(bad)
        stats["dropped_too_long"] += too_long
        stats["duplicates"] += dup
    stats["kept"] = len(columns.query_ids)
    if stats["kept"] == 0:
        raise ValueError(
            f"no prompt of {files} fits data.max_prompt_len={max_prompt_len} tokens "
            f"({stats['dropped_too_long']} dropped); raise data.max_prompt_len"
        )
    dataset = PromptDataset(columns, stats, name=name)
    logger.info(dataset.report())
    return dataset
