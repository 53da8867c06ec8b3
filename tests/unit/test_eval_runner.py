"""Unit tier: the evaluation runner (metric reduction, answer keys, tables, ``armor eval``)."""

from __future__ import annotations

import json

import pytest

from megatron_armor.cli import main
from megatron_armor.data.dataset import PromptItem
from megatron_armor.evaluation.report import markdown_table, write_report
from megatron_armor.evaluation.runner import answer_key, evaluate, last_boxed
from megatron_armor.reward.scorer import RewardScorer
from megatron_armor.rollout.protocol import GenerationOutput, RolloutEngine, SamplingParams
from megatron_armor.tiny.model import TinyModelConfig, write_model_dir
from megatron_armor.tiny.task import write_task
from megatron_armor.tiny.tokenizer import build_tokenizer

pytestmark = pytest.mark.unit

SMALL = TinyModelConfig(
    hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64
)


class ScriptedEngine(RolloutEngine):
    """Replays fixed responses per prompt (keyed by the prompt's token ids)."""

    def __init__(self, tokenizer, script: dict[str, list[str]]):
        self.tokenizer = tokenizer
        self.script = {tuple(tokenizer(p).input_ids): r for p, r in script.items()}
        self.calls: list[tuple[int, int]] = []

    def generate(self, prompts, n, params, weights="policy"):
        self.calls.append((len(prompts), n))
        return [
            [
                GenerationOutput(self.tokenizer(r).input_ids, [0.0] * len(r), "stop", 0)
                for r in self.script[tuple(p)][:n]
            ]
            for p in prompts
        ]

    def update_weights(self, named_tensors, version, weights="policy"):
        raise NotImplementedError

    def weight_version(self, weights="policy"):
        return 0

    def health(self):
        return True


def item(tokenizer, prompt: str, truth: str) -> PromptItem:
    return PromptItem(prompt, tokenizer(prompt).input_ids, prompt, truth, "tiny_arith")


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(num_workers=1, overlong_enabled=False) as s:
        yield s


def test_answer_keys():
    assert answer_key("3+4=7\nAnswer: 7") == "7"
    assert answer_key("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert answer_key("no answer here") is None
    assert last_boxed("\\boxed{1} and \\boxed{{2}+3}") == "{2}+3"
    assert last_boxed("\\boxed{unclosed") is None


def test_evaluate_reduces_per_problem_then_averages(scorer):
    tok = build_tokenizer()
    engine = ScriptedEngine(
        tok,
        {
            "3+4=?": ["Answer: 7", "Answer: 3", "Answer: 3", "Answer: 7"],  # avg .5, maj tie -> 7
            "9-4=?": ["Answer: 4", "Answer: 4", "nothing", "Answer: 5"],  # avg .25, maj 4 (wrong)
            "1+1=?": ["Answer: 3", "Answer: 3", "Answer: 3", "Answer: 3"],  # all wrong
        },
    )
    bench = [item(tok, "3+4=?", "7"), item(tok, "9-4=?", "5"), item(tok, "1+1=?", "2")]
    out = evaluate(engine, {"b": bench}, scorer, 4, SamplingParams(), tokenizer=tok)
    assert out["b"]["n"] == 3
    assert out["b"]["avg@k"] == pytest.approx((0.5 + 0.25 + 0.0) / 3)
    assert out["b"]["pass@k"] == pytest.approx(2 / 3)
    assert out["b"]["maj@k"] == pytest.approx(1 / 3)
    assert engine.calls == [(3, 4)]

    capped = evaluate(
        engine, {"b": bench}, scorer, 2, SamplingParams(), max_problems=1, tokenizer=tok
    )
    assert capped["b"]["n"] == 1
    assert capped["b"]["pass@k"] == pytest.approx(1.0)  # 1 correct of n=2, k=2


def test_evaluate_argument_errors(scorer):
    tok = build_tokenizer()
    engine = ScriptedEngine(tok, {})
    with pytest.raises(ValueError, match="k=0"):
        evaluate(engine, {}, scorer, 0, SamplingParams(), tokenizer=tok)
    with pytest.raises(ValueError, match="tokenizer"):
        evaluate(engine, {}, scorer, 2, SamplingParams())


def test_report_tables(tmp_path):
    results = {"aime24": {"avg@k": 0.25, "pass@k": 0.5, "maj@k": 0.3, "n": 30.0}}
    table = markdown_table(results, 32)
    assert "| benchmark | n | avg@32 | pass@32 | maj@32 |" in table
    assert "| aime24 | 30 | 25.0 | 50.0 | 30.0 |" in table
    md, js = write_report(results, tmp_path, 32, {"model": "m"})
    assert json.loads(js.read_text())["results"] == results
    assert "- model: m" in md.read_text()


def test_armor_eval_on_a_tiny_model(tmp_path, capsys):
    model = write_model_dir(tmp_path / "model", SMALL)
    data = write_task(tmp_path / "data", n_train=4, n_val=6, seed=0)
    rc = main(
        [
            "eval", "--model", str(model), "--data", str(data["val"]), "--k", "2",
            "--max-problems", "3", "--max-new-tokens", "8", "--template", "plain",
            "--max-prompt-len", "32", "--out", str(tmp_path / "out"), "--device", "cpu",
        ]
    )  # fmt: skip
    assert rc == 0
    payload = json.loads((tmp_path / "out" / "eval.json").read_text())
    row = payload["results"]["val"]
    assert row["n"] == 3
    assert all(0.0 <= row[m] <= 1.0 for m in ("avg@k", "pass@k", "maj@k"))
    assert payload["meta"]["k"] == 2 and payload["meta"]["backend"] == "torch"
    assert "| val | 3 |" in (tmp_path / "out" / "eval.md").read_text()
    assert "wrote" in capsys.readouterr().out
