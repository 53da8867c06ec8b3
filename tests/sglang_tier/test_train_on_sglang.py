"""The tiny ARMOR run end to end on real SGLang servers on CPU (sglang tier).

``armor train`` of the tiny config (4 steps, resets and checkpoints every 2: ``e2e_runs.Run``)
with ``rollout.backend: sglang`` on ``orchestration.layout: cpu``: the rollout worker launches
the servers with the project's launch command, the trainer rank pushes every weight update.

1. Dedicated reference pool, anchor cache, ``distributed`` (gloo here, NCCL on GPUs): the
   policy server is stopped (SIGSTOP: alive, never answering, a wedged server) once it
   prefills step 2's rollout; past the generate call's deadline the run finds it does not
   answer ``/health_generate``, names it, kills it, restarts it with the current weights and
   draws step 2's rollout again (``recoveries.jsonl``: reason ``stuck``); the run is killed -9
   once step 2's checkpoint is complete and resumed with ``--resume auto``. The run lowers
   ``orchestration.call_deadline_floor_s`` to 15 s (default 30 s) to keep the tier short.
2. ``swap``, fresh anchors, ``tensor`` (inline CPU payloads): the reference is loaded into the
   policy server around each reference call and the policy put back.

What resume reproduces here and what it does not: the CPU server cannot sample by seed
(``sampling_seed`` needs ``--enable-deterministic-inference``, which SGLang 0.5.23 refuses with
its torch-native attention, the only one on CPU), so two runs of the same config draw different
samples and their metrics differ. Exact: the steps before the kill stay as written, every step
is logged once, the resumed servers serve exactly the checkpointed weights (engine and trainer
log-probs agree to 1e-3 at every step, before and after the kill) and the reference the run had
(the reset of step 2 survives), and the reset schedule goes on (step 4 resets).
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from e2e_runs import Run
from process_group import server_pids
from sglang_servers import free_ports

from megatron_armor.observability.metrics import read_metrics
from megatron_armor.orchestration.run.checkpoints import list_checkpoints
from megatron_armor.orchestration.step.step_metrics import read_anchor_file

pytestmark = pytest.mark.sglang
RUN_S = 1500  # start-up of Ray, the trainer and two servers takes minutes on 2 busy cores


def sglang_overrides(transport: str, strategy: str, ports: list[int], *extra: str) -> list[str]:
    return ["rollout.backend=sglang", f"rollout.sglang.weight_transport={transport}",
            "rollout.sglang.router=false", "rollout.sglang.startup_timeout_s=600",
            f"rollout.ref_strategy={strategy}", f"rollout.sglang.base_port={ports[0]}",
            f"rollout.sglang.ref_pool.base_port={ports[1]}", *extra]  # fmt: skip


def rollout_prefilled(log: Path, after: int) -> bool:
    """Whether the server log ``log`` holds, past byte ``after``, a prefill of prompts (a
    health check prefills one token of one sequence)."""
    if not log.is_file():
        return False
    with log.open("rb") as f:
        f.seek(after)
        text = f.read().decode(errors="replace")
    health = re.compile(r"Prefill batch, #new-seq: 1, #new-token: 1,")
    return any("Prefill batch" in x and not health.search(x) for x in text.splitlines())


def kill_servers(port: int) -> list[int]:
    """``kill -9`` of the server on ``port`` and its children (its process group)."""
    leaders = server_pids(port)
    for pid in leaders:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return leaders


def anchor_versions(run_dir: Path, step: int) -> set[int]:
    return {x["anchor_version"] for x in read_anchor_file(run_dir, step) if "anchor_version" in x}


def policy_versions(run_dir: Path, step: int) -> set[int]:
    kept = [x for x in read_anchor_file(run_dir, step) if x.get("kept")]
    assert kept, step
    return {v for x in kept for v in x["policy_versions"]}


def assert_servers_hold_the_trainers_weights(records: dict, steps) -> None:
    for s in steps:  # the engines' log-probs are the trainer's: every push (re)arrived
        assert records[s]["rollout/policy_logprob_absdiff_max"] < 1e-3, s
        assert records[s]["rollout/anchor_logprob_absdiff_max"] < 1e-3, s


@pytest.mark.timeout(2 * RUN_S)
def test_dedicated_pool_restarts_a_stuck_server_and_resumes_after_kill_9(tiny_dir, tmp_path):
    ports = free_ports(2)
    overrides = sglang_overrides("distributed", "dedicated", ports, "algo.anchor_source=cache",
                                 "orchestration.call_deadline_floor_s=15")  # fmt: skip
    run = Run(tmp_path, "sglang_dedicated", tiny_dir, *overrides)
    log = run.run_dir / "sglang_0.log"
    try:
        run.wait_for(lambda: 1 in run.steps_logged(), RUN_S)
        after = log.stat().st_size
        run.wait_for(lambda: rollout_prefilled(log, after), RUN_S)  # step 2's rollout
        stopped = server_pids(ports[0])
        for pid in stopped:  # the server's HTTP process: alive, never answering
            os.kill(pid, signal.SIGSTOP)
        named = f"at http://127.0.0.1:{ports[0]} (pid {min(stopped)}, RolloutWorker 0"
        run.wait_for(lambda: named in run.text(), 120)  # found past the generate deadline
        run.wait_for(lambda: [s for s, _ in list_checkpoints(run.run_dir)] == [2], RUN_S)
        run.kill_group()
    finally:
        run.cleanup()
        for port in ports:  # a killed job's servers die with it (its cgroup on a cluster)
            kill_servers(port)
    # step 2's line is in its checkpoint; the kill may come before it reaches metrics.jsonl
    before = {r["step"]: r for r in read_metrics(run.run_dir)}
    assert set(before) in ({0, 1}, {0, 1, 2}), sorted(before)
    resumed = Run(tmp_path, "sglang_dedicated", tiny_dir, *overrides)
    code = resumed.wait(RUN_S)
    left = [pid for port in ports for pid in kill_servers(port)]
    assert code == 0, resumed.output()
    assert not left, "the run left its SGLang servers running"
    assert "resumed from" in resumed.text()
    records = {r["step"]: r for r in read_metrics(run.run_dir)}
    assert sorted(records) == [0, 1, 2, 3, 4]
    for s in before:  # the steps before the kill as they were written (or written back)
        assert records[s] == before[s], s
    # stopped in step 2's rollout: killed, restarted with the weights of step 1, drawn again
    restarts = [records[s]["rollout/servers_restarted"] for s in (1, 2, 3, 4)]
    assert restarts == [0.0, 1.0, 0.0, 0.0], restarts
    assert records[2]["faults/stuck_sglang_server"] == 1.0
    rows = [json.loads(x) for x in (run.run_dir / "recoveries.jsonl").read_text().splitlines()]
    assert [(r["step"], r["phase"], r["reason"]) for r in rows] == [(2, "rollout", "stuck")]
    assert rows[0]["actor"] == f"SGLang server http://127.0.0.1:{ports[0]}", rows
    assert_servers_hold_the_trainers_weights(records, (1, 2, 3, 4))
    assert [records[s]["reset/performed"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 1.0]
    assert {s: anchor_versions(run.run_dir, s) for s in (1, 2, 3, 4)} == {
        1: {0}, 2: {0}, 3: {2}, 4: {2}}  # fmt: skip
    for s in (1, 2, 3, 4):  # the samples come from the previous step's weights, also resumed
        assert policy_versions(run.run_dir, s) == {s - 1}, s
    assert records[3]["anchor/cache_misses"] > 0  # the cache, emptied by the reset, refills
    # step 3 (resumed) scores with the policy of step 2 and the reference reset to it
    assert records[3]["kl/exact_reverse"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.timeout(RUN_S)
def test_swap_loads_the_reference_into_the_policy_server_around_each_call(tiny_dir, tmp_path):
    ports = free_ports(2)
    overrides = sglang_overrides("tensor", "swap", ports, "run.steps=3", "validation.every=3")
    run = Run(tmp_path, "sglang_swap", tiny_dir, *overrides)
    code = run.wait(RUN_S)
    left = [pid for port in ports for pid in kill_servers(port)]
    assert code == 0, run.output()
    assert not left, "the run left its SGLang servers running"
    records = {r["step"]: r for r in read_metrics(run.run_dir)}
    assert sorted(records) == [0, 1, 2, 3]
    assert_servers_hold_the_trainers_weights(records, (1, 2, 3))
    assert {s: anchor_versions(run.run_dir, s) for s in (1, 2, 3)} == {1: {0}, 2: {0}, 3: {2}}
    for s in (1, 2, 3):
        assert policy_versions(run.run_dir, s) == {s - 1}, s
    # step 2 swaps (reference in, policy back) around each reference call, then pushes; steps
    # 1 and 3 draw the reference while it is the policy (start weights; the reset of step 2)
    assert records[2]["perf/weight_sync_tensor_pushes"] >= 3.0
    assert records[3]["perf/weight_sync_tensor_pushes"] == 1.0
    assert any(k.startswith("val/val/avg@") for k in records[3])  # validation through SGLang
    assert sorted(p.name for p in run.run_dir.glob("sglang*.log")) == ["sglang_0.log"]
