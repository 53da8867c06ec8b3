"""The rollout worker: one Ray actor per node with engines, the union of its services.

Everything a worker holds is built in its constructor, from the config, before the actor
answers its first call: the engines of its node (``rollout_services.EnginePools``), the
tokenizer, the reference sampler (:func:`reference_sampler`) and, for the embedded
engine's ``swap``, the weight copies it loads. The methods the driver calls are those of the
services (``rollout_services.py``), one class per concern; the driver reaches them through
``rollout_fleet.RolloutFleet`` and the classes that use it (``rollout_draws.py``,
``weight_sync.py``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megatron_armor.algo.registry import get_anchor_mode
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.observability.throughput import peak_gpu_memory_gb
from megatron_armor.orchestration.actors.ray_node import ignore_stop_signals
from megatron_armor.orchestration.actors.rollout_services import (
    EnginePools,
    GenerationService,
    HealthService,
    MemoryService,
    ReferenceService,
    WeightCopies,
    WeightIntake,
)
from megatron_armor.orchestration.actors.watched import Watched, beating
from megatron_armor.orchestration.actors.workers import (
    ComputeClock,
    enable_worker_nvtx,
    freeze_heap,
    load_model_tokenizer,
    node_info,
    set_threads,
)
from megatron_armor.rollout.backends import backend_of
from megatron_armor.rollout.reference import ReferenceSampler

ServerSlots = dict[str, list[tuple[int, int]]]
"""``{pool: [(server index, first GPU id)]}`` of the SGLang servers on a worker's node."""


def start_pools(config: ArmorConfig, index: int, device: str,
                servers: ServerSlots | None) -> EnginePools:  # fmt: skip
    """The engines of a worker: with ``servers`` (SGLang) the pools with servers on its node,
    else every pool here; the policy pool first, then a reference pool
    (``config.sglang_pools``), launched once the policy servers are healthy. A failure stops
    the engines already started."""
    from megatron_armor.config.sglang_pools import uses_ref_pool

    pools = ["policy", "ref"] if uses_ref_pool(config) else ["policy"]
    if servers is not None:
        pools = [p for p in pools if servers.get(p)]
    backend, started = backend_of(config), EnginePools({}, index)
    try:
        for pool in pools:
            started.engines[pool] = backend.build(config, device, pool, (servers or {}).get(pool))
    except BaseException:
        started.close()
        raise
    return started


def embedded_engine_profiler(config: ArmorConfig, index: int):
    """``logging.profile=torch`` with the embedded engine: rollout worker ``index``'s
    torch.profiler traces of the chosen steps, ``RUN_DIR/profile/trace_rollout<i>_step<S>.json``
    (its generation and reference sampling); ``None`` otherwise (SGLang servers capture
    themselves; under nsys the worker is in the driver's report)."""
    if config.logging.profile != "torch" or backend_of(config).serves_over_http:
        return None
    from megatron_armor.observability.profiler import TorchStepProfiler

    out_dir = os.path.join(config.run.output_dir, config.run.name, "profile")
    return TorchStepProfiler(list(config.logging.profile_steps), out_dir, index, f"rollout{index}")


def reference_sampler(config: ArmorConfig, pools: EnginePools,
                      copies: WeightCopies) -> ReferenceSampler | None:  # fmt: skip
    """The sampler of ``rollout.ref_strategy`` over the worker's engines (``None``: a node
    with only policy servers of a run with a reference pool samples no reference).

    A run without reference samples (``algo.anchor: none``) holds no reference weights. With
    SGLang and ``swap`` the trainer ranks swap the reference into the policy servers around
    each reference call (``orchestration/actors/weight_sync.py``): the servers then serve it
    like a dedicated pool."""
    from megatron_armor.config.rollout_traits import ReferencePlan
    from megatron_armor.config.sglang_pools import uses_ref_pool
    from megatron_armor.rollout.reference import make_reference_sampler

    plan = reference_plan(config)
    if not get_anchor_mode(config.algo.anchor).draws_reference:
        plan = ReferencePlan("none", "none")
    ref_engine = pools.ref
    if backend_of(config).serves_over_http and plan.swaps_into_policy:
        strategy = plan.strategy if plan.caches_anchors else "dedicated"
        plan, ref_engine = ReferencePlan(strategy, "dedicated"), pools.policy
    if pools.ref is None and uses_ref_pool(config):
        return None
    return make_reference_sampler(plan.strategy, pools.policy, weights_fn=copies,
                                  ref_engine=ref_engine, cache_fill=plan.cache_fill)  # fmt: skip


def reference_plan(config: ArmorConfig):
    """``(strategy, cache_fill)`` of ``rollout.ref_strategy`` and ``algo.anchor_source``
    (``config.rollout_traits.reference_strategy``)."""
    from megatron_armor.config.rollout_traits import reference_strategy

    return reference_strategy(config.rollout.ref_strategy, config.algo.anchor_source)


def keeps_copies(config: ArmorConfig) -> bool:
    """Whether the worker keeps CPU copies of the pushed weights: the embedded engine's
    ``swap`` (SGLang swaps by pushes from the trainer ranks)."""
    from megatron_armor.config.rollout_traits import ReferencePlan

    plan = reference_plan(config)
    if not get_anchor_mode(config.algo.anchor).draws_reference:
        plan = ReferencePlan("none", "none")
    return plan.swaps_into_policy and not backend_of(config).serves_over_http


@beating
class RolloutWorker(
    Watched, GenerationService, ReferenceService, WeightIntake, MemoryService, HealthService
):
    """One rollout worker (docs/algorithm.md, anchor rollout step 2): its engines, and the
    services of ``rollout_services.py`` over them."""

    def __init__(
        self,
        config: ArmorConfig,
        index: int,
        num_threads: int = 0,
        servers: ServerSlots | None = None,
    ):
        """``servers``: with SGLang, the servers on this worker's node
        (``placement.rollout_hosts``); ``None`` runs every pool here."""
        set_threads(num_threads)
        ignore_stop_signals()  # the driver checkpoints on them; Ray must keep running
        enable_worker_nvtx(config)
        import ray

        device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
        pools = start_pools(config, index, device, servers)
        try:  # whatever fails, the servers already started are stopped
            tokenizer = load_model_tokenizer(config.trainer.model_path)
            copies = WeightCopies(keeps_copies(config), index)
            reference = reference_sampler(config, pools, copies)
        except BaseException:
            pools.close()
            raise
        self.index, clock = index, ComputeClock()
        self.profiler = embedded_engine_profiler(config, index)
        GenerationService.__init__(self, pools, tokenizer, clock)
        ReferenceService.__init__(self, reference, tokenizer, clock)
        WeightIntake.__init__(self, pools, copies, reference)
        MemoryService.__init__(self, pools)
        HealthService.__init__(self, pools)
        freeze_heap()

    def compute_intervals(self) -> list[tuple[float, float]]:
        """Engine generation (policy and reference) since the last call (``ComputeClock``)."""
        return self.clock.pop()

    def peak_gpu_memory_gb(self) -> tuple[float, float] | None:
        """Peak GPU memory (allocated, reserved) of the embedded engine in this process
        (``None`` without CUDA; SGLang servers are separate processes)."""
        return peak_gpu_memory_gb()

    def node_info(self) -> dict[str, Any]:
        return node_info()

    def profile_begin(self, step: int) -> None:
        """Start the capture of ``step`` where it is chosen: this worker's embedded engine in a
        torch.profiler trace, an SGLang pool's servers by their own profilers."""
        if self.profiler is not None:
            self.profiler.begin_step(step)
        for pool in self.pools.names():
            self.pools.engines[pool].profile_begin(step)

    def profile_end(self, step: int) -> None:
        for pool in self.pools.names():
            self.pools.engines[pool].profile_end(step)
        if self.profiler is not None:
            self.profiler.end_step(step)

    def close(self) -> None:
        """Stop the engines this worker launched (SGLang servers and routers)."""
        self.pools.close()
