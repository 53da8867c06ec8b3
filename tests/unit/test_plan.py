"""Planner (unit tier): model dims, memory terms, layout rules and verdicts on known cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_armor.cli import main as armor_main
from megatron_armor.config import load_config
from megatron_armor.planner.memory import GiB, TrainerShape, state_terms
from megatron_armor.planner.model import PRESETS, dims_from_hf_config, load_model_dims
from megatron_armor.planner.plan import ADVICE, make_plan

pytestmark = pytest.mark.unit

ONE_NODE = [
    "rollout.backend=sglang",
    "orchestration.layout=colocated",
    "orchestration.nodes=1",
    "orchestration.gpus_per_node=8",
    "trainer.world_size=8",
    "trainer.use_distributed_optimizer=true",
    "data.max_prompt_len=2048",
    "rollout.batch=512",
    "rollout.gen_batch=2048",
    "trainer.ppo_mini_batch=32",
]


def test_preset_parameter_counts_match_the_published_sizes():
    assert PRESETS["qwen2.5-math-7b"].total_params() == pytest.approx(7.62e9, rel=0.01)
    assert PRESETS["qwen3-8b"].total_params() == pytest.approx(8.19e9, rel=0.01)
    assert PRESETS["llama-3-8b"].total_params() == pytest.approx(8.03e9, rel=0.01)


def test_hf_config_and_hub_names_resolve(tmp_path):
    cfg = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    dims = load_model_dims(str(tmp_path))
    assert (dims.head_dim, dims.kv_heads, dims.qkv_bias, dims.tied_embeddings) == (
        16,
        2,
        True,
        True,
    )
    # 2 layers x (attn 64*(64+64)+64*64 + bias 128 + mlp 3*64*128 + norms 128) + embedding 6400 + norm 64
    assert dims.total_params() == 2 * (12288 + 128 + 24576 + 128) + 6400 + 64
    assert load_model_dims("Qwen/Qwen3-8B-Base") == PRESETS["qwen3-8b"]
    with pytest.raises(ValueError, match="presets"):
        load_model_dims("no-such-model")
    with pytest.raises(ValueError, match="model_type"):
        dims_from_hf_config({"model_type": "mixtral"})


def test_distributed_optimizer_shards_adam_state_over_dp():
    dims = PRESETS["llama-3-8b"]
    plain = state_terms(TrainerShape(dims, dp=8), stage=0)
    sharded = state_terms(TrainerShape(dims, dp=8, distributed_optimizer=True), stage=0)
    params = dims.total_params()
    assert plain["optimizer"] == pytest.approx(12 * params)
    assert sharded["optimizer"] == pytest.approx(12 * params / 8)
    assert plain["weights"] == pytest.approx(2 * params) and plain["grads"] == pytest.approx(
        4 * params
    )


def test_7b_at_tp2_colocated_on_80gb_fits():
    config = load_config(
        None,
        ONE_NODE
        + [
            "trainer.tp=2",
            "trainer.sequence_parallel=true",
            "trainer.recompute=true",
            "rollout.sglang.tp=2",
            "rollout.sglang.num_engines=4",
            "rollout.sglang.mem_fraction_static=0.4",
            "rollout.sampling.max_new_tokens=8192",
            "trainer.micro_batch_tokens=10240",
        ],
    )
    plan = make_plan(config, model="qwen2.5-math-7b", gpu_mem_gib=80)
    assert plan.fits, plan.report()
    assert plan.verdict().startswith("FITS")
    assert not [f for f in plan.findings if f.level == "error"]
    assert plan.peak_bytes < 76 * GiB


def test_8b_at_tp1_with_20k_responses_colocated_does_not_fit_and_names_activations():
    config = load_config(
        None,
        ONE_NODE
        + [
            "trainer.tp=1",
            "rollout.sglang.tp=1",
            "rollout.sglang.num_engines=8",
            "rollout.sglang.mem_fraction_static=0.5",
            "rollout.sampling.max_new_tokens=20480",
            "trainer.micro_batch_tokens=22528",
        ],
    )
    plan = make_plan(config, model="qwen3-8b", gpu_mem_gib=80)
    assert not plan.fits
    assert plan.largest_term[0] == "activations"
    verdict = plan.verdict()
    assert verdict.startswith("DOES NOT FIT") and "largest term: activations" in verdict
    assert "trainer.recompute=true" in verdict
    # 36 layers x 22528 tokens x (4h + q+2kv + q + 2f + f) elements x 2 bytes, one micro-batch (pp=1)
    per_token_layer = 4 * 4096 + (4096 + 2048 + 4096 + 3 * 12288)
    assert plan.phases["train"]["activations"] == pytest.approx(36 * 22528 * per_token_layer * 2)


def test_layout_rules_name_the_setting():
    config = load_config(
        None,
        ONE_NODE
        + [
            "trainer.tp=24",
            "trainer.pp=5",
            "trainer.world_size=120",
            "orchestration.nodes=15",  # 120 GPUs: past the load's world-size check
            "trainer.micro_batch_tokens=1024",
            "rollout.sglang.tp=7",
            "rollout.backend=torch",  # the planner's rules, past the SGLang pool validation
        ],
    )
    plan = make_plan(config, model="qwen3-8b")
    messages = [str(f) for f in plan.findings if f.level == "error"]
    # the model-shape rules of load (config/validate.py), run on the --model dims
    assert any("trainer.tp: 24: must divide num_attention_heads=32 of model" in m for m in messages)
    assert any("trainer.pp" in m and "num_hidden_layers=36" in m for m in messages)
    assert any("trainer.micro_batch_tokens" in m for m in messages)
    assert any("rollout.sglang.tp" in m and "does not divide" in m for m in messages)
    assert not plan.fits


def test_cli_exit_codes_and_json(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("trainer:\n  model_path: qwen3-8b\n")
    assert armor_main(["plan", str(cfg), "--json"]) == 0  # layout=cpu: an estimate, no verdict
    out = json.loads(capsys.readouterr().out)
    assert out["peak_phase"] == "train" and out["largest_term"] in out["phases_gib"]["train"]
    args = [*ONE_NODE, "trainer.tp=1", "rollout.sglang.num_engines=8"]
    assert armor_main(["plan", str(cfg), *args, "rollout.sampling.max_new_tokens=20480"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert armor_main(["plan", str(cfg), "--model", "nope"]) == 2


def test_colocated_reference_pool_adds_its_share_and_is_named_when_it_decides():
    args = [*ONE_NODE, "trainer.tp=2", "trainer.sequence_parallel=true", "trainer.recompute=true",
            "rollout.sglang.tp=2", "rollout.sglang.mem_fraction_static=0.4",
            "rollout.sampling.max_new_tokens=8192", "trainer.micro_batch_tokens=10240",
            "rollout.ref_strategy=dedicated"]  # fmt: skip
    plan = make_plan(load_config(None, args), model="qwen2.5-math-7b", gpu_mem_gib=80)
    rollout = plan.phases["rollout"]
    assert rollout["sglang_ref"] == pytest.approx(0.2 * 80 * GiB)  # the default colocated share
    assert rollout["sglang_static"] == pytest.approx(0.4 * 80 * GiB)
    assert any("SGLang ref KV cache per server" in n for n in plan.notes)
    big = load_config(None, [*args, "rollout.sglang.ref_pool.mem_fraction=0.55"])
    plan = make_plan(big, model="qwen2.5-math-7b", gpu_mem_gib=80)
    assert not plan.fits and plan.largest_term[0] in ("sglang_static", "sglang_ref")
    small = load_config(None, [*args, "rollout.sglang.ref_pool.mem_fraction=0.05"])
    plan = make_plan(small, model="qwen2.5-math-7b", gpu_mem_gib=80)
    errors = [str(f) for f in plan.findings if f.level == "error"]
    assert any("rollout.sglang.ref_pool.mem_fraction" in e and "ref server" in e for e in errors)


def test_offloading_the_train_state_leaves_only_weights_in_the_colocated_rollout():
    args = [*ONE_NODE, "trainer.tp=1", "rollout.sglang.tp=1",
            "rollout.sglang.mem_fraction_static=0.6", "rollout.sampling.max_new_tokens=4096",
            "trainer.micro_batch_tokens=8192", "trainer.recompute=true"]  # fmt: skip
    resident = make_plan(load_config(None, args), model="qwen3-8b", gpu_mem_gib=80)
    offloaded = make_plan(
        load_config(None, [*args, "trainer.offload_train_state=true"]), model="qwen3-8b",
        gpu_mem_gib=80,
    )  # fmt: skip
    before, after = resident.phases["rollout"], offloaded.phases["rollout"]
    assert "grads" in before and "grads" not in after and "optimizer" not in after
    assert after["weights"] == before["weights"]
    assert offloaded.phases["train"] == resident.phases["train"]
    assert sum(after.values()) < sum(before.values()) - 16 * GiB  # fp32 grads of 8B: ~33 GiB
    assert not resident.fits and resident.peak_phase == "rollout"
    assert offloaded.fits, offloaded.report()


def test_checkpoint_size_and_save_peak_on_disk():
    """Policy + reference weights (bf16) + Adam with fp32 masters: 16 bytes per parameter;
    keep_last complete checkpoints plus the one being written."""
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.planner.plan import checkpoint_disk

    config = ArmorConfig()
    config.run.keep_last = 2
    params = PRESETS["qwen2.5-math-7b"].total_params()
    size, peak = checkpoint_disk(config, PRESETS["qwen2.5-math-7b"])
    assert size == params * 16 and peak == 3 * size
    assert 120e9 < size < 125e9  # ~122 GB for the paper's 7.6 B model
    config.trainer.precision = "fp32"
    assert checkpoint_disk(config, PRESETS["qwen2.5-math-7b"])[0] == params * 16  # 2 * 4 + 8


@pytest.mark.parametrize("override", ["trainer.cp=2", "trainer.vpp=2"])
def test_plan_and_config_show_reject_an_unsupported_layout_with_the_same_message(override, capsys):
    base = str(Path(__file__).parents[2] / "configs" / "base.yaml")
    assert armor_main(["config", "show", base, override]) == 2
    shown = capsys.readouterr().err.removeprefix("armor config: ")
    assert armor_main(["plan", base, override]) == 2
    planned = capsys.readouterr().err.removeprefix("armor plan: ")
    assert shown == planned and f"{override}: " in shown and "not implemented" in shown


def test_the_plan_never_advises_a_setting_load_rejects():
    advice = " ".join(ADVICE.values())
    assert "trainer.cp" not in advice and "trainer.vpp" not in advice


def _model_dir(tmp_path: Path, preset: str) -> str:
    """A directory with only the ``config.json`` of ``preset`` (what the plan reads)."""
    d = PRESETS[preset]
    cfg = {"model_type": "qwen2", "hidden_size": d.hidden, "num_hidden_layers": d.layers,
           "num_attention_heads": d.heads, "num_key_value_heads": d.kv_heads,
           "intermediate_size": d.ffn_hidden, "vocab_size": d.vocab,
           "tie_word_embeddings": d.tied_embeddings}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_colocated_rollout_phase_is_the_resident_state_beside_the_engines_share():
    """The hand-off counted: after the trainer returns its activation and logit blocks, the
    colocated rollout phase holds weights + grads + optimizer + the static share + runtimes."""
    config = load_config(
        None, [*ONE_NODE, "trainer.tp=1", "rollout.sglang.mem_fraction_static=0.5"]
    )
    plan = make_plan(config, model="qwen3-8b", gpu_mem_gib=80)
    rollout, train = plan.phases["rollout"], plan.phases["train"]
    assert sorted(rollout) == ["grads", "optimizer", "runtime", "sglang_static", "weights"]
    for term in ("weights", "grads", "optimizer"):
        assert rollout[term] == train[term]
    assert rollout["sglang_static"] == pytest.approx(0.5 * 80 * GiB)
    assert rollout["runtime"] == pytest.approx(2 * 1.5 * GiB)  # the trainer's + the server's
    assert any("handed back to CUDA" in n for n in plan.notes)


def test_load_refuses_a_colocated_layout_that_does_not_fit_and_names_the_fixes(tmp_path):
    from megatron_armor.planner.plan import colocated_memory_problem

    model = f"trainer.model_path={_model_dir(tmp_path, 'qwen2.5-math-7b')}"
    base = [*ONE_NODE, model, "trainer.tp=2", "trainer.sequence_parallel=true",
            "rollout.sglang.mem_fraction_static=0.45"]  # fmt: skip
    fits = load_config(None, [*base, "trainer.micro_batch_tokens=10240"])
    assert colocated_memory_problem(fits) is None
    big_share = load_config(None, [*base, "rollout.sglang.mem_fraction_static=0.6"])
    problem = colocated_memory_problem(big_share)
    assert "orchestration.gpu_memory_gib=80: the rollout phase needs" in problem
    assert "trainer.offload_train_state=true" in problem
    assert "rollout.sglang.mem_fraction_static" in problem
    offloaded = load_config(None, [*base, "rollout.sglang.mem_fraction_static=0.6",
                                   "trainer.offload_train_state=true"])  # fmt: skip
    assert colocated_memory_problem(offloaded) is None
    long = load_config(None, [*base, "rollout.sampling.max_new_tokens=20480",
                              "trainer.micro_batch_tokens=22528"])  # fmt: skip
    problem = colocated_memory_problem(long)
    assert "the train phase needs" in problem and "trainer.micro_batch_tokens" in problem
    h200 = load_config(None, [*base, "rollout.sglang.mem_fraction_static=0.6",
                              "orchestration.gpu_memory_gib=141"])  # fmt: skip
    assert colocated_memory_problem(h200) is None
    elsewhere = load_config(None, [model, "trainer.micro_batch_tokens=22528"])  # layout cpu
    assert colocated_memory_problem(elsewhere) is None


@pytest.mark.parametrize(
    "name, preset",
    [("qwen25_math_7b_armor", "qwen2.5-math-7b"), ("qwen25_math_7b_dapo", "qwen2.5-math-7b"),
     ("qwen25_math_7b_quatro", "qwen2.5-math-7b"), ("qwen3_8b_base_armor", "qwen3-8b"),
     ("qwen3_8b_base_dapo", "qwen3-8b")],
)  # fmt: skip
def test_the_paper_configs_fit_80gb_with_the_hand_off_counted(name, preset, tmp_path):
    from megatron_armor.planner.plan import colocated_memory_problem

    path = Path(__file__).parents[2] / "configs" / "paper" / f"{name}.yaml"
    config = load_config(path, [f"trainer.model_path={_model_dir(tmp_path, preset)}"])
    assert config.orchestration.layout == "colocated"
    plan = make_plan(config)
    assert plan.fits, plan.report()
    assert colocated_memory_problem(config) is None
