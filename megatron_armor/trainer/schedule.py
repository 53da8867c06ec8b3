"""``forward_step`` / ``loss_func`` for megatron-core's ``get_forward_backward_func()``.

The schedule (no pipelining or 1F1B) calls ``forward_step(data_iterator, model)`` once per
micro-batch; on the last pipeline stage it calls the returned ``loss_func(output)``, which
must return ``(loss, num_units, metrics)``. Our ``loss_func`` computes per-token log-probs from
the vocab-parallel logits and calls ``algo.compute_policy_loss`` with the GLOBAL normalizer
(see ``optim.py`` for why gradients are then summed, not averaged).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_armor.algo.losses import LossSettings, compute_policy_loss, count_units
from megatron_armor.heartbeat import beat
from megatron_armor.trainer import parallel
from megatron_armor.trainer.batching import MicroBatch, padding_counts
from megatron_armor.trainer.logprobs import vocab_parallel_exact_kl, vocab_parallel_logprobs
from megatron_armor.types import ROUTE_KEYS


@dataclass(frozen=True)
class LogprobSettings:
    """How log-probs are read from the logits."""

    vocab_size: int
    """True vocabulary ``V`` (padded columns are excluded)."""
    temperature: float = 1.0
    """Rollout temperature: log-probs of ``softmax(z / T)``."""
    chunk: int = 1024
    """Rows per chunk of the vocab-parallel computation."""


def token_logprobs(
    output: torch.Tensor, mb: MicroBatch, lp: LogprobSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``(logp [T], entropy [T])`` of ``mb``'s tokens from logits ``[n, L, Vp/tp]``.

    ``logp[t] = log p(x_t | x_<t)`` comes from the logits at position ``t - 1`` of the same
    row; the first token of each sample (``mb.sample_starts()``, also inside a packed row)
    gets 0 (it has ``loss_mask == 0``).
    """
    n, seq, vocab_local = output.shape
    nxt = torch.zeros_like(mb.tokens)
    nxt[:, :-1] = mb.tokens[:, 1:]
    logp, entropy = vocab_parallel_logprobs(
        output.reshape(n * seq, vocab_local),
        nxt.reshape(-1).to(output.device),
        lp.vocab_size,
        lp.temperature,
        lp.chunk,
        parallel.tp_group() if parallel.tp_size() > 1 else None,
    )
    zero = logp.new_zeros(n, 1)
    starts = mb.sample_starts().to(output.device)
    logp = torch.cat([zero, logp.view(n, seq)[:, :-1]], dim=1).masked_fill(starts, 0.0)
    entropy = torch.cat([zero, entropy.view(n, seq)[:, :-1]], dim=1).masked_fill(starts, 0.0)
    valid = mb.valid.to(output.device)
    return logp[valid], entropy[valid]


def _policy_loss(
    mb: MicroBatch, output, *, lp: LogprobSettings, settings: LossSettings, normalizer: float
):
    logp, entropy = token_logprobs(output, mb, lp)
    dev = logp.device
    loss, metrics = compute_policy_loss(
        logp,
        **{k: v.to(dev) for k, v in mb.token_data.items() if k not in ROUTE_KEYS},
        sample_index=mb.sample_index.to(dev),
        settings=settings,
        normalizer=normalizer,
        entropy=entropy,
    )
    metrics["loss/objective"] = loss.detach()
    units = count_units(settings.loss_agg, mb.loss_mask, mb.sample_index)
    return loss, torch.tensor(units, dtype=torch.int, device=dev), metrics


def _logprob_only(mb: MicroBatch, output, *, lp: LogprobSettings):
    with torch.no_grad():
        logp, entropy = token_logprobs(output, mb, lp)
    keep = 0 if mb.filler else len(logp)  # a filler (batching.py) reports no token
    data = {"logp": logp[:keep], "entropy": entropy[:keep], "index": mb.token_index[:keep]}
    return output.new_zeros(()), torch.tensor(0, dtype=torch.int, device=logp.device), data


def selected_logit_rows(
    output: torch.Tensor, mb: MicroBatch, select: torch.Tensor | None = None
) -> torch.Tensor:
    """The logits ``[k, Vp/tp]`` that predict the tokens of ``mb`` flagged by ``select``
    (``[T]``, default ``mb.loss_mask``): for a token at row ``r``, column ``c`` the logits at
    ``(r, c - 1)`` (a selected token is never the first of its sample)."""
    n, seq, vocab_local = output.shape
    select = mb.loss_mask if select is None else select
    flat = mb.valid.reshape(-1).nonzero().squeeze(1).to(output.device)
    chosen = flat[select.to(output.device).bool()]
    return output.reshape(n * seq, vocab_local)[chosen - 1]


def _capture_rows(mb: MicroBatch, output, *, captured: list):
    captured.append(selected_logit_rows(output, mb).detach().clone())
    return output.new_zeros(()), torch.tensor(0, dtype=torch.int, device=output.device), {}


def exact_kl_sums(policy_rows, ref_rows, lp: LogprobSettings, device) -> dict[str, torch.Tensor]:
    """Sums and maxima of the exact KLs (both ways) between matching logit rows."""
    group = parallel.tp_group() if parallel.tp_size() > 1 else None
    reverse, forward = vocab_parallel_exact_kl(
        policy_rows, ref_rows, lp.vocab_size, lp.temperature, group
    )
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return {
        "kl/exact_reverse": reverse.sum().float(),
        "kl/exact_forward": forward.sum().float(),
        "kl/exact_positions": torch.tensor(float(len(reverse)), device=device),
        "kl/exact_reverse_max": reverse.max().float() if len(reverse) else zero,
        "kl/exact_forward_max": forward.max().float() if len(forward) else zero,
    }


def _exact_kl(mb: MicroBatch, output, *, lp: LogprobSettings, captured):
    data = exact_kl_sums(next(captured), selected_logit_rows(output, mb), lp, output.device)
    return output.new_zeros(()), torch.tensor(0, dtype=torch.int, device=output.device), data


def _logprob_kl(mb: MicroBatch, output, *, lp: LogprobSettings, kl_mask, captured: list, compare):
    """Log-probs of ``mb``; with ``kl_mask`` (``[total]`` over the full batch) also the logit
    rows of the selected tokens: kept (``captured`` list, policy pass) or compared with the
    kept ones (``compare``, reference pass) into ``kl/exact_*`` sums."""
    _, units, data = _logprob_only(mb, output, lp=lp)
    if kl_mask is None:
        return output.new_zeros(()), units, data
    with torch.no_grad():
        rows = selected_logit_rows(output, mb, kl_selection(mb, kl_mask))
        if compare is None:
            captured.append(rows.clone())
        else:
            data.update(exact_kl_sums(next(compare), rows, lp, output.device))
    return output.new_zeros(()), units, data


def kl_selection(mb: MicroBatch, kl_mask: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: the exact-KL diagnostic's tokens in ``mb`` (``kl_mask`` is over the full
    batch; a micro-batch standing in for a rank without samples selects none)."""
    return kl_mask[mb.token_index] & (mb.loss_mask != 0)


def packed_seq_params(mb: MicroBatch, device) -> PackedSeqParams | None:
    """megatron-core's ``PackedSeqParams`` (``qkv_format='thd'``) of a packed micro-batch:
    the same ``cu_seqlens`` for queries and keys (self-attention); ``None`` when padded."""
    if not mb.packed:
        return None
    cu = mb.cu_seqlens.to(device=device, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)  # fmt: skip


def make_forward_step(loss_builder, routing=None):
    """A megatron ``forward_step_func`` whose ``loss_func`` is ``loss_builder(mb, output)``;
    with ``routing`` (a ``routing_replay.PassRouting``) each micro-batch's MoE routers
    replay / record / count as it says."""

    def forward_step(data_iterator, model):
        mb: MicroBatch = next(data_iterator)
        dev = parallel.collective_device()
        if routing is not None:
            routing.begin(mb)
        output = model(mb.tokens.to(dev), mb.position_ids.to(dev), None,
                       packed_seq_params=packed_seq_params(mb, dev))  # fmt: skip
        if routing is not None:
            routing.forward_done()
        return output, partial(loss_builder, mb)

    return forward_step


def policy_loss_builder(lp: LogprobSettings, settings: LossSettings, normalizer: float):
    return partial(_policy_loss, lp=lp, settings=settings, normalizer=normalizer)


def logprob_builder(lp: LogprobSettings):
    return partial(_logprob_only, lp=lp)


def logprob_kl_builder(lp: LogprobSettings, kl_mask, captured: list, compare: list | None):
    """Log-probs, plus the exact-KL rows of ``kl_mask``: appended to ``captured`` (policy
    pass, ``compare=None``) or compared with ``compare``'s rows, one entry per micro-batch
    (reference pass)."""
    return partial(_logprob_kl, lp=lp, kl_mask=kl_mask, captured=captured,
                   compare=None if compare is None else iter(compare))  # fmt: skip


def capture_builder(captured: list):
    """Keeps each micro-batch's selected logit rows (policy pass of :func:`exact_kl_builder`)."""
    return partial(_capture_rows, captured=captured)


def exact_kl_builder(lp: LogprobSettings, captured: list):
    """Exact KLs between the captured (policy) rows and this pass's (reference) rows."""
    return partial(_exact_kl, lp=lp, captured=iter(captured))


def beat_each(items: list):
    """``items`` one by one, a heartbeat at each (``heartbeat.py``: a micro-batch
    started is progress the driver's call deadline sees)."""
    for item in items:
        beat()
        yield item


def run_schedule(
    model, micro_batches: list[MicroBatch], loss_builder, forward_only: bool, routing=None
) -> list:
    """Run megatron-core's forward(-backward) schedule over ``micro_batches``; returns the
    ``loss_func`` outputs (last pipeline stage; empty elsewhere). ``routing``: the pass's
    MoE routing (``routing_replay.PassRouting``; ``None``: the routers' own top-k)."""
    forward_backward = get_forward_backward_func()
    try:
        return forward_backward(
            forward_step_func=make_forward_step(loss_builder, routing),
            data_iterator=beat_each(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.seq_len for mb in micro_batches),
            micro_batch_size=max(mb.num_rows for mb in micro_batches),
            forward_only=forward_only,
        )
    finally:
        if routing is not None:
            routing.end()


def global_units(micro_batches: list[MicroBatch], loss_agg: str) -> float:
    """The loss normalizer: aggregation units summed over micro-batches and DP ranks."""
    local = sum(count_units(loss_agg, mb.loss_mask, mb.sample_index) for mb in micro_batches)
    total = torch.tensor([float(local)], device=parallel.collective_device())
    if parallel.dp_size() > 1:
        dist.all_reduce(total, group=parallel.dp_group())
    return float(total.item())


def padding_fraction(micro_batches: list[MicroBatch]) -> float:
    """``train/padding_fraction``: padded positions over all computed positions, summed over
    micro-batches and DP ranks (0 in the packed layout but for rounding to ``pad_multiple``)."""
    real, slots = padding_counts(micro_batches)
    total = torch.tensor([float(real), float(slots)], device=parallel.collective_device())
    if parallel.dp_size() > 1:
        dist.all_reduce(total, group=parallel.dp_group())
    real_sum, slot_sum = total.tolist()
    return 1.0 - real_sum / slot_sum if slot_sum else 0.0


def reduce_metric_sums(outputs: list[dict]) -> dict[str, float]:
    """Sum (``*_max``: max) the metrics over micro-batches and DP ranks; every rank of the
    pipeline gets the result (it is computed on the last stage and broadcast)."""
    sums: dict[str, float] | None = None
    if parallel.is_last_stage():
        keys = sorted(outputs[0]) if outputs else []
        is_max = [k.endswith("_max") for k in keys]
        dev = parallel.collective_device()
        stacked = [torch.stack([o[k].float().to(dev) for o in outputs]) for k in keys]
        local = (
            torch.stack([s.max() if m else s.sum() for s, m in zip(stacked, is_max, strict=True)])
            if keys
            else torch.zeros(0)
        )
        sums = _all_reduce_mixed(local, is_max, dict(zip(keys, range(len(keys)), strict=True)))
    if parallel.pp_size() > 1:
        box = [sums]
        src = dist.get_global_rank(parallel.pp_group(), parallel.pp_size() - 1)
        dist.broadcast_object_list(box, src=src, group=parallel.pp_group())
        sums = box[0]
    return sums or {}


def _all_reduce_mixed(
    local: torch.Tensor, is_max: list[bool], index: dict[str, int]
) -> dict[str, float]:
    """All-reduce over DP: SUM for sums, MAX for ``*_max`` entries."""
    mask = torch.tensor(is_max, dtype=torch.bool, device=local.device)
    sums, maxes = torch.where(mask, 0.0, local), torch.where(mask, local, float("-inf"))
    if parallel.dp_size() > 1:
        dist.all_reduce(sums, group=parallel.dp_group())
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=parallel.dp_group())
    merged = torch.where(mask, maxes, sums).tolist()
    return {k: merged[i] for k, i in index.items()}
