"""Unit tier: anchor rejection sampling (docs/algorithm.md, anchor rollout) with scripted in-process generators.

The rollout and reward actors here are small deterministic test doubles with the same
methods as ``orchestration.actors.actor_handles`` (``generate``, ``sample_reference``, ``score``): each query
has a scripted number of correct policy responses and a scripted reference correctness
sequence, so group compositions and rejection counts are known exactly.
"""

from __future__ import annotations

import json
import math

import pytest

from megatron_armor.algo.advantages import assign_advantages
from megatron_armor.algo.registry import get_anchor_mode
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.data.dataset import PromptItem
from megatron_armor.data.sampler import ResumableSampler
from megatron_armor.orchestration.actors.rollout_services import set_remembered_scores
from megatron_armor.orchestration.step.acceptance import AcceptanceError
from megatron_armor.orchestration.step.anchor_rollout import (
    AnchorRollout,
    caches_anchors,
    derive_seed,
    followup_size,
    prefers_reference_first,
    reference_parts,
)
from megatron_armor.orchestration.step.step_metrics import (
    anchor_file_steps,
    compress_anchor_files,
    read_anchor_file,
    rollout_metrics,
    write_anchor_file,
)
from megatron_armor.rollout.protocol import GenerationOutput
from megatron_armor.rollout.reference import CachedReferenceSampler, ReferenceSampler
from megatron_armor.types import Sample, SampleSource, pack_groups

pytestmark = pytest.mark.unit

# query -> (correct policy responses, reference correctness in generation order)
SCRIPT = {
    "q0": (2, [False, True, True]),  # accepted; anchor = reference #1
    "q1": (99, [True, True, True]),  # all correct
    "q2": (0, [True, False, False]),  # all wrong (accepted only with weak_filter)
    "q3": (1, [False, False, False]),  # no reference correct
    "q4": (2, [True, False, False]),  # accepted; anchor = reference #0
    "q5": (1, [False, False, True]),  # accepted; anchor = reference #2
    "q6": (3, [True, False, False]),  # all correct with n_on = 3, accepted with 4 samples
}


class ScriptedRollout:
    def __init__(self):
        self.calls = []

    def _samples(self, item, n, correct, source, length):
        return [
            Sample(query_id=item.query_id, prompt_ids=item.prompt_ids, response_ids=[7] * (length + i),
                   source=source, response_text="right" if correct(i) else "wrong")
            for i in range(n)
        ]  # fmt: skip

    def generate(self, items, n, params):
        self.calls.append(("policy", len(items), n, params.seed))
        return [self._samples(it, n, lambda i, it=it: i < SCRIPT[it.query_id][0], SampleSource.POLICY, 3)
                for it in items]  # fmt: skip

    def sample_reference(self, items, n, params):
        self.calls.append(("reference", len(items), n, params.seed))
        return [self._samples(it, n, lambda i, it=it: SCRIPT[it.query_id][1][i], SampleSource.REFERENCE, 10)
                for it in items]  # fmt: skip


class PolicyView:
    """``rollout_draws.PolicyDraws`` of a scripted rollout, in process: ``submit_scored`` is
    the call, then ``reward`` scores the samples not already scored when the rows' scores are
    asked for."""

    def __init__(self, rollout):
        self.rollout = rollout

    def generate(self, items, n, params):
        return self.rollout.generate(items, n, params)

    def submit_scored(self, items, n, params, reward):
        return EagerScoredRows(self.rollout.generate(items, n, params), reward)


class ReferenceView:
    """``rollout_draws.ReferenceDraws`` of a scripted rollout, in process."""

    def __init__(self, rollout):
        self.rollout = rollout

    def sample(self, items, n, params):
        return self.rollout.sample_reference(items, n, params)

    def submit_scored(self, items, n, params, reward, wait_rows=True):
        return EagerScoredRows(self.rollout.sample_reference(items, n, params), reward)

    def remember_scores(self, items, rows):
        self.rollout.remember_reference_scores(items, rows)

    def unsolved(self, items, n):
        return self.rollout.reference_unsolved(items, n)


def use(runner, rollout):
    """``runner`` draws from the scripted ``rollout`` from now on; returns it."""
    runner.policy, runner.reference = PolicyView(rollout), ReferenceView(rollout)
    return rollout


class EagerScoredRows:
    def __init__(self, rows, reward):
        self.rows_, self.reward = rows, reward

    def rows(self):
        return self.rows_

    def score(self):
        return self.reward.score([s for row in self.rows_ for s in row if not s.scored])


class ScriptedReward:
    def score(self, samples):
        for s in samples:
            s.acc = s.response_text == "right"
            s.score = 1.0 if s.acc else -1.0
        return {"reward/timeouts": 0.0}


def make(anchor="armor", batch=2, gen_batch=3, max_gen_batches=4, weak_filter=False, group_size=4,
         filter_policy_samples="G", queries=tuple(SCRIPT), reference_first=False,
         on_short_batch="train_partial", min_batch_fraction=0.5, retire_after=0):  # fmt: skip
    cfg = ArmorConfig()
    cfg.data.retire_solved_after = retire_after
    cfg.algo.on_short_batch, cfg.algo.min_batch_fraction = on_short_batch, min_batch_fraction
    cfg.rollout.reference_first = reference_first
    cfg.algo.filter_policy_samples = filter_policy_samples
    cfg.algo.anchor, cfg.algo.weak_filter, cfg.algo.group_size = anchor, weak_filter, group_size
    cfg.algo.ref_n, cfg.algo.max_gen_batches = 3, max_gen_batches
    cfg.rollout.batch, cfg.rollout.gen_batch = batch, gen_batch
    items = [PromptItem(q, [1, 2, 3], q, "1", "tiny") for q in queries]
    rollout = ScriptedRollout()
    sampler = ResumableSampler(len(items), seed=0, shuffle=False, retire_after=retire_after)
    runner = AnchorRollout(cfg, items, sampler, PolicyView(rollout), ReferenceView(rollout),
                           ScriptedReward())  # fmt: skip
    return runner, rollout


def test_armor_groups_are_n_on_policy_plus_first_correct_reference():
    runner, rollout = make("armor", batch=2, gen_batch=3)
    result = runner.collect(step=1)
    assert [g.query_id for g in result.groups] == ["q0", "q4"]
    for g in result.groups:
        assert len(g.samples) == 4 and g.anchor_index == 3  # |G| = n_on + 1
        assert [s.source for s in g.samples[:3]] == [SampleSource.POLICY] * 3
        assert g.samples[3].source == SampleSource.REFERENCE and g.samples[3].acc
    # q0's anchor is its reference #1 (length 10 + 1); q4's is reference #0 (length 10)
    assert result.groups[0].samples[3].response_len == 11
    assert result.groups[1].samples[3].response_len == 10
    s = result.stats
    assert (s.gen_batches, s.queries_seen, s.accepted) == (2, 6, 3)
    assert (s.rejected_all_correct, s.rejected_all_wrong, s.rejected_no_ref_correct) == (1, 1, 1)
    kept = [r for r in result.records if r.get("kept")]
    surplus = [r for r in result.records if r["reason"] == "accepted" and not r["kept"]]
    assert [r["query_id"] for r in kept] == ["q0", "q4"] and [r["query_id"] for r in surplus] == [
        "q5"
    ]
    # the reference is sampled only for queries that pass rule (a): q0 of q0-q2, then q3-q5
    assert [c[:3] for c in rollout.calls] == [
        ("policy", 3, 3), ("reference", 1, 3), ("policy", 3, 3), ("reference", 3, 3)
    ]  # fmt: skip


def samples_of(groups) -> list:
    return [[(s.source, s.response_len, s.acc) for s in g.samples] for g in groups]


def test_reference_first_draws_policy_samples_only_for_queries_the_reference_solved():
    """``rollout.reference_first``: the reference samples of every query first; q3 (none
    correct) is rejected by rule (b) before its policy samples are drawn; the same groups,
    anchors and counts as the policy-first order."""
    runner, rollout = make("armor", batch=2, gen_batch=3, reference_first=True)
    result = runner.collect(step=1)
    plain = make("armor", batch=2, gen_batch=3)[0].collect(step=1)
    assert [g.query_id for g in result.groups] == ["q0", "q4"]
    assert samples_of(result.groups) == samples_of(plain.groups)
    assert [c[:3] for c in rollout.calls] == [
        ("reference", 3, 3), ("policy", 3, 3), ("reference", 3, 3), ("policy", 2, 3)
    ]  # fmt: skip
    assert rollout.calls[0][3] == plain_seed(1, 0, "reference")
    s = result.stats
    assert (s.gen_batches, s.queries_seen, s.accepted) == (2, 6, 3)
    assert (s.rejected_all_correct, s.rejected_all_wrong, s.rejected_no_ref_correct) == (1, 1, 1)
    assert s.rejected_cached_no_ref_correct == 0
    (q3,) = [r for r in result.records if r["query_id"] == "q3"]
    assert (q3["reason"], q3["policy_n"], q3["ref_n"], q3["ref_correct"]) == (
        "no_reference_correct", 0, 3, 0
    )  # fmt: skip
    assert "cached_verdict" not in q3
    # reference samples of 10, 11, 12 tokens for all 6 queries; policy 3 + 4 + 5 for 5
    assert result.generated_tokens == 6 * 33 + 5 * 12


def plain_seed(step: int, batch: int, role: str) -> int:
    return derive_seed(ArmorConfig().run.seed, step, batch, role)


def test_reference_first_is_off_without_rule_b():
    for order in (True, "auto"):
        runner, rollout = make("none", batch=3, gen_batch=6, reference_first=order)
        runner.collect(step=1)
        runner.observe(
            {
                "anchor/queries_seen": 6.0,
                "anchor/rejected_all_correct": 0.0,
                "anchor/rejected_all_wrong": 0.0,
                "anchor/rejected_no_ref_correct": 6.0,
            }
        )
        runner.collect(step=2)
        assert all(c[0] == "policy" for c in rollout.calls)


def shares(seen, all_correct, all_wrong, no_ref, first=False, cached=0, hits=None, misses=None):
    """A previous step's ``anchor/*`` metrics as :func:`prefers_reference_first` reads them."""
    m = {
        "anchor/queries_seen": seen,
        "anchor/rejected_all_correct": all_correct,
        "anchor/rejected_all_wrong": all_wrong,
        "anchor/rejected_no_ref_correct": no_ref,
        "anchor/rejected_cached_no_ref_correct": cached,
        "anchor/reference_first": float(first),
    }
    if hits is not None:
        m.update({"anchor/cache_hits": hits, "anchor/cache_misses": misses})
    return {k: float(v) for k, v in m.items()}


def test_auto_order_follows_the_cost_rule_on_the_previous_steps_shares():
    """Reference first iff ``n_on q > m ref_n p_a`` (docs/algorithm.md), each share over the
    queries its rule judged; policy first without a previous step."""
    assert not prefers_reference_first({}, 15, 4)
    assert not prefers_reference_first({"anchor/queries_seen": 16.0}, 15, 4)  # validation line
    # policy first before: p_a = 12/16 over all, q = 1/4 over the 4 that passed rule (a)
    before = shares(16, 8, 4, 1)
    assert prefers_reference_first(before, 15, 4)  # 15 * 0.25 = 3.75 > 4 * 0.75 = 3
    assert not prefers_reference_first(before, 15, 8)  # 3.75 < 8 * 0.75 = 6
    # the anchor cache generates for half of the look-ups only: 3.75 > 0.5 * 6
    assert prefers_reference_first(shares(16, 8, 4, 1, hits=5, misses=5), 15, 8)
    assert not prefers_reference_first(shares(16, 8, 4, 1, hits=1, misses=9), 15, 8)
    after_reset = {**shares(16, 8, 4, 1, hits=5, misses=5), "reset/performed": 1.0}
    assert not prefers_reference_first(after_reset, 15, 8)  # the cache is empty: m = 1
    # reference first before: q = 4/16 over all, p_a = 6/12 over those rule (b) passed
    assert prefers_reference_first(shares(16, 4, 2, 4, first=True), 15, 4)  # 3.75 > 2
    assert not prefers_reference_first(shares(16, 4, 2, 4, first=True), 3, 4)  # 0.75 < 2
    # rejections by a cached verdict judged nothing: here no live query rule (b) rejected
    assert not prefers_reference_first(shares(16, 2, 2, 10, cached=10), 15, 4)
    assert not prefers_reference_first(shares(16, 16, 0, 0), 15, 4)  # rule (b) judged none


def test_auto_order_switches_after_a_step_rule_b_rejected_much():
    """``auto``: step 1 policy first; q3 (no correct reference) is rejected three times and
    rule (a) never rejects, so step 2 draws the reference first; a runner that resumes from
    step 1's metrics line picks the same order and draws the same."""
    queries = ("q3", "q0", "q3", "q4", "q3", "q5")
    runner, rollout = make("armor", batch=2, gen_batch=3, queries=queries, reference_first="auto")
    first = runner.collect(step=1)
    assert not first.reference_first and rollout.calls[0][0] == "policy"
    line = rollout_metrics(first)
    assert line["anchor/reference_first"] == 0.0 and line["anchor/rejected_no_ref_correct"] == 3
    runner.observe(line)
    state = runner.sampler.state_dict()
    rollout.calls.clear()
    second = runner.collect(step=2)
    assert second.reference_first and rollout.calls[0][0] == "reference"
    assert rollout_metrics(second)["anchor/reference_first"] == 1.0
    resumed, resumed_rollout = make("armor", batch=2, gen_batch=3, queries=queries,
                                    reference_first="auto")  # fmt: skip
    resumed.sampler.load_state_dict(state)
    resumed.observe(line)
    again = resumed.collect(step=2)
    assert group_keys(again.groups) == group_keys(second.groups)
    assert resumed_rollout.calls == rollout.calls


def test_none_is_dapo_dynamic_sampling_without_reference():
    runner, rollout = make("none", batch=3, gen_batch=6)
    result = runner.collect(step=1)
    assert all(len(g.samples) == 4 and g.anchor_index is None for g in result.groups)
    # rule (a) only: q3 (no reference correct) is accepted now
    assert [g.query_id for g in result.groups] == ["q0", "q3", "q4"]
    assert all(c[0] == "policy" for c in rollout.calls) and rollout.calls[0][2] == 4


def test_filter_only_uses_rule_b_but_inserts_no_anchor():
    runner, _ = make("filter_only", batch=3, gen_batch=6)
    result = runner.collect(step=1)
    assert [g.query_id for g in result.groups] == ["q0", "q4", "q5"]
    assert all(len(g.samples) == 4 and g.anchor_index is None for g in result.groups)
    assert all(s.source == SampleSource.POLICY for g in result.groups for s in g.samples)


def test_filter_only_g_minus_1_applies_armors_acceptance_rule_to_the_same_draws():
    """Rule (a) over ARMOR's n_on = G - 1 samples: the same accepted queries, records and
    generation calls (seeds included) as ARMOR; the groups are ARMOR's without the anchor."""
    armor_runner, armor_rollout = make("armor", batch=4, gen_batch=7)
    filt_runner, filt_rollout = make("filter_only", batch=4, gen_batch=7,
                                     filter_policy_samples="G-1")  # fmt: skip
    armor, filt = armor_runner.collect(step=3), filt_runner.collect(step=3)
    assert filt_rollout.calls == armor_rollout.calls
    assert filt.records == armor.records and filt.stats.accepted_ids == armor.stats.accepted_ids
    assert [g.query_id for g in filt.groups] == ["q0", "q4", "q5"] + ["q0"]  # next epoch
    for f, a in zip(filt.groups, armor.groups, strict=True):
        assert f.samples == a.samples[: a.anchor_index] and f.anchor_index is None
    # the reference samples decided rule (b) only: none is ever trained on
    assert all(s.source == SampleSource.POLICY for g in filt.groups for s in g.samples)
    assign_advantages(filt.groups, "grpo")
    assert not pack_groups(filt.groups).is_anchor.any()


def test_filter_only_g_evaluates_rule_a_over_g_samples():
    """With G on-policy samples q6 (3 of 4 correct) has variance and is accepted; with G - 1
    (3 of 3 correct) it is rejected as all-correct."""
    full, _ = make("filter_only", batch=4, gen_batch=7)
    minus, _ = make("filter_only", batch=3, gen_batch=7, filter_policy_samples="G-1")
    assert "q6" in full.collect(step=1).stats.accepted_ids
    reasons = {r["query_id"]: r["reason"] for r in minus.collect(step=1).records}
    assert reasons["q6"] == "all_correct"


def test_weak_filter_keeps_all_wrong_groups_the_reference_solved():
    runner, _ = make("armor", batch=4, gen_batch=6, weak_filter=True)
    result = runner.collect(step=1)
    assert [g.query_id for g in result.groups] == ["q0", "q2", "q4", "q5"]


@pytest.mark.parametrize("policy", ["error", "train_partial"])
def test_exhausted_generation_batches_name_rate_and_settings(policy):
    runner, _ = make("armor", batch=5, gen_batch=2, max_gen_batches=2, on_short_batch=policy)
    with pytest.raises(AcceptanceError) as err:  # 1 accepted: below train_partial's floor of 3
        runner.collect(step=1)
    msg = str(err.value)
    assert "only 1 of the 5 queries" in msg and "after 2 generation batches" in msg
    assert "acceptance rate 0.250" in msg and "algo.max_gen_batches" in msg
    assert "rollout.gen_batch" in msg and "algo.ref_n" in msg and "algo.weak_filter" in msg
    if policy == "error":
        assert "set algo.on_short_batch=train_partial" in msg and "short batch needs" not in msg
    else:
        assert "a short batch needs 3 (algo.min_batch_fraction)" in msg
        assert "lower algo.min_batch_fraction (now 0.5" in msg


SHORT_QUERIES = ("q0", "q4", "q1", "q5", "q2", "q3")  # one batch of 4: q0, q4, q5 accepted


def test_train_partial_trains_a_short_batch_at_or_above_the_floor():
    runner, _ = make("armor", batch=4, gen_batch=4, max_gen_batches=1, queries=SHORT_QUERIES)
    result = runner.collect(step=1)
    assert result.short_batch and [g.query_id for g in result.groups] == ["q0", "q4", "q5"]
    m = rollout_metrics(result)
    assert m["anchor/short_batch"] == 1.0 and m["anchor/kept"] == 3.0
    assert m["anchor/accepted"] == 3.0 and m["anchor/queries_seen"] == 4.0
    assert all(len(g.samples) == 4 and g.anchor_index == 3 for g in result.groups)


@pytest.mark.parametrize(("policy", "fraction"), [("error", 0.5), ("train_partial", 1.0)])
def test_a_short_step_fails_with_error_or_below_the_floor(policy, fraction):
    runner, _ = make("armor", batch=4, gen_batch=4, max_gen_batches=1, queries=SHORT_QUERIES,
                     on_short_batch=policy, min_batch_fraction=fraction)  # fmt: skip
    with pytest.raises(AcceptanceError, match="only 3 of the 4 queries"):
        runner.collect(step=1)


def test_error_and_train_partial_draw_and_keep_the_same_when_the_batch_fills():
    """``algo.on_short_batch=error`` is today's rollout: whenever ``B`` groups are accepted
    both policies make the same calls with the same seeds and keep the same groups."""
    runs = [
        make("armor", batch=3, gen_batch=3, on_short_batch=p) for p in ("error", "train_partial")
    ]
    results = [runner.collect(step=2) for runner, _ in runs]
    assert runs[0][1].calls == runs[1][1].calls and len(runs[0][1].calls) > 2  # 2+ batches
    assert results[0].records == results[1].records and not results[1].short_batch
    assert [g.query_id for g in results[0].groups] == [g.query_id for g in results[1].groups]
    assert rollout_metrics(results[0]) == rollout_metrics(results[1])


def test_an_acceptance_failure_after_skipped_updates_names_them_first():
    """Right after a step that skipped updates (non-finite loss or gradient norm), the error
    says so before it suggests the acceptance settings; after a normal step it does not."""
    runner, _ = make("armor", batch=5, gen_batch=2, max_gen_batches=2, on_short_batch="error")
    runner.observe({"train/skipped_updates": 2.0, "train/updates": 2.0, "loss/pg": math.nan})
    with pytest.raises(AcceptanceError) as err:
        runner.collect(step=4)
    msg = str(err.value)
    assert msg.startswith("the step before (step 3) skipped 2 of 2 optimizer updates")
    assert "non-finite loss/pg" in msg and "trainer.lr" in msg
    assert msg.index("diverged") < msg.index("algo.max_gen_batches")
    runner.observe({"train/skipped_updates": 0.0, "train/updates": 2.0, "loss/pg": 0.1})
    with pytest.raises(AcceptanceError) as err:
        runner.collect(step=5)
    assert str(err.value).startswith("only ")


def test_an_acceptance_failure_with_only_wrong_answers_after_a_sound_step_names_the_update():
    """``trainer.lr`` far too large: the update is finite, yet the policy that was partly right
    now answers every query wrongly; the error says the update likely diverged."""
    runner, _ = make(
        "armor", batch=1, gen_batch=1, max_gen_batches=1, queries=("q2",), on_short_batch="error"
    )  # all wrong
    runner.observe({"reward/policy_acc": 0.3, "lr": 1000.0, "loss/grad_norm": 0.8,
                    "train/skipped_updates": 0.0})  # fmt: skip
    with pytest.raises(AcceptanceError) as err:
        runner.collect(step=2)
    msg = str(err.value)
    assert msg.startswith("the step before (step 1) had on-policy accuracy 0.300")
    assert "lr 1e+03" in msg and "only wrong answers" in msg and "algo.max_gen_batches" in msg


def test_seeds_depend_only_on_seed_step_batch_role():
    assert derive_seed(1, 3, 0, "policy") == derive_seed(1, 3, 0, "policy")
    seeds = {
        derive_seed(1, s, b, r) for s in (1, 2) for b in (0, 1) for r in ("policy", "reference")
    }
    assert len(seeds) == 8 and all(0 <= x < 2**31 for x in seeds)
    runner_a, roll_a = make("armor")
    runner_b, roll_b = make("armor")
    runner_a.collect(step=5)
    runner_b.collect(step=5)
    assert roll_a.calls == roll_b.calls and roll_a.calls[0][3] == derive_seed(1, 5, 0, "policy")


def test_policy_samples_and_reference_draws_of_each_anchor_mode():
    assert get_anchor_mode("armor").policy_samples(16) == 15
    assert get_anchor_mode("none").policy_samples(16) == 16
    assert get_anchor_mode("filter_only").policy_samples(16) == 16
    assert get_anchor_mode("filter_only").policy_samples(16, "G-1") == 15
    assert get_anchor_mode("none").policy_samples(16, "G-1") == 16  # only filter_only reads it
    with pytest.raises(ValueError, match="algo.filter_policy_samples='G-2'"):
        get_anchor_mode("filter_only").policy_samples(16, "G-2")
    assert [get_anchor_mode(m).draws_reference for m in ("none", "armor", "filter_only")] == [
        False,
        True,
        True,
    ]


def test_rollout_metrics_and_anchor_file(tmp_path):
    runner, _ = make("armor", batch=2, gen_batch=3)
    result = runner.collect(step=1)
    for g in result.groups:
        g.advantages = [0.5] * len(g.samples)
    m = rollout_metrics(result)
    assert m["anchor/acceptance_rate"] == pytest.approx(3 / 6)
    assert m["anchor/rejected_all_wrong_frac"] == pytest.approx(1 / 6)
    assert m["reward/anchor_acc"] == 1.0 and m["length/anchor_mean"] == pytest.approx(10.5)
    assert m["anchor/kept"] == 2.0 and m["reward/policy_mean"] < m["reward/anchor_mean"]
    path = write_anchor_file(tmp_path, 1, result)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert path.name == "step_000001.jsonl" and lines[0]["type"] == "stats"
    kept = [x for x in lines[1:] if x.get("kept")]
    assert [(x["query_id"], x["anchor_len"]) for x in kept] == [("q0", 11), ("q4", 10)]
    assert len(lines) == 1 + 6


def test_anchor_files_gzipped_up_to_a_step_read_back_the_same_and_rewritten_plain(tmp_path):
    runner, _ = make("armor", batch=2, gen_batch=3)
    result = runner.collect(step=1)
    for step in (1, 2, 3):
        write_anchor_file(tmp_path, step, result)
    plain = {step: read_anchor_file(tmp_path, step) for step in (1, 2, 3)}
    done = compress_anchor_files(tmp_path, up_to_step=2)
    assert [p.name for p in done] == ["step_000001.jsonl.gz", "step_000002.jsonl.gz"]
    names = sorted(p.name for p in (tmp_path / "anchors").iterdir())
    assert names == ["step_000001.jsonl.gz", "step_000002.jsonl.gz", "step_000003.jsonl"]
    assert anchor_file_steps(tmp_path) == [1, 2, 3]
    assert {step: read_anchor_file(tmp_path, step) for step in (1, 2, 3)} == plain
    write_anchor_file(tmp_path, 2, result)  # a resumed run redoes step 2: one plain file again
    assert not (tmp_path / "anchors" / "step_000002.jsonl.gz").exists()
    assert read_anchor_file(tmp_path, 2) == plain[2]


def test_followup_batches_are_sized_to_the_shortfall_with_a_floor():
    assert followup_size(24, 16, 0, 0) == 24  # first batch: a whole gen_batch
    assert followup_size(24, 16, 0, 24) == 24  # nothing accepted yet: no rate to go by
    assert followup_size(24, 16, 12, 24) == 8  # 4 missing at rate 1/2
    assert followup_size(24, 16, 15, 20) == 6  # 1 missing at rate 3/4: the floor, 24 / 4
    assert followup_size(24, 16, 2, 24) == 24  # 14 missing at rate 1/12: capped at gen_batch
    # rule (a) alone: 4 of q0..q5 accepted, 1 missing -> ceil(1 * 6 / 4) = 2 queries (q6, q0)
    runner, rollout = make("none", batch=5, gen_batch=6)
    result = runner.collect(step=1)
    assert [c[:2] for c in rollout.calls] == [("policy", 6), ("policy", 2)]
    assert [g.query_id for g in result.groups] == ["q0", "q3", "q4", "q5", "q6"]


def test_weak_filter_samples_the_reference_for_all_wrong_groups_too():
    runner, rollout = make("armor", batch=1, gen_batch=3, weak_filter=True)
    runner.collect(step=1)
    assert [c[:2] for c in rollout.calls] == [("policy", 3), ("reference", 2)]  # q0 and q2


class ScriptedReferencePool(ReferenceSampler):
    """Fresh reference draws for the anchor cache: correctness from :data:`SCRIPT`, lengths
    that encode the draw number, so a cached sample is recognisable."""

    def __init__(self):
        super().__init__()
        self.draws = 0

    def sample(self, query_ids, prompts, n, params):
        self.draws += 1
        return [[GenerationOutput([5 if SCRIPT[q][1][i] else 6] * (10 + self.draws), [0.0],
                                  "stop", self.ref_version) for i in range(n)]
                for q in query_ids]  # fmt: skip


def reset_period_steps(runner, rollout) -> list:
    """Steps 1-6 of ``runner`` with a reference reset after step 4 (``rollout``'s anchor cache
    dropped); each step's result."""
    results = []
    for step in range(1, 7):
        results.append(runner.collect(step))
        if step == 4:
            rollout.cache.on_reset(4, None)
    return results


class CachedRollout(ScriptedRollout):
    """Policy samples as :class:`ScriptedRollout`; reference samples through the anchor cache."""

    def __init__(self):
        super().__init__()
        self.cache = CachedReferenceSampler(ScriptedReferencePool())

    def sample_reference(self, items, n, params):
        self.calls.append(("reference", len(items), n, params.seed))
        outs = self.cache.sample([it.query_id for it in items], [it.prompt_ids for it in items],
                                 n, params)  # fmt: skip
        return [[Sample(query_id=it.query_id, prompt_ids=it.prompt_ids, response_ids=o.token_ids,
                        source=SampleSource.REFERENCE,
                        response_text="right" if o.token_ids[0] == 5 else "wrong") for o in row]
                for it, row in zip(items, outs, strict=True)]  # fmt: skip


def test_anchor_cache_hits_queries_that_recur_within_a_reset_period():
    """6 queries, 3 per step: each recurs every 2 steps; a reset every 4 steps. Only the
    rule-(a) passers q0, q3, q4, q5 look the reference up: steps 1-2 miss (first sight),
    steps 3-4 hit; the reset at step 4 empties the cache, so steps 5-6 miss again."""
    runner, rollout = make(
        "armor", batch=1, gen_batch=3, queries=("q0", "q1", "q2", "q3", "q4", "q5")
    )
    rollout = use(runner, CachedRollout())
    anchors = {step: r.groups[0].samples[-1].response_len
               for step, r in enumerate(reset_period_steps(runner, rollout), start=1)}  # fmt: skip
    m = rollout.cache.metrics()
    assert (m["anchor/cache_hits"], m["anchor/cache_misses"]) == (4.0, 8.0)
    assert anchors[3] == anchors[1] and anchors[5] != anchors[1]  # cached, then fresh again


class RememberingRollout(CachedRollout):
    """:class:`CachedRollout` that hands out remembered scores as ``RolloutWorker`` does."""

    def sample_reference(self, items, n, params):
        rows = super().sample_reference(items, n, params)
        set_remembered_scores(rows, self.cache.scores([it.query_id for it in items], n))
        self.last_reference_ids = [it.query_id for it in items]
        return rows

    def remember_reference_scores(self, items, rows):
        # the rows of the whole call: the real group shards them as it sharded the call
        assert [it.query_id for it in items] == self.last_reference_ids
        self.calls.append(("remember", len(items)))
        self.cache.remember_scores([it.query_id for it in items],
                                   [[(s.score, s.acc) for s in row] for row in rows])  # fmt: skip

    def reference_unsolved(self, items, n):
        self.calls.append(("verdicts", len(items)))
        return self.cache.unsolved(
            [it.query_id for it in items], [it.prompt_ids for it in items], n
        )


class CountingReward(ScriptedReward):
    def __init__(self):
        self.scored = []

    def score(self, samples):
        self.scored.extend(s.source for s in samples)
        return super().score(samples)


def test_cached_anchors_are_scored_once_per_reset_period():
    """With the anchor cache, a query's reference samples are scored when drawn, remembered
    by the cache, and a hit reuses them: the same groups as scoring them again, and no
    reference sample goes to the scorer twice until the reset drops the cache."""
    queries = ("q0", "q1", "q2", "q3", "q4", "q5")
    runs = {}
    for remembering in (False, True):
        runner, _ = make("armor", batch=1, gen_batch=3, queries=queries)
        runner.caches_anchors = remembering
        rollout = use(runner, RememberingRollout() if remembering else CachedRollout())
        reward = runner.reward = CountingReward()
        groups = [group_keys(r.groups) for r in reset_period_steps(runner, rollout)]
        runs[remembering] = (groups, reward.scored.count(SampleSource.REFERENCE), rollout.calls)
    assert runs[True][0] == runs[False][0]
    # 12 look-ups of 3 samples each; the 4 hits (steps 3-4) are not scored again
    assert (runs[False][1], runs[True][1]) == (12 * 3, 8 * 3)
    assert sum(c[0] == "remember" for c in runs[True][2]) == 4  # only after fresh draws
    assert caches_anchors(make_config(anchor_source="cache"))
    assert not caches_anchors(make_config(anchor="none", anchor_source="cache"))
    assert not caches_anchors(make_config())


def make_config(anchor="armor", anchor_source="generate") -> ArmorConfig:
    cfg = ArmorConfig()
    cfg.algo.anchor, cfg.algo.anchor_source = anchor, anchor_source
    return cfg


def test_reference_parts_are_contiguous_slices_and_keep_repeated_queries_together():
    assert reference_parts(["a", "b", "c", "d", "e"], 2) == [[0, 1, 2], [3, 4]]
    assert reference_parts(["a", "b"], 4) == [[0], [1]]
    assert reference_parts(["a", "b", "a"], 2) == [[0, 1, 2]]  # one cache look-up per query


class OrderedScoring(ScriptedReward):
    """Scores like :class:`ScriptedReward`, but the policy samples of ``waiting`` (a query id
    set) are scored only after the reference samples of ``after`` were drawn: the parts of a
    generation batch are made to finish in a chosen order."""

    def __init__(self, waiting: set[str], drawn):
        self.waiting, self.drawn = waiting, drawn

    def score(self, samples):
        if (
            samples
            and samples[0].query_id in self.waiting
            and samples[0].source == SampleSource.POLICY
        ):
            assert self.drawn.wait(timeout=60), "the other part's reference was never drawn"
        return super().score(samples)


class SignallingRollout(ScriptedRollout):
    def __init__(self, signal_on: str, drawn):
        super().__init__()
        self.signal_on, self.drawn = signal_on, drawn

    def sample_reference(self, items, n, params):
        rows = super().sample_reference(items, n, params)
        if any(it.query_id == self.signal_on for it in items):
            self.drawn.set()
        return rows


def collect_in_order(first_part_waits: bool):
    """One step of 6 queries in 2 reference parts (q0-q2, q3-q5), one part's scoring held
    until the other part's reference samples are drawn."""
    import threading

    runner, _ = make("armor", batch=3, gen_batch=6, queries=("q0", "q1", "q2", "q3", "q4", "q5"))
    runner.parts = 2
    drawn = threading.Event()
    waiting, signal = ({"q0", "q1", "q2"}, "q3") if first_part_waits else ({"q3", "q4", "q5"}, "q0")
    rollout = use(runner, SignallingRollout(signal, drawn))
    runner.reward = OrderedScoring(waiting, drawn)
    result = runner.collect(step=1)
    return result, rollout.calls


def group_keys(groups) -> list[list[tuple]]:
    return [[(s.query_id, s.source, s.response_len, s.acc) for s in g.samples] for g in groups]


def test_overlapped_parts_select_the_same_groups_whatever_part_finishes_first():
    """Scoring overlaps reference generation part by part; the accepted groups, the
    records, the reward stats and every call's seed are the same in either finishing order."""
    forward, forward_calls = collect_in_order(first_part_waits=False)
    backward, backward_calls = collect_in_order(first_part_waits=True)
    assert [c for c in backward_calls if c[0] == "reference"][0][1] == 3  # part 1 drew first
    assert sorted(forward_calls) == sorted(backward_calls)
    assert forward.records == backward.records and forward.reward_stats == backward.reward_stats
    assert group_keys(forward.groups) == group_keys(backward.groups)
    seeds = {c[3] for c in forward_calls if c[0] == "reference"}
    run_seed = 1
    assert seeds == {derive_seed(run_seed, 1, 0, r) for r in ("reference", "reference/1")}


def test_a_cached_all_wrong_reference_rejects_a_recurring_query_before_it_is_generated():
    """q3's reference never solves it. Once its cached samples are scored (step 2), rule (b)
    rejects it at its next visits of the period (step 4) without drawing its on-policy samples;
    the groups are those of the run that draws them, and after the reset (step 4) q3 is drawn
    and looked up afresh (step 6)."""
    queries = ("q0", "q1", "q2", "q3", "q4", "q5")
    runs = {}
    for verdicts in (False, True):
        runner, _ = make("armor", batch=1, gen_batch=3, queries=queries)
        runner.caches_anchors = verdicts
        rollout = use(runner, RememberingRollout())
        results = reset_period_steps(runner, rollout)
        groups = [group_keys(r.groups) for r in results]
        stats = [r.stats.as_metrics() for r in results]
        records = [r.records for r in results]
        runs[verdicts] = (groups, stats, records, rollout.calls)
    assert runs[True][0] == runs[False][0]
    stats, records, calls = runs[True][1:]
    # step 4: q3 rejected by its cached verdict, q4 accepted; only q4, q5 were generated
    assert [s["anchor/rejected_cached_no_ref_correct"] for s in stats] == [0, 0, 0, 1, 0, 0]
    assert (
        stats[3]["anchor/rejected_no_ref_correct"]
        == 1
        == runs[False][1][3]["anchor/rejected_no_ref_correct"]
    )
    assert records[3][0] == {"query_id": "q3", "gen_batch": 0, "reason": "no_reference_correct",
                             "policy_correct": 0, "policy_n": 0, "ref_correct": 0, "ref_n": 0,
                             "policy_lengths": [], "cached_verdict": True}  # fmt: skip
    policy_calls = [c[1] for c in calls if c[0] == "policy"]
    assert policy_calls == [3, 3, 3, 2, 3, 3]  # q3 skipped at step 4 only (after the reset: drawn)
    assert sum(c[0] == "verdicts" for c in calls) == 6
    assert all(s["anchor/rejected_cached_no_ref_correct"] == 0 for s in runs[False][1])


def test_reference_first_with_the_anchor_cache_selects_the_same_groups():
    """Reference first over the anchor cache: cached verdicts still come first (no reference
    look-up for them), every other query's reference samples (hits or fresh) decide rule (b)
    before its policy samples are drawn; the groups are the policy-first run's, and a query
    whose reference never solves it (q3) never gets policy samples."""
    queries = ("q0", "q1", "q2", "q3", "q4", "q5")
    runs = {}
    for first in (False, True):
        runner, _ = make("armor", batch=1, gen_batch=3, queries=queries, reference_first=first)
        runner.caches_anchors = True
        rollout = use(runner, RememberingRollout())
        groups = [group_keys(r.groups) for r in reset_period_steps(runner, rollout)]
        runs[first] = (groups, rollout.calls)
    assert runs[True][0] == runs[False][0]
    calls = runs[True][1]
    policy = [c[1] for c in calls if c[0] == "policy"]
    reference = [c[1] for c in calls if c[0] == "reference"]
    # q3 sits in the second batch of each cycle: its policy samples are never drawn
    assert policy == [3, 2, 3, 2, 3, 2] and reference == [3, 3, 3, 2, 3, 3]


def test_no_cached_verdict_without_rule_b_or_without_the_cache():
    runner, rollout = make("none", batch=1, gen_batch=3)
    runner.caches_anchors = True  # DAPO never applies rule (b): nothing to ask the cache
    runner.collect(step=1)
    assert [c[0] for c in rollout.calls] == ["policy"]
    runner, rollout = make("armor", batch=1, gen_batch=3)
    assert not runner.caches_anchors and runner._cached_verdicts(["x", "y"]) == [False, False]


def two_steps(order, prefetch: bool, queries=("q3", "q0", "q3", "q4", "q3", "q5")):
    """Steps 1 and 2 as the loop runs them (``observe`` the step's line; with ``prefetch``,
    :meth:`AnchorRollout.prefetch` after step 1's rollout). Returns the runner, the
    scripted rollout and both results."""
    runner, rollout = make("armor", batch=2, gen_batch=3, queries=queries, reference_first=order)
    runner.rollout_cfg.prefetch_reference = prefetch
    first = runner.collect(step=1)
    sent = runner.prefetch(1, first) if prefetch else False
    runner.observe(rollout_metrics(first))
    return runner, rollout, first, runner.collect(step=2), sent


@pytest.mark.parametrize("order", [True, "auto"])
def test_prefetched_reference_call_is_the_call_the_next_step_makes(order):
    """Step 2 draws the reference first (``true``, or ``auto`` after step 1's rule (b)
    rejections): its first batch's reference call, sent after step 1's rollout (while the
    trainer works), is the same call with the same seed; step 2 makes no call of its own for
    it and accepts the same groups as without the prefetch, and the sampler is where it
    would be."""
    runner, rollout, _, second, sent = two_steps(order, prefetch=True)
    plain_runner, plain_rollout, _, plain, _ = two_steps(order, prefetch=False)
    assert sent and second.reference_prefetched and not plain.reference_prefetched
    assert rollout.calls == plain_rollout.calls  # the same calls, the prefetched one earlier
    step2 = [c for c in rollout.calls if c[3] in {plain_seed(2, b, r) for b in range(4)
                                                  for r in ("policy", "reference")}]  # fmt: skip
    assert step2[0] == ("reference", 3, 3, plain_seed(2, 0, "reference"))
    assert group_keys(second.groups) == group_keys(plain.groups)
    assert samples_of(second.groups) == samples_of(plain.groups)
    assert second.records == plain.records and second.generated_tokens == plain.generated_tokens
    assert rollout_metrics(second)["perf/reference_prefetched"] == 1.0
    assert runner.sampler.state_dict() == plain_runner.sampler.state_dict()


def test_no_prefetch_when_the_next_step_draws_policy_first_or_the_call_differs():
    """``auto`` after a step rule (b) did not reject: nothing sent. A prefetched call that is
    not the next step's first reference call (another step collects next) is left unused:
    that step draws its own, the same as without the prefetch."""
    runner, rollout, first, _, sent = two_steps("auto", True, queries=("q0", "q4", "q5"))
    assert not first.reference_first and not sent
    runner, rollout = make("armor", batch=2, gen_batch=3, reference_first=True)
    first = runner.collect(step=1)
    assert runner.prefetch(1, first)
    rollout.calls.clear()
    third = runner.collect(step=3)  # not step 2: the prefetched call is not this step's
    assert not third.reference_prefetched
    assert rollout.calls[0] == ("reference", 3, 3, plain_seed(3, 0, "reference"))
    assert runner._prefetched is None


@pytest.mark.parametrize(
    "change",
    [
        {"rollout.prefetch_reference": False},
        {"rollout.reference_first": False},
        {"algo.anchor": "none"},
        {"algo.anchor_source": "cache"},
        {"orchestration.layout": "colocated"},
        {"rollout.reference_parts": 2},
        {"rollout.backend": "sglang", "rollout.ref_strategy": "swap"},  # the driver swaps
    ],
)
def test_prefetch_applies_only_where_the_call_is_known_and_the_engines_are_free(change):
    from megatron_armor.orchestration.step.anchor_rollout import prefetches_reference

    config = make_config()
    config.rollout.ref_strategy = "dedicated"
    assert prefetches_reference(config)
    for key, value in change.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    assert not prefetches_reference(config)


@pytest.mark.parametrize("reference_first", [False, True])
def test_a_query_solved_k_draws_in_a_row_leaves_the_sampler(reference_first):
    """q1 is all-correct at every draw; q3's reference is never correct, so a reference-first
    step draws no policy samples for it (no evidence either way)."""
    runner, _ = make("armor", batch=1, gen_batch=4, retire_after=2,
                     queries=("q1", "q0", "q3", "q4"), reference_first=reference_first)  # fmt: skip
    seen = []
    for step in (1, 2, 3):
        result = runner.collect(step)
        seen.append([r["query_id"] for r in result.records])
        retired = [r["query_id"] for r in result.records if r.get("retired")]
        assert retired == (["q1"] if step == 2 else []), (step, result.records)
    assert seen[0] == seen[1] == ["q1", "q0", "q3", "q4"]
    assert seen[2] == ["q0", "q3", "q4", "q0"]  # 4 drawn from the 3 left: into the next epoch
    assert runner.sampler.metrics()["data/retired"] == 1.0
    assert runner.sampler.retirement.streaks == {}  # q0, q4 accepted, q3 never all-correct


@pytest.mark.parametrize("retire_after", [0, 2])
def test_a_step_failing_on_solved_queries_names_retirement(retire_after):
    runner, _ = make("armor", batch=2, gen_batch=2, max_gen_batches=1, queries=("q1", "q6"),
                     retire_after=retire_after)  # fmt: skip
    with pytest.raises(AcceptanceError) as err:
        runner.collect(step=1)
    msg = str(err.value)
    assert "rejected 2 all-correct" in msg and "most rejected queries were all-correct" in msg
    if retire_after:
        assert "although data.retire_solved_after=2 retires solved ones: lower it" in msg
    else:
        assert "set data.retire_solved_after (e.g. 3)" in msg
