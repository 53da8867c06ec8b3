"""Host memory of a run's processes on one node, read with psutil (docs/metrics.md, ``mem/*``).

:func:`node_memory` takes named *roots* (a pid, and whether its descendants count too) and
returns, in bytes, the resident set size (RSS) of each root (its process tree: a reward
worker's verifier pool, a rollout worker's SGLang servers), the RSS of the union of all
their processes (each pid once: the run's footprint on the node) and the node's own
``used = total - available`` and ``available`` (every user's processes). RSS counts the
shared pages a process has touched (libraries, the Ray object store's mappings) in every
process that maps them, so a sum over processes over-counts what is shared; its growth over a
run is the signal. A root whose process is gone is left out (it has no memory to report).
Pure psutil: no Ray, no torch.
"""

from __future__ import annotations

import psutil


def tree_pids(pid: int, with_children: bool) -> list[int]:
    """``pid`` and, ``with_children``, its live descendants; ``[]`` when ``pid`` is gone."""
    try:
        root = psutil.Process(pid)
        children = root.children(recursive=True) if with_children else []
    except psutil.NoSuchProcess:
        return []
    return [pid, *(c.pid for c in children)]


def rss_of(pids: list[int]) -> dict[int, int]:
    """``{pid: RSS bytes}`` of the pids still alive."""
    out = {}
    for pid in pids:
        try:
            out[pid] = psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return out


def node_memory(roots: dict[str, tuple[int, bool]]) -> dict:
    """``{"roots": {name: RSS bytes of its tree}, "run": RSS bytes of the union, "used",
    "available", "total"}`` for ``roots`` = ``{name: (pid, with_children)}`` on this node."""
    trees = {name: tree_pids(pid, children) for name, (pid, children) in roots.items()}
    rss = rss_of(sorted({p for pids in trees.values() for p in pids}))
    vm = psutil.virtual_memory()
    return {
        "roots": {n: sum(rss.get(p, 0) for p in pids) for n, pids in trees.items() if pids},
        "run": sum(rss.values()),
        "used": vm.total - vm.available,
        "available": vm.available,
        "total": vm.total,
    }
