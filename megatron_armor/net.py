"""Where a run's processes meet on the network: this node's address, a free port, and the name
of each weight-sync process group.

The driver's workers (``orchestration/actors/workers.py``) and the trainer ranks' weight sender
(``trainer/weight_sync.py``) both use these, so they live below both (docs/architecture.md,
"Layers").
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
BELOW_EPHEMERAL = 12000
"""How many ports under the kernel's ephemeral range :func:`free_port` draws from."""


def free_port() -> int:
    """A TCP port that is free on this node right now, drawn at random below the kernel's
    ephemeral range (the ``BELOW_EPHEMERAL`` ports under its first port, from 1024 up).

    The port is bound by another process later (a trainer rank's rendezvous, a Ray head, a
    server), and until then it is free: a port of the ephemeral range can meanwhile become the
    local port of any outgoing connection on the node (a Ray node opens many), and the later
    bind fails with EADDRINUSE. Below the range only an explicit bind takes it. Where the
    range cannot be read, or no port there binds, the kernel chooses one (``bind`` to 0)."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    draw = random.SystemRandom()  # not the seeded module state: two runs must not draw alike
    for _ in range(64 if low - BELOW_EPHEMERAL >= 1024 else 0):
        port = draw.randrange(low - BELOW_EPHEMERAL, low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
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
