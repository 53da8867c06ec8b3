"""Unit tier (no devices, one process): the vocab-parallel log-prob function with a TP size of 1
equals ``log_softmax`` and its autograd gradient; padded vocabulary columns are excluded.
The TP=2 comparison is in ``tests/dist/test_trainer_dist.py``."""

from __future__ import annotations

import pytest
import torch

from megatron_armor.trainer.logprobs import vocab_parallel_logprobs

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_grad_match_log_softmax(chunk: int, temperature: float) -> None:
    torch.manual_seed(0)
    vocab, padded, n = 11, 16, 7
    logits = torch.randn(n, padded, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, vocab, (n,))
    weights = torch.randn(n, dtype=torch.float64)

    logp, entropy = vocab_parallel_logprobs(logits, target, vocab, temperature, chunk)
    (logp * weights).sum().backward()
    grad = logits.grad.clone()

    ref_logits = logits.detach().clone().requires_grad_(True)
    ref_lsm = torch.log_softmax(ref_logits[:, :vocab] / temperature, dim=-1)
    ref_logp = ref_lsm.gather(1, target[:, None]).squeeze(1)
    (ref_logp * weights).sum().backward()
    ref_entropy = -(ref_lsm.exp() * ref_lsm).sum(-1)

    # the function computes in float32 (as on real bf16/fp32 logits)
    tol = {"atol": 1e-6, "rtol": 1e-5}
    torch.testing.assert_close(logp.double(), ref_logp.detach(), **tol)
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), **tol)
    torch.testing.assert_close(grad, ref_logits.grad, **tol)
    assert torch.all(grad[:, vocab:] == 0)


def test_rejects_non_positive_temperature() -> None:
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), 4, 0.0)
