"""Supervised warm start of the tiny model on reference solutions (plain torch, CPU).

RL needs groups with mixed outcomes: a policy that never solves a problem gives all-wrong
groups (zero advantage), one that always does gives all-correct groups. The warm start
fits the untrained model on ``prompt -> render_solution(...) + <eos>`` for freshly drawn
training-distribution problems (not the rows of ``train.parquet``) just long enough that
sampling at temperature 1.0 solves part of the training split (target 20-70%).

Stopping rule: every ``check_every`` steps, sample one response per problem (T = 1.0) for a
fixed held-out set of training-distribution problems and score it with the DAPO rule; stop
as soon as that accuracy reaches ``target_accuracy`` (or after ``max_steps``). Stopping on
measured accuracy rather than a fixed step count keeps the result in range whatever the
machine's speed or the seed.

Loss: mean token cross-entropy over response tokens (and the final ``<eos>``) only,
``L = -1/|R| sum_{t in R} log p(y_t | y_<t)``; AdamW with linear warmup and cosine decay.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from megatron_armor.tiny.accuracy import measure_accuracy
from megatron_armor.tiny.task import (
    TRAIN_LEVELS,
    Problem,
    generate_problems,
    make_problem,
    render_prompt,
    render_solution,
)


@dataclass(frozen=True)
class WarmStartConfig:
    """Settings of the supervised warm start."""

    max_steps: int = 1500
    """Upper bound on optimizer steps (also the length of the cosine schedule)."""
    target_accuracy: float = 0.4
    """Stop once sampled (T = 1.0) accuracy on the held-out check set reaches this."""
    check_every: int = 25
    """Steps between accuracy checks (0 = never check; train ``max_steps``)."""
    first_check: int = 100
    """No check before this step (an untrained model never stops, so a check costs most)."""
    check_problems: int = 128
    """Size of the held-out check set."""
    batch_size: int = 64
    """Problems per step."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int = 30
    """Linear warmup steps."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a fraction of ``lr``."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    seed: int = 1234
    """Seed of the training problem stream (the check set uses ``seed + 1``)."""
    num_threads: int = 1
    """``torch.set_num_threads`` during training. One thread: the tiny matrices gain little
    from a second, and with other processes on the same cores (Ray workers, a test run)
    OpenMP threads spin-waiting on each other made a step 10-20x slower in our measurements."""
    log_every: int = 100
    """Print the loss every this many steps (0 = silent)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.target_accuracy <= 1.0:
            raise ValueError(
                f"WarmStartConfig: target_accuracy={self.target_accuracy} must lie in (0, 1]"
            )
        if self.max_steps < 1 or self.batch_size < 1:
            raise ValueError(
                f"WarmStartConfig: max_steps={self.max_steps} and batch_size={self.batch_size} "
                "must be >= 1"
            )


@dataclass
class WarmStartResult:
    """What the warm start did: steps run, last loss, wall time, accuracy checks."""

    steps: int
    final_loss: float
    seconds: float
    check_accuracy: float = float("nan")
    """Last measured check-set accuracy (NaN when never checked)."""
    history: list[tuple[int, float, float]] = field(default_factory=list)
    """``(step, loss, check accuracy)`` at every check."""


def encode_example(
    tokenizer: PreTrainedTokenizerFast, problem: Problem
) -> tuple[list[int], list[int]]:
    """(token ids ``[L]``, loss mask ``[L]``) for prompt + solution + eos; mask 1 on the response."""
    prompt = tokenizer(render_prompt(problem)).input_ids
    response = tokenizer(render_solution(problem.expression)).input_ids + [tokenizer.eos_token_id]
    return prompt + response, [0] * len(prompt) + [1] * len(response)


def collate(
    examples: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to ``[B, T]``: (input_ids, attention_mask, labels with -100 off the response).

    ``labels[b, t]`` is the target of position ``t`` (HF shifts internally).
    """
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for b, (tok, mask) in enumerate(examples):
        n = len(tok)
        ids[b, :n] = torch.tensor(tok)
        attn[b, :n] = 1
        labels[b, :n] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(tok), -100)
    return ids, attn, labels


def lr_at(step: int, cfg: WarmStartConfig) -> float:
    """Linear warmup to ``lr`` then cosine decay to ``min_lr_ratio * lr`` (``step`` 0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def check_due(step: int, cfg: WarmStartConfig) -> bool:
    """Whether the accuracy check runs after ``step`` (1-based)."""
    return bool(cfg.check_every) and step >= cfg.first_check and step % cfg.check_every == 0


def problem_stream(seed: int, levels: dict[int, float] = TRAIN_LEVELS) -> Callable[[], Problem]:
    """A callable drawing training-distribution problems (independent of the parquet rows)."""
    rng = random.Random(seed)
    names, weights = list(levels), list(levels.values())
    return lambda: make_problem(rng, rng.choices(names, weights)[0])


def train_step(
    model: PreTrainedModel,
    opt: torch.optim.Optimizer,
    batch: Sequence[tuple[list[int], list[int]]],
    pad_id: int,
    lr: float,
) -> float:
    """One AdamW step on ``batch`` (grad-norm clipped to 1.0); returns the loss."""
    for group in opt.param_groups:
        group["lr"] = lr
    ids, attn, labels = collate(batch, pad_id)
    loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    cfg: WarmStartConfig,
    levels: dict[int, float] = TRAIN_LEVELS,
) -> WarmStartResult:
    """Train ``model`` in place until the check accuracy reaches the target (see module doc)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    draw = problem_stream(cfg.seed, levels)
    check_set = generate_problems(cfg.check_problems, cfg.seed + 1, levels)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    result = WarmStartResult(steps=0, final_loss=float("nan"), seconds=0.0)
    start = time.perf_counter()
    model.train()
    try:
        for step in range(1, cfg.max_steps + 1):
            batch = [encode_example(tokenizer, draw()) for _ in range(cfg.batch_size)]
            result.final_loss = train_step(
                model, opt, batch, tokenizer.pad_token_id, lr_at(step - 1, cfg)
            )
            result.steps = step
            if cfg.log_every and step % cfg.log_every == 0:
                print(f"warm start step {step} loss {result.final_loss:.4f}", flush=True)
            if check_due(step, cfg):
                acc = measure_accuracy(model, tokenizer, check_set, temperature=1.0).accuracy
                result.check_accuracy = acc
                result.history.append((step, result.final_loss, acc))
                if cfg.log_every:
                    print(f"warm start step {step} check accuracy {acc:.1%}", flush=True)
                if acc >= cfg.target_accuracy:
                    break
    finally:
        model.eval()
        torch.set_num_threads(threads)
    result.seconds = time.perf_counter() - start
    return result
