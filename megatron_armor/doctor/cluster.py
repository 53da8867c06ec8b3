"""``armor doctor --all-nodes``: every node's checks plus a cross-node all-reduce, under ``srun``.

Run one task per node (``srun --ntasks-per-node=1 armor doctor --all-nodes CONFIG``); each
task runs this node's checks, then all tasks meet in one process group (NCCL on GPUs, gloo on
CPU) and time an all-reduce across the nodes: the path a multi-node job's gradients and
weight broadcasts take, and the usual failure of an InfiniBand cluster (a wrong
``NCCL_SOCKET_IFNAME``, a missing HCA, a firewall). Rank 0 gathers every node's results and
prints them; the exit code is 1 when any node failed.

The results travel over the rendezvous's TCP key-value store (:class:`ReportBoard`), not over
the process group whose all-reduce is under test: a broken group (a rank that fails its
collective, one that never joins it) costs at most the all-reduce's own deadline
(``--all-reduce-timeout-s``), after which rank 0 prints every node's table with what each
posted. Each task posts its node checks before the all-reduce, so a task that dies in it still
shows them.

Rank and world come from Slurm's task environment (``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_NODEID``, ``SLURM_LOCALID``); the rendezvous address is ``MASTER_ADDR`` or the first
host of ``SLURM_JOB_NODELIST`` (expanded here: the container has no Slurm client), its port
``MASTER_PORT`` or one derived from ``SLURM_JOB_ID``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

from megatron_armor.doctor.report import FAIL, Check, CheckResult, run_check

RENDEZVOUS_TIMEOUT_S = 900
"""Seconds a task waits for the others (their node checks may take minutes: SGLang, TE)."""
ALL_REDUCE_TIMEOUT_S = 120.0
"""Default seconds for joining the process group and the timed all-reduces (the nodes are all
there by then: their checks are posted); past it the check fails and the reports go on."""
REPORT_MARGIN_S = 30.0
"""Seconds rank 0 waits beyond the all-reduce's deadline for the others' final reports."""
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


def open_store(place: Placement):
    """The job's TCP key-value store, served by rank 0 at ``MASTER_ADDR:MASTER_PORT`` (the
    rendezvous of the process group and the board of the reports)."""
    import torch.distributed as dist

    return dist.TCPStore(
        place.master_addr, place.master_port, place.world, place.rank == 0,
        timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S), wait_for_workers=False,
    )  # fmt: skip


def init_group(place: Placement, store, timeout_s: float) -> None:
    """Join the job's process group (every task of the ``srun``) through ``store``; joining
    and each collective are bounded by ``timeout_s``."""
    import torch
    import torch.distributed as dist

    if backend() == "nccl":
        torch.cuda.set_device(place.local_rank)
    dist.init_process_group(
        backend(),
        store=dist.PrefixStore("group", store),
        rank=place.rank,
        world_size=place.world,
        timeout=timedelta(seconds=timeout_s),
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

    @classmethod
    def from_dict(cls, body: dict) -> NodeReport:
        checks = [CheckResult(**c) for c in body["checks"]]
        return cls(body["host"], body["node_id"], body["rank"], checks)


class ReportBoard:
    """The tasks' reports on the job's TCP store, apart from the process group: each task posts
    its node checks (``local``) and then its full report (``final``); rank 0 reads them."""

    def __init__(self, store, world: int) -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore("armor-doctor", store)
        self.world = world

    def post(self, stage: str, report: NodeReport) -> None:
        self.store.set(f"{stage}/{report.rank}", json.dumps(report.to_dict()))

    def wait_all(self, stage: str, timeout_s: float) -> list[int]:
        """Wait up to ``timeout_s`` for every task's ``stage`` report; the ranks that posted."""
        deadline = time.monotonic() + timeout_s
        for rank in range(self.world):
            left = max(deadline - time.monotonic(), 0.001)
            try:
                self.store.wait([f"{stage}/{rank}"], timedelta(seconds=left))
            except Exception:  # noqa: BLE001 - the store's timeout: that task is late
                continue
        return [r for r in range(self.world) if self.store.check([f"{stage}/{r}"])]

    def read(self, stage: str, rank: int) -> NodeReport | None:
        if not self.store.check([f"{stage}/{rank}"]):
            return None
        return NodeReport.from_dict(json.loads(self.store.get(f"{stage}/{rank}")))

    def gather(self, timeout_s: float) -> list[NodeReport]:
        """Every task's final report, in rank order, waiting up to ``timeout_s`` for them; a
        task without one shows its node checks and why the cross-node row is missing."""
        self.wait_all("final", timeout_s)
        out = []
        for rank in range(self.world):
            final = self.read("final", rank)
            if final is not None:
                out.append(final)
                continue
            local = self.read("local", rank)
            why = f"rank {rank} posted no result within {timeout_s:.0f} s of the all-reduce"
            missing = CheckResult(CROSS_NODE, FAIL, why, CROSS_NODE_FIX)
            if local is None:
                local = NodeReport("?", rank, rank, [])
                missing.detail = f"rank {rank} posted no report: its node checks never finished"
            out.append(NodeReport(local.host, local.node_id, rank, [*local.checks, missing]))
        return out


def cross_node_reports(
    place: Placement, local: list[CheckResult], timeout_s: float = ALL_REDUCE_TIMEOUT_S
) -> list[NodeReport]:
    """This node's ``local`` results plus the cross-node all-reduce (bounded by
    ``timeout_s``); rank 0 gets every node's report (in rank order, over the store: a failed
    collective loses none), the others their own."""
    try:
        store = open_store(place)
    except Exception as e:  # noqa: BLE001 - a rendezvous fails in many ways; report it
        detail = (
            f"rendezvous at {place.master_addr}:{place.master_port} failed: {type(e).__name__}: {e}"
        )
        failed = CheckResult(CROSS_NODE, FAIL, detail[:800], CROSS_NODE_FIX)
        return [NodeReport(place.host, place.node_id, place.rank, [*local, failed])]
    board = ReportBoard(store, place.world)
    board.post("local", NodeReport(place.host, place.node_id, place.rank, local))
    board.wait_all("local", RENDEZVOUS_TIMEOUT_S)  # every node's checks are done
    check = run_check(
        Check(CROSS_NODE, lambda: bounded_all_reduce(place, store, timeout_s), CROSS_NODE_FIX)
    )
    own = NodeReport(place.host, place.node_id, place.rank, [*local, check])
    try:
        board.post("final", own)
    except Exception as e:  # noqa: BLE001 - rank 0 (the store) is gone: print our own
        print(f"armor doctor: could not post this node's report to rank 0: {e}", flush=True)
        return [own]
    if place.rank != 0:
        return [own]
    return board.gather(timeout_s + REPORT_MARGIN_S)


def bounded_all_reduce(place: Placement, store, timeout_s: float) -> str:
    """:func:`all_reduce_bandwidth` in the job's process group, joined through ``store``; it
    raises when joining or the all-reduce takes over ``timeout_s`` (gloo's own timeout; a
    thread's deadline for a collective that hangs inside NCCL)."""
    import threading

    import torch.distributed as dist

    result: dict = {}

    def run() -> None:
        try:
            init_group(place, store, timeout_s)
            result["detail"] = all_reduce_bandwidth(place)
            dist.destroy_process_group()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = err

    worker = threading.Thread(target=run, name="armor-doctor-all-reduce", daemon=True)
    worker.start()
    worker.join(timeout_s + REPORT_MARGIN_S)
    if worker.is_alive():
        raise TimeoutError(f"the cross-node all-reduce did not finish within {timeout_s:.0f} s")
    if "error" in result:
        raise result["error"]
    return result["detail"]
