"""Profilers and NVTX ranges (unit tier, CPU): torch traces load, NVTX is free when unused."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch

from megatron_armor.observability import nvtx
from megatron_armor.observability.profiler import (
    ProfilerError,
    StepProfiler,
    TorchStepProfiler,
    make_profiler,
)

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _nvtx_off():
    nvtx.disable_nvtx()
    yield
    nvtx.disable_nvtx()


def _fake_step(x: torch.Tensor) -> torch.Tensor:
    with nvtx.nvtx_range("rollout/policy"):
        y = x @ x
    with nvtx.nvtx_range("train"):
        return (y.relu() @ x).sum()


def test_torch_profiler_writes_a_loadable_chrome_trace_for_chosen_steps_only(tmp_path):
    prof = make_profiler("torch", steps=[2], ranks=[0], rank=0, out_dir=tmp_path)
    assert isinstance(prof, TorchStepProfiler)
    x = torch.randn(32, 32)
    for step in (1, 2, 3):
        prof.begin_step(step)
        _fake_step(x)
        prof.end_step(step)
    prof.close()
    assert [p.name for p in tmp_path.iterdir()] == ["trace_rank0_step2.json"]
    trace = json.loads((tmp_path / "trace_rank0_step2.json").read_text())
    assert trace["armor_host"] == socket.gethostname()  # the node the rank ran on
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"rollout/policy", "train"} <= names  # phase ranges became record_function blocks
    assert any(str(n).startswith("aten::mm") for n in names)
    assert nvtx.nvtx_backend() is None  # ranges back to no-ops after the captured step


def test_an_embedded_rollout_worker_traces_its_chosen_steps_under_its_own_name(tmp_path):
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.orchestration.actors.rollout_worker import embedded_engine_profiler

    config = ArmorConfig()
    config.run.output_dir, config.run.name = str(tmp_path), "r"
    assert embedded_engine_profiler(config, 1) is None  # logging.profile none
    config.logging.profile, config.logging.profile_steps = "torch", [2]
    prof = embedded_engine_profiler(config, 1)
    x = torch.randn(32, 32)
    for step in (1, 2):
        prof.begin_step(step)
        _fake_step(x)
        prof.end_step(step)
    traces = sorted(p.name for p in (tmp_path / "r" / "profile").iterdir())
    assert traces == ["trace_rollout1_step2.json"]  # beside the trainer ranks' trace_rank<R>
    config.rollout.backend = "sglang"  # its servers capture themselves
    assert embedded_engine_profiler(config, 1) is None


def test_torch_profiler_only_on_chosen_ranks(tmp_path):
    prof = make_profiler("torch", steps=[1], ranks=[0], rank=1, out_dir=tmp_path)
    assert type(prof) is StepProfiler
    prof.begin_step(1)
    prof.end_step(1)
    assert not list(tmp_path.iterdir())


def test_nsys_without_cuda_and_dlprof_without_the_tool_say_why(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ProfilerError, match="needs CUDA"):
        make_profiler("nsys", steps=[1], ranks=[0], rank=0, out_dir=tmp_path)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ProfilerError, match="`dlprof` tool is not installed"):
        make_profiler("dlprof", steps=[1], ranks=[0], rank=0, out_dir=tmp_path)
    with pytest.raises(ProfilerError, match="choose one of"):
        make_profiler("perf", steps=[1], ranks=[0], rank=0, out_dir=tmp_path)


def test_disabled_nvtx_range_is_one_shared_noop_and_never_imports_nvtx():
    code = (
        "import sys\n"
        "from megatron_armor.observability.nvtx import nvtx_range\n"
        "a = nvtx_range('train'); b = nvtx_range('rollout')\n"
        "assert a is b\n"
        "with a: pass\n"
        "assert 'nvtx' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "ARMOR_NVTX": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_enabled_nvtx_pushes_and_pops_named_ranges(monkeypatch):
    import nvtx as nvtx_package

    calls = []
    monkeypatch.setattr(
        nvtx_package, "push_range", lambda message, domain: calls.append(("push", message, domain))
    )
    monkeypatch.setattr(nvtx_package, "pop_range", lambda domain: calls.append(("pop", domain)))
    nvtx.enable_nvtx("nvtx")
    with nvtx.nvtx_range("weight_sync"):
        calls.append("body")
    assert calls == [("push", "weight_sync", "armor"), "body", ("pop", "armor")]
    nvtx.disable_nvtx()
    with nvtx.nvtx_range("weight_sync"):
        pass
    assert len(calls) == 3
    with pytest.raises(ValueError, match="choose one of"):
        nvtx.enable_nvtx("itt")


def test_env_switch_enables_nvtx():
    nvtx.enable_from_env({"ARMOR_NVTX": "1"})
    assert nvtx.nvtx_backend() == "nvtx"
