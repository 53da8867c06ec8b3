"""Unit tier: checkpoint manifests, resume fallback, stale temp dirs, free space, rotation,
the safe loader, the run-directory lock and the config record of a resumed run."""

from __future__ import annotations

import errno
import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.orchestration.run import checkpoints, disk_space
from megatron_armor.orchestration.run.run_dir import RESUMES_FILE, announce_resume, open_run_dir
from megatron_armor.orchestration.run.run_lock import LOCK_FILE, RunDirLocked, RunLock
from megatron_armor.orchestration.run.run_state import STATE_FILE, RunState

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


def _huge_model(path: Path) -> str:
    """An HF config.json of a model whose checkpoint no disk holds (about 22.5 PiB)."""
    return _model(path, {**TINY, "hidden_size": 2**20, "intermediate_size": 2**22,
                         "num_hidden_layers": 96, "vocab_size": 2**17})  # fmt: skip


@pytest.mark.parametrize(
    ("count", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (7.4 * 2**20, "7.4 MiB"),
     (0.01 * 2**30, "10.2 MiB"), (3 * 2**40, "3 TiB")],
)  # fmt: skip
def test_sizes_are_written_in_the_unit_that_fits(count, text):
    assert disk_space.format_bytes(count) == text


def test_free_space_is_checked_before_the_first_checkpoint_too(tmp_path):
    """Before any checkpoint exists the need is estimated from the model: weights, reference
    and Adam's state (16 bytes per parameter in fp32 and in bf16)."""
    huge = _huge_model(tmp_path / "huge")
    estimate = disk_space.estimated_checkpoint_bytes(huge, "bf16")
    with pytest.raises(disk_space.DiskFullError) as err:
        disk_space.check_free_space(tmp_path / "run", 2, estimate)
    message = str(err.value)
    assert "not enough free space for the checkpoint of step 2: about 24.8 PiB needed" in message
    assert "(the model's checkpoint is about 22.5 PiB)" in message and " free under " in message
    tiny = disk_space.estimated_checkpoint_bytes(_model(tmp_path / "tiny", TINY), "fp32")
    assert tiny == 16 * 22_816  # TINY's parameters
    assert disk_space.check_free_space(tmp_path / "run", 2, tiny) == int(tiny * 1.1)


def test_free_space_before_a_later_save_follows_the_previous_checkpoint(tmp_path):
    _save(tmp_path, 1)
    size = checkpoints.directory_bytes(checkpoints.latest_checkpoint(tmp_path))
    assert disk_space.space_needed(tmp_path, 10**18) == (
        int(size * 1.1),
        f"step_000001 is {disk_space.format_bytes(size)}",
    )


def test_a_save_that_ran_out_of_space_is_removed_and_named(tmp_path):
    """The trainer's write fails (torch says ``basic_ios::clear: iostream error``, no errno):
    the partial directory goes, the error names the path, the bytes needed and free, and the
    intact previous checkpoint; an ``ENOSPC`` from anywhere in the cause chain is named too,
    another failure with room to spare is not turned into one."""
    _save(tmp_path, 2)
    need = disk_space.estimated_checkpoint_bytes(_huge_model(tmp_path / "huge"), "bf16")
    tmp = checkpoints.begin_checkpoint(tmp_path, 4)
    (tmp / "trainer").mkdir()
    (tmp / "trainer" / "part.distcp").write_bytes(b"x" * 4096)
    err = disk_space.no_space_error(
        tmp_path, 4, tmp, RuntimeError("basic_ios::clear: iostream error"), need
    )
    message = str(err)
    assert isinstance(err, disk_space.DiskFullError) and not tmp.exists()
    assert (
        f"writing the checkpoint of step 4 to {tmp_path / 'checkpoints' / 'step_000004'}" in message
    )
    assert "(RuntimeError: basic_ios::clear: iostream error)" in message and "PiB needed" in message
    assert (
        f"the previous checkpoint {tmp_path / 'checkpoints' / 'step_000002'} is intact" in message
    )
    assert checkpoints.latest_checkpoint(tmp_path).name == "step_000002"
    tmp = checkpoints.begin_checkpoint(tmp_path, 4)
    try:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "x"))
    except OSError as cause:
        wrapped = RuntimeError("the trainer's save failed")
        wrapped.__cause__ = cause
    assert "No space left" in str(disk_space.no_space_error(tmp_path, 4, tmp, wrapped, 1))
    tmp = checkpoints.begin_checkpoint(tmp_path, 4)
    assert disk_space.no_space_error(tmp_path, 4, tmp, ValueError("a bug"), 1) is None


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


def _checkpoint_with_layout(tmp_path: Path, config: ArmorConfig) -> tuple[Path, Path, object]:
    """A run directory with a checkpoint of the tiny shape and ``config`` set to resume it
    with the distributed optimizer; returns ``(run_dir, checkpoint, save)``: ``save(layout)``
    writes the layout the trainer's save records (``trainer/dist/common.pt``)."""
    import torch

    run_dir = tmp_path / "run"
    ckpt = write_checkpoint_of_model(run_dir / "checkpoints" / "step_000002", TINY, 2)
    checkpoints.write_manifest(ckpt, 2)
    t = config.trainer
    t.model_path, t.use_distributed_optimizer = _model(tmp_path / "m", TINY), True

    def save(layout: dict) -> None:
        common = {"optimizer_stepped": True, "parallel_layout": layout}
        torch.save(common, ckpt / "trainer" / "dist" / "common.pt")

    return run_dir, ckpt, save


def _resumes(config: ArmorConfig, run_dir: Path, ckpt: Path) -> Path:
    lock, path = open_run_dir(config, run_dir, str(ckpt))
    lock.release()
    return path


def test_a_dp_reshardable_checkpoint_resumes_at_its_own_model_parallel_layout_only(tmp_path):
    """A save that records no ``optimizer_format`` holds ``dp_reshardable`` state: it loads
    at another data-parallel size only, so another tp / pp / ep / etp is refused before
    anything starts, naming the saved layout and the one to resume at; so is switching the
    optimizer kind. A save without ``ep`` / ``etp`` predates expert parallelism: ep 1, etp
    its tp."""
    config = ArmorConfig()
    run_dir, ckpt, save = _checkpoint_with_layout(tmp_path, config)
    t = config.trainer
    save({"tp": 2, "pp": 1, "distributed_optimizer": True})
    t.tp, t.world_size = 1, 4
    with pytest.raises(checkpoints.CheckpointError) as err:
        open_run_dir(config, run_dir, str(ckpt))
    message = str(err.value)
    assert "saved dp_reshardable at tp=2 pp=1 ep=1 etp=2 (it records" in message, message
    assert "not to tp=1 pp=1 ep=1 etp=1 dp=4" in message, message
    assert "resume once with trainer.tp=2 trainer.pp=1 trainer.ep=1 trainer.etp=2" in message
    assert "saved fully_reshardable and resume at any layout" in message
    t.tp, t.use_distributed_optimizer = 2, False
    with pytest.raises(checkpoints.CheckpointError, match="use_distributed_optimizer=True"):
        open_run_dir(config, run_dir, str(ckpt))
    t.use_distributed_optimizer, t.world_size = True, 8  # DP 2 -> 4: reshards
    assert _resumes(config, run_dir, ckpt) == ckpt
    save({"tp": 1, "pp": 1, "ep": 2, "etp": 1, "distributed_optimizer": True})
    t.tp, t.world_size = 1, 4
    for ep, etp in ((4, "auto"), (2, 2)):
        t.ep, t.etp = ep, etp
        with pytest.raises(checkpoints.CheckpointError) as err:
            open_run_dir(config, run_dir, str(ckpt))
        message = str(err.value)
        assert "at tp=1 pp=1 ep=2 etp=1 (it records no optimizer_format); it reshards over " \
               f"data parallelism only, not to tp=1 pp=1 ep={ep} etp={1 if etp == 'auto' else etp}" \
               in message, message  # fmt: skip
    t.ep, t.etp = 2, "auto"
    assert _resumes(config, run_dir, ckpt) == ckpt


def test_a_fully_reshardable_checkpoint_resumes_at_any_layout_and_says_so(tmp_path, capsys):
    """Today's saves (``optimizer_format: fully_reshardable``) resume at another tp, pp, ep
    and dp: the change is said before anything starts and, once the resume succeeded,
    recorded in ``resumes.jsonl`` as ``layout: {from, to}`` beside the changed settings.
    Switching the optimizer kind is still refused."""
    from megatron_armor.config.loader import save_config

    config = ArmorConfig()
    run_dir, ckpt, save = _checkpoint_with_layout(tmp_path, config)
    t = config.trainer
    t.tp, t.world_size = 2, 4
    save_config(config, run_dir)  # the config the run started with
    save({"tp": 2, "pp": 1, "ep": 1, "etp": 2, "dp": 2, "world_size": 4,
          "distributed_optimizer": True, "optimizer_format": "fully_reshardable"})  # fmt: skip
    assert _resumes(config, run_dir, ckpt) == ckpt
    assert "resharded" not in capsys.readouterr().out  # the same layout
    t.tp, t.pp, t.world_size = 1, 2, 6  # tp 2 -> 1, pp 1 -> 2, dp 2 -> 3
    assert _resumes(config, run_dir, ckpt) == ckpt
    said = "resume: step_000002 was saved at tp=2 pp=1 ep=1 etp=2 dp=2; resharded on load to " \
           "tp=1 pp=2 ep=1 etp=1 dp=3"  # fmt: skip
    assert said in capsys.readouterr().out
    announce_resume(run_dir, config, 2, ckpt)
    record = json.loads((run_dir / RESUMES_FILE).read_text().splitlines()[-1])
    assert record["layout"] == {"from": {"tp": 2, "pp": 1, "ep": 1, "etp": 2, "dp": 2},
                                "to": {"tp": 1, "pp": 2, "ep": 1, "etp": 1, "dp": 3}}  # fmt: skip
    assert record["changed"]["trainer.tp"] == [2, 1]
    t.use_distributed_optimizer = False
    with pytest.raises(checkpoints.CheckpointError, match="use_distributed_optimizer=True"):
        open_run_dir(config, run_dir, str(ckpt))


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


def test_convert_reads_the_run_precision_and_overrides_and_writes_a_matching_config(tmp_path):
    from argparse import Namespace

    from megatron_armor.cli.convert_cmd import resolve_source
    from megatron_armor.config import save_config
    from megatron_armor.trainer.convert import write_hf_config

    config = ArmorConfig()
    config.trainer.precision = "fp32"
    config.trainer.model_overrides = {"rope_theta": 40000, "max_position_embeddings": 512}
    save_config(config, tmp_path / "run")
    step = tmp_path / "run" / "checkpoints" / "step_000001"
    (step / "trainer").mkdir(parents=True)
    for path in (step, step / "trainer"):
        args = Namespace(to_hf=str(path), name=None, model="m", precision=None)
        assert resolve_source(args) == (str(path), "m", "fp32", config.trainer.model_overrides)
    elsewhere = Namespace(to_hf=str(tmp_path / "elsewhere" / "a" / "b"), name=None, model="m",
                          precision=None)  # fmt: skip
    with pytest.raises(ValueError, match="pass --precision"):
        resolve_source(elsewhere)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(
        json.dumps({"torch_dtype": "bfloat16", "rope_theta": 10000.0, "rope_scaling": None})
    )
    write_hf_config(str(tmp_path / "model"), str(tmp_path), "float32", {"rope_theta": 40000})
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["torch_dtype"] == "float32"
    assert written["rope_parameters"] == {"rope_type": "default", "rope_theta": 40000.0}
    assert written["rope_theta"] == 40000.0 and written["rope_scaling"] is None


def test_non_distributed_moe_optimizer_state_does_not_cross_ep_one(tmp_path):
    """The non-distributed optimizer keeps a MoE model's expert state in a second optimizer
    only at ep > 1: its checkpoint resumes at another ep > 1 but not at ep 1 (nor the other
    way), refused before anything starts naming the ep to resume with."""
    config = ArmorConfig()
    run_dir, ckpt, save = _checkpoint_with_layout(tmp_path, config)
    t = config.trainer
    t.use_distributed_optimizer, t.world_size = False, 4
    save({"tp": 1, "pp": 1, "ep": 2, "etp": 1, "dp": 2, "world_size": 2,
          "distributed_optimizer": False})  # fmt: skip
    t.ep = 4
    assert _resumes(config, run_dir, ckpt) == ckpt
    t.ep = 1
    with pytest.raises(checkpoints.CheckpointError) as err:
        open_run_dir(config, run_dir, str(ckpt))
    message = str(err.value)
    assert "non-distributed optimizer state of a mixture-of-experts model saved at ep=2" in message
    assert "does not load at ep=1; resume with trainer.ep > 1" in message, message
