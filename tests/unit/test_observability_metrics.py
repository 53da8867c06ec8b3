"""Unit tier: metric sinks, phase timers, plots and the end-of-run summary (no Ray, no model)."""

from __future__ import annotations

import errno
import json
import threading
import time

import pytest

from megatron_armor.observability.metrics import (
    MetricsLogger,
    read_metrics,
    truncate_metrics,
    wandb_run_id,
)
from megatron_armor.observability.plot import plot_run, reset_steps, series
from megatron_armor.observability.summary import step_line, summarize, write_summary
from megatron_armor.observability.timers import PhaseTimers

pytestmark = pytest.mark.unit


def _fill(run_dir, steps=4, tensorboard=False):
    logger = MetricsLogger(run_dir, tensorboard=tensorboard)
    for step in range(steps + 1):
        m = {"val/tiny/avg@4": 0.5 + 0.01 * step} if step % 2 == 0 else {}
        if step:
            m.update(
                {
                    "reward/policy_mean": -1 + 0.1 * step,
                    "kl/reverse_k3": 0.01 * step,
                    "kl/forward_k1": 0.02,
                    "anchor/acceptance_rate": 0.5,
                    "loss/clipfrac_high": 0.001,
                    "reset/performed": float(step == 2),
                    "timing/step_s": 1.5,
                    "mem/run_gb": 2.0 + 0.01 * step,
                    "mem/node0_used_gb": 8.0,
                }
            )
        if step == 4:
            m.update({"disk/run_dir_gb": 0.5, "disk/checkpoint_gb": 0.2})
        logger.log(step, m)
    logger.close()


def test_jsonl_one_record_per_step_with_namespaced_keys(tmp_path):
    _fill(tmp_path)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[1]["reward/policy_mean"] == pytest.approx(-0.9)
    assert all("wall_time" in r for r in records)


def test_non_finite_values_are_written_as_they_are_and_flagged(tmp_path):
    """A NaN is a NaN in metrics.jsonl (``NaN``, ``Infinity``: Python's json, pandas), in
    TensorBoard and on the console line, never a silent ``null``."""
    import math

    logger = MetricsLogger(tmp_path, tensorboard=True)
    clean = logger.log(1, {"loss/pg": float("nan"), "loss/ratio_max": float("inf"), "lr": 1e-6})
    logger.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert '"loss/pg": NaN' in line and '"loss/ratio_max": Infinity' in line
    record = read_metrics(tmp_path)[0]
    assert math.isnan(record["loss/pg"]) and record["loss/ratio_max"] == math.inf
    assert record["lr"] == 1e-6
    text = step_line(1, 4, clean)
    assert "NON-FINITE loss/pg, loss/ratio_max" in text
    assert "NON-FINITE" not in step_line(1, 4, {"lr": 1e-6, "loss/pg": 0.5})


def test_skipped_updates_are_flagged_on_the_console():
    m = {"train/skipped_updates": 1.0, "train/updates": 2.0, "loss/pg": float("nan")}
    assert "SKIPPED 1/2 updates" in step_line(3, 4, m)
    assert "SKIPPED" not in step_line(3, 4, {**m, "train/skipped_updates": 0.0})
    rows = {r[0]: r for r in summarize([{"step": 3, **m}, {"step": 4, "loss/pg": 0.5}])}
    assert rows["policy loss"][1:] == ("+nan", "+0.5000", "+0.5000")  # max over finite values


def test_truncate_drops_steps_a_resume_recomputes(tmp_path):
    _fill(tmp_path)
    assert truncate_metrics(tmp_path, 2) == 3
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    assert truncate_metrics(tmp_path, -1) == 0


def test_tensorboard_event_file_written(tmp_path):
    _fill(tmp_path, steps=2, tensorboard=True)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_a_failed_write_of_tensorboards_thread_is_raised_by_the_sink_without_a_traceback(
    tmp_path, monkeypatch
):
    """The disk fills while TensorBoard's writer thread writes (it writes the queue in the
    background): the sink's flush raises the error with the folder, for the driver to name,
    and the thread's own re-raise prints nothing. The failed write is
    ``RecordWriter.write`` raising ENOSPC, as the real file write under it does on a full
    disk; another thread's error still reaches Python's hook."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    from tensorboard.summary.writer.record_writer import RecordWriter

    reported: list[threading.ExceptHookArgs] = []  # what reaches the hook there was before
    monkeypatch.setattr(threading, "excepthook", reported.append)
    logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.log(1, {"reward/policy_mean": 0.5})

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RecordWriter, "write", full)
    with pytest.raises(OSError) as err:
        for step in range(2, 6):  # the thread may take the first record after its flush
            logger.log(step, {"reward/policy_mean": 0.5})
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tmp_path / "tb")
    for thread in threading.enumerate():
        if isinstance(thread, _AsyncWriterThread):
            thread.join(timeout=30)
    other = threading.Thread(target=lambda: 1 / 0)
    other.start()
    other.join()
    assert [type(args.exc_value) for args in reported] == [ZeroDivisionError], reported


def tensorboard_scalars(log_dir, tag: str) -> dict[int, float]:
    """``{step: value}`` of ``tag`` as TensorBoard shows it (its reader purges what a later
    event file's first event drops)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), purge_orphaned_data=True)
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def test_a_resume_from_an_older_checkpoint_rewinds_tensorboard_and_wandb(tmp_path, monkeypatch):
    """Steps 1-6 logged, the run resumes from the checkpoint of step 3 and logs 4-5 again
    (another trajectory): metrics.jsonl, TensorBoard and W&B (offline) all continue from step 3.
    W&B's own server applies ``resume_from``; offline, the run is re-opened with it."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    from megatron_armor.observability.metrics import WandbSettings

    settings = WandbSettings(project="armor-test", mode="offline")
    logger = MetricsLogger(tmp_path, tensorboard=True, wandb=True, wandb_settings=settings)
    for step in range(1, 7):
        logger.log(step, {"reward/policy_mean": float(step)})
    logger.close()
    logger = MetricsLogger(tmp_path, tensorboard=True, wandb=True, wandb_settings=settings)
    assert logger.rewind(3) == 3
    wandb_run = logger.sinks[1].run
    assert (wandb_run.id, wandb_run.settings.resume_from.value) == (wandb_run_id(tmp_path, None), 4)
    for step in (4, 5):
        logger.log(step, {"reward/policy_mean": 10.0 * step})
    logger.close()
    assert {r["step"]: r["reward/policy_mean"] for r in read_metrics(tmp_path)} == {
        1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0, 5: 50.0}  # fmt: skip
    shown = tensorboard_scalars(tmp_path / "tb", "reward/policy_mean")
    assert shown == {1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0, 5: 50.0}, shown
    again = MetricsLogger(tmp_path, tensorboard=True)  # the newest checkpoint: nothing to drop
    assert again.rewind(5) == 0
    again.close()
    assert tensorboard_scalars(tmp_path / "tb", "reward/policy_mean") == shown


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def block(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("blocked")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", block)
    with pytest.raises(RuntimeError, match="requirements-wandb.txt"):
        MetricsLogger(tmp_path, tensorboard=False, wandb=True)


def test_phase_timers_accumulate_and_clear():
    timers = PhaseTimers()
    with timers.phase("rollout"):
        with timers.phase("generate"):
            time.sleep(0.01)
    with timers.phase("generate"):
        time.sleep(0.01)
    m = timers.pop_metrics()
    assert m["timing/generate_s"] >= 0.02 and m["timing/rollout_s"] >= 0.01
    assert timers.pop_metrics() == {}


def test_plots_written_with_reset_markers(tmp_path):
    _fill(tmp_path)
    records = read_metrics(tmp_path)
    assert reset_steps(records) == [2]
    assert series(records, "val/tiny/avg@4")[0] == [0, 2, 4]
    paths = plot_run(tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["acceptance.png", "clip.png", "disk.png", "kl.png", "memory.png",
                     "reward_vs_val.png"]  # fmt: skip
    assert all(p.stat().st_size > 1000 for p in paths)


def test_mismatch_and_correction_plots_with_a_nan_step(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        nan = step == 2  # a skipped update's NaN: a gap, not a failure
        logger.log(step, {"rollout/policy_mismatch_k3": 1e-4 * step,
                          "rollout/anchor_mismatch_k1": 2e-4,
                          "correction/policy_weight_mean": float("nan") if nan else 1.0,
                          "correction/policy_cut_frac": 0.01})  # fmt: skip
    logger.close()
    records = read_metrics(tmp_path)
    steps, values = series(records, "correction/policy_weight_mean")
    assert steps == [1, 2, 3] and values[0] == 1.0 and values[1] != values[1]
    names = sorted(p.name for p in plot_run(tmp_path))
    assert names == ["correction.png", "mismatch.png"]


def test_plot_of_empty_dir_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)


def test_step_line_and_summary(tmp_path):
    _fill(tmp_path)
    records = read_metrics(tmp_path)
    line = step_line(2, 4, records[2])
    assert line.startswith("step 2/4") and "RESET" in line and "tiny/avg@4 0.520" in line
    rows = {r[0]: r for r in summarize(records)}
    assert rows["train reward (on-policy)"][1:] == ("-0.900", "-0.600", "-0.600")
    text = write_summary(tmp_path, {"plots": "x"})
    assert "reference_resets: [2]" in text
    assert json.loads((tmp_path / "summary.json").read_text())["reference_resets"] == [2]


def test_a_torn_last_line_is_left_out_and_a_damaged_one_elsewhere_is_named(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"a": 1.0})
    path = tmp_path / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 2, "wall_')  # kill -9 during the append
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    assert truncate_metrics(tmp_path, 1) == 1 and path.read_text().endswith("}\n")
    path.write_text('{"step": 1}\n{"step": 2, "wall_\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2 is not a JSON line"):
        read_metrics(tmp_path)


def test_wandb_run_id_is_kept_in_the_run_dir(tmp_path):
    ids = iter(["first", "second"])
    assert wandb_run_id(tmp_path, lambda: next(ids)) == "first"
    assert wandb_run_id(tmp_path, lambda: next(ids)) == "first"  # a requeue: the same run
    assert (tmp_path / "wandb_run_id").read_text() == "first\n"


def test_wandb_without_the_package_is_refused_at_load(monkeypatch):
    import importlib.util

    from megatron_armor.config import load_config
    from megatron_armor.config.inputs import wandb_problems

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else find_spec(name, *a),
    )
    config = load_config(None, ["logging.wandb=true", "logging.wandb_mode=offline"])
    assert [p for p in wandb_problems(config) if "requirements-wandb.txt" in p]
    assert not list(wandb_problems(load_config(None, [])))


def test_a_pipeline_with_wandb_but_without_the_package_exits_2(monkeypatch, capsys):
    import importlib.util

    from megatron_armor.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else find_spec(name, *a),
    )
    assert main(["pipeline", "configs/tiny_pipeline.yaml", "logging.wandb=true"]) == 2
    assert "requirements-wandb.txt" in capsys.readouterr().err


def test_wandb_online_without_a_login_is_refused_at_load_naming_the_key(tmp_path, monkeypatch):
    """A container without the home directory (pyxis ``--no-container-mount-home``) does not see
    ``wandb login``'s ~/.netrc: refused before anything starts, naming WANDB_API_KEY."""
    from megatron_armor.config import load_config
    from megatron_armor.config.inputs import wandb_problems

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("NETRC", raising=False)
    online = load_config(None, ["logging.wandb=true"])
    assert [p for p in wandb_problems(online) if "export WANDB_API_KEY before sbatch" in p]
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    (tmp_path / ".netrc").chmod(0o600)  # as `wandb login` writes it
    assert not [p for p in wandb_problems(online) if "WANDB_API_KEY" in p]  # wandb login's
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert not list(wandb_problems(online))
    monkeypatch.delenv("WANDB_API_KEY")
    offline = load_config(None, ["logging.wandb=true", "logging.wandb_mode=offline"])
    assert not list(wandb_problems(offline))
