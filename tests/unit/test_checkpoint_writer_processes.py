"""megatron-core's checkpoint writer leaves no process behind (``trainer/checkpoint.py:
tie_writer_processes``): a real ``dist_checkpointing.save`` on one gloo rank, in a process of
its own (the fork hook it installs stays in the process that calls it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SAVE_AND_LOOK = textwrap.dedent(
    """
    import ctypes, json, multiprocessing, os, sys, torch, torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron_armor.trainer.checkpoint import tie_writer_processes
    from megatron_armor.trainer.cpu_compat import enable_cpu_mode

    enable_cpu_mode()  # on a host without CUDA, as the trainer does

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/store",
                            rank=0, world_size=1)
    tie_writer_processes()
    os.makedirs(sys.argv[1] + "/dist")
    weights = torch.arange(12.0).reshape(3, 4)
    state = {"w": ShardedTensor.from_rank_offsets("w", weights.clone())}
    dist_checkpointing.save(state, sys.argv[1] + "/dist")
    children = [p for p in os.listdir("/proc") if p.isdigit() and
                open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid())]
    empty = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}
    loaded = dist_checkpointing.load(empty, sys.argv[1] + "/dist")["w"]

    def pdeathsig(out):
        value = ctypes.c_int()
        ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
        out.put(value.value)

    fork = multiprocessing.get_context("fork")
    out = fork.SimpleQueue()
    child = fork.Process(target=pdeathsig, args=(out,))
    child.start()
    child.join()
    print(json.dumps({"children": children, "equal": bool(torch.equal(loaded, weights)),
                      "child_pdeathsig": out.get()}))
    """
)


def test_a_save_starts_no_lasting_process_and_its_forks_die_with_the_trainer(tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", SAVE_AND_LOOK, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # no spawn Manager, no resource tracker; the writer's forks joined; the same tensor back
    assert seen == {"children": [], "equal": True, "child_pdeathsig": 9}, seen
