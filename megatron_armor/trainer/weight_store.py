"""Named CPU copies of the live model's parameters (``ref``; ``behavior`` with
``orchestration.async_rollout: one_step``, the weights a one-step-off batch was generated with).

A copy holds this rank's shard of every parameter (TP/PP-local, like the live model). For a
forward pass under a stored copy, :meth:`WeightStore.swapped` copies it into the live
parameters and restores the live values afterwards (bit-exact), through one host buffer kept
between swaps (allocated at the first). On a GPU the copies and that buffer sit in pinned
memory so the swaps are fast device-host copies, and no step allocates (and page-locks) a
model's worth of host memory again.

The store also knows which copies equal the live parameters bit for bit: a copy does from its
:meth:`~WeightStore.snapshot` until the owner reports a write to the live parameters
(:meth:`~WeightStore.live_changed`: an optimizer update, a checkpoint load). A pass under such
a copy would repeat the live pass exactly (the reference right after a reset).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

BEHAVIOR = "behavior"
"""The copy of the weights the engines generate the next step's batch with while the live
weights are updated (``MegatronTrainer.snapshot_behavior``)."""


class WeightStore:
    """CPU copies of ``model``'s named parameters, swapped into the live model on demand."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.copies: dict[str, dict[str, torch.Tensor]] = {}
        self._live: set[str] = set()  # copies known to equal the live parameters bit for bit
        self._backup: dict[str, torch.Tensor] = {}  # the live values during a swap

    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    @staticmethod
    def _host_copy(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
        out.copy_(t.detach())
        return out

    def snapshot(self, name: str) -> None:
        """Store the live parameters as copy ``name`` (``reset``: ``snapshot("ref")``; every
        step for ``behavior``): into the buffers of the copy held under that name when it has
        the live shapes (nothing allocated or page-locked again), else into new ones."""
        params = self._params()
        held = self.copies.get(name)
        with torch.no_grad():
            if held is not None and _same_layout(held, params):
                for k, p in params.items():
                    held[k].copy_(p.detach())
            else:
                self.copies[name] = {k: self._host_copy(p) for k, p in params.items()}
        self._live.add(name)

    def has(self, name: str) -> bool:
        return name in self.copies

    def get(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self.copies:
            raise KeyError(f"no stored weights named {name!r}; stored: {sorted(self.copies)}")
        return self.copies[name]

    def load_into(self, name: str, values: dict[str, torch.Tensor]) -> None:
        """Replace copy ``name`` with ``values`` (e.g. read back from a checkpoint)."""
        params = self._params()
        missing = set(params) - set(values)
        if missing:
            raise KeyError(f"weights {name!r} lack parameters {sorted(missing)[:3]}...")
        self.copies[name] = {k: self._host_copy(values[k]) for k in params}
        self._live.discard(name)

    def live_changed(self) -> None:
        """The live parameters were written (an update, a load): no copy is known to equal them."""
        self._live.clear()

    def matches_live(self, name: str) -> bool:
        """Whether copy ``name`` is known to equal the live parameters bit for bit."""
        return name in self._live

    def equals_live(self, name: str) -> bool:
        """Compare copy ``name`` with the live parameters, bit for bit (one read of each)."""
        stored = self.get(name)
        with torch.no_grad():
            return all(
                torch.equal(p.detach(), stored[k].to(p.device, non_blocking=True))
                for k, p in self._params().items()
            )

    def mark_live(self, name: str) -> None:
        """Record that copy ``name`` equals the live parameters (after :meth:`equals_live`)."""
        self.get(name)
        self._live.add(name)

    @contextlib.contextmanager
    def swapped(self, name: str) -> Iterator[None]:
        """Run the block with copy ``name`` in the live parameters (``policy``, or a copy that
        equals them: no swap)."""
        if name == "policy" or self.matches_live(name):
            yield
            return
        stored, params = self.get(name), self._params()
        with torch.no_grad():
            live = self._backup_of(params)
            for k, p in params.items():
                p.copy_(stored[k])
        try:
            yield
        finally:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(live[k])

    def _backup_of(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The live values copied into the swap buffer (allocated at the first swap)."""
        if not self._backup:
            self._backup = {k: self._host_copy(p) for k, p in params.items()}
        else:
            for k, p in params.items():
                self._backup[k].copy_(p.detach())
        return self._backup


def _same_layout(copy: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> bool:
    """Whether ``copy`` holds a tensor of each parameter's name, shape and dtype."""
    return copy.keys() == params.keys() and all(
        copy[k].shape == p.shape and copy[k].dtype == p.dtype for k, p in params.items()
    )
