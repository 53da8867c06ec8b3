"""Prompt datasets: both schemas, bad rows, every template, the length filter.

Tier: unit (no devices; tiny parquet/jsonl files written to ``tmp_path``).
"""

from __future__ import annotations

import json
import logging
import string

import pandas as pd
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from megatron_armor.data import PromptItem, load_prompt_dataset
from megatron_armor.data.dataset import check_data_file
from megatron_armor.data.templates import DAPO_PREFIX, DAPO_SUFFIX, format_dapo_prompt

pytestmark = pytest.mark.unit

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (one token per character, [UNK] for the rest)."""
    chars = ["[UNK]", "[PAD]", "[EOS]"] + sorted(set(string.printable))
    model = models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="[UNK]")
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )


@pytest.fixture
def chat_tokenizer(tokenizer) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, unk_token="[UNK]")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def dapo_row(problem: str, answer, index: str | None = None, source: str = "math_dapo") -> dict:
    row = {
        "data_source": source,
        "prompt": [{"role": "user", "content": format_dapo_prompt(problem)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule"},
    }
    if index is not None:
        row["extra_info"] = {"index": index}
    return row


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows: list[dict]) -> str:
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def test_dapo_schema_parquet(tmp_path, tokenizer):
    rows = [dapo_row("What is 1+1?", "2", "a"), dapo_row("What is 2+3?", "5", "b")]
    ds = load_prompt_dataset(
        [write_parquet(tmp_path / "dapo.parquet", rows)], tokenizer, "dapo", 512
    )
    assert len(ds) == 2
    item = ds[0]
    assert isinstance(item, PromptItem)
    assert item.query_id == "dapo/a"
    assert item.ground_truth == "2" and item.data_source == "math_dapo"
    # DAPO rows already carry the instruction: used as is, not wrapped twice.
    assert item.prompt_text == format_dapo_prompt("What is 1+1?")
    assert tokenizer.decode(item.prompt_ids) == item.prompt_text
    assert ds.stats == {
        "files": 1, "rows": 2, "bad_rows": 0, "dropped_too_long": 0, "duplicates": 0, "kept": 2
    }  # fmt: skip


def test_benchmark_schema_jsonl_int_answers_and_file_stem_source(tmp_path, tokenizer):
    rows = [
        {"id": 60, "problem": "Find x.", "answer": 204},
        {"problem": "Find y.", "answer": "1/2"},
    ]
    ds = load_prompt_dataset([write_jsonl(tmp_path / "aime24.jsonl", rows)], tokenizer, "dapo", 512)
    assert [ds[i].query_id for i in range(2)] == ["aime24/60", "aime24/1"]
    assert [ds[i].ground_truth for i in range(2)] == ["204", "1/2"]
    assert ds[0].data_source == "aime24"
    assert ds[0].prompt_text == DAPO_PREFIX + "Find x." + DAPO_SUFFIX


def test_benchmark_aliases_question_and_math_solution(tmp_path, tokenizer):
    rows = [
        {"question": "Q1", "solution": "so $x=\\frac{1}{2}$, i.e. $\\boxed{\\frac{1}{2}}$."},
        {"question": "Q2", "solution": "no box here"},
    ]
    ds = load_prompt_dataset([write_jsonl(tmp_path / "math.jsonl", rows)], tokenizer, "plain", 512)
    assert len(ds) == 1 and ds.stats["bad_rows"] == 1
    assert ds[0].ground_truth == "\\frac{1}{2}" and ds[0].prompt_text == "Q1"


def test_bad_rows_skipped_counted_and_logged(tmp_path, tokenizer, caplog):
    rows = [
        dapo_row("ok", "1", "good"),
        dapo_row("missing answer", None, "r1"),
        dapo_row("empty answer", "  ", "r2"),
        {**dapo_row("x", "1", "r3"), "prompt": ""},
        {**dapo_row("x", "1", "r4"), "prompt": [{"role": "user", "content": 5}]},
        {**dapo_row("x", "1", "r5"), "reward_model": "7"},
        {**dapo_row("x", "1", "r6"), "data_source": 3},
        dapo_row("ok too", "3", "good2"),
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="megatron_armor.data.dataset"):
        ds = load_prompt_dataset([path], tokenizer, "dapo", 512)
    assert [ds[i].query_id for i in range(len(ds))] == ["mixed/good", "mixed/good2"]
    assert ds.stats["bad_rows"] == 6 and ds.stats["rows"] == 8 and ds.stats["kept"] == 2
    message = caplog.text
    assert "skipped 6 of 8 bad rows" in message and "r1 (" in message and "r5 (" in message
    assert "r6" not in message  # only the first few ids are logged


def test_bad_rows_are_reported_once_by_the_input_check_and_the_load(tmp_path, tokenizer, caplog):
    """``armor train`` checks a data file at load and loads it again when the run starts: one
    line names its skipped rows."""
    rows = [dapo_row("ok", "1", "good"), dapo_row("missing answer", None, "r1")]
    path = write_jsonl(tmp_path / "once.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="megatron_armor.data.dataset"):
        assert check_data_file(path) == 1
        assert len(load_prompt_dataset([path], tokenizer, "dapo", 512)) == 1
    assert caplog.text.count("skipped 1 of 2 bad rows") == 1, caplog.text


def test_benchmark_bad_rows(tmp_path, tokenizer):
    rows = [
        {"problem": "ok", "answer": "1"},
        {"problem": "", "answer": "1"},
        {"problem": ["list"], "answer": "1"},
        {"problem": "no answer", "answer": None},
        {"problem": "bool answer", "answer": True},
    ]
    ds = load_prompt_dataset([write_jsonl(tmp_path / "b.jsonl", rows)], tokenizer, "plain", 512)
    assert len(ds) == 1 and ds.stats["bad_rows"] == 4


def test_file_with_no_usable_row_names_the_file(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "broken.jsonl", [{"problem": "", "answer": "1"}] * 3)
    with pytest.raises(ValueError, match=r"broken\.jsonl: none of its 3 rows is usable"):
        load_prompt_dataset([path], tokenizer, "dapo", 512)


@pytest.mark.parametrize(
    ("columns", "missing"),
    [
        ({"problem": ["p"]}, "answer"),
        ({"answer": ["1"]}, "problem"),
        ({"prompt": ["p"]}, "reward_model"),
    ],
)
def test_missing_column_names_file_and_column(tmp_path, tokenizer, columns, missing):
    path = write_parquet(
        tmp_path / "cols.parquet",
        [dict(zip(columns, v, strict=True)) for v in zip(*columns.values(), strict=True)],
    )
    with pytest.raises(ValueError, match=rf"cols\.parquet: column '{missing}' is missing"):
        load_prompt_dataset([path], tokenizer, "dapo", 512)


def test_missing_file_and_unknown_suffix(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_prompt_dataset([str(tmp_path / "nope.parquet")], tokenizer, "dapo", 512)
    bad = tmp_path / "data.csv"
    bad.write_text("problem,answer\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_prompt_dataset([str(bad)], tokenizer, "dapo", 512)


def test_empty_and_unreadable_files_name_the_file(tmp_path, tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl: the file is empty"):
        load_prompt_dataset([str(empty)], tokenizer, "dapo", 512)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_text("not parquet")
    with pytest.raises(ValueError, match=r"garbage\.parquet: cannot be read as parquet"):
        load_prompt_dataset([str(garbage)], tokenizer, "dapo", 512)


def test_dapo_rows_without_data_source_take_the_file_stem(tmp_path, tokenizer):
    row = dapo_row("P", "1", "i")
    del row["data_source"]
    ds = load_prompt_dataset(
        [write_jsonl(tmp_path / "tiny_train.jsonl", [row])], tokenizer, "dapo", 512
    )
    assert ds[0].data_source == "tiny_train"


def test_templates_on_both_schemas(tmp_path, tokenizer, chat_tokenizer):
    dapo = write_parquet(tmp_path / "train.parquet", [dapo_row("P1", "1", "q")])
    bench = write_jsonl(tmp_path / "amc.jsonl", [{"problem": "P2", "answer": "2"}])
    texts = {}
    for template, tok in (("dapo", tokenizer), ("plain", tokenizer), ("chat", chat_tokenizer)):
        ds = load_prompt_dataset([dapo, bench], tok, template, 512)
        texts[template] = [ds[0].prompt_text, ds[1].prompt_text]
        assert tok.decode(ds[1].prompt_ids) == ds[1].prompt_text
    assert texts["dapo"] == [format_dapo_prompt("P1"), format_dapo_prompt("P2")]
    assert texts["plain"] == ["P1", "P2"]
    assert texts["chat"] == [
        f"<|user|>{format_dapo_prompt('P1')}\n<|assistant|>",
        f"<|user|>{format_dapo_prompt('P2')}\n<|assistant|>",
    ]


def test_chat_template_missing_is_a_clear_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "a.jsonl", [{"problem": "P", "answer": "1"}])
    with pytest.raises(ValueError, match="has no chat template; use data.template=dapo"):
        load_prompt_dataset([path], tokenizer, "chat", 512)
    with pytest.raises(ValueError, match="data.template='fancy'"):
        load_prompt_dataset([path], tokenizer, "fancy", 512)


def test_length_filter_drops_counts_and_reports(tmp_path, tokenizer, caplog):
    rows = [{"problem": "x" * n, "answer": "1"} for n in (1, 10, 30, 100)]
    path = write_jsonl(tmp_path / "len.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="megatron_armor.data.dataset"):
        ds = load_prompt_dataset([path], tokenizer, "plain", 30)
    assert [len(it.prompt_ids) for it in ds] == [1, 10, 30]
    assert ds.stats["dropped_too_long"] == 1 and ds.stats["kept"] == 3
    assert "dropped 1 of 4 prompts longer than max_prompt_len=30" in caplog.text
    assert "1 longer than max_prompt_len" in ds.report()
    with pytest.raises(ValueError, match="raise data.max_prompt_len"):
        load_prompt_dataset([path], tokenizer, "dapo", 30)  # the instruction alone is longer


def test_duplicate_ids_and_dedupe(tmp_path, tokenizer):
    rows = [dapo_row("P", "1", "same"), dapo_row("P", "1", "same"), dapo_row("Q", "2", "same")]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = load_prompt_dataset([path], tokenizer, "dapo", 512)
    assert [it.query_id for it in ds] == ["d/same", "d/same#1", "d/same#2"]
    deduped = load_prompt_dataset([path], tokenizer, "dapo", 512, dedupe=True)
    assert len(deduped) == 2 and deduped.stats["duplicates"] == 1
