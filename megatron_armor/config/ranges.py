"""Warnings for settings that are valid but far outside their useful range.

A value here is not an error (a user may mean it), but it changes the cost of a run by an
order of magnitude, or nothing at all (a mixture-of-experts setting on a dense model), without
a word otherwise: ``algo.group_size=1000`` is accepted and makes
every step ~30x slower. :func:`range_warnings` names the setting, the value, the range the
recipe is meant for and what the value costs; ``load_config`` prints them on stderr once per
load. The bounds are wide: the paper's configs and every config under ``configs/`` sit well
inside them (``tests/unit/test_config_validate.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from megatron_armor.config.moe import dense_model_warnings
from megatron_armor.config.schema import ArmorConfig

MAX_GROUP_SIZE = 64
"""``algo.group_size`` beyond this: the paper uses 16 (8 for QUATRO); each query costs G
generations, so the rollout grows with G."""
MAX_GEN_BATCHES = 64
"""``algo.max_gen_batches`` beyond this: a step that cannot fill its batch draws this many
generation batches before it says so (the configs use 8 to 32)."""
MAX_GEN_BATCH_RATIO = 16
"""``rollout.gen_batch`` beyond this many times ``rollout.batch``: most drawn queries are
thrown away (the paper draws 4x, ``k * B``)."""


def range_warnings(config: ArmorConfig) -> Iterator[str]:
    """One line per setting far outside its useful range (none for a usual config)."""
    a, r = config.algo, config.rollout
    if a.group_size > MAX_GROUP_SIZE:
        yield (
            f"algo.group_size={a.group_size} is far above the useful range (2 to "
            f"{MAX_GROUP_SIZE}; the paper uses 16): every query costs {a.group_size} "
            f"generations, about {a.group_size / 16:.0f}x the rollout of G=16 per step"
        )
    if a.max_gen_batches > MAX_GEN_BATCHES:
        yield (
            f"algo.max_gen_batches={a.max_gen_batches} is far above the useful range (1 to "
            f"{MAX_GEN_BATCHES}; the configs use 8 to 32): a step that cannot fill its batch "
            f"draws up to {a.max_gen_batches} x rollout.gen_batch={r.gen_batch} queries before "
            "it fails"
        )
    longest = config.data.max_prompt_len + r.sampling.max_new_tokens
    if 1 <= config.trainer.micro_batch_tokens < longest:
        yield (
            f"trainer.micro_batch_tokens={config.trainer.micro_batch_tokens} is below the "
            f"longest sequence (data.max_prompt_len + rollout.sampling.max_new_tokens = "
            f"{longest}): a longer sequence is a micro-batch of its own, over the bound the "
            f"setting means for memory; raise it to >= {longest} or shorten the sequences"
        )
    if r.batch >= 1 and r.gen_batch > MAX_GEN_BATCH_RATIO * r.batch:
        yield (
            f"rollout.gen_batch={r.gen_batch} is {r.gen_batch / r.batch:.0f}x rollout.batch="
            f"{r.batch} (useful: 1x to {MAX_GEN_BATCH_RATIO}x; the paper draws 4x): most of "
            "each generation batch is drawn and thrown away"
        )
    yield from dense_model_warnings(config)  # settings for experts on a model without any


def print_range_warnings(config: ArmorConfig) -> list[str]:
    """Print :func:`range_warnings` on stderr; returns them."""
    found = list(range_warnings(config))
    for line in found:
        print(f"warning: {line}", file=sys.stderr, flush=True)
    return found
