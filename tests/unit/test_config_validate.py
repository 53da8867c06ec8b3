"""Config validation: every rule names the key, the bad value and the fix. Tier: unit."""

from __future__ import annotations

import json

import pytest

from megatron_armor.config import ArmorConfig, ConfigError, load_config
from megatron_armor.config.validate import find_problems, validate

pytestmark = pytest.mark.unit


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    return str(info.value)


def test_defaults_are_valid():
    assert find_problems(ArmorConfig()) == []
    validate(ArmorConfig())


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["algo.alpha=0"], ["algo.alpha=0", "(0, 1]", "'auto'"]),
        (["algo.alpha=1.5"], ["algo.alpha=1.5", "(0, 1]"]),
        (["algo.alpha=half"], ["algo.alpha='half'", "'auto'"]),
        (["algo.alpha=true"], ["algo.alpha=True", "'auto'"]),
        (["algo.group_size=1"], ["algo.group_size=1", ">= 2"]),
        (["algo.ref_n=0"], ["algo.ref_n=0", "set algo.ref_n >= 1"]),
        (["algo.clip_low=0"], ["algo.clip_low=0", "(0, 1)"]),
        (["algo.clip_low=1.2"], ["algo.clip_low=1.2", "(0, 1)"]),
        (["algo.clip_high=-0.1"], ["algo.clip_high=-0.1", "> 0"]),
        (["algo.dual_clip_c=1"], ["algo.dual_clip_c=1", "> 1"]),
        (["algo.log_ratio_clamp=0"], ["algo.log_ratio_clamp=0", "> 0"]),
        (["algo.kl_coef=-0.1"], ["algo.kl_coef=-0.1", ">= 0"]),
        (["algo.quatro.delta=0"], ["algo.quatro.delta=0", "> 0"]),
        (["algo.quatro.lambda_min=1e5"], ["algo.quatro.lambda_min=100000.0", "lambda_max"]),
        (["algo.filter_policy_samples=G-1"], ["algo.filter_policy_samples='G-1'", "filter_only"]),
        (
            ["algo.anchor=filter_only", "algo.ratio=standard", "algo.filter_policy_samples=G-2"],
            ["algo.filter_policy_samples='G-2'", "'G-1'"],
        ),
        (["algo.qae_quantile=2"], ["algo.qae_quantile=2", "[0, 1]"]),
        (["algo.max_gen_batches=0"], ["algo.max_gen_batches=0", ">= 1"]),
        (["rollout.batch=8", "rollout.gen_batch=4"], ["rollout.gen_batch=4", ">= rollout.batch=8"]),
        (["rollout.batch=0"], ["rollout.batch=0", ">= 1"]),
        (
            ["rollout.batch=6", "trainer.ppo_mini_batch=4"],
            ["trainer.ppo_mini_batch=4", "divide rollout.batch=6", "e.g. 3"],
        ),
        (["trainer.ppo_mini_batch=0"], ["trainer.ppo_mini_batch=0", ">= 1"]),
        (
            ["algo.reset.schedule=every-until", "algo.reset.every=5", "algo.reset.until=3"],
            ["algo.reset.until=3", ">= algo.reset.every=5"],
        ),
        (["algo.reset.schedule=every", "algo.reset.every=0"], ["algo.reset.every=0", "every >= 1"]),
        (
            ["algo.reset.schedule=every-until", "algo.reset.every=0", "algo.reset.until=4"],
            ["algo.reset.every=0", "every >= 1"],
        ),
        (
            ["algo.weak_filter=true", "algo.anchor=none", "algo.ratio=standard"],
            ["algo.weak_filter=true", "algo.anchor"],
        ),
        (["algo.anchor=filter_only"], ["algo.ratio='mixed'", "set algo.ratio=standard"]),
        (
            ["algo.anchor=none", "algo.ratio=off_policy"],
            ["algo.ratio='off_policy'", "algo.ratio=standard"],
        ),
        (["algo.anchor=filter_only", "algo.ratio=off_policy"], ["algo.ratio='off_policy'"]),
        (
            ["rollout.ref_strategy=cache"],
            ["rollout.ref_strategy='cache'", "algo.anchor_source=cache"],
        ),
        (["rollout.sampling.temperature=0"], ["rollout.sampling.temperature=0", "> 0"]),
        (["rollout.sampling.top_p=1.5"], ["rollout.sampling.top_p=1.5", "(0, 1]"]),
        (["reward.overlong.buffer=64"], ["reward.overlong.buffer=64", "overlong.enabled=false"]),
        (["run.steps=0"], ["run.steps=0", ">= 1"]),
        (["run.seed=-1"], ["run.seed=-1", "[0, 2147483647]", "e.g. 1"]),
        (["run.seed=2147483648"], ["run.seed=2147483648", "[0, 2147483647]"]),
        (["run.max_recoveries=-1"], ["run.max_recoveries=-1", ">= 0"]),
        (["run.recovery_window=0"], ["run.recovery_window=0", ">= 1 step"]),
        (["rollout.reference_parts=0"], ["rollout.reference_parts=0", ">= 1 part"]),
        (["validation.n_samples=0"], ["validation.n_samples=0", ">= 1"]),
        (
            ["rollout.reference_first=true", "algo.anchor=none"],
            ["rollout.reference_first=true", "algo.anchor='none'", "rule (b)"],
        ),
        (
            ["rollout.reference_first=true", "rollout.reference_parts=2"],
            ["rollout.reference_parts=2", "rollout.reference_parts=1"],
        ),
        (
            ["rollout.reference_first=maybe"],
            ["rollout.reference_first='maybe'", "one of true, false, auto"],
        ),
        (["trainer.fp8.enabled=true"], ["trainer.fp8.enabled=true", "transformer_impl=te"]),
        (["algo.min_batch_fraction=-0.1"], ["algo.min_batch_fraction=-0.1", "must lie in [0, 1]"]),
        (["algo.min_batch_fraction=1.5"], ["algo.min_batch_fraction=1.5", "e.g. 0.5"]),
        (["data.retire_solved_after=-1"], ["data.retire_solved_after=-1", "0 = never retire"]),
        (["data.retire_max_fraction=0"], ["data.retire_max_fraction=0.0", "must lie in (0, 1]"]),
        (["watch.window=1"], ["watch.window=1", "must be >= 2 steps"]),
        (["watch.memory_growth_gb=0"], ["watch.memory_growth_gb=0.0", "must be > 0 GB"]),
        (["watch.repeat_every=0"], ["watch.repeat_every=0", "must be >= 1"]),
    ],
)
def test_rule_messages(overrides, expected):
    message = _error(*overrides)
    assert message.startswith("<defaults>: ")
    for part in expected:
        assert part in message, (part, message)


@pytest.mark.parametrize(
    "key, value",
    [
        ("algo.anchor", "anchors"),
        ("algo.ratio", "mix"),
        ("algo.advantage", "gae"),
        ("algo.loss_agg", "mean"),
        ("algo.kl_estimator", "k4"),
        ("algo.reset.schedule", "cosine"),
        ("algo.anchor_source", "replay"),
        ("rollout.backend", "vllm"),
        ("rollout.ref_strategy", "copy"),
        ("trainer.precision", "fp8"),
        ("trainer.transformer_impl", "apex"),
        ("orchestration.layout", "hybrid"),
        ("trainer.fp8.recipe", "fast"),
        ("reward.verifier", "llm"),
        ("algo.on_short_batch", "skip"),
    ],
)
def test_unknown_names_list_valid_ones(key, value):
    message = _error(
        f"{key}={value}", "algo.ratio=standard" if key != "algo.ratio" else "algo.anchor=armor"
    )
    assert f"{key}={value!r}: unknown name; use one of [" in message


def test_registry_names_are_accepted():
    for ratio in ("standard", "mixed", "off_policy", "static_expansion"):
        load_config(None, [f"algo.ratio={ratio}"])
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        load_config(None, [f"algo.loss_agg={agg}"])
    cfg = load_config(
        None,
        [
            "algo.anchor=filter_only",
            "algo.ratio=standard",
            "algo.weak_filter=true",
            "algo.advantage=qae",
            "algo.kl_estimator=k1",
            "algo.reset.schedule=log2",
        ],
    )
    assert cfg.algo.anchor == "filter_only"
    cfg = load_config(
        None, ["algo.reset.schedule=every-until", "algo.reset.every=1", "algo.reset.until=180"]
    )
    assert cfg.algo.reset.until == 180


def test_mixed_ratio_without_anchor_is_an_allowed_ablation():
    load_config(None, ["algo.anchor=none", "algo.ratio=mixed"])


def test_reference_first_auto_is_the_default_and_fits_every_anchor_mode():
    """``auto`` falls back to policy first where ``true`` would be an error."""
    assert load_config(None, []).rollout.reference_first == "auto"
    load_config(None, ["algo.anchor=none", "algo.ratio=standard"])
    load_config(None, ["rollout.reference_parts=2"])
    for text, value in (("TRUE", True), ("false", False), ("Auto", None), ("'true'", True)):
        cfg = load_config(None, [f"rollout.reference_first={text}"])
        assert cfg.resolved.reference_first is value  # None: each step decides


def test_rules_read_the_registry_entry_not_the_name(monkeypatch):
    from megatron_armor.algo import registry
    from megatron_armor.algo.anchors import AnchorMode

    control = AnchorMode("control", True, inserts_anchor=False, is_filter_control=True)
    monkeypatch.setitem(registry.ANCHOR_MODES, "control", control)
    load_config(
        None, ["algo.anchor=control", "algo.ratio=standard", "algo.filter_policy_samples=G-1"]
    )
    assert "the filter-only control trains" in _error("algo.anchor=control", "algo.ratio=mixed")
    assert "set algo.ref_n >= 1" in _error("algo.anchor=control", "algo.ref_n=0")


def test_ref_n_unused_without_anchor():
    load_config(None, ["algo.anchor=none", "algo.ratio=standard", "algo.ref_n=0"])


def test_anchor_cache_settings():
    load_config(None, ["algo.anchor_source=cache", "rollout.ref_strategy=swap"])
    load_config(None, ["algo.anchor_source=cache", "rollout.ref_strategy=cache"])


def test_fp8_with_te_is_valid():
    cfg = load_config(None, ["trainer.fp8.enabled=true", "trainer.transformer_impl=te"])
    assert cfg.trainer.fp8.enabled


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["trainer.tp=2", "trainer.world_size=3"], ["trainer.world_size=3", "tp*pp*cp=2*1*1=2"]),
        (
            ["trainer.tp=4", "trainer.pp=2", "trainer.world_size=4"],
            ["trainer.world_size=4: fewer ranks", "tp*pp*cp=4*2*1=8", "--checkpoint CKPT"],
        ),
        (
            ["trainer.tp=2", "trainer.pp=2", "trainer.cp=2", "trainer.world_size=12"],
            ["tp*pp*cp=2*2*2=8"],
        ),
        (["trainer.tp=0"], ["trainer.tp=0", ">= 1"]),
        (["trainer.sequence_parallel=true"], ["trainer.sequence_parallel=true", "tp > 1"]),
        (
            ["trainer.vpp=2", "trainer.pp=2"],
            ["trainer.vpp=2", "not implemented", "set trainer.vpp=1"],
        ),
        (
            ["trainer.cp=2", "trainer.world_size=2"],
            ["trainer.cp=2", "not implemented", "set trainer.cp=1"],
        ),
        (
            ["trainer.ppo_mini_batch=1", "algo.group_size=2", "trainer.world_size=4"],
            ["trainer.ppo_mini_batch=1", "2 sequences per update < data-parallel size 4"],
        ),
    ],
)
def test_parallel_sizes(overrides, expected):
    message = _error(*overrides)
    for part in expected:
        assert part in message, (part, message)


@pytest.fixture
def hf_dir(tmp_path):
    cfg = {"num_attention_heads": 12, "num_key_value_heads": 4, "num_hidden_layers": 6}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["trainer.tp=8", "trainer.world_size=8"],
            ["trainer.tp=8", "num_attention_heads=12", "[1, 2, 3, 4, 6, 12]"],
        ),
        (["trainer.tp=3", "trainer.world_size=3"], ["trainer.tp=3", "num_key_value_heads=4"]),
        (
            ["trainer.pp=4", "trainer.world_size=4"],
            ["trainer.pp=4 x trainer.vpp=1", "num_hidden_layers=6"],
        ),
        (
            ["trainer.pp=2", "trainer.vpp=2", "trainer.world_size=2"],
            ["trainer.pp=2 x trainer.vpp=2"],
        ),
    ],
)
def test_model_shape_rules(hf_dir, overrides, expected):
    message = _error(f"trainer.model_path={hf_dir}", *overrides)
    for part in expected:
        assert part in message, (part, message)


def test_model_shape_accepts_valid_and_replicated_kv(hf_dir):
    load_config(None, [f"trainer.model_path={hf_dir}", "trainer.tp=4", "trainer.world_size=8"])
    load_config(None, [f"trainer.model_path={hf_dir}", "trainer.tp=12", "trainer.world_size=12"])
    load_config(
        None,
        [f"trainer.model_path={hf_dir}", "trainer.pp=3", "trainer.world_size=3"],
    )


def test_missing_model_dir_is_not_checked_yet(tmp_path):
    load_config(
        None, [f"trainer.model_path={tmp_path / 'later'}", "trainer.tp=7", "trainer.world_size=7"]
    )


def test_all_problems_reported_together():
    message = _error("algo.group_size=1", "algo.clip_low=2", "rollout.gen_batch=1")
    assert "3 problems" in message
    assert (
        "algo.group_size=1" in message
        and "algo.clip_low=2" in message
        and "rollout.gen_batch=1" in message
    )


def test_sglang_reference_serving_rules():
    sglang = ["rollout.backend=sglang"]
    assert find_problems(load_config(None, [*sglang, "rollout.ref_strategy=swap"])) == []
    cached = ["rollout.ref_strategy=cache", "algo.anchor_source=cache"]
    for served in (["rollout.ref_strategy=dedicated"], cached):
        # a reference pool streamed into by the trainer: every transport works
        for transport in ("tensor", "distributed", "disk"):
            overrides = [*sglang, *served, f"rollout.sglang.weight_transport={transport}"]
            assert find_problems(load_config(None, overrides)) == []
    for swapped in (["rollout.ref_strategy=swap"], ["algo.anchor_source=cache"]):
        # the trainer ranks swap the reference into the policy servers: every transport
        overrides = [*sglang, *swapped, "rollout.sglang.weight_transport=distributed"]
        assert find_problems(load_config(None, overrides)) == []
    message = _error(*sglang, "orchestration.layout=disaggregated", "orchestration.rollout_gpus=1",
                     "rollout.sglang.weight_transport=tensor")  # fmt: skip
    assert "weight_transport=distributed (NCCL) or layout=colocated" in message
    message = _error(*sglang, "orchestration.layout=colocated", "trainer.world_size=8",
                     "rollout.sglang.weight_transport=distributed")  # fmt: skip
    assert "weight_transport='distributed' with orchestration.layout='colocated'" in message
    assert "Duplicate GPU detected" in message and "set weight_transport=tensor" in message
    anchor_free = [*sglang, "algo.anchor=none", "algo.ratio=standard"]
    config = load_config(None, [*anchor_free, "rollout.sglang.weight_transport=distributed"])
    assert config.rollout.sglang.weight_transport == "distributed"


def test_sglang_pool_rules_name_the_settings():
    colocated = ["rollout.backend=sglang", "orchestration.layout=colocated", "trainer.world_size=8"]
    dedicated = [*colocated, "rollout.ref_strategy=dedicated"]
    assert find_problems(load_config(None, dedicated)) == []
    message = _error(*dedicated, "rollout.sglang.mem_fraction_static=0.6",
                     "rollout.sglang.ref_pool.mem_fraction=0.4")  # fmt: skip
    assert "mem_fraction_static=0.6 + ref_pool.mem_fraction=0.4" in message
    message = _error(*colocated, "rollout.sglang.num_engines=9")
    assert "need 9 GPUs but trainer.world_size=8" in message
    message = _error(*dedicated, "rollout.sglang.ref_pool.tp=16", "orchestration.gpus_per_node=8")
    assert "rollout.sglang.ref_pool.tp=16 > orchestration.gpus_per_node=8" in message
    disaggregated = ["rollout.backend=sglang", "orchestration.layout=disaggregated",
                     "trainer.world_size=4", "orchestration.rollout_gpus=4"]  # fmt: skip
    message = _error(*disaggregated, "rollout.ref_strategy=dedicated",
                     "rollout.sglang.num_engines=3")  # fmt: skip
    assert "policy 3 x tp 1, ref 3 x tp 1" in message and "need 6 GPUs" in message
    message = _error(*disaggregated, "rollout.sglang.num_engines=2")
    assert "orchestration.rollout_gpus=4 but the SGLang servers use 2" in message


def test_sglang_servers_may_span_nodes_but_not_straddle_them():
    two_nodes = ["rollout.backend=sglang", "orchestration.layout=colocated",
                 "orchestration.nodes=2", "orchestration.gpus_per_node=8",
                 "trainer.world_size=16", "rollout.ref_strategy=dedicated"]  # fmt: skip
    config = load_config(None, [*two_nodes, "rollout.sglang.tp=2"])
    assert find_problems(config) == []
    message = _error(*two_nodes, "rollout.sglang.tp=3", "rollout.sglang.num_engines=5")
    assert "SGLang policy server 2 would span GPUs 6-8, across nodes of 8 GPUs" in message
    disaggregated = ["rollout.backend=sglang", "orchestration.layout=disaggregated",
                     "orchestration.nodes=1", "trainer.world_size=6",
                     "orchestration.rollout_gpus=4"]  # fmt: skip
    message = _error(*disaggregated)
    assert "trainer.world_size=6 + the SGLang servers' 4 GPUs > orchestration.nodes" in message


def test_offloading_the_train_state_is_for_shared_gpus():
    ok = ["rollout.backend=sglang", "orchestration.layout=colocated", "trainer.world_size=8",
          "trainer.offload_train_state=true"]  # fmt: skip
    assert find_problems(load_config(None, ok)) == []
    message = _error("trainer.offload_train_state=true", "orchestration.layout=disaggregated",
                     "orchestration.rollout_gpus=1", "rollout.backend=sglang")  # fmt: skip
    assert "trainer.offload_train_state=true with orchestration.layout='disaggregated'" in message


def test_prompt_plus_response_beyond_the_models_context_names_the_override():
    tiny = ["trainer.model_path=artifacts/tiny/model"]  # max_position_embeddings: 256
    long = [*tiny, "data.max_prompt_len=200", "rollout.sampling.max_new_tokens=100"]
    with pytest.raises(ConfigError, match="trainer.model_overrides.max_position_embeddings >= 300"):
        load_config(None, long)
    config = load_config(None, [*long, "trainer.model_overrides.max_position_embeddings=512"])
    assert config.trainer.model_overrides == {"max_position_embeddings": 512}
    served = [
        *long,
        "trainer.model_overrides.max_position_embeddings=512",
        "rollout.backend=sglang",
    ]
    with pytest.raises(ConfigError, match="rollout.sglang.context_length=256: raise it to >= 300"):
        load_config(None, [*served, "rollout.sglang.context_length=256"])
    with pytest.raises(ConfigError, match="context_length=1024 exceeds the model's"):
        load_config(None, [*served, "rollout.sglang.context_length=1024"])


def test_concurrent_reference_resolves_on_for_one_cpu_rank_only():
    """``auto``: the cpu layout with one trainer rank (the idle engine's core); ``true`` is
    refused where two passes at once could not run (GPU layouts, collectives in the forward)."""
    assert load_config(None, []).trainer.concurrent_reference == "auto"
    cpu_one = ["orchestration.layout=cpu", "trainer.world_size=1"]
    assert load_config(None, cpu_one).resolved.concurrent_reference
    two_ranks = ["orchestration.layout=cpu", "trainer.world_size=2", "trainer.ppo_mini_batch=8"]
    assert not load_config(None, two_ranks).resolved.concurrent_reference
    assert load_config(
        None, [*two_ranks, "trainer.concurrent_reference=TRUE"]
    ).resolved.concurrent_reference  # pure data parallelism: no collective in a forward pass
    off = load_config(None, ["trainer.concurrent_reference=false"])
    assert not off.resolved.concurrent_reference
    colocated = _error("trainer.concurrent_reference=true", "orchestration.layout=colocated")
    assert "trainer.concurrent_reference=true with orchestration.layout='colocated'" in colocated
    assert "set trainer.concurrent_reference=auto or false" in colocated
    tp = _error(*two_ranks, "trainer.tp=2", "trainer.concurrent_reference=true")
    assert "trainer.concurrent_reference=true with tp=2" in tp and "=false" in tp
    bad = _error("trainer.concurrent_reference=sometimes")
    assert "trainer.concurrent_reference='sometimes' is not one of true, false, auto" in bad


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["algo.group_size=1000"], ["algo.group_size=1000", "2 to 64", "1000 generations"]),
        (["algo.max_gen_batches=500"], ["algo.max_gen_batches=500", "1 to 64"]),
        (["rollout.gen_batch=1000"], ["rollout.gen_batch=1000", "125x rollout.batch=8"]),
    ],
)
def test_settings_far_outside_their_range_load_with_a_warning(overrides, expected, capsys):
    load_config(None, overrides)
    err = capsys.readouterr().err
    assert err.count("warning: ") == 1, err
    for part in expected:
        assert part in err, (part, err)


def test_the_shipped_configs_load_without_range_warnings(capsys):
    """Every config under configs/ sits inside the ranges of config/ranges.py."""
    from pathlib import Path

    from megatron_armor.config.ranges import range_warnings

    root = Path(__file__).resolve().parents[2] / "configs"
    for path in sorted(root.rglob("*.yaml")):
        text = path.read_text()
        if "stage1:" in text or "variants:" in text or "seeds:" in text:
            continue  # pipelines and comparison specs, not run configs
        config = load_config(path)
        assert list(range_warnings(config)) == [], path


@pytest.fixture
def moe_dir(tmp_path):
    """A Qwen3-MoE ``config.json`` (6 experts, transformers 5's ``num_local_experts``)."""
    cfg = {"model_type": "qwen3_moe", "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "num_local_experts": 6, "moe_intermediate_size": 30,
           "num_experts_per_tok": 2}  # fmt: skip
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path / "moe")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["trainer.ep=4", "trainer.world_size=4"],
            ["trainer.ep=4", "num_experts=6", "[1, 2, 3, 6]"],
        ),
        (["trainer.ep=2", "trainer.world_size=3"], ["trainer.world_size=3", "etp*ep*pp=1*2*1=2"]),
        (
            ["trainer.etp=2", "trainer.ep=3", "trainer.world_size=3"],
            ["trainer.world_size=3: fewer ranks", "etp*ep*pp=2*3*1=6", "trainer.etp"],
        ),
        (
            ["trainer.etp=2", "trainer.world_size=2"],
            ["trainer.etp=2 with trainer.ep=1 and trainer.tp=1", "set trainer.etp=1 or"],
        ),
        (
            ["trainer.tp=2", "trainer.world_size=2"],
            ["trainer.tp=2 with a mixture-of-experts model", "trainer.sequence_parallel=true"],
        ),
        (
            ["trainer.etp=4", "trainer.world_size=4"],
            ["trainer.etp=4", "moe_intermediate_size=30", "use etp=1"],
        ),
        (["trainer.etp=0"], ["trainer.etp=0", ">= 1"]),
        (["trainer.etp=some"], ["trainer.etp='some'", "or auto"]),
        (["trainer.ep=0"], ["trainer.ep=0", ">= 1"]),
        (["trainer.moe.aux_loss_coeff=-1"], ["trainer.moe.aux_loss_coeff", ">= 0"]),
    ],
)
def test_expert_parallel_layout_rules(moe_dir, overrides, expected):
    message = _error(f"trainer.model_path={moe_dir}", *overrides)
    for part in expected:
        assert part in message, (part, message)


def test_expert_parallel_needs_experts(hf_dir, moe_dir):
    """EP splits experts: a dense model refuses it; a layout megatron-core builds passes."""
    message = _error(f"trainer.model_path={hf_dir}", "trainer.ep=2", "trainer.world_size=2")
    assert "trainer.ep=2" in message and "dense model" in message
    message = _error(f"trainer.model_path={hf_dir}", "trainer.etp=2", "trainer.world_size=2")
    assert "trainer.etp=2" in message and "set trainer.etp=1" in message
    ok = [f"trainer.model_path={moe_dir}", "trainer.ep=3", "trainer.world_size=6"]
    assert load_config(None, ok).trainer.ep == 3
    sp = ["trainer.tp=2", "trainer.sequence_parallel=true", "trainer.ep=2"]
    load_config(None, [f"trainer.model_path={moe_dir}", *sp, "trainer.world_size=4"])
    # expert TP apart from TP (with ep > 1): tp=2 beside etp=1, tp=1 beside etp=2
    for layout in (["trainer.tp=2", "trainer.sequence_parallel=true"], ["trainer.etp=2"]):
        ok = [f"trainer.model_path={moe_dir}", *layout, "trainer.ep=2", "trainer.world_size=4"]
        cfg = load_config(None, ok)
        assert (cfg.trainer.tp, cfg.trainer.ep, cfg.resolved.etp) in ((2, 2, 1), (1, 2, 2))
    # etp auto: tp at ep=1 (the experts' gradients are reduced like dense weights), 1 at ep>1
    tp2 = [f"trainer.model_path={moe_dir}", "trainer.tp=2", "trainer.sequence_parallel=true"]
    assert load_config(None, [*tp2, "trainer.world_size=2"]).resolved.etp == 2
    ep2 = load_config(None, [*tp2, "trainer.ep=2", "trainer.world_size=4"])
    assert ep2.trainer.etp == "auto" and ep2.resolved.etp == 1


def test_train_takes_a_moe_model(moe_dir):
    """``armor train``'s input check takes a mixture-of-experts model like a dense one: what it
    names about ``moe_dir`` (a config.json alone) is its missing files, not its experts."""
    from megatron_armor.config.inputs import check_inputs

    config = load_config(None, [f"trainer.model_path={moe_dir}"])
    found = list(check_inputs(config))
    assert found and not [p for p in found if "mixture-of-experts" in p or "qwen3_moe" in p]
