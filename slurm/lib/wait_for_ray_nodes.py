"""Wait, within a hard deadline, until every Slurm node of the job has joined the Ray cluster.

Each node's ``ray start`` (slurm/lib/ray_node.sh) carries a resource ``armor_node_<nodename>``.
The Ray client runs in a child process (``--probe``) that connects to the head and prints the
joined node names once a second; this process only reads its lines, so a ``ray.init`` that
blocks (a head whose GCS never answers) cannot hold the deadline. It exits 0 when all expected
nodes are alive, and 1 with a message naming the node and its log when the deadline passes or
when the local ``srun`` that starts a node's Ray has exited (``--watch node=pid``, checked
every second).

    python wait_for_ray_nodes.py --address IP:PORT --nodes n1,n2 --timeout 300 \
        --watch n1=123 --logs JOB_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import subprocess
import sys
import time

RESOURCE_PREFIX = "armor_node_"
POLL_S = 1.0
AUTH_FAILED_EXIT = 3


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


def probe(address: str) -> int:
    """Child mode: connect (this may block), then print the joined node names as a JSON list
    once a second until killed. Exit 3 on a token-auth failure."""
    import ray

    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except ray.exceptions.AuthenticationError as e:
        print(f"Ray token auth failed (check RAY_AUTH_TOKEN_PATH): {e}", file=sys.stderr)
        return AUTH_FAILED_EXIT
    while True:
        print(json.dumps(sorted(joined_nodes(ray))), flush=True)
        time.sleep(POLL_S)


def port_open(address: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at ``address`` (IP:PORT)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


class Waiter:
    """The deadline, the probe child, and the messages that name a node and its log."""

    def __init__(self, address: str, expected: list[str], timeout_s: float, watch, logs: str):
        self.address, self.expected, self.timeout_s = address, expected, timeout_s
        self.watch, self.logs = watch, logs
        self.deadline = time.monotonic() + timeout_s
        self.joined: set[str] | None = None  # None until the head answered
        self.child: subprocess.Popen | None = None

    def log_of(self, node: str) -> str:
        return os.path.join(self.logs, f"ray-{node}.log") if self.logs else f"ray-{node}.log"

    def fail(self, message: str) -> int:
        print(f"wait_for_ray_nodes: {message}", file=sys.stderr)
        return 1

    def start_probe(self) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--probe", self.address]
        self.child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    def stop_probe(self) -> None:
        if self.child and self.child.poll() is None:
            self.child.kill()
        if self.child:
            self.child.wait()

    def read_lines(self, selector: selectors.BaseSelector) -> None:
        """Take the probe's latest line (if any arrived within one poll)."""
        for _key, _ in selector.select(timeout=POLL_S):
            line = self.child.stdout.readline()
            if line:
                self.joined = set(json.loads(line))
            else:  # end of output: the probe is exiting
                self.child.wait()

    def verdict(self) -> int | None:
        """0 when all joined; 1 (with the message) on a dead launcher or the deadline."""
        head = self.expected[0]
        if self.joined is not None and not set(self.expected) - self.joined:
            print(f"wait_for_ray_nodes: all {len(self.expected)} node(s) joined", file=sys.stderr)
            return 0
        missing = sorted(set(self.expected) - (self.joined or set()))
        dead = [n for n in dead_launchers(self.watch) if n in missing]
        if dead:
            logs = ", ".join(self.log_of(n) for n in dead)
            return self.fail(f"node(s) {', '.join(dead)}: its Ray start exited; see {logs}")
        if time.monotonic() < self.deadline:
            return None
        if self.joined is None:
            state = "its port is open" if port_open(self.address) else "nothing listens there"
            return self.fail(
                f"the Ray head at {self.address} on node {head} did not answer within "
                f"{self.timeout_s:.0f}s ({state}); see {self.log_of(head)}"
            )
        logs = ", ".join(self.log_of(n) for n in missing)
        return self.fail(
            f"node(s) {', '.join(missing)} missing from the Ray cluster (not joined after "
            f"{self.timeout_s:.0f}s); see {logs}"
        )

    def run(self) -> int:
        self.start_probe()
        selector = selectors.DefaultSelector()
        selector.register(self.child.stdout, selectors.EVENT_READ)
        try:
            while True:
                self.read_lines(selector)
                result = self.verdict()
                if result is not None:
                    return result
                if self.child.poll() is not None:  # stdout closed: the probe ended
                    if self.child.returncode == AUTH_FAILED_EXIT:
                        return self.fail(f"Ray token auth failed at {self.address}")
                    selector.unregister(self.child.stdout)
                    time.sleep(POLL_S)
                    self.start_probe()  # e.g. ray.init gave up before the head was up
                    selector.register(self.child.stdout, selectors.EVENT_READ)
        finally:
            self.stop_probe()


def wait_for_nodes(
    address: str, expected: list[str], timeout_s: float, watch: dict[str, int], logs: str = ""
) -> int:
    """0 when all ``expected`` nodes (the head first) joined within ``timeout_s``; else 1."""
    return Waiter(address, expected, timeout_s, watch, logs).run()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", help="Ray head IP:PORT")
    p.add_argument("--nodes", help="comma-separated Slurm node names, the head's first")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait in total")
    p.add_argument("--watch", action="append", default=[], help="NODE=PID of its local srun")
    p.add_argument("--logs", default="", help="directory of the ray-<node>.log files")
    p.add_argument("--probe", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.probe and not (args.address and args.nodes):
        p.error("--address and --nodes are required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe:
        return probe(args.probe)
    watch = {}
    for item in args.watch:
        node, _, pid = item.partition("=")
        watch[node] = int(pid)
    return wait_for_nodes(args.address, args.nodes.split(","), args.timeout, watch, args.logs)


if __name__ == "__main__":
    sys.exit(main())
