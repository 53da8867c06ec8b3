"""Unit tier: a step's batch crosses from the driver to the trainer ranks once.

``TrainerActors.submit_logprobs`` puts the packed batch into the object store; every rank
(``TrainerWorker``) fills in the whole old / reference log-probs the trainer hands every rank
(``step_logprobs(shared=True)``, checked at TP/PP/DP in ``tests/dist/test_trainer_dist.py``)
and keeps it; ``submit_updates``, queued right behind it (the loop does not wait for the
log-probs first), sends only each mini-batch's sample ids. The ranks here
are real ``TrainerWorker`` methods over a trainer that records what it is given, called
in-process through a ``.remote`` shim that pickles the arguments as Ray would.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch

from megatron_armor.orchestration.actors.actor_handles import TrainerActors
from megatron_armor.orchestration.actors.workers import ComputeClock, TrainerWorker
from megatron_armor.orchestration.step.phases import minibatch_sample_ids
from megatron_armor.types import Group, Sample, SampleSource, pack_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inprocess_actors import InstantWatch  # noqa: E402

pytestmark = pytest.mark.unit


class RecordingTrainer:
    """Log-probs as a function of the tokens (what a policy / the reference would give);
    ``train_step`` records the batch it trains on."""

    def __init__(self) -> None:
        self.trained: list[dict[str, torch.Tensor]] = []
        self.shared: list[bool] = []

    def step_logprobs(self, batch, with_ref, kl_mask=None, shared=False, old_weights="policy"):
        self.shared.append(shared)
        old = -0.01 * batch.tokens.float() * batch.loss_mask
        ref = -0.02 * batch.tokens.float() * batch.loss_mask if with_ref else None
        return old, ref, {"kl/exact_reverse": 0.5}

    def train_step(self, batch, num_minibatches):
        self.trained.append(
            {"tokens": batch.tokens.clone(), "old": batch.old_logprobs.clone(),
             "ref": batch.ref_logprobs.clone(), "advantages": batch.advantages.clone()}
        )  # fmt: skip
        return {"loss/objective": float(len(self.trained))}

    def end_step(self):
        self.trained.append("end of step")


class Remote:
    """``actor.method.remote(*args)`` runs ``method`` now on pickled copies of the arguments
    (each rank gets its own, as from Ray's object store); the value stands in for its ref."""

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        method = getattr(self.target, name)

        def remote(*args):
            return method(*pickle.loads(pickle.dumps(args)))

        return type("Method", (), {"remote": staticmethod(remote)})


def rank(r: int) -> TrainerWorker:
    w = object.__new__(TrainerWorker)
    w.rank, w.world_size, w.clock = r, 2, ComputeClock()
    w.trainer, w.step_batch, w.policy_changed = RecordingTrainer(), None, True
    return w


def groups() -> list[Group]:
    out = []
    for g in range(4):
        samples = [
            Sample(f"q{g}", [1, 2 + g], [10 + g, 20 + i, 30 + g * i][: 1 + i % 3], score=1.0,
                   source=SampleSource.REFERENCE if i == 3 else SampleSource.POLICY)
            for i in range(4)
        ]  # fmt: skip
        out.append(Group(f"q{g}", samples, anchor_index=3, advantages=[1.0, -1.0, 0.5, -0.5]))
    return out


@pytest.fixture
def trainer(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "put", lambda value: value)  # no cluster: the shim copies
    workers = [rank(0), rank(1)]
    return TrainerActors(InstantWatch(), [Remote(w) for w in workers]), workers


def test_updates_train_on_the_kept_batch_with_its_logprobs(trainer):
    trainer, workers = trainer
    gs = groups()
    batch = pack_groups(gs)
    logprobs = trainer.submit_logprobs(batch, True, None)
    minibatches = minibatch_sample_ids(gs, 2)
    queued = trainer.submit_updates(minibatches)  # behind the log-probs, before their result
    old, ref, kl = logprobs.result()
    torch.testing.assert_close(old, -0.01 * batch.tokens.float() * batch.loss_mask, rtol=0, atol=0)
    torch.testing.assert_close(ref, -0.02 * batch.tokens.float() * batch.loss_mask, rtol=0, atol=0)
    assert kl == {"kl/exact_reverse": 0.5}
    batch.old_logprobs, batch.ref_logprobs = old, ref  # as the loop fills the driver's copy
    metrics = [update.result() for update in queued]
    assert metrics == [{"loss/objective": 1.0}, {"loss/objective": 2.0}]
    for w in workers:
        assert w.trainer.shared == [True]  # the ranks asked for the whole log-probs
        assert w.step_batch is None  # the last update freed the kept batch
        assert len(w.trainer.trained) == 3 and w.trainer.trained[-1] == "end of step"
        for ids, got in zip(minibatches, w.trainer.trained[:2], strict=True):
            want = batch.select(ids)
            assert torch.equal(got["tokens"], want.tokens)
            assert torch.equal(got["old"], want.old_logprobs) and got["old"].abs().sum() > 0
            assert torch.equal(got["ref"], want.ref_logprobs)
            assert torch.equal(got["advantages"], want.advantages)


def test_only_rank_0_returns_the_logprobs(trainer):
    _, workers = trainer
    assert workers[1].step_logprobs(pack_groups(groups()), True)[:2] == (None, None)
    assert workers[1].step_batch.ref_logprobs.any()  # but keeps them
    old, ref, _ = workers[0].step_logprobs(pack_groups(groups()), False)
    assert old is not None and ref is None
    assert torch.equal(workers[0].step_batch.old_logprobs, old)
    assert not workers[0].step_batch.ref_logprobs.any()  # with_ref off: left at zero


def test_an_update_without_a_kept_batch_says_what_is_missing(trainer):
    worker = trainer[1][0]
    with pytest.raises(RuntimeError, match="trainer rank 0.*no step_logprobs call"):
        worker.train_step(None, 1, [0])
    worker.step_logprobs(pack_groups(groups()), True)
    worker.train_step(None, 1, [0, 1], True)
    with pytest.raises(RuntimeError, match="since the last release"):
        worker.train_step(None, 1, [0])
