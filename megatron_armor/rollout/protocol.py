"""The one rollout-engine protocol shared by the embedded ``torch`` engine and SGLang.

:class:`RolloutEngine` declares every method a rollout worker calls on an engine. The server
methods (``servers`` and what takes a server) concern backends whose engine is a pool of
server processes (``RolloutBackend.serves_over_http`` in ``rollout/backends.py``); an embedded
engine has no servers, so the workers never call them on it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_armor.types import RoutedExperts


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
    finish_reason: str
    """``stop`` (a stop token) | ``length`` (``max_new_tokens``) | ``abort`` | ``partial``
    (:meth:`RolloutEngine.generate_window`: the window ended first; continue it)."""
    weight_version: int
    routed_experts: RoutedExperts | None = None
    """A mixture-of-experts engine asked for routes: the experts of every position of
    prompt + response but the last (``types.RoutedExperts``); ``None`` otherwise."""
    token_versions: list[int] = field(default_factory=list)
    """The weight version of each token when a push came while it was generated (SGLang's
    ``meta_info.weight_versions``); empty: every token is of ``weight_version``."""
    seconds: float = field(default=0.0, compare=False)
    """Seconds from the start of the engine call to this response's last token: how long its
    slot of the batch was busy (``perf/rollout_tail_idle_s``, docs/metrics.md)."""


@dataclass
class PartialRequest:
    """One request of :meth:`RolloutEngine.generate_window`: a prompt and the response tokens
    it has so far (none for a new request), to be continued under the engine's weights."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)


def window_limits(
    requests: Sequence[PartialRequest], params: SamplingParams, window_tokens: int
) -> list[int]:
    """The new tokens each request may decode in a window: ``window_tokens``, and no more
    than ``params.max_new_tokens`` in all (at least 1: a request at its limit is finished)."""
    if window_tokens < 1:
        raise ValueError(f"generate_window: window_tokens={window_tokens} must be >= 1")
    limits = [min(window_tokens, params.max_new_tokens - len(r.response_ids)) for r in requests]
    done = [i for i, n in enumerate(limits) if n < 1]
    if done:
        raise ValueError(
            f"generate_window: request {done[0]} has {len(requests[done[0]].response_ids)} "
            f"response tokens, max_new_tokens={params.max_new_tokens}: it is finished"
        )
    return limits


def window_finish_reason(stopped: bool, total: int, params: SamplingParams) -> str:
    """The finish reason of a window's output: ``stop`` (ended by a stop token), ``length``
    (``total`` response tokens reached ``max_new_tokens``) or ``partial`` (to be continued)."""
    if stopped:
        return "stop"
    return "length" if total >= params.max_new_tokens else "partial"


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

    def generate_window(
        self,
        requests: list[PartialRequest],
        params: SamplingParams,
        window_tokens: int,
        weights: str = "policy",
    ) -> list[GenerationOutput]:
        """One window of a partial rollout (docs/orchestration.md, "Bounded staleness"): each
        request, its response so far appended to its prompt and evaluated under the current
        weights, decodes at most ``window_tokens`` new tokens (and no more than
        ``params.max_new_tokens`` in all, :func:`window_limits`). Returns the *new* tokens of
        each request, ``finish_reason`` from :func:`window_finish_reason`."""
        raise NotImplementedError(
            f"{type(self).__name__} has no windowed generation; partial rollouts "
            "(orchestration.async_rollout: bounded) need the torch or sglang backend"
        )

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

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take memory back after :meth:`release_memory`: the parts ``tags`` (SGLang's
        ``weights`` / ``kv_cache``; ``None``: all); default: nothing to take back."""
        return None

    def has_weights(self, weights: str) -> bool:
        """Whether weight set ``weights`` is loaded; default: only ``policy``."""
        return weights == "policy"

    def close(self) -> None:
        """Stop what the engine started (server processes, routers); default: nothing."""
        return None

    def profile_begin(self, step: int) -> None:
        """Start the capture of training step ``step`` in processes of the engine's own
        (SGLang servers: ``rollout/sglang/profile.py``); default: none, an embedded engine is
        in its worker's trace."""
        return None

    def profile_end(self, step: int) -> None:
        """End what :meth:`profile_begin` started; default: nothing."""
        return None

    # ------------------------------------------------------------------ server pools
    servers: Sequence[Any] = ()
    """The engine's server processes (``.url``, ``.tp``, ``.index``); an embedded engine: none."""

    @property
    def api_key(self) -> str:
        """The key weight pushes send to the servers (``""``: none needed)."""
        return ""

    def set_weight_version(self, version: int) -> None:
        """Record ``version`` after the trainer ranks pushed weights to the servers themselves."""
        raise self._no_servers("set_weight_version")

    def begin_weight_update(self, servers: list | None = None) -> None:
        """Open the weight-update session of ``servers`` (default: all) before a pushed
        update that needs one (SGLang's tensor and distributed updates)."""
        raise self._no_servers("begin_weight_update")

    def end_weight_update(self, servers: list | None = None) -> None:
        """Close the session :meth:`begin_weight_update` opened."""
        raise self._no_servers("end_weight_update")

    def update_weights_from_disk(
        self, model_path: str, version: int, servers: list | None = None
    ) -> None:
        """Load the HF dir ``model_path`` into ``servers`` (default: all, which then serve
        ``version``)."""
        raise self._no_servers("update_weights_from_disk")

    def wedged_servers(self, timeout_s: float) -> list:
        """The serving servers whose generation health check gives no answer within
        ``timeout_s``; default: none (no servers)."""
        return []

    def kill_server(self, server: Any) -> None:
        """Kill a wedged ``server``, out of rotation until :meth:`restart_server`."""
        raise self._no_servers("kill_server")

    def server_healthy(self, server: Any) -> bool:
        """Whether ``server`` answers its health check."""
        raise self._no_servers("server_healthy")

    def restart_server(self, server: Any) -> None:
        """Restart ``server``; it stays out of rotation until :meth:`rejoin`."""
        raise self._no_servers("restart_server")

    def rejoin(self, server: Any) -> None:
        """Put a restarted, re-synced ``server`` back into rotation."""
        raise self._no_servers("rejoin")

    def _no_servers(self, method: str) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__}.{method}: this engine runs in the worker's process and has "
            "no servers; server methods need a backend that serves over HTTP (rollout.backend)"
        )
