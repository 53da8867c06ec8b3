"""The trainer interface the orchestrator talks to (no Megatron import here).

One object per trainer rank (a Ray actor at scale). Every rank receives the same full
:class:`TrainBatch`; a rank works on its data-parallel shard (balanced by tokens, see
``trainer.batching``). Methods returning per-token data return a ``[total]`` tensor from the
*reporting* ranks only (last pipeline stage, tensor-parallel rank 0, context-parallel rank 0)
with zeros outside their shard, and ``None`` from the others: the caller sums the non-None
results to get the full tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

from megatron_armor.types import TrainBatch


class TrainerInterface(ABC):
    """What orchestration needs from a policy trainer rank."""

    @abstractmethod
    def compute_logprobs(self, batch: TrainBatch, weights: str = "policy") -> torch.Tensor | None:
        """Forward-only per-token log-probs of ``batch.tokens`` under ``weights``
        (``policy`` = current weights, ``ref`` = the reference copy), at the rollout
        temperature. Shape ``[total]``; 0 where ``loss_mask == 0``."""

    @abstractmethod
    def offload_train_state(self) -> None:
        """Free what only the update needs (optimizer state, gradient buffers) until the next
        ``train_step``, which restores it."""

    @abstractmethod
    def hand_over_memory(self) -> None:
        """Before colocated engines take their GPU memory back: :meth:`offload_train_state`
        when configured, then this rank's cached allocator blocks returned to the device."""

    @abstractmethod
    def exact_kl(self, batch: TrainBatch) -> dict[str, float]:
        """Exact vocabulary-wide ``KL(policy || ref)`` and ``KL(ref || policy)`` at the tokens of
        ``batch`` with ``loss_mask`` set (``kl/exact_*`` means and maxima); every rank returns
        the same numbers."""

    @abstractmethod
    def step_logprobs(
        self,
        batch: TrainBatch,
        with_ref: bool,
        kl_mask: torch.Tensor | None = None,
        shared: bool = False,
        old_weights: str = "policy",
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, float]]:
        """A step's log-prob work in one call: ``compute_logprobs(batch, "policy")``,
        ``compute_logprobs(batch, "ref")`` when ``with_ref`` (else ``None``), and ``exact_kl``
        at the tokens flagged by ``kl_mask`` (``[total]``; ``{}`` when ``None``), reusing the
        policy pass for the diagnostic. ``shared``: the whole log-probs on every rank (not only
        the reporting ranks' parts). While the reference equals the policy (reset, no update
        since) ``ref`` is the policy pass's result, bit for bit what a reference pass gives.
        ``old_weights``: the first pass under ``policy`` (the live weights) or ``behavior``,
        the copy of :meth:`snapshot_behavior` (a one-step-off batch's behavior policy)."""

    @abstractmethod
    def snapshot_behavior(self) -> None:
        """Keep the live weights as ``behavior`` (``orchestration.async_rollout: one_step``:
        the engines generate the next batch with them while the updates change the live
        ones); kept until the next call and saved in checkpoints."""

    @abstractmethod
    def train_step(self, batch: TrainBatch, num_minibatches: int) -> dict[str, float]:
        """Split ``batch`` (consecutive samples; a batch selected from the step's, or that
        batch itself) into ``num_minibatches`` mini-batches and take one optimizer update on
        each. ``batch.old_logprobs`` and
        ``batch.ref_logprobs`` must be filled. Returns metrics averaged over updates and
        reduced over data-parallel ranks (``loss/*``, ``kl/*``, ``lr``)."""

    def end_step(self) -> None:
        """The step's last update is done: drop what the trainer kept for its updates (the
        ``old`` pass's recorded routes, ``routing_replay.RecordedRoutes``); default: nothing
        kept."""
        return None

    @abstractmethod
    def reset_reference(self) -> None:
        """Copy the current policy weights into the reference copy (docs/algorithm.md, reference reset)."""

    @abstractmethod
    def export_weights(
        self, weights: str = "policy", device: str | None = "cpu", every_rank: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream of full (TP-gathered) HF-named tensors for this rank's pipeline stage, copied
        to ``device`` (``None``: left on the training device). Only tensor-parallel rank 0 /
        data-parallel rank 0 of each stage yields tensors, or every rank with ``every_rank``."""

    @abstractmethod
    def save_checkpoint(self, path: str, run_state: dict) -> None:
        """Collectively write model, optimizer, scheduler, reference weights, RNG and the
        orchestrator's ``run_state`` under ``path`` (the caller makes it atomic)."""

    @abstractmethod
    def load_checkpoint(self, path: str) -> dict:
        """Restore everything :meth:`save_checkpoint` wrote; returns ``run_state``."""
