"""Where a run's processes meet on the network: this node's address, a free port, and the name
of each weight-sync process group.

The driver's workers (``orchestration/actors/workers.py``) and the trainer ranks' weight sender
(``trainer/weight_sync.py``) both use these, so they live below both (docs/architecture.md,
"Layers").
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port that is free on this node right now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """This node's IP as Ray reports it (reachable from the other nodes of the cluster)."""
    import ray

    return ray.util.get_node_ip_address()


def weight_group_name(pp_stage: int, pool: str = "policy") -> str:
    """The weight-sync process group of pipeline stage ``pp_stage`` into SGLang pool ``pool``
    (one sender per stage and pool)."""
    prefix = "armor-weights" if pool == "policy" else f"armor-{pool}-weights"
    return f"{prefix}-pp{pp_stage}"
