"""Reference serving strategies draw anchors from the reference weights, never the policy's
(unit tier: two different tiny Qwen2 models stand in for policy and reference)."""

from __future__ import annotations

import io

import pytest
import torch

from megatron_armor.config.rollout_traits import STRATEGIES, reference_strategy
from megatron_armor.rollout.protocol import GenerationOutput, SamplingParams
from megatron_armor.rollout.reference import (
    CachedReferenceSampler,
    ReferenceSampler,
    SwapReferenceSampler,
    make_reference_sampler,
)
from megatron_armor.rollout.torch_engine import TorchEngine

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]


PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [20]]
QIDS = ["q0", "q1", "q2"]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, seed=11)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_qwen2):
    """``(policy_engine_dir, ref_engine_dir)`` plus frozen oracles for each."""
    root = tmp_path_factory.mktemp("ref")
    policy_dir, ref_dir = tiny_qwen2(root / "pol", 0), tiny_qwen2(root / "ref", 1)
    return {
        "policy_dir": policy_dir,
        "ref_dir": ref_dir,
        "policy": TorchEngine(policy_dir),
        "ref": TorchEngine(ref_dir),
    }


def weights_fn_for(models):
    def weights_fn(which: str):
        return models["policy" if which == "policy" else "ref"].state_tensors()

    return weights_fn


def max_error(oracle: TorchEngine, outputs, temperature=1.0) -> float:
    err = 0.0
    for prompt, samples in zip(PROMPTS, outputs, strict=True):
        for s in samples:
            tf = oracle.teacher_forced_logprobs(prompt, s.token_ids, temperature)
            err = max(err, max(abs(a - b) for a, b in zip(tf, s.logprobs, strict=True)))
    return err


def assert_from_reference(models, outputs, version):
    assert max_error(models["ref"], outputs) < 1e-5
    assert max_error(models["policy"], outputs) > 1e-2
    assert all(s.weight_version == version for g in outputs for s in g)


@pytest.mark.parametrize("strategy", ["swap", "dedicated", "cache"])
def test_strategy_samples_reference_weights(models, strategy):
    engine = TorchEngine(models["policy_dir"])
    engine.update_weights(models["policy"].state_tensors(), version=7)
    sampler = make_reference_sampler(strategy, engine, weights_fn=weights_fn_for(models))
    sampler.load_reference(3, models["ref"].state_tensors)
    outputs = sampler.sample(QIDS, PROMPTS, 2, PARAMS)
    assert [len(g) for g in outputs] == [2, 2, 2]
    assert_from_reference(models, outputs, version=3)
    # The policy is untouched afterwards (swap reloaded it; dedicated/cache never touched it).
    assert engine.weight_version() == 7
    policy_out = engine.generate(PROMPTS, 1, PARAMS)
    assert max_error(models["policy"], policy_out) < 1e-5


def test_dedicated_on_separate_engine(models):
    ref_engine = TorchEngine(models["policy_dir"])
    engine = TorchEngine(models["policy_dir"])
    sampler = make_reference_sampler("dedicated", engine, ref_engine=ref_engine)
    sampler.on_reset(4, models["ref"].state_tensors)
    assert_from_reference(models, sampler.sample(QIDS, PROMPTS, 1, PARAMS), version=4)
    assert not engine.has_weights("ref") and engine.weight_version() == 0


def test_swap_calls_two_syncs_per_sample(models):
    calls = []

    def weights_fn(which):
        calls.append(which)
        return weights_fn_for(models)(which)

    sampler = SwapReferenceSampler(TorchEngine(models["policy_dir"]), weights_fn)
    sampler.load_reference(3, None)  # a reference of another step than the policy's (0)
    sampler.sample(QIDS, PROMPTS, 1, PARAMS)
    assert calls == ["ref", "policy"]


def test_swap_loads_nothing_while_the_policy_is_the_reference(models):
    """A reset since the last policy push (the same version): the engine serves the reference
    already, so a swap would load the same weights twice. The samples are the policy's."""
    calls = []

    def weights_fn(which):
        calls.append(which)
        return weights_fn_for(models)(which)

    engine = TorchEngine(models["policy_dir"])
    engine.update_weights(models["policy"].state_tensors(), version=6)
    sampler = SwapReferenceSampler(engine, weights_fn)
    sampler.on_reset(6, None)
    outputs = sampler.sample(QIDS, PROMPTS, 2, PARAMS)
    assert calls == [] and engine.weight_version() == 6
    assert all(s.weight_version == 6 for g in outputs for s in g)
    policy = engine.generate(PROMPTS, 2, PARAMS)
    assert [[s.token_ids for s in g] for g in outputs] == [[s.token_ids for s in g] for g in policy]
    sampler.load_reference(5, None)  # the policy moved on: swapped again
    sampler.sample(QIDS, PROMPTS, 1, PARAMS)
    assert calls == ["ref", "policy"]


def test_cache_reuses_until_reset_and_reset_invalidates(models):
    engine = TorchEngine(models["policy_dir"])
    sampler = make_reference_sampler("cache", engine)
    sampler.load_reference(1, models["ref"].state_tensors)
    assert sampler.uncached(QIDS, PROMPTS, 2) == len(QIDS)
    first = sampler.sample(QIDS, PROMPTS, 2, PARAMS)
    assert sampler.uncached(QIDS, PROMPTS, 2) == 0  # every anchor cached
    assert sampler.uncached(QIDS, PROMPTS, 3) == len(QIDS)  # but not three per query
    other_seed = SamplingParams(temperature=1.0, max_new_tokens=6, seed=99)
    again = sampler.sample(QIDS[:2], PROMPTS[:2], 2, other_seed)
    assert [[s.token_ids for s in g] for g in again] == [
        [s.token_ids for s in g] for g in first[:2]
    ]
    assert sampler.metrics()["anchor/cache_hits"] == 2.0
    # A reset to new reference weights (here: the policy's) drops every cached anchor.
    sampler.on_reset(2, models["policy"].state_tensors)
    assert sampler.metrics()["anchor/cache_size"] == 0.0
    fresh = sampler.sample(QIDS, PROMPTS, 2, PARAMS)
    assert max_error(models["policy"], fresh) < 1e-5
    assert all(s.weight_version == 2 for g in fresh for s in g)


def test_cache_state_dict_round_trip_keeps_anchors_and_version(models):
    engine = TorchEngine(models["policy_dir"])
    sampler = make_reference_sampler("cache", engine)
    sampler.load_reference(5, models["ref"].state_tensors)
    first = sampler.sample(QIDS, PROMPTS, 2, PARAMS)
    buffer = io.BytesIO()  # through a checkpoint file: tensors only, the safe loader reads it
    torch.save(sampler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert all(isinstance(e["prompt"], torch.Tensor) for e in state["cache"].values())
    restored = make_reference_sampler("cache", TorchEngine(models["policy_dir"]))
    restored.load_state_dict(state)
    assert restored.ref_version == 5 and restored.inner.ref_version == 5
    again = restored.sample(QIDS, PROMPTS, 2, PARAMS)  # all hits: no engine call needed
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in first]
    assert [[s.logprobs for s in g] for g in again] == [[s.logprobs for s in g] for g in first]
    assert restored.metrics()["anchor/cache_misses"] == 0.0
    with pytest.raises(ValueError, match="different prompt"):
        restored.sample(["q0"], [[9, 9]], 2, PARAMS)


def test_cache_remembers_scores_until_reset_and_through_a_checkpoint(models):
    """Scores recorded for cached samples come back on a hit, survive the state_dict round
    trip (a checkpoint written before they were kept has none: they are scored again), and
    a reset drops them with the samples."""
    sampler = make_reference_sampler("cache", TorchEngine(models["policy_dir"]))
    sampler.load_reference(1, models["ref"].state_tensors)
    sampler.sample(QIDS, PROMPTS, 2, PARAMS)
    assert sampler.scores(QIDS, 2) == [None, None, None]  # drawn, not scored yet
    sampler.remember_scores(QIDS[:2], [[(1.0, True), (-1.0, False)], [(-1.5, False)] * 2])
    assert sampler.scores(QIDS, 2) == [[(1.0, True), (-1.0, False)], [(-1.5, False)] * 2, None]
    assert sampler.scores(["q0"], 1) == [[(1.0, True)]]
    # rule (b)'s verdict: q1's two samples are scored and wrong; q0 is solved, q2 unscored
    assert sampler.unsolved(QIDS, PROMPTS, 2) == [False, True, False]
    assert sampler.unsolved(["q1"], PROMPTS[1:2], 3) == [False]  # only 2 held: a 3rd is due
    with pytest.raises(ValueError, match="different prompt"):
        sampler.unsolved(["q1"], [[1, 2]], 2)
    buffer = io.BytesIO()
    torch.save(sampler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    restored = make_reference_sampler("cache", TorchEngine(models["policy_dir"]))
    restored.load_state_dict(state)
    assert restored.scores(QIDS, 2) == sampler.scores(QIDS, 2)
    assert restored.unsolved(QIDS, PROMPTS, 2) == [False, True, False]  # the verdicts resume
    for entry in state["cache"].values():  # as saved before the scores were kept
        entry.pop("score", None), entry.pop("acc", None)
    restored.load_state_dict(state)
    assert restored.scores(QIDS, 2) == [None, None, None]
    with pytest.raises(KeyError, match="'q9'"):
        sampler.remember_scores(["q9"], [[(1.0, True)]])
    sampler.on_reset(2, models["policy"].state_tensors)
    assert sampler.scores(QIDS, 2) == [None, None, None]
    assert sampler.unsolved(QIDS, PROMPTS, 2) == [False, False, False]


def test_factory_errors_and_config_mapping(models):
    engine = TorchEngine(models["policy_dir"])
    with pytest.raises(ValueError, match="ref_strategy=swap needs weights_fn"):
        make_reference_sampler("swap", engine)
    with pytest.raises(ValueError, match="'bogus' is not one of"):
        make_reference_sampler("bogus", engine)
    strategy, fill = reference_strategy("dedicated", "cache")
    assert (strategy, fill) == ("cache", "dedicated")
    sampler = make_reference_sampler(strategy, engine, cache_fill=fill)
    assert isinstance(sampler, CachedReferenceSampler)


@pytest.mark.parametrize(
    ("ref_strategy", "anchor_source", "plan", "caches", "swaps"),
    [
        ("swap", "generate", ("swap", "swap"), False, True),
        ("dedicated", "generate", ("dedicated", "dedicated"), False, False),
        ("cache", "cache", ("cache", "dedicated"), True, False),
        ("swap", "cache", ("cache", "swap"), True, True),
    ],
)
def test_the_plan_answers_what_the_driver_asks(ref_strategy, anchor_source, plan, caches, swaps):
    resolved = reference_strategy(ref_strategy, anchor_source)
    assert resolved == plan
    assert (resolved.caches_anchors, resolved.swaps_into_policy) == (caches, swaps)
    assert set(STRATEGIES) == {"swap", "dedicated", "cache"}  # the names config accepts
    with pytest.raises(ValueError, match="rollout.ref_strategy='bogus': unknown name"):
        reference_strategy("bogus", anchor_source)


@pytest.mark.parametrize("strategy", ["dedicated", "swap", "cache"])
def test_a_reset_to_the_served_policy_takes_the_engines_own_weights(models, strategy):
    """``WeightIntake.reset_reference_from_policy`` (a rollout worker's): the reference becomes
    the policy the engine serves at that version without receiving weights; it then samples
    what the policy samples, and survives the next policy push (a copy, not the policy's
    tensors)."""
    from megatron_armor.orchestration.actors.rollout_services import (
        EnginePools,
        WeightCopies,
        WeightIntake,
    )

    engine = TorchEngine(models["policy_dir"])
    copies = WeightCopies(strategy == "swap", 0)
    reference = make_reference_sampler(strategy, engine, weights_fn=copies)
    w = WeightIntake(EnginePools({"policy": engine}, 0), copies, reference)
    w.update_weights(4, models["ref"].state_tensors())  # the policy served at version 4
    if strategy == "swap":
        copies.copies["ref"] = models["policy"].state_tensors()  # the previous reference
    reference.load_reference(0, models["policy"].state_tensors)
    with pytest.raises(RuntimeError, match="serves version 4; push the reference"):
        w.reset_reference_from_policy(5)
    w.reset_reference_from_policy(4)
    assert reference.ref_version == 4
    if strategy == "swap":
        assert copies.copies["ref"] is copies.copies["policy"]
    outputs = reference.sample(QIDS, PROMPTS, 2, PARAMS)
    assert_from_reference(models, outputs, version=4)  # the policy at 4 holds models["ref"]
    w.update_weights(5, models["policy"].state_tensors())  # the policy moves on
    assert max_error(models["ref"], reference.sample(QIDS, PROMPTS, 1, PARAMS)) < 1e-5
    assert max_error(models["policy"], engine.generate(PROMPTS, 1, PARAMS)) < 1e-5


class RoutedSampler(ReferenceSampler):
    """Reference samples with the experts of each position, as a MoE engine asked for routes
    returns them (``[prompt + response - 1, layers, k]``)."""

    def sample(self, query_ids, prompts, n, params):
        import numpy as np

        from megatron_armor.types import RoutedExperts

        rng = np.random.default_rng(len(prompts))
        outputs = []
        for prompt in prompts:
            group = []
            for j in range(n):
                tokens = [3 + j, 4]
                ids = rng.integers(0, 300, (len(prompt) + len(tokens) - 1, 2, 2))
                group.append(
                    GenerationOutput(
                        tokens,
                        [-0.5, -0.25],
                        "stop",
                        self.ref_version,
                        routed_experts=RoutedExperts.from_array(ids),
                    )  # fmt: skip
                )
            outputs.append(group)
        return outputs


def test_cached_anchors_keep_their_routes_through_a_checkpoint():
    """A cached anchor of a mixture-of-experts reference keeps the experts it was routed to
    (the trainer's reference pass replays them, docs/algorithm.md) through the checkpoint."""
    sampler = CachedReferenceSampler(RoutedSampler(3))
    first = sampler.sample(QIDS, PROMPTS, 2, PARAMS)
    buffer = io.BytesIO()
    torch.save(sampler.state_dict(), buffer)
    buffer.seek(0)
    restored = CachedReferenceSampler(RoutedSampler(0))
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    again = restored.sample(QIDS, PROMPTS, 2, PARAMS)
    assert restored.metrics()["anchor/cache_misses"] == 0.0
    routes = [[s.routed_experts for s in g] for g in again]
    assert routes == [[s.routed_experts for s in g] for g in first]
    assert routes[1][0].dtype == "int16" and routes[1][0].shape == [len(PROMPTS[1]) + 1, 2, 2]
