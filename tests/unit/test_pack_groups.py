"""Unit tier: ``pack_groups`` and the exact-KL token mask against per-token references.

Both are built with tensor operations; the references here spell out the layout one token
and one sample at a time (prompt then response per sample, positions from 0, the loss mask
on response tokens, the advantage times the mask — a negative advantage gives ``-0.0`` on
prompt tokens, kept bit for bit — and ``is_anchor`` on the anchor's response tokens).
"""

from __future__ import annotations

import random

import pytest
import torch

from megatron_armor.orchestration.step.step_metrics import exact_kl_mask
from megatron_armor.types import Group, Sample, pack_groups

pytestmark = pytest.mark.unit


def reference_pack(groups: list[Group]) -> dict[str, torch.Tensor]:
    tokens, positions, loss_mask, advantages, is_anchor, owner, cu = [], [], [], [], [], [], [0]
    for group in groups:
        for i, sample in enumerate(group.samples):
            p, r = len(sample.prompt_ids), len(sample.response_ids)
            for t in range(p + r):
                m = 1.0 if t >= p else 0.0
                tokens.append((sample.prompt_ids + sample.response_ids)[t])
                positions.append(t)
                loss_mask.append(m)
                advantages.append(group.advantages[i] * m)
                is_anchor.append(group.is_anchor(i) and m > 0)
                owner.append(len(cu) - 1)
            cu.append(cu[-1] + p + r)
    return {
        "tokens": torch.tensor(tokens, dtype=torch.long),
        "position_ids": torch.tensor(positions, dtype=torch.long),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "sample_index": torch.tensor(owner, dtype=torch.long),
        "loss_mask": torch.tensor(loss_mask, dtype=torch.float32),
        "advantages": torch.tensor(advantages, dtype=torch.float32),
        "is_anchor": torch.tensor(is_anchor, dtype=torch.bool),
    }


def reference_mask(batch, samples: int, positions: int) -> torch.Tensor | None:
    bounds = batch.cu_seqlens.tolist()
    on_policy = [
        i for i in range(batch.num_samples)
        if batch.loss_mask[bounds[i] : bounds[i + 1]].any()
        and not batch.is_anchor[bounds[i] : bounds[i + 1]].any()
    ]  # fmt: skip
    if not on_policy or samples < 1 or positions < 1:
        return None
    take = min(samples, len(on_policy))
    mask = torch.zeros(batch.num_tokens, dtype=torch.bool)
    for k in range(take):
        i = on_policy[(k * len(on_policy)) // take]
        response = [t for t in range(bounds[i], bounds[i + 1]) if batch.loss_mask[t] > 0]
        keep = min(positions, len(response))
        for j in range(keep):
            mask[response[(j * len(response)) // keep]] = True
    return mask


def random_groups(rng: random.Random, count: int) -> list[Group]:
    out = []
    for g in range(count):
        k = rng.randint(1, 6)
        samples = [
            Sample(f"q{g}", [rng.randint(0, 99) for _ in range(rng.randint(0, 9))],
                   [rng.randint(0, 99) for _ in range(rng.choice([0, 1, 5, 40]))])
            for _ in range(k)
        ]  # fmt: skip
        advantages = [rng.choice([-1.5, -0.25, 0.0, 0.7, 1 / 3]) for _ in range(k)]
        out.append(Group(f"q{g}", samples, rng.choice([None, 0, k - 1]), advantages))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_pack_groups_and_the_exact_kl_mask_match_their_per_token_references(seed):
    rng = random.Random(seed)
    groups = random_groups(rng, rng.randint(0, 12))
    batch, want = pack_groups(groups), reference_pack(groups)
    got = {
        "tokens": batch.tokens, "position_ids": batch.position_ids, "cu_seqlens": batch.cu_seqlens,
        "sample_index": batch.sample_index, **{k: batch.token_data[k] for k in
                                                ("loss_mask", "advantages", "is_anchor")},
    }  # fmt: skip
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert torch.equal(torch.signbit(got["advantages"]), torch.signbit(want["advantages"]))
    assert not batch.old_logprobs.any() and batch.old_logprobs.shape == want["tokens"].shape
    for samples, positions in ((4, 32), (1, 1), (3, 2), (0, 5), (9, 0)):
        mask, expected = (
            exact_kl_mask(batch, samples, positions),
            reference_mask(batch, samples, positions),
        )
        assert (mask is None and expected is None) or torch.equal(mask, expected)


def test_pack_groups_names_a_group_without_advantages():
    group = Group("q7", [Sample("q7", [1], [2])], None, [])
    with pytest.raises(ValueError, match="group 'q7' has 1 samples but 0 advantages"):
        pack_groups([group])
