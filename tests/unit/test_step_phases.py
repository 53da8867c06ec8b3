"""Unit tier: the step's time attributed phase by phase (``observability/timers.py``:
``PhaseClock``), the timers' NVTX ranges named by the phases, and the end-to-end
tokens/s/GPU (``observability/throughput.py``). A stepped clock stands in for
``time.perf_counter``: each reading advances it by one second, so the attribution is exact."""

from __future__ import annotations

import threading

import pytest

from megatron_armor.config import load_config
from megatron_armor.observability import nvtx, timers
from megatron_armor.observability.throughput import e2e_devices, e2e_metrics
from megatron_armor.observability.timers import PhaseClock, PhaseTimers
from megatron_armor.planner.step_phases import PHASE_NAMES, STEP_PHASES, step_phase

pytestmark = pytest.mark.unit


@pytest.fixture
def stepped(monkeypatch):
    """``time.perf_counter`` in timers.py: 0, 1, 2, ... one second per reading."""
    ticks = iter(range(10_000))
    monkeypatch.setattr(timers.time, "perf_counter", lambda: float(next(ticks)))


def test_each_second_goes_to_the_innermost_phase_and_the_rest_to_the_driver(stepped):
    clock = PhaseClock()
    clock.start()  # t=0
    with clock.inside("train"):  # t=1
        with clock.inside("weight_sync"):  # t=2 .. t=3
            pass
    # t=4 leaves train
    got = clock.metrics()  # t=5
    assert got["phase/weight_sync_s"] == 1.0  # 2 -> 3
    assert got["phase/train_s"] == 2.0  # 1 -> 2, 3 -> 4
    assert got["phase/driver_s"] == 2.0  # 0 -> 1, 4 -> 5
    assert sum(got.values()) == 5.0  # every second of the step, once
    assert set(got) == {p.metric for p in STEP_PHASES}


def test_phases_of_other_threads_overlap_the_step_and_do_not_count(stepped):
    clock = PhaseClock()
    clock.start()
    done = threading.Event()

    def rollout_thread():
        with clock.inside("rollout/policy"):
            done.set()

    thread = threading.Thread(target=rollout_thread)
    thread.start()
    thread.join(timeout=30)
    assert done.is_set()
    got = clock.metrics()
    assert got["phase/rollout_policy_s"] == 0.0 and got["phase/driver_s"] > 0


def test_timers_clock_their_step_phase_and_open_its_nvtx_range(stepped, monkeypatch):
    opened = []
    monkeypatch.setattr(timers, "nvtx_range", lambda name: _Recorded(name, opened))
    t = PhaseTimers()
    t.clock.start()
    with t.phase("rollout"):  # several phases: no step phase of its own
        with t.phase("generate", "rollout/reference"):
            pass
        with t.phase("score"):
            pass
    with t.phase("sync"):
        pass
    assert opened == ["rollout", "rollout/reference", "reward", "weight_sync"]
    got = t.clock.metrics()
    assert got["phase/rollout_reference_s"] > 0 and got["phase/reward_s"] > 0
    assert got["phase/weight_sync_s"] > 0
    assert set(t.pop_metrics()) == {
        f"timing/{n}_s" for n in ("rollout", "generate", "score", "sync")
    }


class _Recorded:
    def __init__(self, name, opened):
        opened.append(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_phase_names_are_the_nvtx_ranges_and_unknown_names_are_refused():
    assert nvtx.PHASE_RANGES == PHASE_NAMES
    assert step_phase("rollout/wait").metric == "phase/rollout_wait_s"
    with pytest.raises(ValueError, match="one of"):
        step_phase("generate")
    with pytest.raises(ValueError, match="one of"), PhaseClock().inside("generate"):
        pass


def test_e2e_tokens_per_s_per_gpu_is_nemo_rls_definition():
    metrics = {"train/prompt_tokens": 300.0, "train/response_tokens": 900.0, "timing/step_s": 2.0}
    got = e2e_metrics(metrics, devices=4)
    assert got == {"perf/e2e_tokens_per_s": 600.0, "perf/e2e_tokens_per_s_per_gpu": 150.0}
    colocated = load_config(None, ["orchestration.layout=colocated", "orchestration.nodes=4",
                                   "orchestration.gpus_per_node=8", "rollout.backend=sglang"])  # fmt: skip
    assert e2e_devices(colocated) == 32
    disaggregated = load_config(None, ["orchestration.layout=disaggregated", "orchestration.nodes=2",
                                       "orchestration.gpus_per_node=8", "orchestration.rollout_gpus=4",
                                       "rollout.sglang.weight_transport=distributed",
                                       "rollout.backend=sglang"])  # fmt: skip
    assert e2e_devices(disaggregated) == 16  # trainer and rollout GPUs alike
    assert e2e_devices(load_config(None, [])) == 1  # cpu: its trainer ranks
