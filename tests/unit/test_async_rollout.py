"""One-step-off asynchronous rollout: settings, the in-flight batch in a checkpoint, the
pipeline's rules (drain, staleness) and its driver thread. Tier: unit."""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest
import torch

from megatron_armor.algo.anchors import AcceptanceStats
from megatron_armor.algo.reset import ResetSchedule
from megatron_armor.config import ConfigError, load_config
from megatron_armor.config.validate import (
    find_problems,
    runs_async_rollout,
)
from megatron_armor.orchestration.run.run_state import RunState
from megatron_armor.orchestration.step.anchor_rollout import RolloutResult
from megatron_armor.orchestration.step.async_rollout import (
    AsyncPipeline,
    Collected,
    Collector,
    collected_from_state,
    collected_state,
    lag_metrics,
    overlap_fraction,
)
from megatron_armor.types import Group, Sample, SampleSource

pytestmark = pytest.mark.unit


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    return str(info.value)


# ---------------------------------------------------------------------------- settings
def test_async_rollout_is_off_by_default_and_takes_two_values():
    assert not runs_async_rollout(load_config(None, []))
    assert runs_async_rollout(load_config(None, ["orchestration.async_rollout=one_step"]))
    msg = _error("orchestration.async_rollout=two_step")
    assert "orchestration.async_rollout='two_step'" in msg and "one_step" in msg


def test_layouts_that_cannot_overlap_are_refused_with_why():
    msg = _error("orchestration.async_rollout=one_step", "orchestration.layout=colocated")
    assert "layout='colocated'" in msg and "disaggregated" in msg
    assert "orchestration.async_rollout=off" in msg
    msg = _error("orchestration.async_rollout=one_step", "orchestration.layout=colocated",
                 "trainer.offload_train_state=true")  # fmt: skip
    assert "trainer.offload_train_state=true" in msg


def test_a_reference_swapped_into_the_policy_servers_is_refused():
    sglang = ["rollout.backend=sglang", "orchestration.layout=disaggregated",
              "rollout.sglang.weight_transport=distributed",
              "orchestration.rollout_gpus=2", "trainer.world_size=2",
              "orchestration.gpus_per_node=4"]  # fmt: skip
    msg = _error("orchestration.async_rollout=one_step", *sglang, "rollout.ref_strategy=swap")
    assert "rollout.ref_strategy='swap'" in msg and "ref_strategy=dedicated" in msg
    problems = find_problems(load_config(None, [*sglang, "rollout.ref_strategy=dedicated"]))
    assert problems == []


def test_cpu_layout_needs_a_core_for_the_trainer_and_the_engine(monkeypatch):
    from megatron_armor.config import validate

    monkeypatch.setattr(validate, "host_cores", lambda: 1)
    msg = _error("orchestration.async_rollout=one_step")
    assert "on 1 core(s)" in msg and "need a core each (2)" in msg
    monkeypatch.setattr(validate, "host_cores", lambda: 2)
    load_config(None, ["orchestration.async_rollout=one_step"])


def test_concurrent_reference_pass_yields_its_core_to_the_engine():
    sync = load_config(None, [])
    assert sync.resolved.concurrent_reference  # cpu layout, one rank: on
    overlapped = load_config(None, ["orchestration.async_rollout=one_step"])
    assert not overlapped.resolved.concurrent_reference  # auto: the engine generates meanwhile
    msg = _error("orchestration.async_rollout=one_step", "trainer.concurrent_reference=true")
    assert "trainer.concurrent_reference=true" in msg and "auto or false" in msg


# ---------------------------------------------------------------------------- checkpoint
def _sample(qid: str, source: SampleSource, version: int, lp: list[float]) -> Sample:
    return Sample(query_id=qid, prompt_ids=[1, 2, 3], response_ids=[4, 5], response_logprobs=lp,
                  source=source, weight_version=version, score=-0.25, acc=False,
                  response_text="12", ground_truth="7", data_source="tiny")  # fmt: skip


def _result() -> RolloutResult:
    pol = [_sample("q1", SampleSource.POLICY, 3, [-0.1 / 3, -1e-12]) for _ in range(3)]
    anchor = _sample("q1", SampleSource.REFERENCE, 2, [math.nan, -2.5])
    stats = AcceptanceStats(gen_batches=2, queries_seen=9, accepted=1, accepted_ids=["q1"])
    return RolloutResult(
        groups=[Group("q1", [*pol, anchor], anchor_index=3, advantages=[0.5, -0.5, 0.1, 1.0])],
        stats=stats, records=[{"query_id": "q1", "gen_batch": 0, "reason": "accepted"}],
        policy_samples=pol + [_sample("q2", SampleSource.POLICY, 3, [-0.7])],
        reward_stats={"verify_seconds": 0.01}, generated_tokens=12, reference_first=True,
    )  # fmt: skip


def _same(a, b) -> bool:
    """Dataclass equality that takes NaN for NaN (the engine's missing log-probs)."""
    left, right = dataclasses.asdict(a), dataclasses.asdict(b)
    return repr(left) == repr(right)


def test_the_batch_in_flight_survives_the_safe_loader_exactly(tmp_path):
    collected = Collected(4, _result(), {"data/epoch": 0.0}, {"timing/rollout_s": 0.5}, 3,
                          "behavior", 0.5, 123.0)  # fmt: skip
    state = RunState(step=3, pending=collected_state(collected))
    state.save(tmp_path)
    back = collected_from_state(RunState.load(tmp_path).pending)  # torch.load(weights_only)
    assert back.step == 4 and back.version == 3 and back.old_weights == "behavior"
    assert back.metrics == {"data/epoch": 0.0} and back.timings == {"timing/rollout_s": 0.5}
    assert _same(back.result, collected.result)
    assert back.result.groups[0].samples[0].source is SampleSource.POLICY
    assert back.result.groups[0].samples[0].response_logprobs[0] == -0.1 / 3  # bit for bit
    assert math.isnan(back.result.groups[0].samples[3].response_logprobs[0])
    assert isinstance(back.result.stats, AcceptanceStats) and back.result.stats.queries_seen == 9
    assert collected_state(None) == {} and collected_from_state({}) is None


def test_the_routes_of_a_batch_in_flight_survive_the_checkpoint(tmp_path):
    """A mixture-of-experts run that replays the engines' routes holds them in each sample of
    the batch drawn ahead (the policy's and the anchor's, from the reference engine): the
    checkpoint keeps them, ids and compact dtype, through the safe loader."""
    import numpy as np

    from megatron_armor.types import RoutedExperts

    result = _result()
    samples = [*result.groups[0].samples, *result.policy_samples]
    rng = np.random.default_rng(5)
    for i, sample in enumerate(samples):  # [prompt + response - 1, layers, k]; one int16
        top = 300 if i == 3 else 8
        sample.routed_experts = RoutedExperts.from_array(rng.integers(0, top, (4, 2, 2)))
    collected = Collected(4, result, {}, {}, 3, "behavior", 0.5, 1.0)
    RunState(step=3, pending=collected_state(collected)).save(tmp_path)
    back = collected_from_state(RunState.load(tmp_path).pending)
    restored = [*back.result.groups[0].samples, *back.result.policy_samples]
    for before, after in zip(samples, restored, strict=True):
        assert after.routed_experts.dtype == before.routed_experts.dtype
        assert np.array_equal(after.routed_experts.array(), before.routed_experts.array())
    assert (
        restored[3].routed_experts.dtype == "int16" and restored[0].routed_experts.dtype == "uint8"
    )


def test_checkpoints_without_a_batch_in_flight_still_load(tmp_path):
    saved = RunState(step=2).__dict__
    del saved["pending"]  # a checkpoint written before async_rollout existed
    torch.save(saved, tmp_path / "orchestrator.pt")
    assert RunState.load(tmp_path).pending == {}


# ---------------------------------------------------------------------------- rules
class _Session:
    def __init__(self, steps: int, every: int):
        self.config = load_config(None, [f"run.steps={steps}"])
        self.schedule = ResetSchedule("every", every, 0)


def test_reset_steps_and_the_last_step_drain_the_pipeline():
    pipeline = AsyncPipeline(_Session(steps=7, every=3), rollout=None, timers=None)
    assert [pipeline.overlaps(t) for t in range(1, 8)] == [
        True, True, False, True, True, False, False,
    ]  # fmt: skip


def test_version_lag_counts_pushed_versions_of_policy_samples_only():
    result = _result()  # policy samples of version 3, the anchor of version 2
    assert lag_metrics(result, 4) == {"async/version_lag_mean": 1.0, "async/version_lag_max": 1}
    assert lag_metrics(result, 3)["async/version_lag_max"] == 0
    assert lag_metrics(RolloutResult(groups=[], stats=AcceptanceStats()), 4) == {}


def test_overlap_fraction_is_the_share_of_the_step():
    metrics = {"async/overlap_s": 1.5, "timing/step_s": 2.0}
    overlap_fraction(metrics)
    assert metrics["async/overlap_fraction"] == 0.75
    sync = {"timing/step_s": 2.0}
    overlap_fraction(sync)
    assert "async/overlap_fraction" not in sync


# ---------------------------------------------------------------------------- the thread
def test_collector_draws_on_its_own_thread_and_raises_its_failure_in_the_loop():
    from types import SimpleNamespace

    from megatron_armor.orchestration.actors.call_watch import CallWatch

    collector = Collector(SimpleNamespace(call_watch=CallWatch()), rollout=None, timers=None)
    seen: list[str] = []

    def collect(step, version, old_weights):
        seen.append(threading.current_thread().name)
        if step == 3:
            raise RuntimeError("rollout worker died")
        return Collected(step, _result(), version=version, old_weights=old_weights)

    collector.collect = collect
    collector.launch(2, 1, "behavior")
    got = collector.join()
    assert (got.step, got.version, got.old_weights) == (2, 1, "behavior")
    assert seen == ["rollout-step-2"]
    collector.launch(3, 2, "behavior")
    with pytest.raises(RuntimeError, match="rollout worker died"):
        collector.join()


def test_a_bare_off_is_the_name_off_in_a_file_and_on_the_command_line(tmp_path):
    assert (
        load_config(None, ["orchestration.async_rollout=off"]).orchestration.async_rollout == "off"
    )
    spec = tmp_path / "run.yaml"
    spec.write_text("orchestration: {async_rollout: off}\n")  # YAML 1.1: a boolean
    assert load_config(spec, []).orchestration.async_rollout == "off"
    assert "'True'" in _error("orchestration.async_rollout=on")  # not a name: refused
