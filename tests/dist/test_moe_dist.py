"""Dist tier (gloo, 1-2 CPU processes): the mixture-of-experts policy (tiny Qwen3-MoE).

``moe_worker.py`` runs a ``MegatronTrainer`` per rank; compared here:

- logits equal transformers' within 1e-4 (fp32) at EP=1 (one process) and EP=2 (two
  processes: each holds two of the four experts; tokens reach them through megatron-core's
  all-to-all dispatcher over gloo); the export right after the import reproduces every HF
  tensor exactly (router, every expert from both EP ranks, the dense layer);
- two ARMOR updates at EP=2 equal the single-process ones (metrics, weights); so do, on a
  batch the two DP ranks split into 2 and 1 micro-batches (the shorter rank runs a filler:
  without it the extra micro-batch's all-to-alls would have no partner), the log-probs, the
  exact-KL diagnostic over samples of one rank only and a third update;
- a third update with the load-balancing loss on logs ``train/moe_aux_loss``, and its gradient
  is in the update: the gradient norms of EP=1 and EP=2, equal without the loss, now differ
  (the Switch loss is taken per micro-batch, and the ranks split the batch differently) while
  the policy-loss metrics of that update still agree;
- routing replay against the embedded engine (routers at near-ties, the engine holding the
  trainer's weights): with ``r3`` the ``old`` log-probs equal the engine's within the dense
  tolerance, with ``off`` some token-layers route differently and the log-probs differ by
  far more, at EP=1, EP=2 and with two pipeline stages (a 4-layer model);
- the EP=2 checkpoint, loaded by fresh processes, restores the weights bit for bit and the
  next update is bit-identical; ``armor convert --to-hf`` (one process) reshards it into the
  HF tensors the trainer exported;
- expert tensor parallelism apart from TP: TP=1, EP=2, ETP=2 on four ranks (each expert's MLP
  split over two ranks that are data parallel for attention; run beside the resume): logits
  equal transformers', the export is exact, the two updates equal the single-process ones and
  ``armor convert --to-hf`` reshards its checkpoint exactly; TP=2, EP=2, ETP=1 on two ranks
  (every expert whole on its EP rank; forward passes only: megatron-core trains MoE layers
  under TP only with sequence parallelism, which needs Apex on CPU; run beside EP=2): logits
  equal transformers', the export is exact, the log-probs equal the single process's.
"""

from __future__ import annotations

import glob
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_trainer_dist import (  # noqa: E402
    LOGITS_TOL,
    LOGPROB_TOL,
    LOSS_TOL,
    TIMEOUT_S,
    WEIGHT_TOL,
    free_port,
)
from tiny_models import MOE_EXPERTS, make_moe_model, oracle_tokens  # noqa: E402

from megatron_armor.trainer.ranks import run_rank_processes  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_worker.py")
LAYOUT_DEPENDENT = ("train/padding_fraction",)


EP1, EP2, ETP2, TP2 = (1, 1, 1), (1, 2, 1), (1, 2, 2), (2, 2, 1)
"""``(tp, ep, etp)`` layouts of the runs."""


def worker(mode: str, out: str, model_dir: str, layout: tuple[int, int, int], world: int,
           rank: int) -> list[str]:  # fmt: skip
    return [sys.executable, WORKER, mode, str(rank), str(world), str(PORTS[out]), out,
            model_dir, *map(str, layout)]  # fmt: skip


PORTS: dict[str, int] = {}


def launch(runs: list[tuple[str, str, str, tuple[int, int, int], int]],
           extra: list[list[str]] = ()) -> None:  # fmt: skip
    """Start every rank of every ``(mode, out, model_dir, (tp, ep, etp), world)`` run, and the
    ``extra`` commands, at once (independent runs overlap their start-up), bounded."""
    commands, logs = [], []
    for mode, out, model_dir, layout, world in runs:
        os.makedirs(out, exist_ok=True)
        PORTS[out] = free_port()
        for rank in range(world):
            commands.append(worker(mode, out, model_dir, layout, world, rank))
            logs.append(os.path.join(out, f"{mode}_log{rank}.txt"))
    for i, command in enumerate(extra):
        commands.append(command)
        logs.append(os.path.join(runs[0][1], f"extra_log{i}.txt"))
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    run_rank_processes(commands, logs, env, TIMEOUT_S)


def results(mode: str, out: str) -> list[dict]:
    """What each rank of a run wrote, in rank order."""
    return [torch.load(f, weights_only=False) for f in sorted(glob.glob(f"{out}/{mode}_rank*.pt"))]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    return make_moe_model(str(tmp_path_factory.mktemp("moe_model")))


@pytest.fixture(scope="module")
def moe_model_4(tmp_path_factory) -> str:
    return make_moe_model(str(tmp_path_factory.mktemp("moe_model_4")), num_layers=4)


@pytest.fixture(scope="module")
def hf_logits(moe_model) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
    with torch.no_grad():
        return model(oracle_tokens()).logits


def assert_matches_hf(result: dict, hf_logits: torch.Tensor, moe_model: str) -> None:
    from safetensors.torch import load_file

    torch.testing.assert_close(result["logits"], hf_logits, atol=LOGITS_TOL, rtol=0)
    hf = load_file(os.path.join(moe_model, "model.safetensors"))
    exported = result["export0"]
    assert sorted(exported) == sorted(hf)
    assert sum(".mlp.experts." in k for k in hf) == 2 * MOE_EXPERTS * 3  # 2 sparse layers
    for key, tensor in hf.items():
        assert torch.equal(exported[key], tensor), key


def assert_same_metrics(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if k not in LAYOUT_DEPENDENT:
            assert got[k] == pytest.approx(v, abs=LOSS_TOL, rel=LOSS_TOL), k


def assert_aux_loss_update(result: dict) -> None:
    """The third update (load-balancing loss on) logs the loss; the first two (off) do not."""
    assert "train/moe_aux_loss" not in result["m2"]
    aux = result["m3"]["train/moe_aux_loss"]
    assert 0.5 < aux < MOE_EXPERTS  # Switch loss: 1 when balanced, E when one expert takes all


def test_expert_parallel_matches_hf_single_process_and_resumes(
    hf_logits, moe_model, moe_model_4, tmp_path
):
    ep1, ep2, pp2 = str(tmp_path / "ep1"), str(tmp_path / "ep2"), str(tmp_path / "pp2")
    tp2, etp2 = str(tmp_path / "tp2"), str(tmp_path / "etp2")
    launch([("run", ep1, moe_model, EP1, 1), ("run", ep2, moe_model, EP2, 2),
            ("forward", tp2, moe_model, TP2, 2), ("pp_replay", pp2, moe_model_4, EP1, 2)])  # fmt: skip
    single, ranks = results("run", ep1)[0], results("run", ep2)
    assert_replay(results("pp_replay", pp2)[0])
    for stage, result in enumerate(results("pp_replay", pp2)):  # each stage its own layers
        assert_update_routes(result, [[0], [2, 3]][stage])
    assert_matches_hf(single, hf_logits, moe_model)
    assert_aux_loss_update(single)
    for result in ranks:  # each EP rank computes the logits of the whole batch
        torch.testing.assert_close(result["logits"], hf_logits, atol=LOGITS_TOL, rtol=0)
    run = ranks[0]  # the export rank (DP rank 0) gathers the experts of both EP ranks
    assert_matches_hf(run, hf_logits, moe_model)
    assert ranks[1]["export0"] == {}
    torch.testing.assert_close(run["lp0"], single["lp0"], atol=LOGPROB_TOL, rtol=0)
    for step in ("m1", "m2"):
        assert_same_metrics(run[step], single[step])
    for step in ("w1", "w2"):
        for k, v in single[step].items():
            torch.testing.assert_close(run[step][k], v, atol=WEIGHT_TOL, rtol=0)
    assert_uneven_split_matches(run, single)
    assert_aux_loss_update(run)
    policy_metrics = {k: v for k, v in single["m3"].items() if k.startswith(("loss/", "kl/"))}
    del policy_metrics["loss/grad_norm"]
    for k, v in policy_metrics.items():
        assert run["m3"][k] == pytest.approx(v, abs=LOSS_TOL, rel=LOSS_TOL), k
    assert abs(run["m3"]["loss/grad_norm"] - single["m3"]["loss/grad_norm"]) > 10 * LOSS_TOL
    for result in (single, run):
        assert_replay(result)
    for result in (single, *ranks):
        assert_update_routes(result, [0, 2])  # layer 1 is dense
    assert_forward_matches(results("forward", tp2), single, hf_logits, moe_model)
    assert_resume_and_convert(run, moe_model, ep2, etp2)
    assert_etp2_trains(etp2, single, hf_logits, moe_model)


def assert_replay(result: dict) -> None:
    """``r3`` reproduces the engine's log-probs (policy samples and anchors: the reference is
    the policy here, so the anchors replay the reference engine's routes); ``off`` does not,
    and its routing agreement shows why."""
    mask = result["loss_mask"] > 0
    engine = result["engine_lp"][mask]
    r3, off = result["replay_r3"], result["replay_off"]
    torch.testing.assert_close(r3["old"][mask], engine, atol=LOGPROB_TOL, rtol=0)
    assert (off["old"][mask] - engine).abs().max() > 100 * LOGPROB_TOL
    assert 0.5 < off["metrics"]["moe/route_agree_policy"] < 1.0
    assert off["metrics"]["moe/expert_load_max_mean"] >= 1.0


def assert_uneven_split_matches(run: dict, single: dict) -> None:
    """The passes over the unevenly split batch (``moe_worker.UNEVEN``) equal the single
    process's: the fillers added nothing and took nobody's log-probs."""
    torch.testing.assert_close(run["lp_u"], single["lp_u"], atol=LOGPROB_TOL, rtol=0)
    torch.testing.assert_close(run["old_u"], single["lp_u"], atol=LOGPROB_TOL, rtol=0)
    assert single["kl_u"]["kl/exact_positions"] > 0
    assert_same_metrics(run["kl_u"], single["kl_u"])
    assert_same_metrics(run["m_u"], single["m_u"])
    for k, v in single["w_u"].items():
        torch.testing.assert_close(run["w_u"][k], v, atol=WEIGHT_TOL, rtol=0)


def assert_update_routes(result: dict, layers: list[int]) -> None:
    """An update's routes (``routing_replay.update_routes``, fetched over the data-parallel
    ranks): the rank's own shard only, one byte per id, the engine's on policy samples (the
    ``r3`` ``old`` pass replayed them); the updates ran and compared their routing with them."""
    got = result["update_routes"]
    assert got["own_tokens"] == got["shard_tokens"] > 0
    assert got["layers"] == layers and got["dtype"] == torch.uint8
    assert got["policy_rows"] > 0 and got["equal"]
    assert 0.0 < result["replay_update"]["moe/route_agree_update"] <= 1.0


def assert_forward_matches(ranks: list[dict], single: dict, hf_logits, moe_model) -> None:
    """Logits (every rank), the export (rank 0 only) and the policy log-probs of a run on
    several ranks match transformers and the single process."""
    for result in ranks:
        torch.testing.assert_close(result["logits"], hf_logits, atol=LOGITS_TOL, rtol=0)
    assert_matches_hf(ranks[0], hf_logits, moe_model)
    assert all(result["export0"] == {} for result in ranks[1:])
    torch.testing.assert_close(ranks[0]["lp0"], single["lp0"], atol=LOGPROB_TOL, rtol=0)


def assert_etp2_trains(etp2: str, single: dict, hf_logits, moe_model) -> None:
    """TP=1, EP=2, ETP=2: each expert's MLP split over two (attention data-parallel) ranks;
    the logits, the export and two updates match the single process; its checkpoint
    converts to the HF tensors it exported."""
    ranks = results("run", etp2)
    assert_forward_matches(ranks, single, hf_logits, moe_model)
    for step in ("m1", "m2"):
        assert_same_metrics(ranks[0][step], single[step])
    for step in ("w1", "w2"):
        for k, v in single[step].items():
            torch.testing.assert_close(ranks[0][step][k], v, atol=WEIGHT_TOL, rtol=0)
    assert_uneven_split_matches(ranks[0], single)
    assert_aux_loss_update(ranks[0])
    assert_converts(etp2, moe_model, ranks[0]["w1"])


def convert_command(run_dir: str, moe_model: str) -> list[str]:
    """``armor convert --to-hf`` of ``run_dir/ckpt`` in one process (fp32, into ``hf``)."""
    return [sys.executable, "-m", "megatron_armor.cli", "convert", "--to-hf",
            os.path.join(run_dir, "ckpt"), "--model", moe_model,
            "--out", os.path.join(run_dir, "hf"), "--precision", "fp32"]  # fmt: skip


def assert_converts(run_dir: str, moe_model: str, weights: dict) -> None:
    """One process reshards the checkpoint of ``run_dir`` into exactly ``weights``."""
    from safetensors.torch import load_file

    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    log = os.path.join(run_dir, "convert_log.txt")
    run_rank_processes([convert_command(run_dir, moe_model)], [log], env, TIMEOUT_S)
    converted = load_file(os.path.join(run_dir, "hf", "model.safetensors"))
    assert sorted(converted) == sorted(weights)
    for k, v in weights.items():
        assert torch.equal(converted[k], v), k


def assert_resume_and_convert(run: dict, moe_model: str, ep2: str, etp2: str) -> None:
    """Fresh EP=2 processes load the checkpoint written after the first update: the same
    weights and a bit-identical second update; ``armor convert --to-hf`` (run beside them)
    writes the same weights. The ETP=2 run starts in the same wave."""
    from safetensors.torch import load_file

    out = os.path.join(ep2, "hf")
    convert = convert_command(ep2, moe_model)
    launch([("resume", ep2, moe_model, EP2, 2), ("run", etp2, moe_model, ETP2, 4)], [convert])
    resumed = results("resume", ep2)[0]
    for step in ("w1", "w2"):
        assert sorted(resumed[step]) == sorted(run[step])
        for k, v in run[step].items():
            assert torch.equal(resumed[step][k], v), (step, k)
    assert resumed["m2"] == run["m2"]
    converted = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(converted) == sorted(run["w1"])
    for k, v in run["w1"].items():
        assert torch.equal(converted[k], v), k
