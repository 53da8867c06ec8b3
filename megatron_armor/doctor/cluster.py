"""``armor doctor --all-nodes``: every node's checks plus a cross-node all-reduce, under ``srun``.

Run one task per node (``srun --ntasks-per-node=1 armor doctor --all-nodes CONFIG``); each
task runs this node's checks, then all tasks meet in one process group (NCCL on GPUs, gloo on
CPU) and time an all-reduce across the nodes: the path a multi-node job's gradients and
weight broadcasts take, and the usual failure of an InfiniBand cluster (a wrong
``NCCL_SOCKET_IFNAME``, a missing HCA, a firewall). Rank 0 gathers every node's results and
prints them; the exit code is 1 when any node failed.

Rank and world come from Slurm's task environment (``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_NODEID``, ``SLURM_LOCALID``); the rendezvous address is ``MASTER_ADDR`` or the first
host of ``SLURM_JOB_NODELIST`` (expanded here: the container has no Slurm client), its port
``MASTER_PORT`` or one derived from ``SLURM_JOB_ID``.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

from megatron_armor.doctor.report import FAIL, Check, CheckResult, run_check

RENDEZVOUS_TIMEOUT_S = 900
"""Seconds a task waits for the others (their node checks may take minutes: SGLang, TE)."""
PORT_BASE = 29400
"""The rendezvous port is ``PORT_BASE + SLURM_JOB_ID % 1000`` without ``MASTER_PORT``."""
ALL_REDUCE_MIB = {"nccl": 256, "gloo": 32}
REPS = 5
CROSS_NODE = "cross-node all-reduce"
CROSS_NODE_FIX = (
    "check every node reaches MASTER_ADDR:MASTER_PORT; on InfiniBand rerun with NCCL_DEBUG=INFO "
    "and set NCCL_SOCKET_IFNAME / NCCL_IB_HCA to the cluster's interfaces (docs/slurm.md)"
)


@dataclass(frozen=True)
class Placement:
    """This task's place in the ``srun`` job."""

    rank: int
    world: int
    node_id: int
    local_rank: int
    master_addr: str
    master_port: int
    host: str = field(default_factory=socket.gethostname)


def slurm_placement(env: dict[str, str] | None = None) -> Placement:
    """The placement from Slurm's task environment; ``ValueError`` (with the ``srun`` command)
    outside ``srun``."""
    env = dict(os.environ if env is None else env)
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS") if k not in env]
    if missing:
        raise ValueError(
            f"--all-nodes runs as one task per node under srun ({', '.join(missing)} not set): "
            "srun --nodes=N --ntasks-per-node=1 armor doctor --all-nodes [CONFIG]"
        )
    return Placement(
        rank=int(env["SLURM_PROCID"]),
        world=int(env["SLURM_NTASKS"]),
        node_id=int(env.get("SLURM_NODEID", env["SLURM_PROCID"])),
        local_rank=int(env.get("SLURM_LOCALID", "0")),
        master_addr=env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "")),
        master_port=int(
            env.get("MASTER_PORT") or PORT_BASE + int(env.get("SLURM_JOB_ID", "0")) % 1000
        ),
    )


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (``node[01-04]`` -> ``node01``), expanded here: the
    project's image has no Slurm client (no ``scontrol show hostnames``)."""
    if not nodelist:
        raise ValueError("neither MASTER_ADDR nor SLURM_JOB_NODELIST is set; export MASTER_ADDR")
    return expand_hostlist(nodelist)[0]


def expand_hostlist(nodelist: str) -> list[str]:
    """Every host of a Slurm host list, in order: ``gpu[01-03,07],login`` -> ``gpu01, gpu02,
    gpu03, gpu07, login``; several bracket groups multiply (``r[1-2]n[1-2]`` -> ``r1n1, r1n2,
    r2n1, r2n2``); a range keeps its zero padding. ``ValueError`` naming a malformed list."""
    hosts: list[str] = []
    for item in _top_level_items(nodelist):
        hosts.extend(_expand_item(item, nodelist))
    if not hosts:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: no host in it; export MASTER_ADDR")
    return hosts


def _top_level_items(nodelist: str) -> list[str]:
    """``a[1,2],b`` -> ``["a[1,2]", "b"]``: the commas outside brackets separate hosts."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    items.append(nodelist[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str, nodelist: str) -> list[str]:
    """One host pattern with zero or more ``[ranges]`` groups."""
    head, bracket, rest = item.partition("[")
    if not bracket:
        if "]" in item:
            raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: unbalanced ']' in {item!r}")
        return [item]
    ranges, closed, tail = rest.partition("]")
    if not closed:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: unbalanced '[' in {item!r}")
    return [head + number + suffix for number in _numbers(ranges, nodelist)
            for suffix in _expand_item(tail, nodelist)]  # fmt: skip


def _numbers(ranges: str, nodelist: str) -> list[str]:
    """``01-03,7`` -> ``["01", "02", "03", "7"]`` (the width of a range's first number)."""
    numbers = []
    for part in ranges.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: bad range {part!r}")
        width = len(low)
        numbers.extend(f"{n:0{width}d}" for n in range(int(low), int(high or low) + 1))
    return numbers


def backend() -> str:
    """NCCL where this task sees a GPU, else gloo."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def init_group(place: Placement) -> None:
    """Join the job's process group (every task of the ``srun``)."""
    import torch
    import torch.distributed as dist

    if backend() == "nccl":
        torch.cuda.set_device(place.local_rank)
    dist.init_process_group(
        backend(),
        init_method=f"tcp://{place.master_addr}:{place.master_port}",
        rank=place.rank,
        world_size=place.world,
        timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
    )


def all_reduce_bandwidth(place: Placement) -> str:
    """All-reduce ``rank + 1`` over every task: checks the sum, reports the bus bandwidth of the
    slowest task (``2 (n - 1) / n`` bytes moved per byte reduced, NCCL's convention)."""
    import torch
    import torch.distributed as dist

    name = backend()
    device = f"cuda:{place.local_rank}" if name == "nccl" else "cpu"
    data = torch.full((ALL_REDUCE_MIB[name] << 18,), float(place.rank + 1), device=device)
    dist.all_reduce(data)  # warm-up (connections), and the value checked
    expected = place.world * (place.world + 1) / 2
    if float(data[0]) != expected:
        raise ValueError(f"all-reduce gave {float(data[0])}, expected {expected}")
    seconds = _timed_all_reduce(data, name)
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    n = place.world
    bus_gbps = 2 * (n - 1) / n * data.numel() * 4 / float(slowest[0]) / 1e9 if n > 1 else 0.0
    return (f"{n} tasks, {ALL_REDUCE_MIB[name]} MiB {name} all-reduce, bus bandwidth "
            f"{bus_gbps:.2f} GB/s (slowest task)")  # fmt: skip


def _timed_all_reduce(data, name: str) -> float:
    """Mean seconds of ``REPS`` all-reduces of ``data``."""
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if name == "nccl" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(REPS):
        dist.all_reduce(data)
    sync()
    return (time.perf_counter() - start) / REPS


@dataclass
class NodeReport:
    """One task's checks, with where it ran."""

    host: str
    node_id: int
    rank: int
    checks: list[CheckResult]

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def cross_node_reports(place: Placement, local: list[CheckResult]) -> list[NodeReport]:
    """This node's ``local`` results plus the cross-node all-reduce; rank 0 gets every node's
    report (in rank order), the others their own."""
    import torch.distributed as dist

    try:
        init_group(place)
    except Exception as e:  # noqa: BLE001 - a rendezvous fails in many ways; report it
        detail = (
            f"rendezvous at {place.master_addr}:{place.master_port} failed: {type(e).__name__}: {e}"
        )
        failed = CheckResult(CROSS_NODE, FAIL, detail[:800], CROSS_NODE_FIX)
        return [NodeReport(place.host, place.node_id, place.rank, [*local, failed])]
    try:
        check = run_check(Check(CROSS_NODE, lambda: all_reduce_bandwidth(place), CROSS_NODE_FIX))
        own = NodeReport(place.host, place.node_id, place.rank, [*local, check])
        gathered: list = [None] * place.world
        dist.all_gather_object(gathered, own)
        return gathered if place.rank == 0 else [own]
    finally:
        dist.destroy_process_group()
