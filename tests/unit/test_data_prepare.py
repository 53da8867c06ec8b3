"""``armor data``: every published layout of the paper's datasets, through the CLI parser, read
back by the run's dataset loader.

Tier: unit (no devices, no network; small source files written to ``tmp_path`` in the layouts
of DAPO-Math-17k, verl's AIME-2024, open-r1's processed DAPO-Math, HuggingFaceH4/aime_2024,
Maxwell-Jia/AIME_2024, opencompass/AIME2025, AI-MO/aimo-validation-amc, math-ai/amc23 and
HuggingFaceH4/MATH-500).
"""

from __future__ import annotations

import json
import string

import datasets
import pandas as pd
import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from megatron_armor.cli import main
from megatron_armor.data import load_prompt_dataset
from megatron_armor.data.templates import format_dapo_prompt

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """One token per character."""
    chars = ["[UNK]"] + sorted(set(string.printable))
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def dapo_row(problem: str, answer: str, index: int) -> dict:
    """A row as DAPO-Math-17k (and verl's preprocessed benchmarks) publish it."""
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": format_dapo_prompt(problem), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": f"id-{index}"},
    }


def write_jsonl(path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_data(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["data", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def load(path, tokenizer):
    return load_prompt_dataset([str(path)], tokenizer, "dapo", 4096)


def test_dapo_math_is_deduplicated_into_the_dapo_schema(tmp_path, capsys, tokenizer):
    rows = [dapo_row(f"What is {i}+{i}?", str(2 * i), i) for i in range(3)] * 4
    rows.append({**dapo_row("broken", "1", 99), "reward_model": {"style": "rule"}})
    src = tmp_path / "hub" / "dapo-math-17k.parquet"
    src.parent.mkdir()
    pd.DataFrame(rows).to_parquet(src)
    code, out, err = run_data(
        capsys, "--source", f"dapo-math-17k={src}", "--out", str(tmp_path / "data")
    )
    assert code == 0, err
    assert "dapo-math-17k: 3 rows" in out and "9 duplicates dropped, 1 bad rows" in out
    assert "id-99 (no usable answer)" in err
    ds = load(tmp_path / "data" / "dapo-math-17k.parquet", tokenizer)
    assert [ds[i].ground_truth for i in range(len(ds))] == ["0", "2", "4"]
    assert ds[1].query_id == "dapo-math-17k/id-1" and ds[1].data_source == "math_dapo"
    assert ds[1].prompt_text == format_dapo_prompt("What is 1+1?")


def test_keep_duplicates_keeps_every_row(tmp_path, capsys):
    src = write_jsonl(tmp_path / "src.jsonl", [dapo_row("P", "1", 0)] * 5)
    code, out, _ = run_data(capsys, "dapo-math-17k", "--source", f"dapo-math-17k={src}",
                            "--out", str(tmp_path), "--keep-duplicates")  # fmt: skip
    assert code == 0 and "dapo-math-17k: 5 rows" in out


def test_open_r1_processed_layout_uses_its_source_prompt(tmp_path, capsys, tokenizer):
    """open-r1/DAPO-Math-17k-Processed: bare ``prompt`` text, messages in ``source_prompt``."""
    row = dapo_row("Find x.", "7", 0)
    src = write_jsonl(tmp_path / "openr1.jsonl", [{
        "prompt": "Find x.", "solution": "7", "data_source": "math_dapo",
        "source_prompt": row["prompt"], "ability": "MATH", "reward_model": row["reward_model"],
        "extra_info": row["extra_info"],
    }])  # fmt: skip
    assert run_data(capsys, "--source", f"dapo-math-17k={src}", "--out", str(tmp_path))[0] == 0
    ds = load(tmp_path / "dapo-math-17k.parquet", tokenizer)
    assert ds[0].prompt_text == format_dapo_prompt("Find x.") and ds[0].ground_truth == "7"


def test_aime24_h4_jsonl_and_maxwell_jia_parquet(tmp_path, capsys, tokenizer):
    h4 = write_jsonl(tmp_path / "h4" / "train.jsonl", [
        {"id": 60, "problem": "AIME P1", "solution": "... \\boxed{204}", "answer": "204",
         "url": "u", "year": "2024"},
        {"id": 61, "problem": "AIME P2", "solution": "...", "answer": "25", "url": "u",
         "year": "2024"},
    ])  # fmt: skip
    code, out, _ = run_data(capsys, "--source", f"aime24={h4}", "--out", str(tmp_path / "a"))
    assert code == 0 and "aime24: 2 rows" in out
    ds = load(tmp_path / "a" / "aime24.parquet", tokenizer)
    assert [ds[0].query_id, ds[0].ground_truth, ds[0].data_source] == ["aime24/60", "204", "aime24"]
    assert ds[1].prompt_text == format_dapo_prompt("AIME P2")

    maxwell = tmp_path / "maxwell" / "aime_2024_problems.parquet"
    maxwell.parent.mkdir()
    pd.DataFrame([{"ID": "2024-I-1", "Problem": "Q1", "Solution": "s", "Answer": 33}]).to_parquet(
        maxwell
    )
    assert (
        run_data(
            capsys, "aime24", "--source", f"aime24={maxwell.parent}", "--out", str(tmp_path / "b")
        )[0]
        == 0
    )
    ds = load(tmp_path / "b" / "aime24.parquet", tokenizer)
    assert (ds[0].query_id, ds[0].ground_truth) == ("aime24/2024-I-1", "33")


def test_verl_aime_repeated_32_times_becomes_30_problems(tmp_path, capsys, tokenizer):
    """BytedTsinghua-SIA/AIME-2024: DAPO-wrapped messages, each problem 32 times."""
    rows = [dapo_row(f"Problem {i}", str(i), i) for i in range(30)] * 32
    src = tmp_path / "aime.parquet"
    pd.DataFrame(rows).to_parquet(src)
    code, out, err = run_data(capsys, "--source", f"aime24={src}", "--out", str(tmp_path / "o"))
    assert code == 0 and "aime24: 30 rows" in out and "930 duplicates dropped" in out
    assert "where AIME 2024 has" not in err
    ds = load(tmp_path / "o" / "aime24.parquet", tokenizer)
    assert ds[3].prompt_text == format_dapo_prompt("Problem 3")  # one wrapper, not two


def test_aime25_opencompass_directory_concatenates_both_parts(tmp_path, capsys, tokenizer):
    snap = tmp_path / "AIME2025"
    write_jsonl(
        snap / "aime2025-I.jsonl", [{"question": f"I-{i}", "answer": str(i)} for i in range(15)]
    )
    write_jsonl(
        snap / "aime2025-II.jsonl", [{"question": f"II-{i}", "answer": str(i)} for i in range(15)]
    )
    write_jsonl(snap / ".cache" / "junk.jsonl", [{"other": 1}])  # a download cache is skipped
    (snap / "README.md").write_text("# AIME 2025")
    code, out, err = run_data(capsys, "--source", f"aime25={snap}", "--out", str(tmp_path / "d"))
    assert code == 0, err
    assert "aime25: 30 rows" in out
    ds = load(tmp_path / "d" / "aime25.parquet", tokenizer)
    assert len(ds) == 30 and ds[15].prompt_text == format_dapo_prompt("II-0")


def test_amc23_from_aimo_floats_and_a_saved_dataset_dict(tmp_path, capsys, tokenizer):
    aimo = tmp_path / "aimo.parquet"
    pd.DataFrame([{"id": 0, "problem": "AMC P", "answer": 142.0, "url": "u"},
                  {"id": 1, "problem": "AMC Q", "answer": 0.5, "url": "u"}]).to_parquet(aimo)  # fmt: skip
    code, _, err = run_data(capsys, "--source", f"amc23={aimo}", "--out", str(tmp_path / "x"))
    assert code == 0 and "amc23: 2 problems where AMC 2023 has 40" in err
    ds = load(tmp_path / "x" / "amc23.parquet", tokenizer)
    assert [ds[0].ground_truth, ds[1].ground_truth] == ["142", "0.5"]

    saved = tmp_path / "saved"
    rows = {"id": [0, 1], "question": ["Q0", "Q1"], "answer": ["3", "4"], "url": ["u", "u"]}
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows)}).save_to_disk(str(saved))
    assert (
        run_data(capsys, "amc23", "--source", f"amc23={saved}", "--out", str(tmp_path / "y"))[0]
        == 0
    )
    ds = load(tmp_path / "y" / "amc23.parquet", tokenizer)
    assert [ds[1].query_id, ds[1].ground_truth] == ["amc23/1", "4"]


def test_math500_json_answer_or_boxed_solution(tmp_path, capsys, tokenizer):
    src = tmp_path / "test.json"
    src.write_text(json.dumps([
        {"problem": "M1", "solution": "so \\boxed{\\frac{1}{2}}", "answer": "\\frac{1}{2}",
         "subject": "Algebra", "level": 3, "unique_id": "test/algebra/1.json"},
    ]))  # fmt: skip
    assert run_data(capsys, "--source", f"math500={src}", "--out", str(tmp_path))[0] == 0
    ds = load(tmp_path / "math500.parquet", tokenizer)
    assert (ds[0].query_id, ds[0].ground_truth) == ("math500/test/algebra/1.json", "\\frac{1}{2}")
    boxed = write_jsonl(tmp_path / "m.jsonl", [{"problem": "M2", "solution": "x \\boxed{7}"}])
    assert run_data(capsys, "--source", f"math500={boxed}", "--out", str(tmp_path / "b"))[0] == 0
    assert load(tmp_path / "b" / "math500.parquet", tokenizer)[0].ground_truth == "7"


def test_unknown_layout_is_refused_naming_the_columns(tmp_path, capsys):
    src = write_jsonl(tmp_path / "weird.jsonl", [{"text": "P", "label": "1"}])
    code, _, err = run_data(capsys, "--source", f"aime24={src}", "--out", str(tmp_path))
    assert code == 2
    assert "cannot read it as aime24: found columns ['label', 'text']" in err
    assert "'prompt' (chat messages) + 'reward_model'" in err and "problem / question" in err
    assert not (tmp_path / "aime24.parquet").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["aime2024"], "unknown dataset 'aime2024'; `armor data` prepares dapo-math-17k, aime24"),
        (["--source", "aime24"], "--source 'aime24': expected NAME=PATH"),
        (["--source", "amc=x.parquet"], "unknown dataset 'amc'"),
        (["--source", "aime24=/nonexistent/a.parquet"], "/nonexistent/a.parquet: no such file"),
    ],
)
def test_bad_arguments_exit_2(capsys, tmp_path, argv, message):
    code, _, err = run_data(capsys, *argv, "--out", str(tmp_path))
    assert code == 2 and message in err
