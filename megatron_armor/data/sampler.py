"""A deterministic, resumable sampler over dataset indices.

Epoch ``e`` visits the items in the order ``permutation(seed, e)`` (a NumPy PCG64 stream
seeded by ``[seed, e]``; identity order when ``shuffle`` is off). The state is three
integers, ``(seed, epoch, position)``, so a checkpoint restores the exact continuation:
after ``load_state_dict(s.state_dict())`` the next indices equal those the original
sampler would have produced.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def sampled_prompt_count(available: int, train_limit: int) -> int:
    """Prompts the sampler draws from: the first ``train_limit`` of ``available``
    (``data.train_limit``; 0 = all)."""
    return min(train_limit, available) if train_limit > 0 else available


class ResumableSampler:
    """Yields dataset indices in batches of any size, crossing epoch boundaries."""

    def __init__(self, num_items: int, seed: int, shuffle: bool = True):
        if num_items <= 0:
            raise ValueError(f"num_items={num_items}: the sampler needs a non-empty dataset")
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """The visiting order of ``epoch``, ``[num_items]``."""
        if not self.shuffle:
            return np.arange(self.num_items)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def next_indices(self, k: int) -> list[int]:
        """The next ``k`` indices; a new epoch (new permutation) starts when one runs out."""
        if k < 0:
            raise ValueError(f"k={k}: must be >= 0")
        out: list[int] = []
        while len(out) < k:
            take = min(k - len(out), self.num_items - self.position)
            out.extend(self._order[self.position : self.position + take].tolist())
            self.position += take
            if self.position == self.num_items:
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
        return out

    def peek(self, k: int) -> list[int]:
        """The ``k`` indices :meth:`next_indices` would return next, without advancing."""
        saved = (self.epoch, self.position, self._order)
        try:
            return self.next_indices(k)
        finally:
            self.epoch, self.position, self._order = saved

    def state_dict(self) -> dict[str, Any]:
        """``{num_items, seed, shuffle, epoch, position}`` (plain ints/bools)."""
        return {
            "num_items": self.num_items,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
        }

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
