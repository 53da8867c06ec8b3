"""Dist tier (gloo, 1-2 CPU processes per run): a checkpoint of the distributed optimizer
resumed at another parallel layout (``reshard_worker.py``; ``config/resume_layout.py``).

Four runs save after two updates (the ``behavior`` copy kept between them, so policy,
reference and behavior weights differ) and go on at their layout for two more updates; fresh
processes at another layout load each checkpoint and take the same two updates:

======================  ================================  ===========================
saved at                resumed at                        what changes
======================  ================================  ===========================
tp=2 (2 ranks)          tp=1 (1 rank)                     tp 2 -> 1
pp=2 (2 ranks)          pp=1 (1 rank)                     pp 2 -> 1
tp=1, dp=2 (2 ranks)    tp=2, dp=1 (2 ranks)              tp 1 -> 2 with dp 2 -> 1
tiny MoE ep=2 (2 ranks) ep=1 (1 rank)                     ep 2 -> 1 (expert optimizer)
======================  ================================  ===========================

After the load the three weight sets, the gathered optimizer state (fp32 master weights, Adam
moments, step), the update count and the LR scheduler's position equal the saved ones bit for
bit (a load moves data; it computes nothing). The first update after it and the one after
that match the run continued at the saved layout within the tolerances of
``test_trainer_dist.py``, which compares layouts of one computation: the reductions over TP
and DP ranks and the micro-batches add in another order (loss and metrics ``LOSS_TOL``, weights
``WEIGHT_TOL``; the Adam moments ``MOMENT_TOL`` of their largest magnitude). Measured: the
losses differ by up to 2e-7, the weights by 2.4e-7, the moments by 5e-7 of their scale.
"""

from __future__ import annotations

import glob
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_trainer_dist import LOSS_TOL, TIMEOUT_S, WEIGHT_TOL, free_port  # noqa: E402
from tiny_models import make_models, make_moe_model  # noqa: E402

from megatron_armor.trainer.ranks import run_rank_processes  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reshard_worker.py")
MOMENT_TOL = 1e-5
"""Adam moments after one update at two layouts, relative to the moment's largest magnitude
(the gradients differ in their last bits: up to 5e-7 of it measured, 0 for pp 2 -> 1)."""
LAYOUT_DEPENDENT = ("train/padding_fraction",)
"""How a rank's samples fall into micro-batches depends on the data-parallel split."""

SAVES = {  # name: (model, tp, pp, ep, etp, world)
    "tp2": ("qwen2", 2, 1, 1, 2, 2),
    "pp2": ("qwen2", 1, 2, 1, 1, 2),
    "dp2": ("qwen2", 1, 1, 1, 1, 2),
    "ep2": ("qwen3_moe", 1, 1, 2, 1, 2),
}
LOADS = {  # saved run: (tp, pp, ep, etp, world) it is resumed at
    "tp2": (1, 1, 1, 1, 1),
    "pp2": (1, 1, 1, 1, 1),
    "dp2": (2, 1, 1, 2, 2),
    "ep2": (1, 1, 1, 1, 1),
}


def launch(runs: list[tuple[str, str, str, tuple, str]]) -> None:
    """Every rank of every ``(mode, out, model_dir, (tp, pp, ep, etp, world), saved)`` run at
    once (independent runs overlap their start-up), bounded; ``saved``: the directory whose
    ``ckpt`` a ``load`` run loads."""
    commands, logs = [], []
    for mode, out, model_dir, (tp, pp, ep, etp, world), saved in runs:
        os.makedirs(out, exist_ok=True)
        port = str(free_port())
        for rank in range(world):
            commands.append([sys.executable, WORKER, mode, str(rank), str(world), port, out,
                             model_dir, str(tp), str(pp), str(ep), str(etp), saved])  # fmt: skip
            logs.append(os.path.join(out, f"{mode}_log{rank}.txt"))
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    run_rank_processes(commands, logs, env, TIMEOUT_S)


def merged(out: str, mode: str) -> dict:
    """The ranks' results: HF weight dicts (each rank exports its stage's part) united."""

    def unite(values: list):
        if isinstance(values[0], dict):
            keys = dict.fromkeys(k for v in values for k in v)
            return {k: unite([v[k] for v in values if k in v]) for k in keys}
        return values[0]

    ranks = [torch.load(f, weights_only=False) for f in sorted(glob.glob(f"{out}/{mode}_rank*.pt"))]
    return unite(ranks)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """``{name: (saved run, resumed run)}``: the saves in one wave, the loads in the next."""
    root = tmp_path_factory.mktemp("reshard")
    models = make_models(str(root / "models"))
    models["qwen3_moe"] = make_moe_model(str(root / "models"))
    out = {name: str(root / name) for name in SAVES}
    launch([("save", out[n], models[m], layout, out[n]) for n, (m, *layout) in SAVES.items()])
    launch([("load", out[n] + "_resumed", models[SAVES[n][0]], layout, out[n])
            for n, layout in LOADS.items()])  # fmt: skip
    return {n: (merged(out[n], "save"), merged(out[n] + "_resumed", "load")) for n in SAVES}


def assert_equal_tensors(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k, v in want.items():
        assert torch.equal(got[k], v), (what, k)


def assert_close_metrics(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k, v in want.items():
        if k not in LAYOUT_DEPENDENT:
            assert got[k] == pytest.approx(v, abs=LOSS_TOL, rel=LOSS_TOL), (what, k)


@pytest.mark.parametrize("name", list(SAVES))
def test_resume_at_another_layout(runs, name) -> None:
    saved, resumed = runs[name]
    held, now = saved["held"], resumed["held"]
    for weights in ("policy", "ref", "behavior"):
        assert_equal_tensors(now[weights], held[weights], weights)
    assert not torch.equal(held["policy"]["lm_head.weight"], held["ref"]["lm_head.weight"])
    assert not torch.equal(held["policy"]["lm_head.weight"], held["behavior"]["lm_head.weight"])
    assert now["adam"]["step"] == held["adam"]["step"] == [2.0]
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert_equal_tensors(now["adam"][key], held["adam"][key], key)
    assert (now["updates"], now["lr_steps"]) == (held["updates"], held["lr_steps"]) == (2, 2)
    # the updates after the load: within the tolerances of one computation at two layouts
    assert_close_metrics(resumed["m3"], saved["m3"], "m3")
    after, want = resumed["after_m3"], saved["after_m3"]
    assert after["adam"]["step"] == [3.0]
    for k, v in want["policy"].items():
        torch.testing.assert_close(after["policy"][k], v, atol=WEIGHT_TOL, rtol=0)
    for key in ("exp_avg", "exp_avg_sq"):
        scale = max(v.abs().max().item() for v in want["adam"][key].values())
        for k, v in want["adam"][key].items():
            got = after["adam"][key][k]
            torch.testing.assert_close(got, v, atol=MOMENT_TOL * scale, rtol=0)
    assert_close_metrics(resumed["m4"], saved["m4"], "m4")
