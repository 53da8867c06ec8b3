"""Inputs that used to pass without a word: a jsonl file's bad line (named by its 1-based
number) and ``trainer.micro_batch_tokens`` below one sequence (a load-time warning)."""

from __future__ import annotations

import pytest

from megatron_armor.config.ranges import range_warnings
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.data.dataset import bad_json_line, read_table

pytestmark = pytest.mark.unit


def test_a_bad_jsonl_line_is_named_by_its_line_number(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": 2\n')
    with pytest.raises(ValueError, match=r"train.jsonl: cannot be read as json \(line 3: "):
        read_table(str(path))
    path.write_text('{"prompt": "a"}\n[1, 2]\n')
    assert bad_json_line(path) == " (line 2: a JSON list, not an object)"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert bad_json_line(path) == ""


def test_micro_batch_tokens_below_one_sequence_is_said():
    config = ArmorConfig()
    config.data.max_prompt_len, config.rollout.sampling.max_new_tokens = 512, 1024
    config.trainer.micro_batch_tokens = 1000
    (line,) = [w for w in range_warnings(config) if "micro_batch_tokens" in w]
    assert line.startswith("trainer.micro_batch_tokens=1000 is below the longest sequence")
    assert "= 1536" in line and ">= 1536" in line
    config.trainer.micro_batch_tokens = 1536
    assert not [w for w in range_warnings(config) if "micro_batch_tokens" in w]


def test_a_full_disk_outside_a_checkpoint_names_the_file_and_fits_the_state(tmp_path):
    import errno

    from megatron_armor.orchestration.run.disk_space import check_free_space, full_disk_error

    run_dir = tmp_path / "run"
    (run_dir / "anchors").mkdir(parents=True)
    path = run_dir / "anchors" / "step_000003.jsonl"
    err = OSError(errno.ENOSPC, "No space left on device", str(path))
    full = full_disk_error(run_dir, err)
    text = str(full)
    assert text.startswith(f"no space left on the device while writing {path} (OSError: ")
    assert f" free under {run_dir / 'anchors'}; no checkpoint of the run exists yet" in text
    assert "keep_last" not in text
    from megatron_armor.orchestration.run.checkpoints import write_manifest

    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000002" / "orchestrator.pt").write_bytes(b"x")
    write_manifest(run_dir / "checkpoints" / "step_000002", 2)
    assert "the newest checkpoint" in str(full_disk_error(run_dir, err))
    assert full_disk_error(run_dir, OSError(errno.EACCES, "denied", str(path))) is None
    with pytest.raises(Exception, match=r"\(no checkpoint of the run exists yet\)"):
        check_free_space(tmp_path / "fresh", 1, estimate=1 << 60)


def test_a_full_disk_met_by_a_write_names_the_file(tmp_path):
    """A write that meets a full disk (``/dev/full``: every write is ENOSPC) raises an
    ``OSError`` without a file name; the run's writers name theirs, and so does the error."""
    from megatron_armor.observability.metrics import MetricsLogger
    from megatron_armor.orchestration.run.disk_space import full_disk_error

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").symlink_to("/dev/full")
    logger = MetricsLogger(run_dir, tensorboard=False)
    with pytest.raises(OSError) as met:
        logger.log(3, {"loss": 1.0})
    assert met.value.filename == str(run_dir / "metrics.jsonl")
    text = str(full_disk_error(run_dir, met.value))
    assert f"while writing {run_dir / 'metrics.jsonl'} (OSError: " in text, text


def test_a_moe_only_setting_on_a_dense_model_is_said_once_at_load(tmp_path, capsys):
    """``trainer.moe.routing_replay=r3`` (and the other ``trainer.moe`` settings) change
    nothing on a dense model: one warning at load naming them; none for a model with
    experts, or for a model directory that is not there yet."""
    import json

    from megatron_armor.config import load_config

    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
        "max_position_embeddings": 4096}))  # fmt: skip
    moe = ["trainer.moe.routing_replay=r3", "trainer.moe.aux_loss_coeff=0.001"]
    load_config("configs/tiny_cpu.yaml", [f"trainer.model_path={dense}", *moe])
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("warning: ")]
    assert "trainer.moe.aux_loss_coeff=0.001, trainer.moe.routing_replay='r3' change nothing: " in (
        line
    )
    assert f"{dense} is a dense model (model_type='qwen2', no experts)" in line
    load_config("configs/tiny_cpu.yaml", [f"trainer.model_path={tmp_path / 'later'}", *moe])
    load_config("configs/tiny_cpu.yaml", [f"trainer.model_path={dense}"])
    assert capsys.readouterr().err == ""
