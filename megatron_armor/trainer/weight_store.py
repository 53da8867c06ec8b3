"""Named CPU copies of the live model's parameters (``ref``, optionally ``old``).

A copy holds this rank's shard of every parameter (TP/PP-local, like the live model). For a
forward pass under a stored copy, :meth:`WeightStore.swapped` copies it into the live
parameters and restores the live values afterwards (bit-exact). On a GPU the copies sit in
pinned memory so the swaps are fast host-to-device copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class WeightStore:
    """CPU copies of ``model``'s named parameters, swapped into the live model on demand."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.copies: dict[str, dict[str, torch.Tensor]] = {}

    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    @staticmethod
    def _host_copy(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
        out.copy_(t.detach())
        return out

    def snapshot(self, name: str) -> None:
        """Store the live parameters as copy ``name`` (``reset``: ``snapshot("ref")``)."""
        with torch.no_grad():
            self.copies[name] = {k: self._host_copy(p) for k, p in self._params().items()}

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

    @contextlib.contextmanager
    def swapped(self, name: str) -> Iterator[None]:
        """Run the block with copy ``name`` in the live parameters (``policy``: no swap)."""
        if name == "policy":
            yield
            return
        stored, params = self.get(name), self._params()
        with torch.no_grad():
            live = {k: self._host_copy(p) for k, p in params.items()}
            for k, p in params.items():
                p.copy_(stored[k])
        try:
            yield
        finally:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(live[k])
