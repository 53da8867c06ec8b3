"""Uneven first-dimension collectives of megatron-core on gloo (CPU mode only).

With expert tensor parallelism (``trainer.etp > 1``) megatron-core's all-to-all token
dispatcher gathers each expert-TP rank's tokens with ``_gather_along_first_dim(...,
output_split_sizes)`` (``torch.distributed.all_gather`` of unequal tensors) and hands the
expert outputs back with ``_reduce_scatter_along_first_dim(..., input_split_sizes)``
(``torch.distributed.reduce_scatter`` of a list). NCCL runs both; gloo refuses tensors of
unequal size. :func:`install_uneven_collectives` swaps in host versions of the two split
branches that are exact for sums of two or more ranks:

- gather: every rank's block is padded to the largest, all-gathered, and cut back;
- reduce-scatter: the whole tensor is all-reduced and each rank keeps its own block.

Only the ``*_split_sizes`` branches change; the even case keeps megatron's own code. The GPU
path never calls this module (``parallel.init_parallel`` installs it in CPU mode only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_INSTALLED = False


def gather_uneven(input_: torch.Tensor, group, output_split_sizes: list[int]) -> torch.Tensor:
    """``cat`` over the ranks of ``group`` of each rank's ``input_`` (``output_split_sizes[r]``
    rows on rank ``r``), through one all-gather of equal, padded blocks."""
    rows = max(output_split_sizes)
    padded = input_.new_zeros((rows, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    blocks = [torch.empty_like(padded) for _ in output_split_sizes]
    dist.all_gather(blocks, padded.contiguous(), group=group)
    return torch.cat([b[:n] for b, n in zip(blocks, output_split_sizes, strict=True)], dim=0)


def reduce_scatter_uneven(
    input_: torch.Tensor, group, input_split_sizes: list[int]
) -> torch.Tensor:
    """This rank's block (``input_split_sizes[rank]`` rows) of the sum over ``group`` of
    ``input_``: an all-reduce of the whole tensor, then the rank's slice."""
    total = input_.clone().contiguous()
    dist.all_reduce(total, group=group)
    start = sum(input_split_sizes[: group.rank()])
    return total[start : start + input_split_sizes[group.rank()]].contiguous()


def install_uneven_collectives() -> None:
    """Route megatron's uneven first-dimension gather and reduce-scatter through
    :func:`gather_uneven` / :func:`reduce_scatter_uneven` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from megatron.core.tensor_parallel import mappings

    even_gather, even_reduce_scatter = (
        mappings._gather_along_first_dim,
        mappings._reduce_scatter_along_first_dim,
    )

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return even_gather(input_, group, output_split_sizes, use_global_buffer)
        return gather_uneven(input_, group, [int(n) for n in output_split_sizes])

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return even_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        return reduce_scatter_uneven(input_, group, [int(n) for n in input_split_sizes])

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter
    _INSTALLED = True
