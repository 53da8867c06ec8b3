"""A deterministic, resumable sampler over dataset indices.

Epoch ``e`` visits the items in the order ``permutation(seed, e)`` (a NumPy PCG64 stream
seeded by ``[seed, e]``; identity order when ``shuffle`` is off). The state is three
integers, ``(seed, epoch, position)``, so a checkpoint restores the exact continuation:
after ``load_state_dict(s.state_dict())`` the next indices equal those the original
sampler would have produced. With ``retire_after = K > 0`` (``data.retire_solved_after``,
``retirement.py``) the sampler skips the indices retired so far (their positions in the
epoch order are passed over) and its state holds the retirement's too.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from megatron_armor.data.retirement import SolvedRetirement


class SamplerExhausted(RuntimeError):
    """Every training prompt is retired (``data.retire_solved_after``): nothing left to draw."""


def sampled_prompt_count(available: int, train_limit: int) -> int:
    """Prompts the sampler draws from: the first ``train_limit`` of ``available``
    (``data.train_limit``; 0 = all)."""
    return min(train_limit, available) if train_limit > 0 else available


class ResumableSampler:
    """Yields dataset indices in batches of any size, crossing epoch boundaries."""

    def __init__(
        self,
        num_items: int,
        seed: int,
        shuffle: bool = True,
        retire_after: int = 0,
        retire_max_fraction: float = 1.0,
    ):
        if num_items <= 0:
            raise ValueError(f"num_items={num_items}: the sampler needs a non-empty dataset")
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)
        max_retired = math.floor(round(retire_max_fraction * num_items, 9))
        self.retirement = SolvedRetirement(retire_after, max_retired)
        self._retired_since = 0  # since the last metrics()

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """The visiting order of ``epoch``, ``[num_items]``."""
        if not self.shuffle:
            return np.arange(self.num_items)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def next_indices(self, k: int) -> list[int]:
        """The next ``k`` indices that are not retired; a new epoch (new permutation) starts
        when one runs out."""
        if k < 0:
            raise ValueError(f"k={k}: must be >= 0")
        if k and len(self.retirement.retired) >= self.num_items:
            raise SamplerExhausted(
                f"all {self.num_items} training prompts are retired (data.retire_solved_after="
                f"{self.retirement.after}: all on-policy samples correct {self.retirement.after} "
                "draws in a row): the policy solves the training set; add harder data "
                "(data.train_files) or resume with data.retire_solved_after=0 to draw them again"
            )
        out: list[int] = []
        while len(out) < k:
            index = int(self._order[self.position])
            self.position += 1
            if self.position == self.num_items:
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            if index not in self.retirement.retired:
                out.append(index)
        return out

    @property
    def retires(self) -> bool:
        """Whether solved queries are retired (``data.retire_solved_after > 0``)."""
        return self.retirement.enabled

    def observe(self, index: int, solved: bool | None) -> bool:
        """One draw's outcome for ``index`` (:meth:`SolvedRetirement.observe`); ``True`` when
        it retires the index: no later :meth:`next_indices` returns it."""
        retires = self.retirement.observe(index, solved)
        self._retired_since += retires
        return retires

    def metrics(self) -> dict[str, float]:
        """``data/epoch`` (epochs begun so far, from 0) and, when retiring, ``data/retired``
        (prompts retired so far), ``data/retired_step`` (retired since the last call: the
        loop calls it once a step, before the checkpoint) and ``data/active_prompts``."""
        out = {"data/epoch": float(self.epoch)}
        if self.retires:
            retired = len(self.retirement.retired)
            out.update({"data/retired": float(retired),
                        "data/retired_step": float(self._retired_since),
                        "data/active_prompts": float(self.num_items - retired)})  # fmt: skip
            self._retired_since = 0
        return out

    def peek(self, k: int) -> list[int]:
        """The ``k`` indices :meth:`next_indices` would return next, without advancing."""
        saved = (self.epoch, self.position, self._order)
        try:
            return self.next_indices(k)
        finally:
            self.epoch, self.position, self._order = saved

    def state_dict(self) -> dict[str, Any]:
        """``{num_items, seed, shuffle, epoch, position}`` (plain ints/bools), and
        ``retirement`` (:meth:`SolvedRetirement.state_dict`) when retiring."""
        state = {
            "num_items": self.num_items,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
        }
        if self.retires:
            state["retirement"] = self.retirement.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; the dataset and seed must be the same."""
        for key in ("num_items", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has "
                    f"{getattr(self, key)!r}; resume with the same data files, data filters "
                    "and run.seed as the checkpointed run"
                )
        if not 0 <= state["position"] < self.num_items:
            raise ValueError(f"sampler state position={state['position']} out of range")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
        if self.retires:  # retirement off now: the retired prompts are drawn again
            self.retirement.load_state_dict(state.get("retirement", {}))
