"""Unit tier: host memory of named process trees (psutil) and the run directory's size, the
``mem/*`` and ``disk/*`` metrics (``observability/host_memory.py``, ``orchestration/run/host_usage.py``).

A child process allocates a known amount of memory and says so on its stdout; the reads wait
for that line, never for a clock.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_armor.observability.host_memory import node_memory, tree_pids
from megatron_armor.orchestration.run.host_usage import HostMemory, RunProcess, disk_metrics

pytestmark = pytest.mark.unit

CHILD_MB = 200
CHILD = (
    "import sys\n"
    f"block = bytearray({CHILD_MB} * 2**20)\n"
    "for i in range(0, len(block), 4096): block[i] = 1  # touch every page: resident\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.fixture
def child():
    """A child of this process holding ``CHILD_MB`` MiB resident until its stdin closes."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


def test_a_tree_holds_its_childs_memory_and_the_union_counts_each_process_once(child):
    me = os.getpid()
    assert child.pid in tree_pids(me, True) and tree_pids(me, False) == [me]
    m = node_memory({"tree": (me, True), "alone": (me, False), "child": (child.pid, False)})
    roots = m["roots"]
    assert roots["child"] >= CHILD_MB * 2**20
    assert roots["tree"] >= roots["alone"] + roots["child"]  # and any other children of ours
    assert m["run"] == roots["tree"]  # "alone" and "child" are inside "tree": counted once
    assert 0 < m["available"] <= m["total"] and m["used"] == m["total"] - m["available"]


def test_a_process_that_is_gone_is_left_out(child):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    m = node_memory({"gone": (gone.pid, True), "child": (child.pid, True)})
    assert set(m["roots"]) == {"child"} and m["run"] == m["roots"]["child"]


def test_run_memory_metrics_name_every_process_and_node(child):
    from megatron_armor.orchestration.actors.call_watch import CallWatch

    host = HostMemory([RunProcess("trainer0", "node-a", child.pid, True)], "node-a", CallWatch())
    m = host.metrics()
    assert set(m) == {"mem/driver_gb", "mem/driver_tree_gb", "mem/trainer0_gb",
                      "mem/node0_run_gb", "mem/node0_used_gb", "mem/node0_available_gb",
                      "mem/run_gb"}  # fmt: skip
    assert m["mem/trainer0_gb"] >= CHILD_MB * 2**20 / 1e9
    assert m["mem/driver_tree_gb"] >= m["mem/driver_gb"] + m["mem/trainer0_gb"]
    assert m["mem/run_gb"] == m["mem/node0_run_gb"] == m["mem/driver_tree_gb"]


def test_disk_metrics_size_the_run_dir_and_its_newest_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b"x" * 1000)
    for step, size in ((2, 3000), (4, 5000)):
        ckpt = tmp_path / "checkpoints" / f"step_{step:06d}" / "trainer"
        ckpt.mkdir(parents=True)
        (ckpt / "model.bin").write_bytes(b"y" * size)
    m = disk_metrics(tmp_path)
    assert m["disk/run_dir_gb"] == pytest.approx(9000 / 1e9)
    assert m["disk/checkpoint_gb"] == pytest.approx(5000 / 1e9)
    assert m["disk/free_gb"] > 0
