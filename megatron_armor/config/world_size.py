"""``trainer.world_size: auto``: the trainer's ranks from the job's nodes and GPUs.

A job's allocation (``orchestration.nodes`` x ``orchestration.gpus_per_node``, which
``slurm/armor.sbatch`` passes from the Slurm job) decides the layout: ``auto`` is every GPU of
the allocation (``colocated``), every GPU but the rollout pool's (``disaggregated``) or one rank
per node (``cpu``: a CPU rank uses its node's cores). An explicit size that leaves GPUs of the
allocation idle is refused at load unless ``trainer.allow_idle_gpus`` says it is deliberate
(docs/configuration.md, "World size").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_armor.config.schema import ArmorConfig, OrchestrationConfig

AUTO = "auto"


def allocation_gpus(orch: OrchestrationConfig) -> int:
    """GPUs of the job: ``orchestration.nodes * orchestration.gpus_per_node``."""
    return orch.nodes * orch.gpus_per_node


def auto_world_size(orch: OrchestrationConfig) -> int | None:
    """The trainer ranks ``auto`` stands for in ``orch``'s layout; ``None`` where there are
    none to give (a disaggregated rollout pool as large as the job, or no nodes or GPUs,
    named by :func:`world_size_problems`)."""
    if orch.layout == "cpu":
        return orch.nodes if orch.nodes >= 1 else None
    gpus = allocation_gpus(orch)  # colocated (and an unknown layout, named by check_names)
    if orch.layout == "disaggregated":
        gpus -= orch.rollout_gpus
    return gpus if gpus >= 1 else None


def resolve_world_size(config: ArmorConfig) -> None:
    """Replace ``trainer.world_size: auto`` by its number, where it has one (in place: every
    reader after this, the trainer included, sees the number)."""
    if config.trainer.world_size == AUTO:
        size = auto_world_size(config.orchestration)
        if size is not None:
            config.trainer.world_size = size


def world_size_problems(config: ArmorConfig) -> Iterator[str]:
    """``trainer.world_size`` is a number or ``auto`` with a number to stand for, and, in the
    GPU layouts, uses the allocation's GPUs: no more, and no fewer unless
    ``trainer.allow_idle_gpus``."""
    t, orch = config.trainer, config.orchestration
    resolve_world_size(config)
    if t.world_size == AUTO:
        yield (
            f"trainer.world_size=auto: the {orch.layout} layout leaves no GPU for the trainer "
            f"(orchestration.nodes={orch.nodes} x gpus_per_node={orch.gpus_per_node}, "
            f"rollout_gpus={orch.rollout_gpus}); lower orchestration.rollout_gpus or add nodes"
        )
        return
    if isinstance(t.world_size, str):
        yield (
            f"trainer.world_size={t.world_size!r}: a number of trainer ranks or auto (every "
            "GPU of the job)"
        )
        return
    if orch.layout in ("colocated", "disaggregated") and t.world_size >= 1:
        yield from _gpu_count_problems(config)


def _gpu_count_problems(config: ArmorConfig) -> Iterator[str]:
    t, orch = config.trainer, config.orchestration
    rollout = orch.rollout_gpus if orch.layout == "disaggregated" else 0
    used, gpus = t.world_size + rollout, allocation_gpus(orch)
    auto = auto_world_size(orch)
    job = f"orchestration.nodes={orch.nodes} x gpus_per_node={orch.gpus_per_node} = {gpus} GPUs"
    pool = f" + orchestration.rollout_gpus={rollout}" if rollout else ""
    if used > gpus and orch.layout == "colocated":
        yield (
            f"trainer.world_size={t.world_size}: more ranks than the job's {job}; set "
            f"trainer.world_size=auto ({auto}) or ask for more nodes"
        )
    elif used < gpus and not t.allow_idle_gpus:
        yield (
            f"trainer.world_size={t.world_size}{pool} leaves {gpus - used} of the job's {job} "
            f"idle; set trainer.world_size=auto ({auto}), or trainer.allow_idle_gpus=true to "
            "leave them idle on purpose"
        )
