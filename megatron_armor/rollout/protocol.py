"""The one rollout-engine protocol shared by the embedded ``torch`` engine and SGLang."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass
class GenerationOutput:
    """One generated response: token ids in, token ids + per-token log-probs out."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int


class RolloutEngine(ABC):
    """Generate ``n`` samples per prompt and accept weight updates (versioned).

    ``weights`` names a weight set held by the engine: ``policy`` always; ``ref`` where the
    reference strategy keeps one in the engine.
    """

    @abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        weights: str = "policy",
    ) -> list[list[GenerationOutput]]:
        """For each prompt (token ids), ``n`` samples; result ``[len(prompts)][n]``."""

    @abstractmethod
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        weights: str = "policy",
    ) -> None:
        """Load HF-named full tensors into weight set ``weights`` and record ``version``."""

    @abstractmethod
    def weight_version(self, weights: str = "policy") -> int:
        """Version of the weights last loaded into ``weights``."""

    @abstractmethod
    def health(self) -> bool:
        """True when the engine can serve."""

    def release_memory(self) -> None:
        """Free accelerator memory while the trainer runs (colocated mode); default: nothing to free."""
        return None

    def resume_memory(self) -> None:
        """Take memory back after :meth:`release_memory`; default: nothing to take back."""
        return None
