"""Solved queries leave the sampler: ``data.retire_solved_after = K`` (docs/data_reward.md).

Every draw of a training query ends in one of three outcomes for its on-policy group:

- *solved*: every on-policy sample correct (rule (a)'s upper bound rejects it as
  ``all_correct``: a group with no reward variance, no gradient);
- *not solved*: on-policy samples drawn, not all correct;
- *no evidence*: no on-policy sample drawn (rule (b) rejected the query first: a
  reference-first step, or the anchor cache's verdict).

A query's streak counts its solved draws in a row: a not-solved draw resets it to 0, a draw
without evidence leaves it. When the streak reaches ``K`` the query is *retired*: the sampler
skips it for the rest of the run, unless ``max_retired`` prompts are retired already
(``data.retire_max_fraction`` of the training set): then it stays, its streak at ``K``. The cap
keeps the pool broad: in the tiny soak, retirement without it took out 2028 of 2048 prompts
by step 1000 and the run, left with its 20-150 hardest prompts, over-fitted them (validation
avg@4 0.48 -> 0.12; docs/benchmarks.md, "Soak"). It is not brought back at the next epoch because the
sampler visits every query once per epoch, so "K solved draws in a row" already spans K
epochs, and "until the next epoch" would retire nothing; a query's difficulty is also
consistent across epochs (arXiv 2506.02177, GRESO's temporal consistency), and Skywork-OR1
(arXiv 2505.22312) drops the prompts its actor solves for the stages that follow. Retired
queries count in ``data/retired``; the streaks and the retired set are part of the sampler's
checkpointed state, so a resumed run retires the same queries at the same steps.

State (plain ints and lists, JSON- and safe-loader-friendly): ``{"after": K, "retired":
[index, ...] (sorted), "streaks": [[index, streak], ...] (sorted, streak > 0 only)}``.
"""

from __future__ import annotations

from typing import Any


class SolvedRetirement:
    """Streaks of solved draws per dataset index and the indices retired (see module doc)."""

    def __init__(self, after: int, max_retired: int | None = None):
        if after < 0:
            raise ValueError(f"data.retire_solved_after={after}: must be >= 0 (0 = off)")
        self.after, self.max_retired = after, max_retired
        self.retired: set[int] = set()
        self.streaks: dict[int, int] = {}

    @property
    def enabled(self) -> bool:
        return self.after > 0

    def observe(self, index: int, solved: bool | None) -> bool:
        """Record one draw of ``index`` (``solved``: ``True``, ``False`` or ``None`` = no
        evidence); returns whether the draw retires it."""
        if not self.enabled or solved is None or index in self.retired:
            return False
        if not solved:
            self.streaks.pop(index, None)
            return False
        streak = self.streaks.get(index, 0) + 1
        full = self.max_retired is not None and len(self.retired) >= self.max_retired
        if streak < self.after or full:
            self.streaks[index] = min(streak, self.after)
            return False
        self.streaks.pop(index, None)
        self.retired.add(index)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "after": self.after,
            "retired": sorted(self.retired),
            "streaks": [[i, n] for i, n in sorted(self.streaks.items())],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (a changed ``after`` applies from now on: the
        retired stay retired, streaks count on towards the new ``K``)."""
        self.retired = {int(i) for i in state.get("retired", [])}
        self.streaks = {int(i): int(n) for i, n in state.get("streaks", [])}


def retire_drawn(sampler, indices: list[int], records: list[dict[str, Any]]) -> None:
    """Each drawn query's outcome (:func:`draw_outcome` of its anchor-file record) to the
    sampler (``ResumableSampler.observe``), in draw order; the records of those it retires get
    ``"retired": true``. Nothing without retirement."""
    if not sampler.retires:
        return
    for index, record in zip(indices, records, strict=True):
        if sampler.observe(index, draw_outcome(record)):
            record["retired"] = True


def draw_outcome(record: dict[str, Any]) -> bool | None:
    """The outcome of one query line of a step's anchor file (``step_metrics.write_anchor_file``
    records: ``reason``, ``policy_n``): solved, not solved, or ``None`` (no policy samples)."""
    if not record["policy_n"]:
        return None
    return record["reason"] == "all_correct"
