"""Routing replay of a mixture-of-experts policy (``trainer.moe.routing_replay``, docs/trainer.md
"Routing replay", docs/algorithm.md "Mixture-of-experts policies").

Each MoE router of the model gets a :class:`RouteReplay`: megatron-core's ``RouterReplay``
(``transformer/moe/router_replay.py``, switched on by ``TransformerConfig.moe_enable_routing_replay``;
the router calls it for its top-k), driven per model instance rather than through its
class-wide lists (the concurrent reference model's routers run on another thread). A pass
over a batch is described by a :class:`PassRouting`:

- ``targets`` ``[total, layers, k]``: the experts each token-layer must use (``-1``: the
  router's own top-k). The replayed experts' gate values are the router's scores at those
  experts (``scores.gather``), so the gradient reaches the router as with its own choice;
- ``compare`` and ``source``: routes the router's own top-k is compared with (the engine's, or
  the ``old`` pass's), counted per source of the sample (policy sample, anchor): the routing
  agreement;
- ``record``: keep the experts every token-layer used (the ``old`` pass, for R2);
- expert load: tokens per expert per layer.

Token order. A router sees its stage's hidden states ``[s, b, h]`` flattened, ``s``-major
(split over the tensor-parallel ranks along ``s`` with sequence parallelism): in the padded
layout ``[L, n]``, in the packed one ``[T, 1]``. :func:`router_positions` maps each of those
rows to its token in the packed batch (``-1`` for padding); expert parallelism dispatches
tokens after the router, so it does not change this order; each pipeline stage replays the
layers it holds (``layer_number``).

Recompute: with ``trainer.recompute`` the layers run their forward again during the backward.
A training pass keeps each micro-batch's final experts per router
(``replay_backward_list``); after a micro-batch's forward the routers switch to
``REPLAY_BACKWARD`` and each recomputation takes the oldest entry (micro-batches are
recomputed in the order they ran forward, with or without pipelining).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_armor.trainer import parallel
from megatron_armor.types import OLD_ROUTES_KEY, ROUTES_KEY

POLICY, ANCHOR = 1, 2
"""Sample sources of :attr:`PassRouting.source` (0: not counted)."""


class RouteReplay(RouterReplay):
    """One router's replay (module docstring): megatron-core's ``RouterReplay`` whose top-k
    follows the :class:`PassRouting` of the running pass."""

    def __init__(self, layer: int):
        super().__init__()
        # driven per model instance (:func:`routers`), not through the class-wide list
        RouterReplay.global_router_replay_instances.remove(self)
        self.layer = layer
        """0-based global layer index (the ``layers`` axis of routes)."""
        self.routing: PassRouting | None = None

    def get_replay_topk(
        self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
    ):
        routing = self.routing
        if routing is None:
            return default_compute_topk(scores, topk, num_groups, group_topk)
        if self.router_replay_action == RouterReplayAction.REPLAY_BACKWARD:
            chosen = self.replay_backward_list.pop(0).to(scores.device)
            return scores.gather(1, chosen), chosen
        target = routing.micro_batch_target(self.layer, scores.device)
        if target is None:
            probs, chosen = default_compute_topk(scores, topk, num_groups, group_topk)
            free = chosen
        else:
            with torch.no_grad():
                _, free = default_compute_topk(scores.detach(), topk, num_groups, group_topk)
            replay = target[:, :1] >= 0
            chosen = torch.where(replay, target, free)
            probs = scores.gather(1, chosen)
        routing.observe(self.layer, free.detach(), chosen.detach())
        if routing.training:
            self.replay_backward_list.append(chosen.detach())
        return probs, chosen


def install(model: torch.nn.Module) -> None:
    """Give every MoE router of ``model`` (a ``GPTModel`` stage built with
    ``moe_enable_routing_replay``) a :class:`RouteReplay` of its layer."""
    for module in model.modules():
        if isinstance(module, TopKRouter):
            if module.layer_number is None:
                raise RuntimeError("a MoE router without its layer number: cannot replay routes")
            built = module.router_replay
            if built in RouterReplay.global_router_replay_instances:  # megatron-core's own
                RouterReplay.global_router_replay_instances.remove(built)
            module.router_replay = RouteReplay(module.layer_number - 1)


def routers(model: torch.nn.Module) -> list[RouteReplay]:
    """The :class:`RouteReplay` of each MoE router of ``model`` (``[]`` for a dense model)."""
    found = (getattr(m, "router_replay", None) for m in model.modules())
    return [r for r in found if isinstance(r, RouteReplay)]


def router_positions(mb, sp_rank: int = 0, sp_size: int = 1) -> torch.Tensor:
    """``[rows]`` long: for each row a router of this rank sees in micro-batch ``mb`` (module
    docstring: ``[s, b]`` flattened ``s``-major, this rank's ``s`` chunk with sequence
    parallelism), the packed batch position of its token (``mb.token_index``), ``-1`` for a
    padding position, and for every position of a filler (``batching.filler_micro_batch``: it
    replays, records and counts nothing)."""
    grid = torch.full(mb.tokens.shape, -1, dtype=torch.long)
    if not mb.filler:
        grid[mb.valid] = mb.token_index
    order = grid.t().contiguous()
    if sp_size > 1:
        order = order.chunk(sp_size, dim=0)[sp_rank]
    return order.reshape(-1)


@dataclass
class PassRouting:
    """The routing of one pass over a batch (module docstring); batch tensors are
    ``[total, layers, k]`` int (``-1``: none). What the routers count and record stays on their
    device (no host synchronisation per router call) until :meth:`counts` / the recording
    are read after the pass."""

    num_layers: int
    num_experts: int
    total: int
    """Tokens of the packed batch."""
    routers: list[RouteReplay] = field(default_factory=list)
    """The routers of the model the pass runs on."""
    targets: torch.Tensor | None = None
    compare: torch.Tensor | None = None
    source: torch.Tensor | None = None
    """``[total]`` int8: :data:`POLICY`, :data:`ANCHOR` or 0 (not compared)."""
    record: bool = False
    training: bool = False
    sp: tuple[int, int] = (0, 1)
    """(rank, size) of the sequence-parallel split of the routers' rows."""
    recorded: torch.Tensor | None = None
    """``[total, layers, k]`` int32 on the routers' device: the experts used (``record``)."""
    load: torch.Tensor | None = None
    """``[layers, experts]`` int64 tokens routed to each expert."""
    agree: torch.Tensor | None = None
    """``[4]`` int64 ``(policy agreeing, policy compared, anchor agreeing, anchor compared)``
    token-layers."""
    _pos: torch.Tensor | None = None
    _mb_target: torch.Tensor | None = None
    _mb_replays: list[bool] = field(default_factory=list)
    _on_device: dict = field(default_factory=dict)

    def begin(self, mb) -> None:
        """Before micro-batch ``mb``'s forward: its rows' targets, the routers on this pass."""
        self._pos = router_positions(mb, *self.sp)
        self._on_device = {k: v for k, v in self._on_device.items() if k[0] == "batch"}
        self._mb_target = None
        if self.targets is not None:
            rows = self.targets[self._pos.clamp(min=0)].long()
            rows[self._pos < 0] = -1
            self._mb_target = rows
            self._mb_replays = (rows[:, :, 0] >= 0).any(0).tolist()
        for r in self.routers:
            r.routing = self
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def forward_done(self) -> None:
        """After a micro-batch's forward: a recomputation in its backward replays what the
        forward chose (module docstring)."""
        for r in self.routers:
            r.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def _on(self, name: str, device) -> torch.Tensor:
        """``name`` (``pos`` / ``target``: this micro-batch's, ``compare`` / ``source``: the
        batch's) on ``device``, moved once."""
        scope = "batch" if name in ("compare", "source") else "mb"
        key = (scope, name, str(device))
        if key not in self._on_device:
            tensor = {"pos": self._pos, "target": self._mb_target}.get(name)
            if scope == "batch":
                tensor = self.compare if name == "compare" else self.source
            self._on_device[key] = tensor.to(device)
        return self._on_device[key]

    def micro_batch_target(self, layer: int, device) -> torch.Tensor | None:
        """``[rows, k]`` experts to replay at ``layer`` (``-1`` rows: own top-k), ``None``
        when nothing is replayed there."""
        if self._mb_target is None or not self._mb_replays[layer]:
            return None
        return self._on("target", device)[:, layer]

    def observe(self, layer: int, free: torch.Tensor, chosen: torch.Tensor) -> None:
        """Count the load, the agreement and keep the route of one router call."""
        dev = chosen.device
        pos = self._on("pos", dev)
        real = pos >= 0
        if self.load is None:
            self.load = torch.zeros(self.num_layers, self.num_experts, dtype=torch.long, device=dev)
            self.agree = torch.zeros(4, dtype=torch.long, device=dev)
        self.load[layer] += torch.bincount(chosen[real].reshape(-1), minlength=self.num_experts)
        if self.compare is not None:
            self._count_agreement(layer, free, pos, real)
        if self.record:
            if self.recorded is None:
                shape = (self.total, self.num_layers, chosen.shape[1])
                self.recorded = torch.full(shape, -1, dtype=torch.int32, device=dev)
            self.recorded[pos[real], layer] = chosen[real].int()

    def _count_agreement(self, layer: int, free, pos, real) -> None:
        dev = free.device
        at = pos.clamp(min=0)
        want = self._on("compare", dev)[at, layer].long()
        src = self._on("source", dev)[at].long() * real * (want[:, 0] >= 0)
        same = (free.sort(1).values == want.sort(1).values).all(1)
        for i, kind in enumerate((POLICY, ANCHOR)):
            mask = src == kind
            self.agree[2 * i] += (same & mask).sum()
            self.agree[2 * i + 1] += mask.sum()

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(agree [4], load [layers, experts])`` float64 on the host (zeros when no router
        of this rank ran)."""
        if self.load is None:
            zeros = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
            return torch.zeros(4, dtype=torch.float64), zeros
        return self.agree.double().cpu(), self.load.double().cpu()

    def end(self) -> None:
        """After the pass: the routers back to their own top-k, their lists emptied."""
        for r in self.routers:
            r.routing = None
            r.clear_indices()
            r.clear_router_replay_action()


def reduce_recorded(recorded: torch.Tensor | None, total: int, shape: tuple) -> torch.Tensor:
    """The recorded routes of the whole batch on every rank: each rank holds its tokens'
    rows of its stage's layers, ``-1`` elsewhere; a MAX over the world fills them all (copies
    on ranks that see the same token-layer agree)."""
    out = recorded if recorded is not None else torch.full((total, *shape), -1, dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        out = out.to(parallel.collective_device())
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.to("cpu", torch.int16)


def agreement_metrics(agree: torch.Tensor, names: tuple[str | None, str | None]) -> dict:
    """``{name: agreeing / compared}`` per source (left out without compared token-layers)."""
    out = {}
    for i, name in enumerate(names):
        if name is not None and float(agree[2 * i + 1]) > 0:
            out[name] = float(agree[2 * i] / agree[2 * i + 1])
    return out


def load_metric(load: torch.Tensor, sparse: list[int]) -> dict:
    """``moe/expert_load_max_mean``: tokens of the busiest expert over the mean per expert,
    averaged over the sparse layers (1 = balanced; ``E / k`` = every token on the same
    experts)."""
    rows = load[sparse]
    mean = rows.mean(1)
    ok = mean > 0
    if not bool(ok.any()):
        return {}
    return {"moe/expert_load_max_mean": float((rows.max(1).values[ok] / mean[ok]).mean())}


def sample_kinds(batch) -> torch.Tensor:
    """``[total]`` int8: :data:`ANCHOR` on every token (prompt included) of an anchor sample,
    :data:`POLICY` elsewhere."""
    flags = torch.zeros(batch.num_samples).index_add_(
        0, batch.sample_index, batch.token_data["is_anchor"].float()
    )
    anchor = (flags > 0)[batch.sample_index]
    return torch.where(anchor, ANCHOR, POLICY).to(torch.int8)


@dataclass(frozen=True)
class ReplayPlan:
    """Which routes each pass of a step uses (``trainer.moe``; docs/trainer.md, "Routing
    replay"): built once per trainer."""

    mode: str
    """``trainer.moe.routing_replay``: ``off`` | ``r2`` | ``r3``."""
    anchors: str
    """``trainer.moe.anchor_routes`` (docs/algorithm.md): ``own`` (the ``old`` pass routes
    with its weights and is recorded, the updates replay it, the reference pass replays the
    reference engine's routes), ``reference`` (every pass replays the reference engine's
    routes), ``free`` (no replay on anchors)."""
    num_layers: int
    num_experts: int
    topk: int
    sparse: tuple[int, ...]
    """Indices of the MoE layers."""
    sp: tuple[int, int] = (0, 1)

    def _new(self, batch, **kw) -> PassRouting:
        return PassRouting(self.num_layers, self.num_experts, batch.num_tokens, sp=self.sp, **kw)

    def old_pass(self, batch, model_routers, single: bool) -> PassRouting:
        """The ``old`` pass, recorded under ``r2`` / ``r3``: policy samples replay the policy
        engine's routes under ``r3``; anchors replay the reference engine's with
        ``anchor_routes: reference``, and with ``own`` when the pass is ``single`` (no
        reference pass runs because the reference weights are these: the pass is the
        reference pass too). Its own routing is compared with the engines' on policy samples,
        and on anchors when ``single``."""
        engine = batch.token_data.get(ROUTES_KEY)
        kinds = sample_kinds(batch)
        anchor = kinds == ANCHOR
        targets = None
        if self.mode != "off" and engine is not None:
            targets = engine.clone() if self.mode == "r3" else torch.full_like(engine, -1)
            replay_anchors = self.anchors == "reference" or (single and self.anchors == "own")
            targets[anchor] = engine[anchor] if replay_anchors else -1
        source = kinds.clone()
        if not single:
            source[anchor] = 0
        return self._new(batch, routers=model_routers, targets=targets, compare=engine,
                         source=source, record=self.mode != "off")  # fmt: skip

    def ref_pass(self, batch, model_routers) -> PassRouting:
        """The reference pass: anchors replay the reference engine's routes (``r2`` / ``r3``
        unless ``anchor_routes: free``), policy samples route freely; its own routing is
        compared with the reference engine's on anchors."""
        engine = batch.token_data.get(ROUTES_KEY)
        kinds = sample_kinds(batch)
        targets = None
        if self.mode != "off" and self.anchors != "free" and engine is not None:
            targets = torch.full_like(engine, -1)
            targets[kinds == ANCHOR] = engine[kinds == ANCHOR]
        source = torch.where(kinds == ANCHOR, ANCHOR, 0).to(torch.int8)
        return self._new(batch, routers=model_routers, targets=targets, compare=engine,
                         source=source)  # fmt: skip

    def update_pass(self, minibatch, model_routers) -> PassRouting:
        """An update: replays the ``old`` pass's routes (``r2`` / ``r3``; anchors not with
        ``anchor_routes: free``); its own routing is compared with them."""
        old = minibatch.token_data.get(OLD_ROUTES_KEY)
        kinds = sample_kinds(minibatch)
        targets = None
        if self.mode != "off" and old is not None:
            targets = old.clone()
            if self.anchors == "free":
                targets[kinds == ANCHOR] = -1
        return self._new(minibatch, routers=model_routers, targets=targets, compare=old,
                         source=kinds, training=True)  # fmt: skip

    def metrics(self, passes: list[PassRouting], load_pass: PassRouting | None, names) -> dict:
        """Agreement (``names``: the policy and anchor metric names) summed over ``passes``
        and the expert load of ``load_pass``, reduced over the world (collective)."""
        agree = torch.zeros(4, dtype=torch.float64)
        for p in passes:
            agree += p.counts()[0]
        load = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        if load_pass is not None:
            load += load_pass.counts()[1]
        flat = torch.cat([agree, load.reshape(-1)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            buf = flat.to(parallel.collective_device())
            dist.all_reduce(buf)
            flat = buf.cpu()
        out = agreement_metrics(flat[:4], names)
        if load_pass is not None:
            out.update(load_metric(flat[4:].view(self.num_layers, -1), list(self.sparse)))
        return out

    def recorded(self, routing: PassRouting) -> torch.Tensor:
        """The ``old`` pass's routes of the whole batch on every rank (collective)."""
        return reduce_recorded(routing.recorded, routing.total, (self.num_layers, self.topk))
