"""The parallel layout a trainer checkpoint was saved at, and the layouts it resumes at.

A trainer save (``trainer/checkpoint.py``) records ``parallel_layout`` in its
``trainer/dist/common.pt``: ``tp``, ``pp``, ``ep``, ``etp``, ``dp``, ``world_size``, whether
the optimizer was megatron-core's distributed optimizer and the format its state was saved in
(``optimizer_format``). The model, the reference and the behavior weights are saved through the
model's sharded state dict and reshard to any layout; so does the optimizer state in the
:data:`FULLY_RESHARDABLE` format (Adam moments and fp32 master weights per parameter, in the
parameter's own shape and sharding). The older :data:`DP_RESHARDABLE` format (every DP rank's
flat buffer slice, the format of checkpoints that record none) reshards over data parallelism
only: such a checkpoint resumes at its own ``tp``, ``pp``, ``ep`` and ``etp``. Switching the
optimizer kind (``trainer.use_distributed_optimizer``) does not convert; the non-distributed
optimizer of a mixture-of-experts model loads across ``ep = 1`` and ``ep > 1`` neither.

:func:`layout_problem` is the one decision, read before Ray starts by ``armor train --resume``
(``orchestration/run/resume_check.py``) and by ``armor plan --checkpoint``
(``planner/resume.py``); the layouts the model admits are the config rules' business
(``config/validate.py``, ``config/moe.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_armor.config.schema import ArmorConfig


FULLY_RESHARDABLE = "fully_reshardable"
"""megatron-core's layout-independent distributed-optimizer format (what saves write)."""
DP_RESHARDABLE = "dp_reshardable"
"""megatron-core's flat-buffer format: data-parallel resharding only (older checkpoints)."""
COMMON = Path("trainer") / "dist" / "common.pt"
"""Where a run checkpoint keeps the trainer's non-tensor state (megatron's ``common.pt``)."""


@dataclass(frozen=True)
class Layout:
    """Parallel sizes of the trainer (``dp`` ``None``: not recorded by an older save)."""

    tp: int
    pp: int
    ep: int
    etp: int
    dp: int | None = None

    def model_parallel(self) -> tuple[int, int, int, int]:
        """What the flat-buffer optimizer format depends on (everything but ``dp``)."""
        return self.tp, self.pp, self.ep, self.etp

    def __str__(self) -> str:
        dp = "" if self.dp is None else f" dp={self.dp}"
        return f"tp={self.tp} pp={self.pp} ep={self.ep} etp={self.etp}{dp}"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SavedLayout:
    """What a trainer checkpoint says about its layout and optimizer state."""

    layout: Layout
    distributed_optimizer: bool
    optimizer_format: str | None
    """:data:`FULLY_RESHARDABLE` or :data:`DP_RESHARDABLE` for the distributed optimizer,
    ``None`` for the non-distributed one (per-parameter state, reshards like the model)."""
    optimizer_stepped: bool
    """``False``: no optimizer state was saved (it never stepped), nothing to reshard."""


def layout_of(config: ArmorConfig) -> Layout:
    """The layout a loaded ``config`` runs (its decided world size and ``etp``)."""
    t, decided = config.trainer, config.resolved
    dp = decided.world_size // (t.tp * t.pp * t.cp)
    return Layout(t.tp, t.pp, t.ep, decided.etp, dp)


def parse_layout(record: dict) -> SavedLayout:
    """A :class:`SavedLayout` from ``common.pt``'s dict. Saves that predate ``ep`` / ``etp``
    were made before the trainer had expert parallelism (``ep`` 1, ``etp`` its ``tp``); those
    that predate ``optimizer_format`` saved the distributed optimizer ``dp_reshardable``."""
    saved = record.get("parallel_layout") or {}
    tp = int(saved.get("tp", 1))
    layout = Layout(tp, int(saved.get("pp", 1)), int(saved.get("ep", 1)),
                    int(saved.get("etp", tp)), saved.get("dp"))  # fmt: skip
    distributed = bool(saved.get("distributed_optimizer", False))
    fmt = saved.get("optimizer_format", DP_RESHARDABLE) if distributed else None
    return SavedLayout(layout, distributed, fmt, bool(record.get("optimizer_stepped", True)))


def read_saved_layout(checkpoint: Path) -> SavedLayout | None:
    """The :class:`SavedLayout` of run checkpoint ``checkpoint`` (``None``: no trainer state,
    or one that records no layout). Read with ``torch.load(weights_only=True)``."""
    import torch

    path = checkpoint / COMMON
    if not path.is_file():
        return None
    common = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(common, dict) or not isinstance(common.get("parallel_layout"), dict):
        return None
    return parse_layout(common)


def layout_problem(saved: SavedLayout, config: ArmorConfig, where: str) -> str | None:
    """Why the checkpoint at ``where`` (saved as ``saved``) cannot resume with ``config``;
    ``None``: it can (every layout the model admits, for a reshardable save)."""
    if not saved.optimizer_stepped:
        return None  # no optimizer state: the model weights reshard
    was, now = saved.distributed_optimizer, bool(config.trainer.use_distributed_optimizer)
    if was != now:
        return (f"{where} holds optimizer state of trainer.use_distributed_optimizer={was}, "
                f"the config sets {now}: the two formats do not convert; resume with "
                f"trainer.use_distributed_optimizer={was}")  # fmt: skip
    target = layout_of(config)
    if not was:
        return _chain_problem(saved.layout, target, where)
    if saved.optimizer_format != DP_RESHARDABLE:
        return None
    if saved.layout.model_parallel() == target.model_parallel():
        return None
    old = saved.layout
    return (f"{where} holds distributed-optimizer state saved {DP_RESHARDABLE} at {old} (it "
            f"records no optimizer_format); it reshards over data parallelism only, not to "
            f"{target}: resume once with trainer.tp={old.tp} trainer.pp={old.pp} "
            f"trainer.ep={old.ep} trainer.etp={old.etp} (any world_size that fits them): the "
            f"checkpoints that run writes are saved {FULLY_RESHARDABLE} and resume at any "
            "layout")  # fmt: skip


def _chain_problem(old: Layout, target: Layout, where: str) -> str | None:
    """The non-distributed optimizer keeps a mixture-of-experts model's expert state in a
    second optimizer at ``ep > 1`` only (megatron-core marks experts expert-parallel there),
    and its checkpoint keys carry the optimizer's place in that chain: such a save loads at
    ``ep > 1`` or at ``ep = 1`` as it was saved, not across."""
    if (old.ep > 1) == (target.ep > 1):
        return None
    keep = "trainer.ep > 1 (any that divides the experts)" if old.ep > 1 else "trainer.ep=1"
    return (f"{where} holds non-distributed optimizer state of a mixture-of-experts model "
            f"saved at ep={old.ep}: its expert state sits in a separate optimizer only at ep > 1, "
            f"so it does not load at ep={target.ep}; resume with {keep} (the distributed "
            "optimizer's checkpoints load at any ep)")  # fmt: skip


def layout_change(saved: SavedLayout, config: ArmorConfig) -> dict[str, dict] | None:
    """``{"from": saved layout, "to": the config's}`` when ``config`` resumes the save at
    another layout (``dp`` compared where the save recorded it), else ``None``."""
    target = layout_of(config)
    old = saved.layout
    same = old.model_parallel() == target.model_parallel() and old.dp in (None, target.dp)
    return None if same else {"from": old.as_dict(), "to": target.as_dict()}
