"""``rollout.backend``: the one map from backend names to engine builders.

Adding a backend is an engine class implementing :class:`~megatron_armor.rollout.protocol.RolloutEngine`,
a builder function here, one :data:`BACKENDS` line and its traits in
``config/rollout_traits.py`` (docs/architecture.md, where to add X). The traits answer what the
rest of the code asks of a backend, so no call site tests its name; config validation reads
them without importing rollout.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from megatron_armor.algo.registry import lookup
from megatron_armor.config.moe import wants_engine_routes
from megatron_armor.config.rollout_traits import BACKEND_TRAITS, BackendTraits
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.rollout.protocol import RolloutEngine

ServerSlots = list[tuple[int, int]]
"""``[(server index, first GPU id)]`` of the servers one worker starts."""


@dataclass(frozen=True)
class RolloutBackend:
    """One ``rollout.backend``: how a rollout worker builds its engine (``build``), and what it
    runs (``traits``, :class:`~megatron_armor.config.rollout_traits.BackendTraits`)."""

    traits: BackendTraits
    build: Callable[[ArmorConfig, str, str, ServerSlots | None], RolloutEngine]

    @property
    def name(self) -> str:
        return self.traits.name

    @property
    def serves_over_http(self) -> bool:
        """Whether the engine is a pool of server processes reached over HTTP
        (:class:`~megatron_armor.config.rollout_traits.BackendTraits`)."""
        return self.traits.serves_over_http


def _torch_engine(
    config: ArmorConfig, device: str, pool: str, servers: ServerSlots | None
) -> RolloutEngine:
    """The embedded HF engine (one per worker; ``pool`` and ``servers`` do not apply); it
    returns each sample's routes when the run replays them (``config/moe.py``:
    ``wants_engine_routes``)."""
    from megatron_armor.rollout.torch_engine import TorchEngine

    return TorchEngine(
        config.trainer.model_path, device=device, max_batch=config.rollout.engine_batch_size,
        model_overrides=dict(config.trainer.model_overrides),
        return_routed_experts=wants_engine_routes(config),
    )  # fmt: skip


def visible_index(gpu_id: int) -> int:
    """The ``--base-gpu-id`` of Ray GPU ``gpu_id`` for a server started from this process.

    Ray names GPUs by their entries in the node's ``CUDA_VISIBLE_DEVICES`` (e.g. ``4`` on a
    Slurm node given GPUs 4-7) and leaves that variable alone for an actor without GPUs, so
    the server inherits it and counts devices from 0 within it: map the id to its position.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return gpu_id
    visible = visible.strip()
    if not visible:
        raise RuntimeError(
            f"Ray placed an SGLang server on GPU {gpu_id}, but this rollout worker sees "
            "CUDA_VISIBLE_DEVICES='' (the servers it starts would see no GPU): Ray blanks it "
            "for an actor without GPUs unless RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0, which "
            "orchestration/actors/placement.py sets for the rollout workers; check that the "
            "cluster does not force it to 1"
        )
    entries = [e.strip() for e in visible.split(",")]
    if str(gpu_id) not in entries:
        raise RuntimeError(
            f"Ray placed an SGLang server on GPU {gpu_id}, which is not in this node's "
            f"CUDA_VISIBLE_DEVICES={visible!r}; start Ray with the same visible devices as the "
            "job (slurm/armor.sbatch does)"
        )
    return entries.index(str(gpu_id))


def _sglang_engine(
    config: ArmorConfig, device: str, pool: str, servers: ServerSlots | None
) -> RolloutEngine:
    """The SGLang servers ``servers`` of ``pool`` (default: the whole pool on this node),
    listening on this node's Ray address (reachable from the other nodes)."""
    import ray

    from megatron_armor.rollout.sglang.engine import SGLangEngine

    host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    indices = [i for i, _ in servers] if servers is not None else None
    gpu_ids = [visible_index(g) for _, g in servers] if servers is not None else None
    return SGLangEngine.from_config(config, pool, host=host, gpu_ids=gpu_ids, indices=indices)


BACKENDS: dict[str, RolloutBackend] = {
    "torch": RolloutBackend(BACKEND_TRAITS["torch"], _torch_engine),
    "sglang": RolloutBackend(BACKEND_TRAITS["sglang"], _sglang_engine),
}
"""``rollout.backend`` (docs/rollout.md): the names of ``BACKEND_TRAITS``, each with its builder."""


def get_backend(name: str) -> RolloutBackend:
    """The :class:`RolloutBackend` for ``rollout.backend``; an unknown name names the choices."""
    return lookup(BACKENDS, name, "rollout.backend")


def backend_of(config: ArmorConfig) -> RolloutBackend:
    """The backend entry of ``config.rollout.backend``."""
    return get_backend(config.rollout.backend)
