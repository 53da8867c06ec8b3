"""One rank of the TP=2 vocab-parallel log-prob check (torch + gloo only, no megatron).

``python logprob_worker.py RANK WORLD PORT OUT``: every rank builds the same full logits
``[N, Vp]`` (padded vocabulary), keeps its vocabulary slice, computes log-probs / entropy and
the gradient of a weighted sum, and the exact KLs against a second set of logits, and writes them with its slice bounds to ``OUT/rank{R}.pt``.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_armor.trainer.logprobs import vocab_parallel_exact_kl, vocab_parallel_logprobs

N, VOCAB, PADDED, TEMPERATURE, CHUNK = 13, 37, 40, 0.8, 5


def full_inputs():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(N, PADDED, generator=g, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (N,), generator=g)
    weights = torch.randn(N, generator=g, dtype=torch.float64)
    other = torch.randn(N, PADDED, generator=g, dtype=torch.float64) * 2  # a second model
    return logits, target, weights, other


if __name__ == "__main__":
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    logits, target, weights, other = full_inputs()
    part = PADDED // world
    lo, hi = rank * part, (rank + 1) * part
    local = logits[:, lo:hi].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(
        local, target, VOCAB, TEMPERATURE, CHUNK, dist.group.WORLD
    )
    (logp * weights).sum().backward()
    kl_pq, kl_qp = vocab_parallel_exact_kl(
        logits[:, lo:hi], other[:, lo:hi], VOCAB, TEMPERATURE, dist.group.WORLD
    )
    torch.save(
        {"logp": logp.detach(), "entropy": entropy, "grad": local.grad, "lo": lo, "hi": hi,
         "kl_pq": kl_pq, "kl_qp": kl_qp},
        os.path.join(out, f"rank{rank}.pt"),
    )  # fmt: skip
    dist.destroy_process_group()
