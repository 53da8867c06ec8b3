"""``armor plan --checkpoint`` (unit tier): the layouts of an allocation a checkpoint resumes
at, as docs/cluster.md's requeue section runs it (the 7B recipe on 3 nodes of 8 GPUs after
4), against checkpoints that record their layout the way the trainer's save does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_armor.cli import main as armor_main
from megatron_armor.orchestration.run.checkpoints import write_manifest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "paper" / "qwen25_math_7b_armor.yaml")
THREE_NODES = ["orchestration.nodes=3", "--gpu-mem-gib", "80", "--model", "qwen2.5-math-7b"]
SAVED_ON_FOUR = {"tp": 2, "pp": 1, "ep": 1, "etp": 2, "dp": 16, "world_size": 32,
                 "distributed_optimizer": True}  # fmt: skip


def run_dir_with_checkpoint(root: Path, layout: dict) -> Path:
    """``root/run`` with a checkpoint ``step_000040`` whose trainer state records ``layout``."""
    dist_dir = root / "run" / "checkpoints" / "step_000040" / "trainer" / "dist"
    dist_dir.mkdir(parents=True)
    torch.save({"optimizer_stepped": True, "parallel_layout": layout}, dist_dir / "common.pt")
    write_manifest(dist_dir.parent.parent, 40)
    return root / "run"


def plan(capsys, *args: str) -> tuple[int, str]:
    code = armor_main(["plan", CONFIG, *THREE_NODES, *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_reshardable_checkpoint_resumes_at_every_layout_of_the_smaller_allocation(
    tmp_path, capsys
):
    """Saved at tp 2 on 4 x 8 GPUs (dp 16), resumed on 3 x 8: the configured tp 2 at dp 12 and
    every other layout the 7B model admits on 24 GPUs (28 heads and layers: tp 1, 2, 4 and pp
    1, 2, 4 whose product divides 24) resume, each with its memory verdict; tp 3, 6 or 8 does
    not divide the heads and is not listed."""
    layout = {**SAVED_ON_FOUR, "optimizer_format": "fully_reshardable"}
    checkpoint = run_dir_with_checkpoint(tmp_path, layout) / "checkpoints" / "step_000040"
    code, out = plan(capsys, "--checkpoint", str(checkpoint.parent.parent))  # the run dir
    assert code == 0, out
    assert f"checkpoint {checkpoint}: saved at tp=2 pp=1 ep=1 etp=2 dp=16 (distributed " \
           "optimizer, fully_reshardable)" in out  # fmt: skip
    assert "layouts of trainer.world_size=24 the model admits" in out
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith(("*", "tp="))]
    assert lines[0].startswith("tp=1 pp=1 ep=1 etp=1 dp=24") and "resumes (resharded)" in lines[0]
    configured = [line for line in lines if line.startswith("*")]
    assert len(configured) == 1 and "tp=2 pp=1 ep=1 etp=2 dp=12" in configured[0]
    assert "resumes; fits" in configured[0]
    listed = {tuple(line.lstrip("* ").split()[:2]) for line in lines}
    assert len(listed) == 8 and ("tp=4", "pp=2") in listed
    assert not {("tp=3", "pp=1"), ("tp=8", "pp=1"), ("tp=4", "pp=4"), ("tp=1", "pp=3")} & listed
    assert all("does not fit (activations)" in line for line in lines if "tp=1 " in line)
    assert all("does not resume" not in line for line in lines)


def test_a_dp_reshardable_checkpoint_resumes_at_its_own_tp_and_pp_only(tmp_path, capsys):
    """A save that records no format holds dp_reshardable state: of the smaller allocation's
    layouts only tp 2, pp 1 (any dp) resume; configuring another is an error (exit 1)."""
    run_dir = run_dir_with_checkpoint(tmp_path, SAVED_ON_FOUR)
    code, out = plan(capsys, "--checkpoint", str(run_dir))
    assert code == 0, out
    resumes = [line for line in out.splitlines() if " resumes" in line]
    assert len(resumes) == 1 and "tp=2 pp=1 ep=1 etp=2 dp=12" in resumes[0]
    assert "does not resume (dp_reshardable state: another tp/pp/ep/etp)" in out
    code, out = plan(capsys, "trainer.tp=4", "--checkpoint", str(run_dir))
    assert code == 1, out
    assert "ERROR: --checkpoint: " in out and "resume once with trainer.tp=2" in out


def test_a_directory_without_a_checkpoint_is_refused(tmp_path, capsys):
    code, out = plan(capsys, "--checkpoint", str(tmp_path))
    assert code == 2
    assert f"--checkpoint {tmp_path}: {tmp_path} holds no trainer checkpoint" in out
