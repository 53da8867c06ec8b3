"""e2e tier: the tiny CPU config through Ray — real Megatron actor, embedded engine, rewards.

Each run is ``armor train configs/tiny_cpu.yaml`` in a subprocess shortened to 4 steps with
resets and checkpoints every 2 steps (``e2e_runs.Run``); the uninterrupted reference run and
the tiny model and data (built once with ``armor tiny``, or reused from ``$ARMOR_TINY_DIR`` /
``artifacts/tiny``) are fixtures of ``conftest.py``, shared with ``test_signals_e2e.py``.

What is checked: a run end to end (metrics, anchors, checkpoints, plots, summary), every
second of each step in one phase (``armor report``: ``test_throughput_run_e2e.py``) (signals,
``kill -9``, damaged checkpoints, one writer per run dir, loopback ports and exact resume:
``test_signals_e2e.py``); ARMOR's group composition of docs/algorithm.md, anchor rollout
(``anchor: none | filter_only``: on the runs of ``test_compare_e2e.py``); a reset makes the
anchors come from the new reference (the cache is invalidated); TP=2 (distributed optimizer)
reproduces one rank, and its checkpoint resumes on one rank after a ``kill -9``; the SGLang
backend through a stand-in server module.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from megatron_armor.observability.metrics import read_metrics, without_wall_clock
from megatron_armor.orchestration.step.step_metrics import read_anchor_file
from megatron_armor.planner.step_phases import STEP_PHASES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_runs import CACHED, Run  # noqa: E402
from process_group import free_ports, server_pids  # noqa: E402

pytestmark = pytest.mark.e2e


def anchor_lines(run_dir: Path, step: int) -> list[dict]:
    return read_anchor_file(run_dir, step)


@pytest.mark.timeout(900)
def test_short_run_end_to_end(reference_run):
    records = read_metrics(reference_run)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert any(k.startswith("val/val/avg@") for k in records[0])
    for r in records[1:]:
        for key in ("reward/policy_mean", "anchor/acceptance_rate", "loss/pg", "kl/reverse_k3",
                    "kl/forward_k1", "algo/alpha", "timing/rollout_s", "timing/train_s"):  # fmt: skip
            assert r.get(key) is not None, (r["step"], key)
        assert r["algo/alpha"] == pytest.approx(3 / 4) and r["anchor/kept"] == 4
    assert [r["step"] for r in records if r.get("reset/performed")] == [2, 4]
    assert records[1]["anchor/cache_misses"] > 0 and records[3]["anchor/cache_size"] > 0
    ckpts = sorted(p.name for p in (reference_run / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000004"]
    for png in ("reward_vs_val.png", "kl.png", "acceptance.png", "clip.png"):
        assert (reference_run / "plots" / png).stat().st_size > 1000
    assert "run summary" in (reference_run / "summary.txt").read_text()
    assert (reference_run / "config.yaml").is_file() and list((reference_run / "tb").iterdir())
    # ARMOR's groups: G - 1 on-policy samples, ref_n reference samples, one anchor inserted
    # (anchor: none and filter_only compose theirs in test_compare_e2e.py's runs)
    armor = [x for x in anchor_lines(reference_run, 1) if x.get("kept")]
    assert len(armor) == 4
    assert all(x["policy_n"] == 3 and x["ref_n"] == 2 and x["anchor_len"] > 0 for x in armor)


@pytest.mark.timeout(900)
def test_phases_sum_to_each_step(reference_run):
    steps = [r for r in read_metrics(reference_run) if r["step"] >= 1]
    for r in steps:  # every second of the step in one phase (docs/metrics.md, phase/*)
        total = sum(r[p.metric] for p in STEP_PHASES)
        assert abs(total - r["timing/step_s"]) <= 0.02 * r["timing/step_s"], r["step"]
        for key in ("phase/rollout_policy_s", "phase/rollout_reference_s", "phase/train_s"):
            assert r[key] > 0, (r["step"], key)
        tokens = r["train/prompt_tokens"] + r["train/response_tokens"]  # one CPU trainer rank
        assert r["perf/e2e_tokens_per_s_per_gpu"] == pytest.approx(tokens / r["timing/step_s"])
    assert [r["step"] for r in steps if r["phase/checkpoint_s"] > 0] == [2, 4]
    assert [r["step"] for r in steps if r["phase/validate_s"] > 0] == [2, 4]


@pytest.mark.timeout(900)
def test_reset_switches_anchor_source_to_new_reference(reference_run):
    records = {r["step"]: r for r in read_metrics(reference_run)}
    versions = {s: {x["anchor_version"] for x in anchor_lines(reference_run, s) if "anchor_version" in x}
                for s in (1, 2, 3, 4)}  # fmt: skip
    assert versions == {1: {0}, 2: {0}, 3: {2}, 4: {2}}
    # before the reset the reference lags the policy; right after it the reference IS the policy
    assert records[2]["kl/reverse_k1"] != 0.0
    assert records[3]["kl/reverse_k1"] == pytest.approx(0.0, abs=1e-6)
    # the exact vocabulary-wide KLs (tiny config: every step) agree: 0 at steps 1 and 3, > 0 at 2
    for step in (1, 3):
        for key in ("kl/exact_reverse", "kl/exact_forward", "kl/exact_reverse_max"):
            assert records[step][key] == pytest.approx(0.0, abs=1e-6), (step, key)
    assert records[2]["kl/exact_reverse"] > 0 and records[2]["kl/exact_forward"] > 0
    assert records[2]["kl/exact_positions"] > 4  # 4 samples x up to 32 response positions
    # the engine's anchor log-probs match the trainer's *current* reference (new after reset)
    for s in (1, 2, 3, 4):
        assert records[s]["rollout/anchor_logprob_absdiff_max"] < 1e-3, s
        assert records[s]["rollout/policy_logprob_absdiff_max"] < 1e-3, s


RELAYOUT_TOL = {"rel": 1e-4, "abs": 1e-5}
"""Two trainer layouts of one run add in another order (TP's all-reduces): the losses and
gradient norms differ in their last bits, the tiny differences in the weights move the
engines' log-probs by about 1e-6; the samples and rewards stay the same."""


def assert_same_run(got: dict, want: dict, step: int) -> None:
    """The metrics of ``step`` of a run at another layout: the same keys, the same samples,
    each value within :data:`RELAYOUT_TOL`."""
    got, want = without_wall_clock(got), without_wall_clock(want)
    assert sorted(got) == sorted(want), step
    assert got["reward/policy_mean"] == want["reward/policy_mean"], step
    for key, value in want.items():
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, **RELAYOUT_TOL), (step, key)
        else:
            assert got[key] == value, (step, key)


@pytest.mark.timeout(900)
def test_tensor_parallel_run_killed_and_resumed_on_one_rank(reference_run, tiny_dir, out_dir):
    """Two Megatron ranks (TP=2, the distributed optimizer) as two Ray actors, the train state
    offloaded after the sync and around the checkpoint: the same samples and, within the
    reduction-order tolerance, the same numbers as one rank. Killed with ``kill -9`` once step
    2's checkpoint is on disk, resumed with ``--resume auto`` on one rank (tp 2 -> 1): the run
    says so, records ``layout: {from, to}`` in ``resumes.jsonl`` and finishes; steps 3 and 4
    stay within the tolerance of the uninterrupted single-rank run's (the difference is the
    reduction order only: its checkpoint holds the two-rank run's weights and Adam state)."""
    name, distopt = "relayout", "trainer.use_distributed_optimizer=true"
    run_dir = out_dir / name
    first = Run(out_dir, name, tiny_dir, *CACHED, distopt, "trainer.world_size=2", "trainer.tp=2",
                "trainer.offload_train_state=true")  # fmt: skip
    first.wait_for(lambda: 2 in first.steps_logged())  # after step 2's checkpoint
    first.kill_group(nothing_left=True)
    second = Run(out_dir, name, tiny_dir, *CACHED, distopt)
    assert second.wait() == 0, second.output()
    said = "resume: step_000002 was saved at tp=2 pp=1 ep=1 etp=2 dp=1; resharded on load to " \
           "tp=1 pp=1 ep=1 etp=1 dp=1"  # fmt: skip
    assert said in second.text()
    record = json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[-1])
    assert record["layout"]["from"]["tp"] == 2 and record["layout"]["to"]["tp"] == 1
    assert record["changed"]["trainer.tp"] == [2, 1]
    got, expected = read_metrics(run_dir), read_metrics(reference_run)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert_same_run(got[step], expected[step], step)
        assert got[step]["rollout/policy_logprob_absdiff_max"] < 1e-3, step


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("transport", "strategy"), [("distributed", "dedicated")])
def test_sglang_backend_with_a_reference_pool_and_a_wedged_server(
    transport, strategy, tiny_dir, out_dir, tmp_path
):
    """A *wedged* server (alive, answering 503 on /health_generate), the one fault the real
    server cannot be made to show on cue; the real SGLang server runs the rest (launch, pools,
    every transport, swap, a killed server, kill -9 and resume) in the sglang tier
    (``tests/sglang_tier/test_train_on_sglang.py``). The rollout worker launches the servers as the
    backend does, with ``rollout.sglang.server_module`` pointing at a stand-in that runs the
    embedded engine behind SGLang's HTTP API (``sglang_standin.py``): a policy server and a
    dedicated reference pool, weights streamed by the trainer rank (gloo here, NCCL on GPUs)
    inside the servers' update sessions, the reference pushed at start-up and at the reset.
    Each server wedges once its weights reach version 1: the health check before the next step
    restarts it and re-syncs it under a new weight-sync group before it serves."""
    marks = tmp_path / "marks"
    marks.mkdir()
    ports = free_ports(2)
    env = {
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
        "ARMOR_STANDIN_WEDGE_AT_VERSION": "1",
        "ARMOR_STANDIN_MARK_DIR": str(marks),
    }
    sglang = ["rollout.backend=sglang", "rollout.sglang.server_module=sglang_standin",
              f"rollout.sglang.weight_transport={transport}", "rollout.sglang.router=false",
              "rollout.sglang.startup_timeout_s=180", f"rollout.ref_strategy={strategy}",
              f"rollout.sglang.base_port={ports[0]}",
              f"rollout.sglang.ref_pool.base_port={ports[1]}"]  # fmt: skip
    run = Run(out_dir, f"sglang_{transport}_{strategy}", tiny_dir, *sglang, "run.steps=3",
              "validation.every=3", env=env)  # fmt: skip
    code = run.wait()
    left = [pid for port in ports for pid in server_pids(port)]
    for pid in left:  # this run's servers only
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert code == 0, run.output()
    assert not left, "the run left its SGLang servers running"
    records = {r["step"]: r for r in read_metrics(run.run_dir)}
    # policy server wedged by step 1's sync, reference server by step 2's reset: one restart each
    pools = ["policy", "ref"] if strategy == "dedicated" else ["policy"]  # swap: one server
    restarts = [records[s]["rollout/servers_restarted"] for s in (1, 2, 3)]
    assert restarts == ([0.0, 1.0, 1.0] if strategy == "dedicated" else [0.0, 1.0, 0.0])
    assert len(list(marks.iterdir())) == len(pools)  # each server wedged once
    for s in (1, 2, 3):  # the engines' log-probs are the trainer's: weights synced and re-synced
        assert records[s]["rollout/policy_logprob_absdiff_max"] < 1e-3, s
        assert records[s]["rollout/anchor_logprob_absdiff_max"] < 1e-3, s
    versions = {s: {x["anchor_version"] for x in anchor_lines(run.run_dir, s) if "anchor_version" in x}
                for s in (1, 2, 3)}  # fmt: skip
    assert versions == {1: {0}, 2: {0}, 3: {2}}  # the reference pool follows the reset
    for s in (1, 2, 3):  # on-policy samples come from the weights of the previous step, also
        kept = [x for x in anchor_lines(run.run_dir, s) if x.get("kept")]  # after a restart
        assert kept and all(x["policy_versions"] == [s - 1] for x in kept), s
    assert records[3]["kl/exact_reverse"] == pytest.approx(0.0, abs=1e-6)
    assert any(k.startswith("val/val/avg@") for k in records[3])  # validation through SGLang
    logs = sorted(p.name for p in run.run_dir.glob("sglang*.log"))
    assert logs == ["sglang_0.log", "sglang_ref_0.log"][: len(pools)]
    weights = run.run_dir / "sglang_weights"
    if transport == "disk":  # written by the trainer rank; one pushed version left per pool
        assert [len(list(d.iterdir())) for d in sorted(weights.iterdir())] == [1] * len(pools)
    else:  # streamed by the trainer rank: nothing written
        assert not weights.exists() or not any(weights.rglob("*.safetensors"))


@pytest.mark.timeout(900)
def test_prefetched_reference_calls_draw_what_the_next_step_would(tiny_dir, out_dir):
    """Fresh anchors, reference first: a step's first reference call is sent while the
    trainer works on the step before and waited for a step later (real Ray actors and object
    refs), except right after a reset (steps 1 and 3 here: resets every 2 steps); the run logs
    the same values as with ``rollout.prefetch_reference=false``."""
    common = ("rollout.reference_first=true", "validation.every=0", "run.ckpt_every=0")
    records = {}
    for prefetch in ("true", "false"):
        run = Run(out_dir, f"prefetch_{prefetch}", tiny_dir, *common,
                  f"rollout.prefetch_reference={prefetch}")  # fmt: skip
        assert run.wait() == 0, run.output()
        records[prefetch] = [r for r in read_metrics(run.run_dir) if r["step"] >= 1]
    on, off = records["true"], records["false"]
    assert [r["anchor/reference_first"] for r in on] == [1.0] * 4
    assert [r["perf/reference_prefetched"] for r in on] == [0.0, 1.0, 0.0, 1.0]
    assert [r["perf/reference_prefetched"] for r in off] == [0.0] * 4
    assert [without_wall_clock(r) for r in on] == [without_wall_clock(r) for r in off]
