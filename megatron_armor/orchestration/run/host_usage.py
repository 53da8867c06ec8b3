"""The run's host memory every step and its run directory at checkpoints (docs/metrics.md,
``mem/*`` and ``disk/*``).

:class:`HostMemory` knows every process of the run by name, node and pid: the driver
(``driver``: the driver alone; ``driver_tree``: with its descendants, which with a local Ray
head are every Ray process and actor of the run on its node), each trainer rank
(``trainer<r>``), rollout worker (``rollout<i>``, with the SGLang servers it launched) and
reward worker (``reward<i>``, with its verifier pool), the actors with their process trees.
Each step it reads them with psutil (``observability/host_memory.py``): on the driver's node
in the driver itself, on any other node in a Ray task pinned to that node (``num_cpus=0``,
so it never waits for a busy actor: an actor's own method would queue behind the step's
work, e.g. the next step's prefetched reference call). The actors' pids and nodes are asked
once, at start-up (their ``node_info``).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from megatron_armor.observability.host_memory import node_memory
from megatron_armor.orchestration.actors.call_kinds import CallKind
from megatron_armor.orchestration.actors.call_watch import CallWatch
from megatron_armor.orchestration.actors.pending import Pending
from megatron_armor.orchestration.run import checkpoints

GB = 1e9


@dataclass(frozen=True)
class RunProcess:
    """One named process of the run (``tree``: its descendants count as its own)."""

    name: str
    node: str
    pid: int
    tree: bool


def actor_processes(groups: dict[str, object], watch: CallWatch) -> list[RunProcess]:
    """``{prefix: handle}`` (``TrainerActors``, ``RolloutFleet``, ``RewardActors``) -> a
    :class:`RunProcess` per actor, named ``<prefix><index>``, from one ``node_info`` call each;
    ``watch`` learns where each runs (a stuck one is named and killed by its pid)."""
    numbered = [(prefix, i, a) for prefix, h in groups.items() for i, a in enumerate(h.actors)]
    named = [(f"{prefix}{i}", a) for prefix, i, a in numbered]
    refs = [a.node_info.remote() for _, a in named]
    infos = Pending(watch, refs, CallKind.NODE_INFO, "actor node info").result()
    for (_, i, actor), info in zip(numbered, infos, strict=True):
        watch.locate_actor(actor, info, i)
    return [
        RunProcess(n, info["node_id"], info["pid"], True)
        for (n, _), info in zip(named, infos, strict=True)
    ]


class HostMemory:
    """``mem/*`` of the run's processes (module docstring); :meth:`metrics` once a step."""

    def __init__(self, actors: list[RunProcess], local_node: str, watch: CallWatch):
        me = os.getpid()
        self.watch = watch
        self.processes = [RunProcess("driver", local_node, me, False),
                          RunProcess("driver_tree", local_node, me, True), *actors]  # fmt: skip
        self.local_node = local_node
        self.nodes = list(dict.fromkeys([local_node, *(p.node for p in actors)]))
        self._remote = None

    @classmethod
    def start(cls, trainer, rollout, reward, watch: CallWatch) -> HostMemory:
        """The run's processes, with the actors of the three handles."""
        import ray

        local = ray.get_runtime_context().get_node_id()
        groups = {"trainer": trainer, "rollout": rollout, "reward": reward}
        return cls(actor_processes(groups, watch), local, watch)

    def replace(self, name: str, actor) -> None:
        """The process ``name`` (e.g. ``rollout1``) is now ``actor``'s: a worker replaced in
        the run (``orchestration/actors/recovery.py``) is measured from then on, under the dead
        one's name."""
        asked = [actor.node_info.remote()]
        (info,) = Pending(self.watch, asked, CallKind.NODE_INFO, "actor node info").result()
        self.watch.locate_actor(actor, info, int(re.search(r"\d+$", name).group()))
        new = RunProcess(name, info["node_id"], info["pid"], True)
        self.processes = [new if p.name == name else p for p in self.processes]
        if new.node not in self.nodes:
            self.nodes.append(new.node)

    def roots(self, node: str) -> dict[str, tuple[int, bool]]:
        return {p.name: (p.pid, p.tree) for p in self.processes if p.node == node}

    def _submit(self, node: str):
        """The Ray task that reads ``node``'s processes there (pinned, no CPU reserved)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self._remote is None:
            self._remote = ray.remote(num_cpus=0)(node_memory)
        strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        return self._remote.options(scheduling_strategy=strategy).remote(self.roots(node))

    def read(self) -> list[dict]:
        """:func:`~megatron_armor.observability.host_memory.node_memory` of every node, in
        :attr:`nodes` order (the driver's first)."""
        remote = {n: self._submit(n) for n in self.nodes if n != self.local_node}
        local = node_memory(self.roots(self.local_node))
        done = {}  # (no ray.get without remote nodes: it would start a Ray of its own)
        if remote:
            read = Pending(self.watch, list(remote.values()), CallKind.HOST_MEMORY,
                           "host memory read").result()  # fmt: skip
            done = dict(zip(remote, read, strict=True))
        return [local if n == self.local_node else done[n] for n in self.nodes]

    def metrics(self) -> dict[str, float]:
        """``mem/<process>_gb`` (RSS of each named process or tree), ``mem/node<n>_run_gb``
        (the run's distinct processes on node ``n``), ``mem/node<n>_used_gb`` and
        ``_available_gb`` (the node, every user), ``mem/run_gb`` (the run on every node)."""
        out: dict[str, float] = {}
        per_node = self.read()
        for n, node in enumerate(per_node):
            out.update({f"mem/{name}_gb": rss / GB for name, rss in node["roots"].items()})
            out[f"mem/node{n}_run_gb"] = node["run"] / GB
            out[f"mem/node{n}_used_gb"] = node["used"] / GB
            out[f"mem/node{n}_available_gb"] = node["available"] / GB
        out["mem/run_gb"] = sum(node["run"] for node in per_node) / GB
        return out


def disk_metrics(run_dir: str | Path) -> dict[str, float]:
    """``disk/run_dir_gb`` (every file under the run directory), ``disk/checkpoint_gb`` (its
    newest checkpoint directory) and ``disk/free_gb`` (free space on its file system)."""
    newest = checkpoints.step_dirs(run_dir)
    return {
        "disk/run_dir_gb": checkpoints.directory_bytes(Path(run_dir)) / GB,
        "disk/checkpoint_gb": checkpoints.directory_bytes(newest[-1][1]) / GB if newest else 0.0,
        "disk/free_gb": shutil.disk_usage(run_dir).free / GB,
    }
