"""Padding of the training micro-batches: batch order (before) vs length buckets (now), and the
packed ``thd`` layout, on response lengths shaped like the paper's.

A step's batch is ``--queries`` groups of ``--group`` samples (a group's samples adjacent, as
``pack_groups`` lays them out); prompt lengths uniform in ``[--prompt-min, --prompt-max]``,
response lengths log-normal (median ``--median``, ``--sigma``) capped at ``--cap`` (the
paper's 20k maximum response length, where the long tail piles up). The batch is planned with
the trainer's own functions (``batching.micro_batch_ids``: DP sharding, then batch order or
length buckets, then the ``--budget``-token micro-batches) for every DP rank. Printed per
layout: padded tokens / real tokens, min / median / max over ``--seeds`` batches.

    python benchmarks/bench_padding.py [--queries 512 --group 16 --dp 8 --budget 32768]
"""

from __future__ import annotations

import argparse
from statistics import median

import numpy as np

from megatron_armor.trainer.batching import micro_batch_ids

LAYOUTS = {  # name: (packed, bucket)
    "padded, batch order (before)": (False, False),
    "padded, length buckets (CPU now)": (False, True),
    "packed thd, length buckets (TE now)": (True, True),
}


def sample_lengths(args, seed: int) -> list[int]:
    """Prompt + response length of every sample of one step's batch."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(args.prompt_min, args.prompt_max + 1, size=args.queries)
    responses = np.minimum(
        rng.lognormal(np.log(args.median), args.sigma, size=args.queries * args.group), args.cap
    ).astype(int)
    return [int(prompts[i // args.group] + r) for i, r in enumerate(responses)]


def padded_ratio(lengths: list[int], args, packed: bool, bucket: bool) -> float:
    """Padded positions / real tokens over all DP ranks' micro-batches."""
    computed = 0
    for rank in range(args.dp):
        for ids in micro_batch_ids(lengths, rank, args.dp, args.budget, packed, bucket):
            size = [lengths[i] for i in ids]
            computed += sum(size) if packed else len(size) * max(size)
    real = sum(lengths)
    return (computed - real) / real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--queries", 512), ("--group", 16), ("--dp", 8), ("--budget", 32768),
                          ("--prompt-min", 64), ("--prompt-max", 512), ("--median", 3000),
                          ("--cap", 20480), ("--seeds", 5)):  # fmt: skip
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--sigma", type=float, default=0.9)
    args = parser.parse_args()
    if args.budget < args.cap + args.prompt_max:
        parser.error(f"--budget must hold the longest sample ({args.cap + args.prompt_max})")
    batches = [sample_lengths(args, seed) for seed in range(args.seeds)]
    responses = np.array([n for b in batches for n in b])
    print(f"{args.queries} queries x {args.group} samples, DP={args.dp}, budget {args.budget} "
          f"tokens; sample length median {np.median(responses):.0f}, mean "
          f"{responses.mean():.0f}, p99 {np.percentile(responses, 99):.0f}, max "
          f"{responses.max()}")  # fmt: skip
    print("layout                                 padded / real tokens (min / median / max)")
    for name, (packed, bucket) in LAYOUTS.items():
        ratios = [padded_ratio(b, args, packed, bucket) for b in batches]
        print(f"{name:38s} {min(ratios):.4f} / {median(ratios):.4f} / {max(ratios):.4f}")


if __name__ == "__main__":
    main()
