"""Synthetic, verifiable arithmetic problems for the tiny CPU recipe.

A problem is a short integer expression such as ``57+8-13``; the reference solution works
it left to right, one line per operation, and ends with the DAPO answer line::

    57+8=65
    65-13=52
    Answer: 52

Difficulty levels (all intermediate results are non-negative):

====  ==============================================  =============
lvl   expression                                      example
====  ==============================================  =============
1     ``a ± b``, a, b in [0, 9]                       ``7-3``
2     ``a ± b``, a in [10, 99], b in [0, 9]           ``57+8``
3     ``a ± b ± c``, a, b, c in [0, 9]                ``7+8-3``
4     ``a ± b``, a, b in [10, 99]                     ``57+38``
5     ``a ± b ± c``, a, b, c in [10, 99]              ``57+38-21``
6     eight operands in [0, 9] (seven lines)           ``7+8-3+2+9-4+1+5``
====  ==============================================  =============

The training split mixes levels 1-3; the validation split holds levels 2-4 and so
includes problems harder than anything the warm start was fit on (level 4). Level 5 is
available for harder benchmarks (``generate_problems(..., levels={5: 1.0})``).

Tasks (:data:`TASKS`, ``armor tiny --task``): ``arith`` is the above; ``long_tail`` adds level 6
to both splits (a tenth of training, a fifth of validation), whose working is about three
times as long as a level-3 answer (~70 tokens against ~25): a few problems need long answers,
so a synchronous rollout batch waits for them (docs/tiny.md, "The long-tail task").

Rows follow the DAPO-Math-17K schema (``prompt`` = chat messages, ``reward_model.ground_truth``,
``data_source``, ``ability``, ``extra_info.index``) with ``data_source = "tiny_arith"``, which
the reward package scores with the DAPO "Answer:" rule (docs/data_reward.md).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DATA_SOURCE = "tiny_arith"
"""``data_source`` of every tiny row; scored by the DAPO rule."""

TRAIN_LEVELS: dict[int, float] = {1: 0.3, 2: 0.4, 3: 0.3}
"""Level -> sampling weight of the training split."""

VAL_LEVELS: dict[int, float] = {2: 0.3, 3: 0.3, 4: 0.4}
"""Level -> sampling weight of the (harder) validation split."""

LONG_LEVEL = 6
"""The level of the long answers (eight single-digit operands: seven working lines)."""

TASKS: dict[str, tuple[dict[int, float], dict[int, float]]] = {
    "arith": (TRAIN_LEVELS, VAL_LEVELS),
    "long_tail": ({1: 0.3, 2: 0.3, 3: 0.3, LONG_LEVEL: 0.1},
                  {2: 0.3, 3: 0.3, 4: 0.2, LONG_LEVEL: 0.2}),
}  # fmt: skip
"""``armor tiny --task NAME`` -> (training levels, validation levels)."""

_TERM = re.compile(r"([+-]?)(\d+)")


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem: ``expression`` evaluates left to right to ``answer``."""

    expression: str
    answer: int
    level: int


def _operand_ranges(level: int) -> list[tuple[int, int]]:
    """Inclusive ranges of the operands of a level-``level`` expression."""
    ranges = {
        1: [(0, 9), (0, 9)],
        2: [(10, 99), (0, 9)],
        3: [(0, 9), (0, 9), (0, 9)],
        4: [(10, 99), (10, 99)],
        5: [(10, 99), (10, 99), (10, 99)],
        LONG_LEVEL: [(0, 9)] * 8,
    }
    if level not in ranges:
        raise ValueError(f"tiny task: level={level} is not defined; use one of {sorted(ranges)}")
    return ranges[level]


def make_problem(rng: random.Random, level: int) -> Problem:
    """Draw one problem of ``level``; a ``-`` is chosen only when the result stays >= 0."""
    ranges = _operand_ranges(level)
    value = rng.randint(*ranges[0])
    text = str(value)
    for lo, hi in ranges[1:]:
        operand = rng.randint(lo, hi)
        if operand <= value and rng.random() < 0.5:
            value, text = value - operand, f"{text}-{operand}"
        else:
            value, text = value + operand, f"{text}+{operand}"
    return Problem(expression=text, answer=value, level=level)


def generate_problems(n: int, seed: int, levels: dict[int, float]) -> list[Problem]:
    """``n`` problems with levels drawn by weight; deterministic in ``seed``."""
    if n < 0:
        raise ValueError(f"tiny task: n={n} must be >= 0")
    rng = random.Random(seed)
    names, weights = list(levels), list(levels.values())
    return [make_problem(rng, rng.choices(names, weights)[0]) for _ in range(n)]


def solution_steps(expression: str) -> list[str]:
    """The left-to-right working of ``expression``, one ``x op y=z`` line per operation.

    A single number has no steps.
    """
    terms = _TERM.findall(expression)
    if not terms or "".join(s + d for s, d in terms) != expression:
        raise ValueError(f"tiny task: cannot parse expression {expression!r}")
    value = int(terms[0][1])
    steps = []
    for sign, digits in terms[1:]:
        new = value + int(digits) if sign == "+" else value - int(digits)
        steps.append(f"{value}{sign}{digits}={new}")
        value = new
    return steps


def evaluate_expression(expression: str) -> int:
    """Value of ``expression`` (left to right)."""
    steps = solution_steps(expression)
    return int(steps[-1].rsplit("=", 1)[1]) if steps else int(expression)


def render_solution(expression: str) -> str:
    """Reference response: the working lines, then ``Answer: N`` as the last line."""
    lines = [*solution_steps(expression), f"Answer: {evaluate_expression(expression)}"]
    return "\n".join(lines)


def render_prompt(problem: Problem) -> str:
    """User-message text of a problem: the bare expression followed by ``=?``.

    Kept short on purpose: the tiny tokenizer is character-level, so every prompt
    character is a token the CPU model has to process (prompts are < 16 characters).
    """
    return f"{problem.expression}=?"


def to_row(problem: Problem, split: str, index: int) -> dict:
    """One DAPO-Math-17K-schema row."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": render_prompt(problem)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": str(problem.answer), "style": "rule"},
        "extra_info": {"index": f"{split}-{index:06d}", "level": problem.level},
    }


def write_split(path: str | Path, problems: Sequence[Problem], split: str) -> Path:
    """Write ``problems`` as a parquet file in the DAPO-Math schema; returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [to_row(p, split, i) for i, p in enumerate(problems)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def task_levels(task: str) -> tuple[dict[int, float], dict[int, float]]:
    """The (training, validation) levels of ``task`` (:data:`TASKS`)."""
    if task not in TASKS:
        raise ValueError(f"tiny task: task={task!r} is not one of {sorted(TASKS)}")
    return TASKS[task]


def write_task(
    out_dir: str | Path, n_train: int = 2048, n_val: int = 256, seed: int = 0, task: str = "arith"
) -> dict[str, Path]:
    """Write ``train.parquet`` and ``val.parquet`` of ``task`` (:data:`TASKS`; ``arith``:
    levels 1-3 and 2-4) under ``out_dir``.

    The splits use different seeds (``seed`` and ``seed + 1``), so they are independent draws.
    """
    out_dir = Path(out_dir)
    train_levels, val_levels = task_levels(task)
    train = generate_problems(n_train, seed, train_levels)
    val = generate_problems(n_val, seed + 1, val_levels)
    return {
        "train": write_split(out_dir / "train.parquet", train, "train"),
        "val": write_split(out_dir / "val.parquet", val, "val"),
    }
