"""Unit tier: checkpoint directories, run state, signals, layouts, mini-batch split, config files."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_armor.algo.losses import needs_reference_logprobs
from megatron_armor.config import load_config
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.config.sglang_pools import pool_problems
from megatron_armor.config.validate import (
    find_problems,
    groups_per_update,
    short_batch_floor,
    updates_per_step,
)
from megatron_armor.observability.metrics import MetricsLogger, metrics_record, read_metrics
from megatron_armor.orchestration.actors import placement
from megatron_armor.orchestration.actors.placement import (
    actor_options,
    plan_layout,
    rollout_hosts,
    trainer_runtime_env,
)
from megatron_armor.orchestration.actors.rollout_worker import reference_plan
from megatron_armor.orchestration.actors.workers import shard
from megatron_armor.orchestration.run import checkpoints
from megatron_armor.orchestration.run.run_state import EXIT_REQUEUE, RunState, StopSignal
from megatron_armor.orchestration.run.session import Session
from megatron_armor.orchestration.step.phases import minibatch_sample_ids
from megatron_armor.orchestration.step.step_metrics import reduce_update_metrics
from megatron_armor.types import Group, Sample

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
# configs/compare/ holds `armor compare` specs (tested with them), not run configs.
CONFIGS = sorted(
    p
    for p in (Path(__file__).resolve().parents[2] / "configs").rglob("*.yaml")
    if p.parent.name != "compare"
)


def _save(run_dir, step, keep=2):
    tmp = checkpoints.begin_checkpoint(run_dir, step)
    (tmp / "payload").write_text(str(step))
    return checkpoints.commit_checkpoint(run_dir, tmp, step, keep)


def test_checkpoints_rotate_and_ignore_partial_saves(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    assert [s for s, _ in checkpoints.list_checkpoints(tmp_path)] == [2, 3]
    checkpoints.begin_checkpoint(tmp_path, 4)  # a save killed before its rename
    assert checkpoints.latest_checkpoint(tmp_path).name == "step_000003"
    assert checkpoints.resolve_resume(tmp_path, "auto", _accept).name == "step_000003"
    assert checkpoints.resolve_resume(tmp_path, "none", _accept) is None
    final = _save(tmp_path, 4)  # the stale temp dir is replaced
    assert (final / "payload").read_text() == "4"
    with pytest.raises(checkpoints.CheckpointError, match="--resume auto"):
        checkpoints.resolve_resume(tmp_path, str(tmp_path / "nowhere"), _accept)


def _accept(path):
    return path


def test_run_state_roundtrip_restores_rng(tmp_path):
    state = RunState(step=7, policy_version=7, ref_version=4, sampler={"epoch": 1},
                     reset={"resets": [4]}, rollout=[{"ref_version": 4}])  # fmt: skip
    random.seed(3)
    torch.manual_seed(3)
    state.capture_rng()
    expected = (random.random(), torch.rand(2))
    state.save(tmp_path)
    loaded = RunState.load(tmp_path)
    loaded.restore_rng()
    assert (loaded.step, loaded.ref_version, loaded.rollout) == (7, 4, [{"ref_version": 4}])
    assert random.random() == expected[0] and torch.equal(torch.rand(2), expected[1])


def test_a_checkpoint_carries_its_step_line_and_a_resume_writes_it_back_once(tmp_path):
    """A kill after the checkpoint of step 2 is committed and before its metrics line is
    appended: the resume writes the line from the checkpoint (safe loader), and only then."""
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"reward/acc": 0.25})
    line = metrics_record(2, {"reward/acc": np.float32(0.5), "loss/ratio_max": float("inf")})
    RunState(step=2, metrics_line=line).save(tmp_path)
    state = RunState.load(tmp_path)
    session = SimpleNamespace(run_dir=tmp_path, logger=logger)
    Session.restore_metrics_line(session, state)
    assert read_metrics(tmp_path) == [read_metrics(tmp_path)[0], line]
    assert line["reward/acc"] == 0.5 and line["loss/ratio_max"] == float("inf")  # kept, not null
    Session.restore_metrics_line(session, state)  # the line is there now: nothing appended
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    Session.restore_metrics_line(session, RunState(step=3))  # a checkpoint without a line
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_stop_signal_flags_sigterm_and_sigusr1():
    stop = StopSignal().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1 and stop.name == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.name == "SIGTERM"
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is not stop._handle
    assert EXIT_REQUEUE == 75


def test_stop_signal_handles_sigint_and_keeps_its_handler_through_start_up_code():
    other = signal.getsignal(signal.SIGUSR2)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when started in the background by a shell
    with StopSignal() as stop:
        with stop.guarded():  # start-up code: ray.init installs a SIGTERM handler that exits
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(signal.SIGTERM))
            assert signal.getsignal(signal.SIGTERM) == stop._handle
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # other signals are left to it
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.name == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: no KeyboardInterrupt
        assert stop.name == "SIGINT"
    signal.signal(signal.SIGUSR2, other)
    assert signal.getsignal(signal.SIGINT) is before  # put back as it was


HELD_THROUGH_NATIVE_HANDLER = """
import ctypes, os, signal
from megatron_armor.orchestration.actors.ray_node import held_stop_signals

held = held_stop_signals()  # armor train's first line (the CLI holds it with `with`)
held.__enter__()
os.kill(os.getpid(), signal.SIGINT)  # while it imports (torch starts threads)
from megatron_armor.orchestration.run.run_state import StopSignal
with StopSignal() as stop:
    with stop.guarded():
        assert stop.received is None, "held until start-up ends"
    print("imports:", stop.name, flush=True)
    with stop.guarded():  # start-up code: a native library puts the default action back
        ctypes.CDLL(None).signal(signal.SIGTERM, 0)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.name == "SIGINT", "the signal waits for the body to end"
    print("start-up:", stop.name, flush=True)
    os.kill(os.getpid(), signal.SIGUSR1)
    print("after:", stop.name, flush=True)
"""


def test_stop_signals_during_imports_and_under_a_native_handler_wait_for_the_run_handler():
    """A signal before the run's handler exists, or while start-up code has a handler of its
    own below Python (absl's in Ray's core worker), neither kills the process nor is lost."""
    out = subprocess.run([sys.executable, "-c", HELD_THROUGH_NATIVE_HANDLER], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = ["imports: SIGINT", "start-up: SIGTERM", "after: SIGUSR1"]
    assert out.stdout.splitlines() == lines, out.stdout


def test_layouts():
    cfg = ArmorConfig()
    cfg.rollout.backend = "torch"
    cpu = plan_layout(cfg)
    assert (cpu.trainer_ranks, cpu.rollout_engines, cpu.bundles) == (1, 1, 0)
    cfg.orchestration.layout, cfg.trainer.world_size, cfg.rollout.sglang.tp = "colocated", 8, 2
    co = plan_layout(cfg)
    assert (co.rollout_engines, co.bundles, co.rollout_bundles) == (4, 8, [0, 2, 4, 6])
    cfg.orchestration.layout, cfg.orchestration.rollout_gpus = "disaggregated", 4
    dis = plan_layout(cfg)
    assert (dis.bundles, dis.rollout_bundles, dis.trainer_bundles) == (12, [8, 10], list(range(8)))
    # SGLang: one rollout worker per node with servers, placed once the bundles are known
    cfg.rollout.backend = "sglang"
    sg = plan_layout(cfg)
    assert (sg.rollout_engines, sg.rollout_bundles, sg.bundles) == (1, [], 12)
    assert sg.rollout_gpus == 0.0 and sg.server_bundles == {"policy": [8, 10]}
    where = [("10.0.0.1", g) for g in range(8)] + [("10.0.0.2", g) for g in range(4)]
    hosts = rollout_hosts(sg, where)
    assert [(h.bundle, h.ip, h.servers) for h in hosts] == [
        (8, "10.0.0.2", {"policy": [(0, 0), (1, 2)]})
    ]
    assert rollout_hosts(sg, []) == []
    with pytest.raises(RuntimeError, match="policy server 1 needs 2 consecutive GPUs"):
        rollout_hosts(sg, where[:11] + [("10.0.0.3", 0)])
    # a dedicated reference: policy and reference servers share the rollout GPUs half and half
    cfg.rollout.ref_strategy, cfg.rollout.sglang.tp = "dedicated", 1
    ded = plan_layout(cfg)
    assert ded.server_bundles == {"policy": [8, 9], "ref": [10, 11]}
    two_nodes = [("10.0.0.1", g) for g in range(8)] + [("10.0.0.2", g) for g in range(2)]
    two_nodes += [("10.0.0.3", g) for g in range(2)]
    hosts = rollout_hosts(ded, two_nodes)  # policy servers on one node, reference on another
    assert [(h.ip, h.servers) for h in hosts] == [
        ("10.0.0.2", {"policy": [(0, 0), (1, 1)]}),
        ("10.0.0.3", {"ref": [(0, 0), (1, 1)]}),
    ]
    cfg.orchestration.layout = "colocated"  # colocated: both pools on the trainer GPUs
    co = plan_layout(cfg)
    assert co.server_bundles == {"policy": list(range(8)), "ref": list(range(8))}
    across = [("10.0.0.1", g) for g in range(4)] + [("10.0.0.2", g) for g in range(4)]
    hosts = rollout_hosts(co, across)  # two nodes: a worker each, both pools on both
    assert [(h.bundle, h.servers["policy"], h.servers["ref"]) for h in hosts] == [
        (0, [(i, i) for i in range(4)], [(i, i) for i in range(4)]),
        (4, [(i + 4, i) for i in range(4)], [(i + 4, i) for i in range(4)]),
    ]
    cfg.orchestration.layout, cfg.rollout.ref_strategy, cfg.rollout.sglang.tp = (
        "disaggregated", "swap", 2
    )  # fmt: skip
    cfg.orchestration.rollout_gpus = 3
    assert any("orchestration.rollout_gpus=3" in p for p in pool_problems(cfg))  # SGLang: pools
    cfg.rollout.backend = "torch"  # embedded engines: rollout_gpus / tp of them
    with pytest.raises(ValueError, match="orchestration.rollout_gpus=3"):
        plan_layout(cfg)
    cfg.orchestration.layout = "mesh"
    with pytest.raises(ValueError, match="orchestration.layout='mesh'"):
        plan_layout(cfg)


def test_cpu_actors_spread_over_nodes_and_nsys_wraps_trainer_ranks_on_a_ray_cluster():
    cfg = ArmorConfig()
    one = actor_options(plan_layout(cfg), None, [], None, 0.0)
    assert one == {"num_cpus": 0.5, "num_gpus": 0}
    cfg.orchestration.nodes = 2
    assert actor_options(plan_layout(cfg), None, [], None, 0.0)["scheduling_strategy"] == "SPREAD"
    cfg.logging.profile = "nsys"
    assert trainer_runtime_env(cfg, 1) == {}  # no ray_address: launch/profile.sh wraps the driver
    cfg.orchestration.ray_address = "10.0.0.1:6379"
    nsight = trainer_runtime_env(cfg, 1)["runtime_env"]["nsight"]
    assert nsight["o"] == "trainer_rank1_%p" and nsight["capture-range"] == "cudaProfilerApi"


def test_batch_sizes_are_checked_at_load_and_give_the_updates_per_step():
    cfg = ArmorConfig()
    cfg.rollout.batch, cfg.trainer.ppo_mini_batch, cfg.rollout.gen_batch = 8, 4, 24
    assert find_problems(cfg) == [] and updates_per_step(cfg) == 2
    cfg.trainer.ppo_mini_batch = 3
    assert [p for p in find_problems(cfg) if p.startswith("trainer.ppo_mini_batch=3")]
    cfg.trainer.ppo_mini_batch, cfg.rollout.gen_batch = 4, 4
    assert [p for p in find_problems(cfg) if p.startswith("rollout.gen_batch=4")]


def test_minibatches_are_consecutive_whole_groups():
    groups = [Group(f"q{i}", [Sample(f"q{i}", [1], [2])] * (3 + i % 2)) for i in range(4)]
    assert minibatch_sample_ids(groups, 2) == [list(range(0, 7)), list(range(7, 14))]
    assert minibatch_sample_ids(groups, 1) == [list(range(14))]


def test_a_short_batch_keeps_the_updates_and_spreads_its_groups_over_them():
    groups = [Group(f"q{i}", [Sample(f"q{i}", [1], [2])] * 3) for i in range(5)]
    assert minibatch_sample_ids(groups, 2) == [list(range(0, 9)), list(range(9, 15))]
    assert minibatch_sample_ids(groups[:3], 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_fewer_groups_than_updates_take_turns_and_every_rank_gets_a_sequence():
    groups = [Group(f"q{i}", [Sample(f"q{i}", [1], [2])] * 3) for i in range(3)]
    assert minibatch_sample_ids(groups[:1], 2) == [[0, 1, 2], [0, 1, 2]]  # one group, 2 updates
    assert minibatch_sample_ids(groups, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]]
    # two groups a mini-batch (dp = 6 ranks, G = 3): 3 groups cannot fill 2 mini-batches apart
    assert minibatch_sample_ids(groups, 2, 2) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 0, 1, 2]]
    assert minibatch_sample_ids(groups + groups[:1], 2, 2) == [list(range(6)), list(range(6, 12))]


@pytest.mark.parametrize(
    ("overrides", "floor", "per_update"),
    [
        ({}, 4, 1),  # ceil(0.5 * 8)
        ({"algo.on_short_batch": "error"}, 8, 1),
        ({"algo.min_batch_fraction": 0.3}, 3, 1),  # 0.3 * 8 = 2.4 -> 3
        ({"algo.min_batch_fraction": 0.0}, 0, 1),  # no floor
        ({"trainer.world_size": 8, "algo.group_size": 2}, 4, 4),  # 8 ranks, 2 sequences a group
    ],
)
def test_the_short_batch_floor_and_the_groups_every_update_needs(overrides, floor, per_update):
    cfg = ArmorConfig()
    cfg.rollout.batch, cfg.trainer.ppo_mini_batch = 8, 4
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    assert find_problems(cfg) == []
    assert (short_batch_floor(cfg), groups_per_update(cfg)) == (floor, per_update)


def test_update_metrics_reduce_mean_max_last():
    m = reduce_update_metrics([{"loss/pg": 1.0, "loss/ratio_max": 2.0, "lr": 1e-6},
                               {"loss/pg": 3.0, "loss/ratio_max": 1.5, "lr": 2e-6}])  # fmt: skip
    assert m == {"loss/pg": 2.0, "loss/ratio_max": 2.0, "lr": 2e-6, "train/updates": 2.0}


def test_shard_keeps_order():
    assert shard(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert shard([1], 3) == [[1], [], []]


def test_reference_needs_and_strategy():
    cfg = ArmorConfig()
    assert needs_reference_logprobs(cfg.algo)
    cfg.algo.anchor, cfg.algo.ratio = "none", "standard"
    assert not needs_reference_logprobs(cfg.algo)
    cfg.algo.kl_coef = 0.1
    assert needs_reference_logprobs(cfg.algo)
    cfg.rollout.ref_strategy, cfg.algo.anchor_source = "dedicated", "cache"
    assert reference_plan(cfg) == ("cache", "dedicated")
    cfg.rollout.ref_strategy, cfg.algo.anchor_source = "swap", "generate"
    assert reference_plan(cfg) == ("swap", "swap")
    cfg.algo.anchor_source = "replay"
    with pytest.raises(ValueError, match="algo.anchor_source='replay'"):
        reference_plan(cfg)


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(p.parents[1])) for p in CONFIGS])
def test_every_config_file_loads(path):
    from megatron_armor.config.pipeline import is_pipeline_file, load_pipeline

    if is_pipeline_file(path):
        pipeline = load_pipeline(path)
        configs = [pipeline.stage1, pipeline.stage2]
    else:
        configs = [load_config(path)]
    for config in configs:
        assert updates_per_step(config) >= 1
        plan_layout(config)


def test_reward_stats_merge_weights_means_and_adds_counters():
    from megatron_armor.orchestration.actors.actor_handles import merge_reward_stats

    a = {"reward/n": 2.0, "reward/acc": 1.0, "reward/timeouts": 1.0, "reward/overlong_frac": 0.5}
    b = {"reward/n": 6.0, "reward/acc": 0.0, "reward/timeouts": 2.0, "reward/overlong_frac": 0.0}
    m = merge_reward_stats(a, b)
    assert m == {"reward/n": 8.0, "reward/acc": 0.25, "reward/timeouts": 3.0,
                 "reward/overlong_frac": 0.125}  # fmt: skip
    assert merge_reward_stats({}, a) == a


def test_engine_logprobs_align_with_packed_response_tokens():
    import math

    from megatron_armor.orchestration.step.step_metrics import logprob_mismatch_metrics
    from megatron_armor.types import pack_groups

    a = Sample("q", [1, 2], [3, 4], response_logprobs=[-0.1, -0.2])
    b = Sample("q", [1, 2], [5], response_logprobs=[-0.3])
    group = Group("q", [a, b], anchor_index=1, advantages=[1.0, -1.0])
    batch = pack_groups([group])
    lp = batch.engine_logprobs
    assert lp.tolist() == pytest.approx([0, 0, -0.1, -0.2, 0, 0, -0.3])
    batch.old_logprobs = lp.clone()
    batch.ref_logprobs = lp.clone()
    batch.ref_logprobs[6] = -0.5
    m = logprob_mismatch_metrics(batch, with_ref=True)
    assert m["rollout/policy_logprob_absdiff_max"] == 0.0
    assert m["rollout/policy_mismatch_k1"] == 0.0 and m["rollout/policy_mismatch_k3"] == 0.0
    assert m["rollout/anchor_logprob_absdiff_max"] == pytest.approx(0.2)
    # the anchor token: lp_e = -0.3 (engine), lp_b = lp_ref = -0.5; rho = exp(-0.2)
    assert m["rollout/anchor_mismatch_k1"] == pytest.approx(0.2, abs=1e-6)
    assert m["rollout/anchor_mismatch_k3"] == pytest.approx(math.exp(-0.2) - 1 + 0.2, abs=1e-6)
    assert "rollout/anchor_logprob_absdiff_mean" not in logprob_mismatch_metrics(batch, False)


def test_a_sample_without_engine_logprobs_packs_nan_on_its_response():
    from megatron_armor.types import pack_groups

    a = Sample("q", [1], [3, 4], response_logprobs=[-0.1])  # one log-prob for two tokens
    b = Sample("q", [1], [5], response_logprobs=[-0.3])
    batch = pack_groups([Group("q", [a, b], advantages=[1.0, -1.0])])
    lp = batch.engine_logprobs
    assert lp[0] == 0 and lp[1:3].isnan().all() and lp[3:].tolist() == pytest.approx([0, -0.3])


def test_a_correction_refuses_a_sample_without_engine_logprobs():
    from megatron_armor.config import load_config
    from megatron_armor.orchestration.step.phases import require_engine_logprobs
    from megatron_armor.types import pack_groups

    a = Sample("q", [1], [3, 4], response_logprobs=[])  # an engine that returned none
    b = Sample("q", [1], [5], response_logprobs=[-0.3])
    batch = pack_groups([Group("q", [a, b], advantages=[1.0, -1.0])])
    require_engine_logprobs(load_config(None, []), batch, 3)  # mode none: not read
    on = load_config(None, ["algo.rollout_correction.mode=seq_tis"])
    with pytest.raises(RuntimeError, match=r"mode='seq_tis': 1 sample\(s\) of step 3"):
        require_engine_logprobs(on, batch, 3)


def test_orchestration_never_imports_megatron():
    import subprocess
    import sys

    code = (
        "import sys, megatron_armor.orchestration.step.loop, megatron_armor.cli.train_cmd; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'ray', "
        "'transformer_engine', 'sglang')); print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_checkpoint_and_validation_cadence():
    from megatron_armor.orchestration.step.phases import checkpoint_due, validation_due

    cfg = ArmorConfig()
    cfg.run.steps, cfg.run.ckpt_every, cfg.validation.every = 7, 3, 2
    assert [s for s in range(1, 8) if checkpoint_due(cfg, s)] == [3, 6, 7]
    assert [s for s in range(1, 8) if validation_due(cfg, s)] == [2, 4, 6, 7]
    cfg.run.ckpt_every, cfg.validation.every = 0, 0
    assert [s for s in range(1, 8) if checkpoint_due(cfg, s)] == [7]
    assert not any(validation_due(cfg, s) for s in range(1, 8))


def test_threads_never_exceed_the_cores_of_a_node(monkeypatch):
    cfg = ArmorConfig()
    cfg.rollout.backend = "torch"
    monkeypatch.setattr(placement, "node_cores", lambda: 2)
    assert plan_layout(cfg).threads == 1  # trainer + rollout + reward on 2 cores
    monkeypatch.setattr(placement, "node_cores", lambda: 64)
    assert plan_layout(cfg).threads == 21  # 64 // 3
    cfg.orchestration.layout, cfg.trainer.world_size, cfg.rollout.sglang.tp = "colocated", 16, 2
    cfg.orchestration.gpus_per_node = 8  # a node: 8 trainer ranks, 4 engines, 1 reward worker
    assert placement.actors_per_node(plan_layout(cfg), 8) == 13
    assert plan_layout(cfg).threads == 4
    cfg.orchestration.threads_per_actor = 3
    assert plan_layout(cfg).threads == 3
    cfg.orchestration.threads_per_actor = -1
    assert "orchestration.threads_per_actor" in " ".join(find_problems(cfg))
