"""Dist tier (gloo, 1-2 CPU processes running real megatron-core TP/PP/DP): the Megatron actor.

Each test launches ``trainer_worker.py`` once per rank (bounded by a timeout, free ports) and
compares what the ranks wrote with the single-process run and with HF transformers:

- logits of tiny Qwen2 / Qwen3 (tied, head_dim != hidden/heads) / Llama 3 (rope scaling)
  equal transformers' within 1e-4 (fp32) at TP=1, TP=2, PP=2 and TP=4 (4 processes: more
  ranks than the 2 KV heads, which megatron-core replicates); export after import reproduces
  every HF tensor exactly;
- per-token log-probs, the loss/metrics and the weights after two ARMOR updates (mixed
  ratio, dual clip, token-mean, >= 2 micro-batches of unequal lengths) equal the single-process
  run at TP=2, PP=2, DP=2 and DP=2 with the distributed optimizer;
- ``step_logprobs(shared=True)`` (the loop's call) gives every rank, reporting or not, the
  whole old and reference log-probs, equal to the reporting ranks' parts summed;
- reference log-probs after training equal the initial policy's; after ``reset_reference``
  they equal the current policy's;
- save, exit, load in fresh processes: the next update's metrics and weights are bit-identical,
  also from a checkpoint as saves wrote it before the layout could change on resume
  (``dp_reshardable``);
  ``armor convert --to-hf`` turns the checkpoint into the exported HF tensors.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_models import make_models, oracle_tokens  # noqa: E402

from megatron_armor.net import free_port  # noqa: E402
from megatron_armor.trainer.ranks import run_rank_processes  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_worker.py")
TIMEOUT_S = 240
LOGITS_TOL = 1e-4  # fp32, vs HF transformers
LOGPROB_TOL = 1e-5  # different reduction orders across TP/PP/DP
LOSS_TOL = 1e-5
# Adam turns tiny gradient differences into update differences; an update moves a weight by
# up to lr = 1e-3, so 2e-5 is 50x below one step
WEIGHT_TOL = 2e-5


def launch(
    mode: str, out: str, models: str, tp: int, pp: int, world: int, distopt=False, extras=""
):
    """Run ``world`` worker ranks to completion (bounded) and merge their results."""
    os.makedirs(out, exist_ok=True)
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    commands = [
        [sys.executable, WORKER, mode, str(rank), str(world), port, out, models, str(tp),
         str(pp), "1" if distopt else "0", extras or "-"]
        for rank in range(world)
    ]  # fmt: skip
    logs = [os.path.join(out, f"{mode}_log{rank}.txt") for rank in range(world)]
    run_rank_processes(commands, logs, env, TIMEOUT_S)
    return merge(
        [torch.load(f, weights_only=False) for f in sorted(glob.glob(f"{out}/{mode}_rank*.pt"))]
    )


def merge(results: list[dict]) -> dict:
    """Per-stage weight dicts are united; logits come from the last stage."""
    merged: dict = {}
    for r in results:
        for k, v in r.items():
            if isinstance(v, dict) and (k.startswith("w") or k.startswith("export/")):
                merged.setdefault(k, {}).update(v)
            else:
                merged.setdefault(k, v)
    return merged


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("models"))
    make_models(root)
    return root


@pytest.fixture(scope="module")
def hf_logits(models) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    out = {}
    for name in ("qwen2", "qwen3", "llama"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.join(models, name), dtype=torch.float32
        )
        with torch.no_grad():
            out[name] = model(oracle_tokens()).logits
    return out


@pytest.fixture(scope="module")
def single(models, tmp_path_factory) -> dict:
    return launch("run", str(tmp_path_factory.mktemp("single")), models, 1, 1, 1, extras="oracle")


def assert_oracle(result: dict, hf_logits: dict, models: str) -> None:
    from safetensors.torch import load_file

    for name, ref in hf_logits.items():
        torch.testing.assert_close(result[f"logits/{name}"], ref, atol=LOGITS_TOL, rtol=0)
        hf = load_file(os.path.join(models, name, "model.safetensors"))
        exported = result[f"export/{name}"]
        assert sorted(exported) == sorted(hf)
        for key, tensor in hf.items():
            assert torch.equal(exported[key], tensor), key


# How a rank's samples fall into micro-batches depends on the data-parallel split.
LAYOUT_DEPENDENT = ("train/padding_fraction",)


def assert_same_training(result: dict, single: dict, world: int) -> None:
    for key in ("lp0", "lp_policy", "lp_ref", "lp_ref_after_reset"):
        torch.testing.assert_close(result[key], single[key], atol=LOGPROB_TOL, rtol=0)
    # step_logprobs(shared=True) hands every rank, reporting or not, the whole log-probs
    shared = {k: v for k, v in result.items() if k.startswith("shared/")}
    assert sorted(shared) == [f"shared/{r}" for r in range(world)]
    for old, ref in shared.values():
        assert torch.equal(old, shared["shared/0"][0]) and torch.equal(ref, shared["shared/0"][1])
        torch.testing.assert_close(old, result["lp_policy"], atol=LOGPROB_TOL, rtol=0)
        torch.testing.assert_close(ref, result["lp_ref"], atol=LOGPROB_TOL, rtol=0)
    diag, plain = result["kl2_diag"], result["kl2_diag_plain"]  # the diagnostic's own samples
    assert sorted(diag) == sorted(plain) and diag["kl/exact_reverse"] > 0
    for k, v in plain.items():
        assert diag[k] == pytest.approx(v, abs=LOSS_TOL, rel=LOSS_TOL), k
    for step in (
        "m1",
        "m2",
        "kl2",
        "kl2_diag",
    ):  # kl2: the exact vocab-parallel KLs after two updates
        assert sorted(result[step]) == sorted(single[step])
        for k, v in single[step].items():
            if k in LAYOUT_DEPENDENT:
                continue
            assert result[step][k] == pytest.approx(v, abs=LOSS_TOL, rel=LOSS_TOL), (step, k)
    for step in ("w1", "w2"):
        for k, v in single[step].items():
            torch.testing.assert_close(result[step][k], v, atol=WEIGHT_TOL, rtol=0)


def assert_reference_swaps(result: dict) -> None:
    # the reference stays the initial weights while the policy trains, then follows a reset
    assert not torch.allclose(result["lp_policy"], result["lp0"])
    torch.testing.assert_close(result["lp_ref"], result["lp0"], atol=1e-6, rtol=0)
    # bit for bit: the store copies the reference into the live parameters (the same tensors)
    torch.testing.assert_close(result["lp_ref_after_reset"], result["lp_policy"], atol=0, rtol=0)
    positions = result["kl2"]["kl/exact_positions"]  # every response token of the batch
    assert positions == float((result["lp0"] != 0).sum()) > 0
    for key in ("kl0", "kl_reset"):  # the exact KLs vanish while policy == reference
        kl = result[key]
        assert kl["kl/exact_positions"] == positions
        assert abs(kl["kl/exact_reverse"]) < 1e-6 and abs(kl["kl/exact_forward_max"]) < 1e-6
    kl = result["kl2"]
    assert kl["kl/exact_reverse"] > 0 and kl["kl/exact_forward"] > 0
    assert kl["kl/exact_reverse_max"] >= kl["kl/exact_reverse"]


CPU_MODE_SCRIPT = """
import threading, torch
from megatron_armor.trainer import cpu_compat
assert cpu_compat.enable_cpu_mode()
assert torch.zeros(2, device="cuda").device.type == "cpu"
assert torch.ones(1).cuda().device.type == "cpu" and torch.ones(1).type() == "torch.cuda.FloatTensor"
assert torch.ones(1).to("cuda").device.type == "cpu"
assert torch.cuda.current_device() == torch.device("cpu")
seen = []
def other_thread():
    try:
        torch.zeros(1, device="cuda")
        seen.append("no mode")
    except (AssertionError, RuntimeError):
        seen.append("needs enable")
    cpu_compat.enable_cpu_mode()
    seen.append(torch.zeros(1, device="cuda").device.type)
t = threading.Thread(target=other_thread)
t.start(); t.join(30)
assert seen == ["needs enable", "cpu"], seen
print("ok")
"""


def test_cpu_mode_redirects_cuda_per_thread() -> None:
    """CPU mode (one process): CUDA requests land on CPU; a new thread enables it again."""
    if torch.cuda.is_available():
        pytest.skip("CPU mode is only used without CUDA")
    done = subprocess.run(
        [sys.executable, "-c", CPU_MODE_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_vocab_parallel_logprobs_and_grad_at_tp2(tmp_path) -> None:
    """TP=2 log-probs / entropy equal ``log_softmax`` of the gathered logits, each rank's
    gradient slice equals autograd's gradient on the gathered logits, and the vocab-parallel
    exact KLs equal ``algo.kl.exact_kl`` of the gathered logits."""
    from logprob_worker import CHUNK, TEMPERATURE, VOCAB, full_inputs

    from megatron_armor.algo.kl import exact_kl

    port, worker = str(free_port()), WORKER.replace("trainer_worker", "logprob_worker")
    procs = [
        subprocess.Popen([sys.executable, worker, str(r), "2", port, str(tmp_path)])
        for r in range(2)
    ]
    try:
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logits, target, weights, other = full_inputs()
    kl_pq, kl_qp = exact_kl(logits[:, :VOCAB], other[:, :VOCAB], TEMPERATURE)
    logits.requires_grad_(True)
    lsm = torch.log_softmax(logits[:, :VOCAB] / TEMPERATURE, dim=-1)
    ref = lsm.gather(1, target[:, None]).squeeze(1)
    (ref * weights).sum().backward()
    tol = {"atol": 1e-6, "rtol": 1e-5}  # the function computes in float32
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(r["logp"].double(), ref.detach(), **tol)
        torch.testing.assert_close(
            r["entropy"].double(), -(lsm.exp() * lsm).sum(-1).detach(), **tol
        )
        torch.testing.assert_close(r["grad"], logits.grad[:, r["lo"] : r["hi"]], **tol)
        torch.testing.assert_close(r["kl_pq"].double(), kl_pq, **tol)  # exact KLs, no gather
        torch.testing.assert_close(r["kl_qp"].double(), kl_qp, **tol)
    assert CHUNK < len(target)


def test_single_process_matches_hf(single, hf_logits, models) -> None:
    assert_oracle(single, hf_logits, models)
    assert_reference_swaps(single)
    assert single["m1"]["count/tokens"] > 0 and single["m1"]["loss/clipfrac_high"] > 0


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_model_parallel_matches_single(tp, pp, single, hf_logits, models, tmp_path) -> None:
    result = launch("run", str(tmp_path), models, tp, pp, 2, extras="oracle")
    assert_oracle(result, hf_logits, models)
    assert_same_training(result, single, 2)
    assert_reference_swaps(result)


def test_tp_beyond_kv_heads_matches_hf(hf_logits, models, tmp_path) -> None:
    """TP=4 with 2 KV heads: each rank holds half a KV group of the fused QKV weight."""
    result = launch("oracle", str(tmp_path), models, 4, 1, 4)
    assert_oracle(result, hf_logits, models)


def assert_offloaded(result: dict) -> None:
    """``offload_train_state`` freed the gradient buffers; the next update did not notice."""
    assert result["grad_bytes"] > 0 and result["grad_bytes_offloaded"] == 0
    assert torch.equal(result["lp_offloaded"], result["lp1"])


def test_data_parallel_matches_single(single, models, tmp_path) -> None:
    result = launch("run", str(tmp_path), models, 1, 1, 2, extras="offload")
    assert_same_training(result, single, 2)
    assert_offloaded(result)


def test_distributed_optimizer_resume_and_convert(single, models, tmp_path) -> None:
    result = launch("run", str(tmp_path), models, 1, 1, 2, distopt=True, extras="ckpt,offload")
    assert_same_training(result, single, 2)
    assert_offloaded(result)
    # the layout the resume check compares (orchestration/run/resume_check.py)
    common = torch.load(tmp_path / "ckpt" / "dist" / "common.pt", weights_only=True)
    layout = {"tp": 1, "pp": 1, "ep": 1, "etp": 1, "dp": 2, "world_size": 2,
              "distributed_optimizer": True, "optimizer_format": "fully_reshardable"}  # fmt: skip
    assert common["parallel_layout"] == layout
    resumed = launch("resume", str(tmp_path), models, 1, 1, 2, distopt=True)
    assert resumed["step"] == 1
    for suffix in ("", "_dp"):  # today's checkpoint, and one as saves wrote it before
        assert resumed[f"m2{suffix}"] == result["m2"], suffix
        for k, v in result["w2"].items():
            assert torch.equal(resumed[f"w2{suffix}"][k], v), (suffix, k)
    assert_convert_reproduces(result, models, str(tmp_path))


def assert_convert_reproduces(result: dict, models: str, tmp: str) -> None:
    """``armor convert --to-hf`` (one process) reshards the DP=2 checkpoint into the HF tensors
    the trainer exported at that step, for the policy and the reference weights."""
    from safetensors.torch import load_file

    ckpt, model_dir = os.path.join(tmp, "ckpt"), os.path.join(models, "qwen2")
    expected = {
        "policy": result["w1"],
        "reference": load_file(os.path.join(model_dir, "model.safetensors")),
    }
    for weights, tensors in expected.items():
        out = os.path.join(tmp, f"hf_{weights}")
        cmd = [
            sys.executable,
            "-m",
            "megatron_armor.cli",
            "convert",
            "--to-hf",
            ckpt,
            "--model",
            model_dir,
            "--out",
            out,
            "--weights",
            weights,
            "--precision",
            "fp32",
        ]
        subprocess.run(cmd, check=True, timeout=TIMEOUT_S, capture_output=True)
        converted = load_file(os.path.join(out, "model.safetensors"))
        assert sorted(converted) == sorted(tensors)
        for k, v in tensors.items():
            assert torch.equal(converted[k], v), (weights, k)
        with open(os.path.join(out, "config.json")) as f:  # says what the tensors are
            assert json.load(f)["torch_dtype"] == "float32"
        assert {v.dtype for v in converted.values()} == {torch.float32}
