"""``armor plan CONFIG --checkpoint CKPT``: the parallel layouts of the config's allocation a
checkpoint resumes at.

A requeued job may get another allocation (fewer nodes: ``trainer.world_size: auto`` follows
``orchestration.nodes``). For that world size, :func:`resume_options` lists every
``(tp, pp, ep)`` the model admits (the planner's and the config's layout rules: heads, FFN width
and experts divisible, layers by the stages, every rank with a share; ``etp`` its ``auto``
value, ``cp`` / ``vpp`` as configured), whether the checkpoint's optimizer state loads there
(``config/resume_layout.layout_problem``) and whether the plan fits the GPUs
(:func:`~megatron_armor.planner.plan.make_plan`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from megatron_armor.config.resume_layout import (
    DP_RESHARDABLE,
    Layout,
    SavedLayout,
    layout_of,
    layout_problem,
)
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.planner.model import load_model_dims
from megatron_armor.planner.plan import Plan, make_plan


@dataclass(frozen=True)
class ResumeOption:
    """One layout of the allocation and what a resume there would meet."""

    layout: Layout
    configured: bool
    """The layout the config sets."""
    plan: Plan
    resume_problem: str | None
    """Why the checkpoint cannot resume here (``None``: it can)."""
    distributed_optimizer: bool
    """The config's ``trainer.use_distributed_optimizer``."""

    @property
    def admitted(self) -> bool:
        """No layout rule refuses it (memory aside)."""
        return not any(f.level == "error" for f in self.plan.findings)

    def describe(self, saved: SavedLayout) -> str:
        """One line: the layout (``*`` the configured one), the resume verdict, the memory."""
        mark = "*" if self.configured else " "
        if self.resume_problem is None:
            same = saved.layout.model_parallel() == self.layout.model_parallel()
            verdict = "resumes" + ("" if same else " (resharded)")
        elif saved.optimizer_format == DP_RESHARDABLE:
            verdict = "does not resume (dp_reshardable state: another tp/pp/ep/etp)"
        elif saved.distributed_optimizer != self.distributed_optimizer:
            verdict = "does not resume (trainer.use_distributed_optimizer switched)"
        else:
            verdict = "does not resume (non-distributed MoE optimizer: ep 1 <-> ep > 1)"
        peak = f"{self.plan.peak_bytes / 2**30:.1f} GiB"
        fit = "fits" if self.plan.fits_memory else f"does not fit ({self.plan.largest_term[0]})"
        return f"{mark} {str(self.layout):<30} {verdict}; {fit}, {peak}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(config: ArmorConfig, num_experts: int) -> list[tuple[int, int, int]]:
    """``(tp, pp, ep)`` whose products divide ``trainer.world_size`` (``cp`` as configured;
    ``ep`` 1 for a dense model, else a divisor of ``num_experts``)."""
    t = config.trainer
    world, out = config.resolved.world_size, []
    for tp in _divisors(world // t.cp):
        for pp in _divisors(world // (t.cp * tp)):
            eps = [1] if not num_experts else _divisors(num_experts)
            out += [(tp, pp, ep) for ep in eps if world % (ep * pp) == 0]
    return out


def resume_options(
    config: ArmorConfig, saved: SavedLayout, where: str, model: str | None, gpu_mem_gib: float
) -> list[ResumeOption]:
    """Every candidate layout the model admits, with its resume verdict and memory plan."""
    configured = layout_of(config)
    num_experts = load_model_dims(model or config.trainer.model_path).num_experts
    options = []
    for tp, pp, ep in candidate_layouts(config, num_experts):
        trial = copy.deepcopy(config)
        t = trial.trainer
        t.tp, t.pp, t.ep, t.etp = tp, pp, ep, "auto"
        t.sequence_parallel = tp > 1 and config.trainer.sequence_parallel
        option = ResumeOption(
            layout=layout_of(trial),
            configured=(tp, pp, ep) == (configured.tp, configured.pp, configured.ep),
            plan=make_plan(trial, model=model, gpu_mem_gib=gpu_mem_gib),
            resume_problem=layout_problem(saved, trial, where),
            distributed_optimizer=t.use_distributed_optimizer,
        )
        if option.admitted:
            options.append(option)
    return options


def resume_report(
    config: ArmorConfig, saved: SavedLayout, where: str, model: str | None, gpu_mem_gib: float
) -> tuple[list[str], bool]:
    """The lines ``armor plan --checkpoint`` prints, and whether the checkpoint resumes at
    the configured layout."""
    optimizer = (
        f"distributed optimizer, {saved.optimizer_format}"
        if saved.distributed_optimizer
        else "non-distributed optimizer"
    )
    lines = [
        f"checkpoint {where}: saved at {saved.layout} ({optimizer})",
        f"layouts of trainer.world_size={config.resolved.world_size} the model admits (* the configured one):",
    ]
    options = resume_options(config, saved, where, model, gpu_mem_gib)
    lines += [f"  {o.describe(saved)}" for o in options]
    problem = layout_problem(saved, config, where)
    if problem is not None:
        lines.append(f"ERROR: --checkpoint: {problem}")
    return lines, problem is None
