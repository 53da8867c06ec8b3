"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits ``z`` ``[N, Vp/tp]`` for its vocabulary slice
``[lo, hi)``. With temperature ``T`` and ``z' = z / T`` (entries of the padded vocabulary,
``v >= V``, are excluded)::

    m      = max_v z'_v                      (all-reduce MAX over TP)
    S      = sum_v exp(z'_v - m)             (all-reduce SUM)
    lse    = m + log S
    logp_y = z'_y - lse                      (z'_y all-reduced SUM: one rank owns y)
    H      = lse - sum_v p_v z'_v            (all-reduce SUM; detached, a metric)

Backward needs no communication: ``d logp_y / d z_v = (1[v == y] - p_v) / T`` on each slice,
with ``p`` recomputed from the saved logits and ``lse``, so no ``[N, V]`` softmax is kept
between forward and backward. The sequence is processed in chunks of ``chunk`` rows to bound
the ``[chunk, Vp/tp]`` float32 temporaries.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _scaled_chunk(z: torch.Tensor, lo: int, vocab: int, temperature: float) -> torch.Tensor:
    """``z / T`` in float32 with the padded-vocabulary columns set to ``-inf``."""
    out = z.float() / temperature
    valid = vocab - lo
    if valid < out.shape[-1]:
        out[:, max(valid, 0) :] = float("-inf")
    return out


def _target_logit(scaled: torch.Tensor, target: torch.Tensor, lo: int) -> torch.Tensor:
    local = target - lo
    owned = (local >= 0) & (local < scaled.shape[-1])
    picked = scaled.gather(1, local.clamp(0, scaled.shape[-1] - 1).unsqueeze(1)).squeeze(1)
    return torch.where(owned, picked, torch.zeros_like(picked))


def _forward_chunk(z, target, lo, vocab, temperature, group):
    """``(logp, entropy, lse)`` for one chunk of rows."""
    scaled = _scaled_chunk(z, lo, vocab, temperature)
    m = _all_reduce(scaled.max(dim=-1).values, dist.ReduceOp.MAX, group)
    e = torch.exp(scaled - m.unsqueeze(1))
    stats = torch.stack(
        [e.sum(-1), (e * scaled.nan_to_num(neginf=0.0)).sum(-1), _target_logit(scaled, target, lo)]
    )
    stats = _all_reduce(stats, dist.ReduceOp.SUM, group)
    lse = m + torch.log(stats[0])
    entropy = lse - stats[1] / stats[0]
    return stats[2] - lse, entropy, lse


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, lo, vocab, temperature, chunk, group):
        outs = [
            _forward_chunk(
                logits[i : i + chunk], target[i : i + chunk], lo, vocab, temperature, group
            )
            for i in range(0, logits.shape[0], chunk)
        ]
        logp, entropy, lse = (torch.cat(parts) for parts in zip(*outs, strict=True))
        ctx.save_for_backward(logits, target, lse)
        ctx.settings = (lo, vocab, temperature, chunk)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        logits, target, lse = ctx.saved_tensors
        lo, vocab, temperature, chunk = ctx.settings
        grad = torch.empty_like(logits)
        for i in range(0, logits.shape[0], chunk):
            scaled = _scaled_chunk(logits[i : i + chunk], lo, vocab, temperature)
            g = -torch.exp(scaled - lse[i : i + chunk].unsqueeze(1))
            local = target[i : i + chunk] - lo
            rows = torch.nonzero((local >= 0) & (local < scaled.shape[-1])).squeeze(1)
            g[rows, local[rows]] += 1.0
            grad[i : i + chunk] = (g * (grad_logp[i : i + chunk].unsqueeze(1) / temperature)).to(
                grad.dtype
            )
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    chunk: int = 1024,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp [N], entropy [N])`` of ``target [N]`` under vocab-parallel ``logits [N, Vp/tp]``.

    ``vocab_size`` is the true vocabulary ``V`` (padded columns are excluded); this rank's
    slice starts at ``rank(group) * Vp/tp``. ``logp`` carries gradients to ``logits``;
    ``entropy`` is detached.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (sampling.temperature)")
    rank = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
    lo = rank * logits.shape[-1]
    return _VocabParallelLogprob.apply(
        logits, target, lo, vocab_size, float(temperature), max(int(chunk), 1), group
    )


def vocab_parallel_exact_kl(
    logits_p: torch.Tensor,
    logits_q: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ``(KL(p || q), KL(q || p))`` per row ``[N]`` from two vocab-parallel logit slices
    ``[N, Vp/tp]`` (this rank's columns of ``p``'s and ``q``'s logits), without gathering::

        lse_p, lse_q                          (max and sum-exp all-reduced, as above)
        KL(p || q) = sum_v p_v (z'p_v - z'q_v) - lse_p + lse_q     (partial sums all-reduced)

    and symmetrically for ``KL(q || p)``; padded columns (``v >= V``) are excluded. No
    gradients (a diagnostic, docs/metrics.md); ``algo.kl.exact_kl`` is the gathered reference.
    """
    rank = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
    lo = rank * logits_p.shape[-1]
    with torch.no_grad():
        zp = _scaled_chunk(logits_p, lo, vocab_size, temperature)
        zq = _scaled_chunk(logits_q, lo, vocab_size, temperature)
        m = _all_reduce(
            torch.stack([zp.max(-1).values, zq.max(-1).values]), dist.ReduceOp.MAX, group
        )
        ep, eq = torch.exp(zp - m[0].unsqueeze(1)), torch.exp(zq - m[1].unsqueeze(1))
        diff = (zp - zq).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # padded: -inf - -inf
        stats = torch.stack([ep.sum(-1), eq.sum(-1), (ep * diff).sum(-1), (eq * diff).sum(-1)])
        stats = _all_reduce(stats, dist.ReduceOp.SUM, group)
        lse_p, lse_q = m[0] + torch.log(stats[0]), m[1] + torch.log(stats[1])
        kl_pq = stats[2] / stats[0] - lse_p + lse_q
        kl_qp = -stats[3] / stats[1] + lse_p - lse_q
    return kl_pq, kl_qp
