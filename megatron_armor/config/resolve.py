"""Every ``auto`` of a config decided once, in one frozen view (torchtitan's ``ParallelDims``).

Five settings may leave their value to the run: ``trainer.world_size`` (the job's GPUs,
``world_size.py``), ``algo.alpha`` (``n_on / (n_on + 1)``), ``trainer.etp`` (1 with expert
parallelism, else ``tp``), ``trainer.concurrent_reference`` and ``rollout.reference_first``
(``true | false | auto``). :func:`resolve` decides them all from the settings they depend on
(:class:`Autos`), once per distinct set of those, and the code reads the decisions from the
view (``config.resolved``), never the word ``auto``; the config keeps what its files say, and
the saved ``config.yaml`` holds the decided world size and alpha (the numbers a run used,
``loader.to_yaml``). :func:`resolution_problems` names what cannot be decided, each with the
setting, the value and the fix; ``config/validate.py`` reports them first.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_armor.algo.ratios import resolve_alpha
from megatron_armor.config.moe import expert_tp_size
from megatron_armor.config.world_size import AUTO, auto_world_size, world_size_auto_problem

if TYPE_CHECKING:
    from megatron_armor.config.schema import ArmorConfig

TRUE_FALSE_AUTO = {"true": True, "false": False, "auto": AUTO}


@dataclass(frozen=True)
class Resolved:
    """The decisions of a config's ``auto`` settings (module docstring)."""

    world_size: int
    """Trainer ranks."""
    alpha: float
    """The mixing coefficient of the mixed ratio (docs/algorithm.md, mixed optimization)."""
    etp: int
    """Expert tensor-parallel size (``config/moe.py``: ``expert_tp_size``; a word other than
    ``auto`` is named by the trainer section's check)."""
    concurrent_reference: bool
    """Whether a CPU rank runs its reference pass beside the policy pass
    (``trainer/reference_model.py``)."""
    reference_first: bool | None
    """Whether a step draws the reference samples first; ``None``: each step by the cost rule
    from the step before (``anchor_rollout.prefers_reference_first``)."""


@dataclass(frozen=True)
class Autos:
    """The settings the decisions read (hashable: a decision is made once per distinct set)."""

    layout: str
    nodes: int
    gpus_per_node: int
    rollout_gpus: int
    world_size: int | str
    group_size: int
    alpha: float | str
    tp: int
    ep: int
    etp: int | str
    concurrent_reference: bool | str
    async_rollout: str
    reference_first: bool | str

    @classmethod
    def of(cls, config: ArmorConfig) -> Autos:
        o, t = config.orchestration, config.trainer
        return cls(
            o.layout,
            o.nodes,
            o.gpus_per_node,
            o.rollout_gpus,
            t.world_size,
            config.algo.group_size,
            config.algo.alpha,
            t.tp,
            t.ep,
            t.etp,
            t.concurrent_reference,
            o.async_rollout,
            config.rollout.reference_first,
        )


def true_false_auto(key: str, value: object, auto: str) -> bool | str:
    """A ``true | false | auto`` setting ``key`` as ``True``, ``False`` or ``"auto"`` (YAML/CLI
    strings in any case too); anything else is a :class:`ValueError` naming it and saying what
    ``auto`` does."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in TRUE_FALSE_AUTO:
        return TRUE_FALSE_AUTO[value.strip().lower()]
    raise ValueError(f"{key}={value!r} is not one of true, false, auto (auto: {auto})")


def reference_first_setting(value: object) -> bool | str:
    """``rollout.reference_first`` as ``True``, ``False`` or ``"auto"``."""
    return true_false_auto(
        "rollout.reference_first", value,
        "each step's order by the rejection shares of the step before",
    )  # fmt: skip


def concurrent_reference_setting(value: object) -> bool | str:
    """``trainer.concurrent_reference`` as ``True``, ``False`` or ``"auto"``."""
    return true_false_auto(
        "trainer.concurrent_reference", value, "on for the cpu layout with one trainer rank"
    )


def decide_world_size(a: Autos) -> int:
    if a.world_size == AUTO:
        size = auto_world_size(a.layout, a.nodes, a.gpus_per_node, a.rollout_gpus)
        if size is None:
            raise ValueError(world_size_auto_problem(a.layout, a.nodes, a.gpus_per_node,
                                                     a.rollout_gpus))  # fmt: skip
        return size
    if isinstance(a.world_size, str):
        raise ValueError(f"trainer.world_size={a.world_size!r}: a number of trainer ranks or auto "
                         "(every GPU of the job)")  # fmt: skip
    return a.world_size


def decide_concurrent_reference(a: Autos, world_size: int) -> bool:
    """``auto``: on in the ``cpu`` layout with one trainer rank (its reference pass borrows the
    idle rollout engine's thread share; more ranks than the layout's one engine would
    oversubscribe the cores), off with ``async_rollout`` (the engine generates meanwhile)."""
    value = concurrent_reference_setting(a.concurrent_reference)
    if value == AUTO:
        return a.layout == "cpu" and world_size == 1 and a.async_rollout == "off"
    return value


def decide_reference_first(a: Autos) -> bool | None:
    value = reference_first_setting(a.reference_first)
    return None if value == AUTO else value


@functools.cache
def decide(a: Autos) -> Resolved:
    """The :class:`Resolved` of ``a``; a :class:`ValueError` listing every setting that cannot
    be decided (:func:`problems_of`)."""
    problems = problems_of(a)
    if problems:
        raise ValueError("; ".join(problems))
    world_size = decide_world_size(a)
    etp = expert_tp_size(a)  # reads a's tp, ep and etp
    return Resolved(
        world_size,
        resolve_alpha(a.alpha, a.group_size),
        etp,
        decide_concurrent_reference(a, world_size),
        decide_reference_first(a),
    )


def problems_of(a: Autos) -> list[str]:
    """Why each setting of ``a`` that cannot be decided cannot (``[]``: all can; but for
    ``algo.alpha: auto`` with ``algo.group_size`` below 2, which the algo section's check
    names)."""
    out = []
    alpha = [] if a.group_size < 2 else [lambda x: resolve_alpha(x.alpha, x.group_size)]
    checks = (decide_world_size, *alpha,
              lambda x: concurrent_reference_setting(x.concurrent_reference),
              decide_reference_first)  # fmt: skip
    for check in checks:
        try:
            check(a)
        except ValueError as err:
            out.append(str(err))
    return out


def resolve(config: ArmorConfig) -> Resolved:
    """The decisions of ``config``'s ``auto`` settings (module docstring); raises
    :class:`ValueError` naming what cannot be decided."""
    return decide(Autos.of(config))


def resolution_problems(config: ArmorConfig) -> Iterator[str]:
    """What :func:`resolve` cannot decide in ``config``, one message per setting."""
    yield from problems_of(Autos.of(config))


def decidable(config: ArmorConfig) -> bool:
    """Whether :func:`resolve` decides every ``auto`` of ``config``."""
    try:
        resolve(config)
    except ValueError:
        return False
    return True
