"""Which SGLang servers a run starts: the ``policy`` pool and, for a dedicated reference, the
``ref`` pool (docs/architecture.md; docs/algorithm.md, anchor rollout).

Both pools live on the *rollout GPUs*, numbered ``0 .. R-1``:

- ``colocated``: the rollout GPUs are the trainer's (``R = trainer.world_size``). Policy server
  ``i`` sits on GPUs ``i*tp ..``; reference server ``i`` on GPUs ``i*ref_tp ..`` — the same
  GPUs, so both pools claim memory on every GPU.
- ``disaggregated``: ``R = orchestration.rollout_gpus``, after the trainer's GPUs. The policy
  servers come first, then the reference servers, each on GPUs of its own.

SGLang reads ``--mem-fraction-static`` against the memory *free when the server starts*
(``ModelRunner.init_memory_pool`` gets ``min_per_gpu_memory`` from ``init_torch_distributed``
before the weights load; ``profile_max_num_token``: ``rest = available - total * (1 - f)``,
sglang 0.4.x-0.5.x). The reference servers start after the policy servers are healthy, so on
shared GPUs their flag is ``share / (1 - policy_fraction)`` to claim ``share`` of the GPU.

Servers may sit on several nodes (one rollout worker per node launches that node's servers,
``orchestration/actors/placement.py``); a server's ``tp`` GPUs are on one node.

Pure config arithmetic: no SGLang, no Ray, so the validator, the planner, the placement and
the SGLang engine (``rollout/sglang/engine.py``) all read the pools from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_armor.algo.registry import get_anchor_mode
from megatron_armor.config.rollout_traits import backend_traits, reference_strategy
from megatron_armor.config.schema import ArmorConfig, SGLangConfig

POOLS = ("policy", "ref")
COLOCATED_REF_SHARE = 0.2
"""Default share of each GPU for colocated reference servers (``ref_pool.mem_fraction: 0``)."""
MAX_SHARED_FRACTION = 0.95
"""Policy + reference shares of one GPU may not exceed this (SGLang's own runtime needs some)."""


@dataclass(frozen=True)
class PoolSpec:
    """One pool of identical SGLang servers."""

    name: str
    num_engines: int
    tp: int
    share: float
    """Fraction of each of its GPUs the pool's server claims (weights + KV cache)."""
    flag: float
    """The ``--mem-fraction-static`` that claims ``share`` (see the module docstring)."""
    base_port: int
    router_port: int
    first_gpu: int
    """Rollout-GPU index of server 0 (the pool's servers are consecutive)."""

    @property
    def gpus(self) -> int:
        return self.num_engines * self.tp

    def gpu_offsets(self) -> list[int]:
        """Rollout-GPU index of each server's first GPU."""
        return [self.first_gpu + i * self.tp for i in range(self.num_engines)]


def uses_ref_pool(config: ArmorConfig) -> bool:
    """Whether the run starts SGLang reference servers (``dedicated``, directly or as the
    anchor cache's fill, with anchors on)."""
    r, a = config.rollout, config.algo
    over_http = backend_traits(r.backend).serves_over_http
    if not over_http or not get_anchor_mode(a.anchor).draws_reference:
        return False
    # ``dedicated`` itself, or the cache filled by it
    return not reference_strategy(r.ref_strategy, a.anchor_source).swaps_into_policy


def policy_pool(sg: SGLangConfig, num_engines: int) -> PoolSpec:
    """The policy pool of ``rollout.sglang`` with ``num_engines`` servers (on fresh GPUs its
    share of memory is its ``--mem-fraction-static``)."""
    return PoolSpec("policy", num_engines, max(sg.tp, 1), sg.mem_fraction_static,
                    sg.mem_fraction_static, sg.base_port, sg.router_port, 0)  # fmt: skip


def rollout_gpus(config: ArmorConfig) -> int:
    """GPUs the SGLang servers may use (see the module docstring; 0 on the CPU layout)."""
    o = config.orchestration
    if o.layout == "colocated":
        return config.resolved.world_size
    if o.layout == "disaggregated":
        return o.rollout_gpus
    return 0


def pool_specs(config: ArmorConfig) -> dict[str, PoolSpec]:
    """The ``policy`` pool and (when :func:`uses_ref_pool`) the ``ref`` pool.

    Counts left at 0 are filled in; nothing is checked here beyond what the arithmetic needs
    (:func:`pool_problems` says what is wrong, with the settings to change).
    """
    sg, layout = config.rollout.sglang, config.orchestration.layout
    rp = sg.ref_pool
    gpus = rollout_gpus(config)
    tp = max(sg.tp, 1)
    ref = uses_ref_pool(config)
    ref_tp = max(rp.tp or tp, 1)
    n = sg.num_engines
    if n <= 0:
        if layout == "disaggregated" and ref:
            n = (
                gpus // (tp + ref_tp)
                if rp.num_engines <= 0
                else (gpus - rp.num_engines * ref_tp) // tp
            )
        else:
            n = gpus // tp
        n = max(n, 1)
    specs = {"policy": policy_pool(sg, n)}
    if ref:
        ref_n = rp.num_engines if rp.num_engines > 0 else n
        if layout == "disaggregated":
            share = rp.mem_fraction or sg.mem_fraction_static
            flag, first = share, n * tp
        else:
            share = rp.mem_fraction or COLOCATED_REF_SHARE
            flag, first = share / max(1.0 - sg.mem_fraction_static, 1e-6), 0
        specs["ref"] = PoolSpec("ref", ref_n, ref_tp, share, flag, rp.base_port,
                                rp.router_port, first)  # fmt: skip
    return specs


def pool_problems(config: ArmorConfig) -> list[str]:
    """What makes the pools impossible, each naming the settings and the fix."""
    over_http = backend_traits(config.rollout.backend).serves_over_http
    if not over_http or config.orchestration.layout == "cpu":
        return []
    sg, o = config.rollout.sglang, config.orchestration
    specs = pool_specs(config)
    gpus = rollout_gpus(config)
    out = []
    where = (
        f"trainer.world_size={gpus} (colocated servers sit on the trainer GPUs)"
        if o.layout == "colocated"
        else f"orchestration.rollout_gpus={gpus}"
    )
    for spec in specs.values():
        key = "rollout.sglang" if spec.name == "policy" else "rollout.sglang.ref_pool"
        if spec.tp > o.gpus_per_node:
            out.append(f"{key}.tp={spec.tp} > orchestration.gpus_per_node={o.gpus_per_node}: "
                       "a server must sit on one node; lower it")  # fmt: skip
        if not 0.0 < spec.share < 1.0:
            field = "mem_fraction_static" if spec.name == "policy" else "mem_fraction"
            out.append(f"{key}.{field}={spec.share}: must be in (0, 1)")
    used = (
        sum(s.gpus for s in specs.values())
        if o.layout == "disaggregated"
        else max(s.gpus for s in specs.values())
    )
    if used > gpus:
        counts = ", ".join(f"{s.name} {s.num_engines} x tp {s.tp}" for s in specs.values())
        out.append(f"the SGLang servers ({counts}) need {used} GPUs but {where}; lower "
                   "rollout.sglang.num_engines / ref_pool.num_engines or their tp")  # fmt: skip
    elif o.layout == "disaggregated" and used < gpus:
        tps = " + ".join(f"{s.name} tp {s.tp}" for s in specs.values())
        out.append(f"orchestration.rollout_gpus={gpus} but the SGLang servers use {used}; set "
                   "rollout.sglang.num_engines (and ref_pool.num_engines) to use them all, or "
                   f"make rollout_gpus a multiple of {tps} (the automatic split, num_engines: "
                   "0, gives each policy server a reference server)")  # fmt: skip
    if "ref" in specs and o.layout == "colocated":
        total = sg.mem_fraction_static + specs["ref"].share
        if total > MAX_SHARED_FRACTION + 1e-9:
            out.append(f"rollout.sglang.mem_fraction_static={sg.mem_fraction_static} + "
                       f"ref_pool.mem_fraction={specs['ref'].share} = {total:.2f} of each GPU "
                       f"> {MAX_SHARED_FRACTION}: the two pools share the GPUs; lower them")  # fmt: skip
    base = config.resolved.world_size if o.layout == "disaggregated" else 0
    if base + (used if o.layout == "disaggregated" else 0) > o.nodes * o.gpus_per_node:
        out.append(f"trainer.world_size={config.resolved.world_size} + the SGLang servers' {used} "
                   f"GPUs > orchestration.nodes * gpus_per_node = {o.nodes * o.gpus_per_node}")  # fmt: skip
    for spec in specs.values():
        for i, offset in enumerate(spec.gpu_offsets()):
            first, last = base + offset, base + offset + spec.tp - 1
            if first // o.gpus_per_node != last // o.gpus_per_node:
                key = "rollout.sglang" if spec.name == "policy" else "rollout.sglang.ref_pool"
                out.append(f"SGLang {spec.name} server {i} would span GPUs {first}-{last}, across "
                           f"nodes of {o.gpus_per_node} GPUs: make {key}.tp divide "
                           "orchestration.gpus_per_node and the GPUs before the pool")  # fmt: skip
                break
    return out
