"""Wait (bounded) until every Slurm node of the job has joined the Ray cluster.

Each node's ``ray start`` (slurm/lib/ray_node.sh) carries a resource ``armor_node_<nodename>``;
this connects to the head, polls ``ray.nodes()`` and exits 0 when all expected nodes are alive.
It exits 1 naming the missing nodes when the deadline passes, or at once when the local
``srun`` that starts a node's Ray has exited (``--watch node=pid``).

    python wait_for_ray_nodes.py --address IP:PORT --nodes n1,n2 --timeout 300 --watch n1=123
"""

from __future__ import annotations

import argparse
import os
import sys
import time

RESOURCE_PREFIX = "armor_node_"


def joined_nodes(ray_module) -> set[str]:
    """Slurm node names of the alive Ray nodes (from their ``armor_node_<name>`` resource)."""
    names = set()
    for node in ray_module.nodes():
        if not node.get("Alive"):
            continue
        for key in node.get("Resources", {}):
            if key.startswith(RESOURCE_PREFIX):
                names.add(key[len(RESOURCE_PREFIX) :])
    return names


def dead_launchers(watch: dict[str, int]) -> list[str]:
    """Nodes whose local launcher process (srun) has already exited."""
    dead = []
    for node, pid in watch.items():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            dead.append(node)
        except PermissionError:
            pass
    return dead


def connect(ray_module, address: str, deadline: float, watch: dict[str, int]) -> None:
    """``ray.init(address)`` retried until the head answers or the deadline passes."""
    while True:
        try:
            ray_module.init(address=address, log_to_driver=False, logging_level="ERROR")
            return
        except ray_module.exceptions.AuthenticationError as e:
            sys.exit(f"wait_for_ray_nodes: Ray token auth failed (check RAY_AUTH_TOKEN_PATH): {e}")
        except (ConnectionError, RuntimeError) as e:
            dead = dead_launchers(watch)
            if dead or time.monotonic() > deadline:
                why = f"Ray start exited on {', '.join(dead)}" if dead else f"{e}"
                sys.exit(f"wait_for_ray_nodes: cannot reach the Ray head at {address}: {why}")
            time.sleep(2)


def wait_for_nodes(
    address: str, expected: list[str], timeout_s: float, watch: dict[str, int]
) -> int:
    """0 when all ``expected`` nodes joined within ``timeout_s``; 1 naming the missing ones."""
    import ray

    deadline = time.monotonic() + timeout_s
    connect(ray, address, deadline, watch)
    try:
        while True:
            missing = sorted(set(expected) - joined_nodes(ray))
            if not missing:
                print(f"wait_for_ray_nodes: all {len(expected)} node(s) joined", file=sys.stderr)
                return 0
            dead = [n for n in dead_launchers(watch) if n in missing]
            if dead or time.monotonic() > deadline:
                why = "its Ray start exited" if dead else f"not joined after {timeout_s:.0f}s"
                print(
                    f"wait_for_ray_nodes: node(s) {', '.join(dead or missing)} missing from the "
                    f"Ray cluster ({why}); see the job's ray-<node>.log files",
                    file=sys.stderr,
                )
                return 1
            time.sleep(2)
    finally:
        ray.shutdown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True, help="Ray head IP:PORT")
    p.add_argument("--nodes", required=True, help="comma-separated Slurm node names")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait in total")
    p.add_argument("--watch", action="append", default=[], help="NODE=PID of its local srun")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = {}
    for item in args.watch:
        node, _, pid = item.partition("=")
        watch[node] = int(pid)
    return wait_for_nodes(args.address, args.nodes.split(","), args.timeout, watch)


if __name__ == "__main__":
    sys.exit(main())
