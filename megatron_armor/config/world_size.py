"""``trainer.world_size: auto``: the trainer's ranks from the job's nodes and GPUs.

A job's allocation (``orchestration.nodes`` x ``orchestration.gpus_per_node``, which
``slurm/armor.sbatch`` passes from the Slurm job) decides the layout: ``auto`` is every GPU of
the allocation (``colocated``), every GPU but the rollout pool's (``disaggregated``) or one rank
per node (``cpu``: a CPU rank uses its node's cores). An explicit size that leaves GPUs of the
allocation idle is refused at load unless ``trainer.allow_idle_gpus`` says it is deliberate
(docs/configuration.md, "World size"). ``config/resolve.py`` decides ``auto`` with
:func:`auto_world_size`.
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


def auto_world_size(layout: str, nodes: int, gpus_per_node: int, rollout_gpus: int) -> int | None:
    """The trainer ranks ``auto`` stands for in a layout of ``nodes`` x ``gpus_per_node``
    (``rollout_gpus`` of them the disaggregated rollout pool's); ``None`` where there are none
    to give (:func:`world_size_auto_problem`)."""
    if layout == "cpu":
        return nodes if nodes >= 1 else None
    gpus = nodes * gpus_per_node  # colocated (and an unknown layout, named by check_names)
    if layout == "disaggregated":
        gpus -= rollout_gpus
    return gpus if gpus >= 1 else None


def world_size_auto_problem(layout: str, nodes: int, gpus_per_node: int, rollout_gpus: int) -> str:
    """Why ``trainer.world_size: auto`` stands for no number in that layout, and the fix."""
    return (
        f"trainer.world_size=auto: the {layout} layout leaves no GPU for the trainer "
        f"(orchestration.nodes={nodes} x gpus_per_node={gpus_per_node}, "
        f"rollout_gpus={rollout_gpus}); lower orchestration.rollout_gpus or add nodes"
    )


def world_size_problems(config: ArmorConfig) -> Iterator[str]:
    """In the GPU layouts, the decided ``trainer.world_size`` uses the allocation's GPUs: no
    more, and no fewer unless ``trainer.allow_idle_gpus``."""
    if config.orchestration.layout in ("colocated", "disaggregated"):
        if config.resolved.world_size >= 1:
            yield from _gpu_count_problems(config)


def _gpu_count_problems(config: ArmorConfig) -> Iterator[str]:
    t, orch = config.trainer, config.orchestration
    world_size = config.resolved.world_size
    rollout = orch.rollout_gpus if orch.layout == "disaggregated" else 0
    used, gpus = world_size + rollout, allocation_gpus(orch)
    auto = auto_world_size(orch.layout, orch.nodes, orch.gpus_per_node, orch.rollout_gpus)
    job = f"orchestration.nodes={orch.nodes} x gpus_per_node={orch.gpus_per_node} = {gpus} GPUs"
    pool = f" + orchestration.rollout_gpus={rollout}" if rollout else ""
    if used > gpus and orch.layout == "colocated":
        yield (
            f"trainer.world_size={world_size}: more ranks than the job's {job}; set "
            f"trainer.world_size=auto ({auto}) or ask for more nodes"
        )
    elif used < gpus and not t.allow_idle_gpus:
        yield (
            f"trainer.world_size={world_size}{pool} leaves {gpus - used} of the job's {job} "
            f"idle; set trainer.world_size=auto ({auto}), or trainer.allow_idle_gpus=true to "
            "leave them idle on purpose"
        )
