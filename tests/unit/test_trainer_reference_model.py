"""``trainer.concurrent_reference`` on the rank: which ranks build the second model, and how its
parameters find the stored copy's tensors (the live model is wrapped, its names prefixed).
The pass itself, bit for bit against the sequential one: ``tests/dist/test_trainer_step_dist.py``."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.trainer.reference_model import _store_keys, concurrent_reference

pytestmark = pytest.mark.unit


class Wrapped(torch.nn.Module):
    """Stands for megatron DDP: the model as ``module``."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


def net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def test_parameters_map_to_the_wrapped_models_names() -> None:
    keys = _store_keys(Wrapped(net()), net())
    assert keys == {n: f"module.{n}" for n in ("0.weight", "0.bias", "1.weight", "1.bias")}
    with pytest.raises(ValueError, match="reference model's 4 parameters do not line up"):
        _store_keys(Wrapped(torch.nn.Sequential(net(), torch.nn.Linear(2, 1))), net())
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Sequential(torch.nn.Linear(4, 2)))
    with pytest.raises(ValueError, match="not the reference model's behind 'module.'"):
        _store_keys(Wrapped(other), net())


def test_a_cuda_rank_keeps_the_sequential_pass(monkeypatch) -> None:
    """``auto`` is off on a rank with CUDA (a GPU runs one pass at a time); ``true`` is an
    error naming the setting; ``false`` builds nothing anywhere."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = ArmorConfig()  # the cpu layout, one rank: auto resolves on
    assert concurrent_reference(cfg, None, None) is None
    cfg.trainer.concurrent_reference = "true"
    with pytest.raises(ValueError, match="set trainer.concurrent_reference=auto or false"):
        concurrent_reference(cfg, None, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg.trainer.concurrent_reference = False
    assert concurrent_reference(cfg, None, None) is None


def test_an_error_in_the_policy_pass_waits_for_the_reference_pass(monkeypatch) -> None:
    """The policy pass's error is the one raised, and only once the reference pass (running
    on its thread) is over: nothing of the step keeps computing behind the error."""
    import threading
    import types
    from concurrent.futures import ThreadPoolExecutor

    from megatron_armor.trainer import megatron_trainer

    release, finished = threading.Event(), []
    pool = ThreadPoolExecutor(max_workers=1)

    def reference_pass():
        release.wait(5)
        finished.append(True)
        raise RuntimeError("the reference pass's own error")

    def failing_policy_pass(*_args):
        release.set()
        raise ValueError("policy pass failed")

    fake = types.SimpleNamespace(
        reference=types.SimpleNamespace(submit=lambda *_a: pool.submit(reference_pass)),
        store=types.SimpleNamespace(get=lambda _name: {}),
        model=None,
        lp=None,
        _under=lambda _weights: contextlib.nullcontext(),  # the live weights: no swap
    )
    monkeypatch.setattr(megatron_trainer, "run_schedule", failing_policy_pass)
    with pytest.raises(ValueError, match="policy pass failed"):
        megatron_trainer.MegatronTrainer._concurrent_passes(fake, [], None, [], None, [])
    assert finished == [True]
    pool.shutdown()
