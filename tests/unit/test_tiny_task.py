"""Unit tier: the tiny arithmetic task (generator, schema, DAPO-rule verifiability)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from megatron_armor.reward.dapo_rule import score_dapo
from megatron_armor.reward.verifiers import auto_verifier
from megatron_armor.tiny.task import (
    DATA_SOURCE,
    LONG_LEVEL,
    TRAIN_LEVELS,
    VAL_LEVELS,
    evaluate_expression,
    generate_problems,
    render_prompt,
    render_solution,
    solution_steps,
    task_levels,
    write_task,
)

pytestmark = pytest.mark.unit


def test_generator_is_deterministic_in_seed():
    a = generate_problems(200, 7, TRAIN_LEVELS)
    b = generate_problems(200, 7, TRAIN_LEVELS)
    c = generate_problems(200, 8, TRAIN_LEVELS)
    assert a == b
    assert a != c


@pytest.mark.parametrize("levels", [TRAIN_LEVELS, VAL_LEVELS, {5: 1.0}, {LONG_LEVEL: 1.0}])
def test_problems_evaluate_to_their_answer_and_stay_non_negative(levels):
    for p in generate_problems(300, 0, levels):
        assert p.level in levels
        assert evaluate_expression(p.expression) == p.answer >= 0
        steps = solution_steps(p.expression)
        assert all(int(s.rsplit("=", 1)[1]) >= 0 for s in steps)


def test_validation_split_is_harder():
    train = generate_problems(500, 0, TRAIN_LEVELS)
    val = generate_problems(500, 1, VAL_LEVELS)
    assert max(p.level for p in train) < max(p.level for p in val)
    assert sum(len(p.expression) for p in val) > sum(len(p.expression) for p in train)


def test_solution_format_and_dapo_rule():
    assert render_solution("57+8-13") == "57+8=65\n65-13=52\nAnswer: 52"
    for p in generate_problems(200, 3, VAL_LEVELS):
        solution = render_solution(p.expression)
        assert solution.splitlines()[-1] == f"Answer: {p.answer}"
        assert score_dapo(solution, str(p.answer)).correct
        assert not score_dapo(solution, str(p.answer + 1)).correct


def test_unparseable_expression_is_an_error():
    with pytest.raises(ValueError, match="cannot parse"):
        solution_steps("3*4")


def test_unknown_level_is_an_error():
    with pytest.raises(ValueError, match="level=9"):
        generate_problems(1, 0, {9: 1.0})


def test_prompts_are_short():
    for p in generate_problems(300, 0, {**TRAIN_LEVELS, **VAL_LEVELS, 5: 1.0}):
        assert len(render_prompt(p)) <= 16


def test_write_task_dapo_math_schema(tmp_path):
    paths = write_task(tmp_path, n_train=40, n_val=10, seed=0)
    train = pq.read_table(paths["train"]).to_pylist()
    val = pq.read_table(paths["val"]).to_pylist()
    assert len(train) == 40 and len(val) == 10
    row = train[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == DATA_SOURCE
    assert auto_verifier(DATA_SOURCE) == "dapo"
    assert row["prompt"][0]["role"] == "user"
    assert row["prompt"][0]["content"].endswith("=?")
    expression = row["prompt"][0]["content"][:-2]
    assert row["reward_model"]["ground_truth"] == str(evaluate_expression(expression))
    assert [r["extra_info"]["index"] for r in train[:2]] == ["train-000000", "train-000001"]
    assert val[0]["extra_info"]["index"] == "val-000000"
    again = write_task(tmp_path / "again", n_train=40, n_val=10, seed=0)
    assert pq.read_table(again["train"]).to_pylist() == train


def test_the_long_tail_task_has_a_few_long_answers(tmp_path):
    """``long_tail``: a tenth of the training problems are level 6, whose answers are about
    three times the others' (characters: the tiny tokenizer's tokens), and they fit the
    ``rollout.sampling.max_new_tokens`` of ``configs/tiny_long_tail.yaml`` (96, with the eos)."""
    train, val = task_levels("long_tail")
    problems = generate_problems(2000, 0, train)
    lengths = sorted(len(render_solution(p.expression)) + 1 for p in problems)
    long = [p for p in problems if p.level == LONG_LEVEL]
    assert 0.08 < len(long) / len(problems) < 0.12 and val[LONG_LEVEL] > 0
    median, top = lengths[len(lengths) // 2], lengths[-1]
    assert top >= 3 * median and top <= 96, (median, top)
    assert all(len(solution_steps(p.expression)) == 7 for p in long)
    paths = write_task(tmp_path, n_train=50, n_val=10, seed=0, task="long_tail")
    levels = [r["extra_info"]["level"] for r in pq.read_table(paths["train"]).to_pylist()]
    assert LONG_LEVEL in levels
    with pytest.raises(ValueError, match="task='longer' is not one of"):
        task_levels("longer")
