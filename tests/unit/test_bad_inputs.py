"""Unit tier: every bad input is named before anything starts (docs/troubleshooting.md).

One row per bad input: the ``armor`` command line (run as a subprocess, like a user would),
the expected message fragment. Each must exit 2 with that fragment on stderr and must not
have started Ray (its temp dir, ``RAY_TMPDIR``, stays empty). The fixture is a well-formed
model directory and data set that each row breaks in one place.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from megatron_armor.orchestration.run.run_lock import process_start_ticks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from crafted_checkpoint import write_checkpoint_of_model  # noqa: E402

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = {
    "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 64, "max_position_embeddings": 128, "torch_dtype": "float32",
}  # fmt: skip


def _qwen2_weights() -> dict[str, torch.Tensor]:
    """Every tensor of an HF Qwen2 model of :data:`TINY_CONFIG` (transformers builds it)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**TINY_CONFIG))
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def _model_dir(path: Path, config: dict | str | None = TINY_CONFIG, tokenizer: bool = True,
               drop: str = "", cut: int = 0) -> Path:  # fmt: skip
    """A model directory; ``drop`` leaves that tensor out, ``cut`` truncates the weights file
    to that many bytes (a download that stopped)."""
    path.mkdir(parents=True)
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (path / "config.json").write_text(text)
    if tokenizer:
        (path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {}}))
    weights = {k: v for k, v in _qwen2_weights().items() if k != drop}
    save_file(weights, str(path / "model.safetensors"))
    if cut:
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[:cut])
    return path


def _evaluated_run(path: Path) -> Path:
    """A run directory (its resolved config.yaml) that validated at steps 0 and 2 of 3."""
    from megatron_armor.config import load_config, save_config

    save_config(load_config(str(REPO / "configs" / "tiny_cpu.yaml"), ["run.steps=3"]), path)
    rows = [{"step": 0, "val/val/avg@2": 0.5}, {"step": 1}, {"step": 2, "val/val/avg@2": 0.6}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, answers: list) -> Path:
    rows = len(answers)
    table = pa.table({"problem": [f"{i} + 1 = ?" for i in range(rows)], "answer": answers})
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A good model dir and data file, and one broken copy of each kind."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "b").mkdir()
    out = {
        "model": _model_dir(root / "model"),
        "no_config": _model_dir(root / "no_config", config=None),
        "bad_json": _model_dir(root / "bad_json", config='{"model_type": "qwen2",\n  "x": }'),
        "no_tokenizer": _model_dir(root / "no_tokenizer", tokenizer=False),
        "gpt2": _model_dir(root / "gpt2", config={**TINY_CONFIG, "model_type": "gpt2"}),
        "data": _parquet(root / "train.parquet", [str(i + 1) for i in range(8)]),
        "nan": _parquet(root / "nan.parquet", [math.nan, None, math.nan]),
        "empty": root / "empty.parquet",
        "csv": root / "train.csv",
        "syntax": root / "syntax.yaml",
        "duplicate": root / "duplicate.yaml",
        "locked": root / "runs",
        "truncated": _model_dir(root / "truncated", cut=20_000),
        "partial": _model_dir(root / "partial", drop="model.layers.1.mlp.down_proj.weight"),
        "other_ckpt": root / "other" / "checkpoints" / "step_000002",
        "same_stem": _parquet(root / "b" / "train.parquet", ["1", "2"]),  # the stem of "data"
        "reused": root / "reused",
        "evaluated": _evaluated_run(root / "evaluated"),
    }
    bigger = {**TINY_CONFIG, "hidden_size": 64, "num_hidden_layers": 4}  # another model size
    write_checkpoint_of_model(out["other_ckpt"], bigger, 2)
    pq.write_table(pa.table({"problem": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   out["empty"])  # fmt: skip
    out["csv"].write_text("problem,answer\n1 + 1,2\n")
    out["syntax"].write_text("base: configs/tiny_cpu.yaml\nrun:\n  steps: [3\n  name: x\n")
    out["duplicate"].write_text("run:\n  steps: 3\n  seed: 1\n  steps: 4\n")
    (root / "cycle_b.yaml").write_text("base: cycle.yaml\n")
    out["cycle"] = root / "cycle.yaml"
    out["cycle"].write_text("base: cycle_b.yaml\n")
    lock = out["locked"] / "busy" / ".lock"  # a live run (this test process) holds the dir
    lock.parent.mkdir(parents=True)
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": 0}))
    # the lock of a run that died, whose pid now belongs to another process (this one)
    reused = out["reused"] / "old" / ".lock"
    reused.parent.mkdir(parents=True)
    reused.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": 0,
                                  "start_ticks": process_start_ticks(os.getpid()) - 1}))  # fmt: skip
    return out


def train(*overrides: str, config: str = "configs/tiny_cpu.yaml") -> list[str]:
    base = ["train", config, "trainer.model_path={model}", "data.train_files=[{data}]",
            "data.val_files=[{data}]", "run.output_dir={runs}"]  # fmt: skip
    return base + list(overrides)


def evaluate(*options: str) -> list[str]:
    return ["eval", "--model", "{model}", "--data", "{data}", "--out", "{runs}/eval", *options]


# (case id, armor arguments with {placeholders}, fragment the error must contain)
CASES = [
    ("yaml_syntax", train(config="{syntax}"), "syntax.yaml:4:"),
    ("yaml_duplicate_key", train(config="{duplicate}"), "duplicate.yaml:4:"),
    ("unknown_key", train("trainer.lrr=1"), "unknown key `trainer.lrr`"),
    ("negative_lr", train("trainer.lr=-1"), "trainer.lr=-1.0: must be > 0"),
    ("adam_eps", train("trainer.adam_eps=0"), "trainer.adam_eps=0.0: must be > 0"),
    ("max_skipped", train("trainer.max_skipped_updates=0"), "trainer.max_skipped_updates=0: must be >= 1"),
    ("correction_bounds", train("algo.rollout_correction.low=3"), "algo.rollout_correction.low=3.0, high=2.0"),
    ("reward_timeout", train("reward.timeout_s=-1"), "reward.timeout_s=-1.0: must be > 0"),
    ("reward_workers", train("reward.num_workers=0"), "reward.num_workers=0: must be >= 1"),
    ("engine_batch", train("rollout.engine_batch_size=0"), "rollout.engine_batch_size=0"),
    ("micro_batch_tokens", train("trainer.micro_batch_tokens=0"), "trainer.micro_batch_tokens=0"),
    ("val_temperature", train("validation.temperature=0"), "validation.temperature=0.0: must be > 0"),
    ("steps", train("run.steps=0"), "run.steps=0: must be >= 1"),
    ("min_batch_fraction", train("algo.min_batch_fraction=2"), "algo.min_batch_fraction=2.0: must lie in [0, 1]"),
    ("retire_solved_after", train("data.retire_solved_after=-1"), "data.retire_solved_after=-1: must be >= 0"),
    ("max_recoveries", train("run.max_recoveries=-1"), "run.max_recoveries=-1: must be >= 0"),
    ("base_cycle", train(config="{cycle}"), "`base:` cycle: cycle.yaml -> cycle_b.yaml -> cycle.yaml"),
    ("minibatch", train("rollout.batch=3", "trainer.ppo_mini_batch=2"), "must divide rollout.batch=3"),
    ("idle_gpus", train("orchestration.layout=colocated", "orchestration.nodes=4", "trainer.world_size=8"),
     "trainer.world_size=8 leaves 24 of the job's orchestration.nodes=4 x gpus_per_node=8 = 32 GPUs idle"),
    ("context_parallel", train("trainer.cp=2", "trainer.world_size=2"), "trainer.cp=2: context parallelism is not implemented"),
    ("too_few_ranks", train("trainer.tp=4", "trainer.pp=2", "trainer.world_size=4"),
     "trainer.world_size=4: fewer ranks than one model replica needs, tp*pp*cp=4*2*1=8"),
    ("expert_tp_dense", train("trainer.etp=2", "trainer.world_size=2"), "trainer.etp=2: {model}/config.json is a dense model"),
    ("distributed_colocated", train("rollout.backend=sglang", "orchestration.layout=colocated",
                                    "rollout.sglang.weight_transport=distributed"),
     "rollout.sglang.weight_transport='distributed' with orchestration.layout='colocated'"),
    ("colocated_memory", train("rollout.backend=sglang", "orchestration.layout=colocated",
                               "orchestration.gpu_memory_gib=2"),
     "orchestration.layout='colocated' does not fit orchestration.gpu_memory_gib=2: the rollout phase"),
    ("te_on_cpu", train("trainer.transformer_impl=te"), "trainer.transformer_impl='te': Transformer Engine does not import"),
    ("nan_answers", train("data.train_files=[{nan}]"), "row 0: answer is missing, NaN"),
    ("zero_rows", train("data.train_files=[{empty}]"), "empty.parquet: the file has no rows"),
    ("missing_data", train("data.train_files=[{runs}/nope.parquet]"), "nope.parquet: data file not found"),
    ("csv_data", train("data.train_files=[{csv}]"), "unsupported file type '.csv'"),
    ("no_config_json", train("trainer.model_path={no_config}"), "no config.json in it"),
    ("bad_config_json", train("trainer.model_path={bad_json}"), "config.json: invalid JSON at line 2"),
    ("no_tokenizer", train("trainer.model_path={no_tokenizer}"), "no tokenizer"),
    ("unsupported_arch", train("trainer.model_path={gpt2}"), "model_type='gpt2' is not supported"),
    ("local_path_missing", train("trainer.model_path={runs}/no_model"), "no_model': no such directory"),
    ("hub_name", train("trainer.model_path=Qwen/Qwen2.5-Math-7B"), "never fetched from the hub"),
    ("run_dir_in_use", train("run.output_dir={locked}", "run.name=busy"), "in use by another run"),
    # a reused pid is not the run's: its lock is taken over, and the next check refuses
    ("reused_pid_lock", train("run.output_dir={reused}", "run.name=old", "--resume", "{runs}/nowhere"),
     "no such checkpoint directory"),
    ("val_same_stem", train("data.val_files=[{data},{same_stem}]"),
     "'{data}' and '{same_stem}' are both benchmark 'train'"),
    ("resume_path_missing", train("--resume", "{runs}/nowhere"), "no such checkpoint directory"),
    ("resume_other_model", train("--resume", "{other_ckpt}"), "holds a model of another shape than trainer.model_path"),
    ("seed", train("run.seed=-1"), "run.seed=-1: must be an integer in [0, 2147483647]"),
    ("wandb_mode", train("logging.wandb_mode=cloud"), "logging.wandb_mode='cloud': unknown name"),
    ("watched_metric_file", train("validation.every=1", "run.keep_best.metric=val/aime24/avg@k"),
     "run.keep_best.metric='val/aime24/avg@k' reads benchmark 'aime24'"),
    ("truncated_weights", train("trainer.model_path={truncated}"), "model.safetensors: tensor"),
    ("missing_tensor", train("trainer.model_path={partial}"), "lack 1 of the 27 tensors its config.json needs (qwen2, 2 layers), e.g. model.layers.1.mlp.down_proj.weight"),
    ("output_dir_not_a_dir", train("run.output_dir={data}/runs"),
     "run.output_dir='{data}/runs' cannot be created or written (NotADirectoryError: "),
    ("eval_step_beyond_the_run", evaluate("--config", "{evaluated}", "--step", "999"),
     "--step 999: the run {evaluated} has neither a validation nor a checkpoint at that step; "
     "its validated and checkpointed steps: 0, 2"),
    ("eval_step_not_validated", evaluate("--config", "configs/tiny_cpu.yaml", "--step", "3"),
     "--step 3: no validation of the run at that step (run.steps=60, validation.every=10): the "
     "validated steps are 0, 10, 20, 30, 40, 50, 60"),
    ("eval_temperature", evaluate("--temperature", "-1"), "validation.temperature=-1.0"),
    ("eval_k", evaluate("--k", "0"), "validation.n_samples=0"),
    ("eval_model_missing", ["eval", "--model", "{runs}/m", "--data", "{data}"], "--model="),
    ("eval_nan_answers", ["eval", "--model", "{model}", "--data", "{nan}"], "row 0: answer is"),
    ("plan_gpus_per_node", ["plan", "configs/tiny_cpu.yaml", "orchestration.gpus_per_node=0"],
     "orchestration.gpus_per_node=0: must be >= 1"),
    ("plan_gpu_mem", ["plan", "configs/tiny_cpu.yaml", "--gpu-mem", "-80"], "--gpu-mem-gib=-80"),
]  # fmt: skip


PARALLEL = 4  # the rows run concurrently (each is one short, mostly import-bound process)


def _run_case(case_id: str, args: list[str], inputs: dict[str, Path], root: Path) -> dict:
    runs, ray_tmp = root / case_id / "runs", root / case_id / "ray"
    ray_tmp.mkdir(parents=True)
    fill = {k: str(v) for k, v in inputs.items()} | {"runs": str(runs)}
    cmd = [sys.executable, "-m", "megatron_armor.cli", *(a.format(**fill) for a in args)]
    env = dict(os.environ, RAY_TMPDIR=str(ray_tmp), HF_HUB_OFFLINE="0")  # no hub lookup either
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return {"code": done.returncode, "stderr": done.stderr, "stdout": done.stdout, "fill": fill,
            "seconds": time.perf_counter() - start, "ray": sorted(p.name for p in ray_tmp.iterdir())}  # fmt: skip


@pytest.fixture(scope="module")
def outcomes(inputs, tmp_path_factory) -> dict[str, dict]:
    """Every row of :data:`CASES` run once, :data:`PARALLEL` at a time."""
    root = tmp_path_factory.mktemp("cases")
    with ThreadPoolExecutor(PARALLEL) as pool:
        futures = {c[0]: pool.submit(_run_case, c[0], c[1], inputs, root) for c in CASES}
        return {case_id: f.result() for case_id, f in futures.items()}


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("case_id", "fragment"), [(c[0], c[2]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_named_before_anything_starts(case_id, fragment, outcomes):
    got = outcomes[case_id]
    assert got["code"] == 2, (got["code"], got["stderr"][-3000:], got["stdout"][-2000:])
    assert fragment.format(**got["fill"]) in got["stderr"], got["stderr"][-3000:]
    assert "Traceback" not in got["stderr"]
    assert not got["ray"], f"Ray was started ({got['seconds']:.1f}s in): {got['ray']}"


def test_a_refused_second_run_never_says_it_started(outcomes):
    """The lock is taken before the driver announces the run: the refusal is the only line."""
    got = outcomes["run_dir_in_use"]
    assert "armor train: starting" not in got["stdout"] + got["stderr"], got["stdout"]


def test_a_lock_whose_pid_is_now_another_process_is_taken_over(outcomes):
    """The lock's pid is alive on this host but started at another time: not the run's."""
    got = outcomes["reused_pid_lock"]
    pid = os.getpid()
    assert f"taking over the stale lock of pid {pid} on {socket.gethostname()}" in got["stdout"]
    assert f"pid {pid} is now another process" in got["stdout"], got["stdout"]


def test_the_listed_inputs_fail_in_seconds_and_leave_no_trace(outcomes):
    """A bad seed, weights or resume checkpoint is refused within seconds (no model is
    loaded, Ray never starts) and writes nothing into the run directory (no ``config.yaml``,
    ``tb/``, ``resumes.jsonl``)."""
    for case_id in ("seed", "truncated_weights", "missing_tensor", "resume_other_model"):
        got = outcomes[case_id]
        assert got["seconds"] < 60, (case_id, got["seconds"])
        run_dir = Path(got["fill"]["runs"]) / "tiny_cpu"
        assert not run_dir.exists() or not {"config.yaml", "tb", "resumes.jsonl"} & {
            p.name for p in run_dir.iterdir()
        }, (case_id, sorted(p.name for p in run_dir.iterdir()))
