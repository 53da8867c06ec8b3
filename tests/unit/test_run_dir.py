"""Unit tier: checkpoint manifests, resume fallback, stale temp dirs, free space, rotation,
the safe loader, the run-directory lock and the config record of a resumed run."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.orchestration import checkpoints
from megatron_armor.orchestration.run_dir import RESUMES_FILE, announce_resume, open_run_dir
from megatron_armor.orchestration.run_lock import LOCK_FILE, RunDirLocked, RunLock
from megatron_armor.orchestration.run_state import STATE_FILE, RunState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from crafted_checkpoint import (  # noqa: E402
    plant_crafted_metadata,
    plant_crafted_pickle,
    write_checkpoint_of_model,
)

pytestmark = pytest.mark.unit


def _save(run_dir: Path, step: int, keep: int = 3) -> Path:
    tmp = checkpoints.begin_checkpoint(run_dir, step)
    RunState(step=step, policy_version=step).save(tmp)
    (tmp / "trainer").mkdir()
    (tmp / "trainer" / "weights.bin").write_bytes(bytes(range(256)) * 8)
    return checkpoints.commit_checkpoint(run_dir, tmp, step, keep)


def _plant_pickle(checkpoint: Path, marker: Path) -> None:
    plant_crafted_pickle(checkpoint, marker, 0)


def test_manifest_is_written_last_and_detects_truncation(tmp_path):
    path = _save(tmp_path, 2)
    manifest = json.loads((path / checkpoints.MANIFEST).read_text())
    assert set(manifest["files"]) == {STATE_FILE, "meta.json", "trainer/weights.bin"}
    assert all("sha256" in e for e in manifest["files"].values())
    assert checkpoints.manifest_problem(path) is None
    (path / "trainer" / "weights.bin").write_bytes(b"short")
    assert "trainer/weights.bin has 5 bytes" in checkpoints.manifest_problem(path)
    (path / checkpoints.MANIFEST).unlink()
    assert "no manifest.json" in checkpoints.manifest_problem(path)


def test_resume_auto_falls_back_and_says_why_without_deleting(tmp_path, capsys):
    for step in (2, 4, 6):
        _save(tmp_path, step)
    (tmp_path / "checkpoints" / "step_000006" / STATE_FILE).write_bytes(b"")  # truncated
    marker = tmp_path / "pwned"
    _plant_pickle(tmp_path / "checkpoints" / "step_000004", marker)
    chosen = checkpoints.resolve_resume(tmp_path, "auto", RunState.load)
    assert chosen.name == "step_000002" and RunState.load(chosen).step == 2
    out = capsys.readouterr().out
    assert "skipping" in out and "step_000006" in out and "orchestrator.pt has 0 bytes" in out
    assert "step_000004" in out and "safe loader" in out
    assert not marker.exists()  # the crafted pickle never ran
    assert [p.name for _, p in checkpoints.step_dirs(tmp_path)] == [
        "step_000002", "step_000004", "step_000006"
    ]  # fmt: skip


def test_explicit_resume_of_a_crafted_checkpoint_is_refused(tmp_path):
    path = _save(tmp_path, 2)
    marker = tmp_path / "pwned"
    _plant_pickle(path, marker)
    with pytest.raises(pickle.UnpicklingError, match="safe loader"):
        checkpoints.resolve_resume(tmp_path, str(path), RunState.load)
    assert not marker.exists()


def test_rotation_counts_complete_checkpoints_only(tmp_path):
    for step in (1, 2):
        _save(tmp_path, step, keep=2)
    broken = tmp_path / "checkpoints" / "step_000003"
    broken.mkdir()  # a directory without a manifest: neither counted nor deleted
    _save(tmp_path, 4, keep=2)
    names = [p.name for _, p in checkpoints.step_dirs(tmp_path)]
    assert names == ["step_000002", "step_000003", "step_000004"]
    assert [s for s, _ in checkpoints.list_checkpoints(tmp_path)] == [2, 4]


def test_free_space_is_checked_before_a_save(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    usage = checkpoints.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda _: usage._replace(free=100))
    with pytest.raises(checkpoints.CheckpointError, match="not enough free space.*step 2"):
        checkpoints.begin_checkpoint(tmp_path, 2)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert checkpoints.latest_checkpoint(tmp_path).name == "step_000001"


def test_open_run_dir_removes_stale_temps_and_keeps_the_original_config(tmp_path, capsys):
    config = ArmorConfig()
    lock, path = open_run_dir(config, tmp_path, "auto")
    assert path is None and (tmp_path / "config.yaml").is_file()
    _save(tmp_path, 2)
    lock.release()
    (tmp_path / "checkpoints" / ".tmp-step_000003").mkdir()  # killed during a save
    original = (tmp_path / "config.yaml").read_text()
    config.run.steps = 20
    lock, path = open_run_dir(config, tmp_path, "auto")
    lock.release()
    assert path.name == "step_000002"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert "removed" in capsys.readouterr().out
    assert (tmp_path / "config.yaml").read_text() == original
    assert not (tmp_path / RESUMES_FILE).exists()  # recorded once the resume has succeeded
    announce_resume(tmp_path, config, 2)
    record = json.loads((tmp_path / RESUMES_FILE).read_text().splitlines()[-1])
    assert record["step"] == 2 and record["changed"] == {"run.steps": [10, 20]}
    with pytest.raises(checkpoints.CheckpointError, match="--resume none"):
        open_run_dir(config, tmp_path, "none")
    assert not (tmp_path / LOCK_FILE).exists()  # released after the refusal


TINY = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "vocab_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def _model(path: Path, hf: dict) -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf))
    return str(path)


def test_a_checkpoint_of_another_model_size_is_refused_before_anything_starts(tmp_path):
    """``--resume auto`` and ``--resume PATH`` alike, naming both shapes; a checkpoint of the
    same model is accepted, whatever its vocabulary padding."""
    run_dir, config = tmp_path / "run", ArmorConfig()
    ckpt = write_checkpoint_of_model(run_dir / "checkpoints" / "step_000002", TINY, 2)
    config.trainer.model_path = _model(tmp_path / "bigger", {**TINY, "num_hidden_layers": 4})
    for resume in ("auto", str(ckpt)):
        with pytest.raises(checkpoints.CheckpointError) as err:
            open_run_dir(config, run_dir, resume)
        message = str(err.value)
        assert f"--resume {resume}: {ckpt} holds a model of another shape" in message, message
        assert "num_hidden_layers=4" in message and "[2, 64, 32] in the checkpoint" in message
        assert not (run_dir / LOCK_FILE).exists() and not (run_dir / RESUMES_FILE).exists()
    padded = {**TINY, "vocab_size": 60}  # the checkpoint's 64 rows: padding of a 60-token vocab
    config.trainer.model_path = _model(tmp_path / "same", padded)
    lock, path = open_run_dir(config, run_dir, "auto")
    lock.release()
    assert path == ckpt


def test_crafted_trainer_metadata_is_refused_without_running_it(tmp_path):
    run_dir, config = tmp_path / "run", ArmorConfig()
    ckpt = write_checkpoint_of_model(run_dir / "checkpoints" / "step_000002", TINY, 2)
    marker = tmp_path / "pwned"
    plant_crafted_metadata(ckpt, marker, 2)
    config.trainer.model_path = _model(tmp_path / "model", TINY)
    with pytest.raises(checkpoints.CheckpointError, match="not checkpoint metadata"):
        open_run_dir(config, run_dir, "auto")
    assert not marker.exists()


def test_second_writer_is_refused_and_a_stale_lock_taken_over(tmp_path, capsys):
    first = RunLock(tmp_path).acquire()
    with pytest.raises(RunDirLocked, match=f"pid {os.getpid()} on {socket.gethostname()}"):
        RunLock(tmp_path).acquire()
    first.release()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    holder = {"pid": int(dead.stdout), "host": socket.gethostname(), "since": 0}
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    lock = RunLock(tmp_path).acquire()
    assert "stale lock" in capsys.readouterr().out
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_convert_reads_the_run_precision_and_writes_a_matching_config(tmp_path):
    from megatron_armor.cli.convert_cmd import run_precision
    from megatron_armor.config import save_config
    from megatron_armor.trainer.convert import write_hf_config

    config = ArmorConfig()
    config.trainer.precision = "fp32"
    save_config(config, tmp_path / "run")
    step = tmp_path / "run" / "checkpoints" / "step_000001"
    (step / "trainer").mkdir(parents=True)
    assert run_precision(str(step)) == run_precision(str(step / "trainer")) == "fp32"
    with pytest.raises(ValueError, match="pass --precision"):
        run_precision(str(tmp_path / "elsewhere" / "a" / "b"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    write_hf_config(str(tmp_path / "model"), str(tmp_path), "float32")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float32"
