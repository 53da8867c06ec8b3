"""Killing a process with everything it started, on this node or on another Ray node.

``ray.kill`` does not end a stopped process, nor the processes an actor started (the SGLang
servers, the checkpoint writer's helpers): the call watch (``call_watch.py``) and the
shutdown (``actor_handles.close_actors``) kill the whole tree by pid instead.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

KILL_TASK_S = 10.0
"""How long the task that kills processes on another node may take."""


def children_of() -> dict[int, list[int]]:
    """``{pid: [child pids]}`` of every process on this node (from /proc)."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def process_trees(roots: list[int]) -> list[int]:
    """``roots`` and all their descendants (a root first, then its children)."""
    children, out, todo = children_of(), [], list(roots)
    while todo:
        pid = todo.pop(0)
        if pid not in out:
            out.append(pid)
            todo += children.get(pid, [])
    return out


def kill_trees(roots: list[int]) -> list[int]:
    """SIGKILL ``roots`` and their descendants, found before any is killed (orphans are
    re-parented and could not be found after); returns the pids signalled."""
    pids = [p for p in process_trees(roots) if p != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def kill_on_node(node_id: str, roots: list[int]) -> None:
    """:func:`kill_trees` of ``roots`` on Ray node ``node_id``: here on the driver's node, else
    by a task pinned there (bounded; best effort: a lost node took them already)."""
    import ray

    if not roots:
        return
    if node_id == ray.get_runtime_context().get_node_id():
        kill_trees(roots)
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    task = ray.remote(num_cpus=0)(kill_trees).options(scheduling_strategy=strategy)
    try:
        ray.get(task.remote(roots), timeout=KILL_TASK_S)
    except Exception as err:  # noqa: BLE001 - report, the run ends or goes on without it
        print(f"warning: could not kill {roots} on node {node_id}: {err}", flush=True)
