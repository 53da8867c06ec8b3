"""Routing replay of a mixture-of-experts policy (``trainer.moe.routing_replay``, docs/trainer.md
"Routing replay", docs/algorithm.md "Mixture-of-experts policies").

Each MoE router of the model gets a :class:`RouteReplay`: megatron-core's ``RouterReplay``
(``transformer/moe/router_replay.py``, switched on by ``TransformerConfig.moe_enable_routing_replay``;
the router calls it for its top-k), driven per model instance rather than through its
class-wide lists (the concurrent reference model's routers run on another thread). What a
pass over a batch does is its :class:`PassSpec` (frozen), and :class:`PassRouting` runs it:
each micro-batch's routes (:class:`MicroBatchRoutes`), the counts (:class:`Agreement`, the
expert load) and the recorded routes. A spec holds:

- ``targets``: the experts each token-layer must use (``-1``: the router's own top-k), read
  per micro-batch (its rows only reach the routers' device). The replayed experts' gate values
  are the router's scores at those experts (``scores.gather``), so the gradient reaches the
  router as with its own choice;
- ``compare`` and ``source``: routes the router's own top-k is compared with (the engine's, or
  the ``old`` pass's), counted per source of the sample (policy sample, anchor): the routing
  agreement;
- ``record``: keep the experts every token-layer used (the ``old`` pass, for the updates);
- ``training`` and ``recompute``: an update, whose layers may run again in the backward.

Every pass also counts the expert load: tokens per expert per layer.

Memory. The engines' routes of the batch stay on the host (``uint8`` up to 255 experts,
``types.routed_experts``). The ``old`` pass records each micro-batch's routes on the routers'
device (:func:`route_dtype`), copies them to the host after the micro-batch's forward
(non-blocking; one synchronisation after the pass) and keeps only the rows of the samples the
rank ran (its data-parallel shard, :class:`RecordedRoutes`, which the trainer keeps for the
step's updates). An update finds the rows of its own shard of the mini-batch by sample id and
fetches them from the ranks that recorded them (:func:`update_routes`: one all-to-all over the
data-parallel group, sized by the shards every rank computes alike).
Memory and traffic therefore scale with a rank's own tokens, never with the batch's
(docs/trainer.md, "Routing replay").

Token order. A router sees its stage's hidden states ``[s, b, h]`` flattened, ``s``-major
(split over the tensor-parallel ranks along ``s`` with sequence parallelism): in the padded
layout ``[L, n]``, in the packed one ``[T, 1]``. :func:`router_positions` maps each of those
rows to its token in the packed batch (``-1`` for padding); expert parallelism dispatches
tokens after the router, so it does not change this order; each pipeline stage replays the
layers it holds (``layer_number``).

Recompute: with ``trainer.recompute`` the layers run their forward again during the backward.
Such a training pass keeps each micro-batch's final experts per router
(``replay_backward_list``); after a micro-batch's forward the routers switch to
``REPLAY_BACKWARD`` and each recomputation takes the oldest entry (micro-batches are
recomputed in the order they ran forward, with or without pipelining). Without it nothing is
kept: no router runs again before the pass ends.

No router call reads a value back from its device: the load and the agreement are counted
with device ops of fixed shapes (``index_add_``, sums), so a pass synchronises with the device
once, when the recorded routes are read (:meth:`PassRouting.held`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_armor.trainer import parallel
from megatron_armor.trainer.batching import shard_samples
from megatron_armor.types import ROUTES_KEY, route_ids

POLICY, ANCHOR = 1, 2
"""Sample sources of :attr:`PassSpec.source` (0: not counted)."""


class RouteReplay(RouterReplay):
    """One router's replay (module docstring): megatron-core's ``RouterReplay`` whose top-k
    follows the :class:`PassRouting` of the running pass (``None`` between passes: the
    router's own top-k). A pass sets it for its routers at each micro-batch
    (:meth:`PassRouting.begin`) and clears it at its end."""

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
        target = routing.target(self.layer, scores.device)
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
        if routing.spec.recompute:  # the backward runs this forward again: it replays these
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


def route_dtype(num_experts: int) -> torch.dtype:
    """The dtype the ``old`` pass's routes are kept in: ``uint8`` up to 256 experts, else
    ``int16`` (every kept row is a real route: no "none" id is needed)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class BatchRoutes:
    """Routes of every token of a batch (the engines', :data:`ROUTES_KEY`, ``uint8`` or
    ``int16``) and ``use`` (``[total]`` bool, ``None``: all): the tokens whose routes count."""

    routes: torch.Tensor
    use: torch.Tensor | None = None

    def rows(self, pos: torch.Tensor) -> torch.Tensor:
        """``[len(pos), layers, k]`` int16 routes of batch positions ``pos`` (``-1``: none,
        padding, not used)."""
        at = pos.clamp(min=0)
        out = route_ids(self.routes[at]).to(torch.int16)
        drop = pos < 0 if self.use is None else (pos < 0) | ~self.use[at]
        out[drop] = -1
        return out


@dataclass
class HeldRoutes:
    """The ``old`` pass's routes of some samples of a batch, on the host of the rank that
    holds them: the rows of their tokens back to back (samples in ``samples`` order), one
    column per layer this rank's routers route (``layers``)."""

    samples: list[int]
    lengths: list[int]
    layers: list[int]
    """0-based global layer of each column."""
    rows: torch.Tensor
    """``[sum(lengths), len(layers), k]`` :func:`route_dtype`."""

    def offsets(self) -> dict[int, int]:
        """First row of each held sample."""
        starts = itertools.accumulate(self.lengths, initial=0)
        return dict(zip(self.samples, starts, strict=False))

    def of_samples(self, ids: list[int]) -> torch.Tensor:
        """The rows of held samples ``ids`` back to back."""
        at = self.offsets()
        n = dict(zip(self.samples, self.lengths, strict=True))
        parts = [self.rows[at[i] : at[i] + n[i]] for i in ids]
        return torch.cat(parts) if parts else self.rows[:0]

    def row_index(self, pos: torch.Tensor, batch) -> torch.Tensor:
        """``[len(pos)]`` long: the row of each position of ``batch`` (``-1``: padding, a
        sample not held)."""
        start = torch.full((batch.num_samples,), -1, dtype=torch.long)
        for sample, first in self.offsets().items():
            start[sample] = first
        at = pos.clamp(min=0)
        sample = batch.sample_index[at]
        row = start[sample] + at - batch.cu_seqlens[sample].long()
        return torch.where((pos >= 0) & (start[sample] >= 0), row, -1)


@dataclass
class HeldRows:
    """:class:`HeldRoutes` read at positions of the ``batch`` they belong to (``use`` as in
    :class:`BatchRoutes`)."""

    held: HeldRoutes
    batch: object
    num_layers: int
    use: torch.Tensor | None = None

    def rows(self, pos: torch.Tensor) -> torch.Tensor:
        """``[len(pos), layers, k]`` int16 routes of ``batch`` positions ``pos`` (``-1``:
        padding, a sample or layer not held, not used)."""
        index = self.held.row_index(pos, self.batch)
        if self.use is not None:
            index[~self.use[pos.clamp(min=0)]] = -1
        k = self.held.rows.shape[-1]
        out = torch.full((len(pos), self.num_layers, k), -1, dtype=torch.int16)
        found = index >= 0
        got = self.held.rows[index[found]].to(torch.int16)
        layers = torch.tensor(self.held.layers, dtype=torch.long)
        out[found.nonzero().view(-1, 1), layers] = got
        return out


@dataclass
class RecordedRoutes:
    """The ``old`` pass's routes of a step's batch, kept by the trainer for the step's
    updates and found by sample id (a sample's index in that batch): this rank holds those of
    the samples it ran (``held``: its data-parallel shard, ``batching.shard_samples``);
    ``owner``: the data-parallel rank that holds each sample's. An update fetches its own with
    :func:`update_routes`."""

    held: HeldRoutes
    owner: list[int]


@dataclass(frozen=True, eq=False)
class PassSpec:
    """What one pass over a batch does with its routes (module docstring): the experts each
    token-layer must use (``targets``, ``-1``: the router's own top-k), the routes its own
    top-k is compared with (``compare``) and the source of each token (``source``, ``[total]``
    int8: :data:`POLICY`, :data:`ANCHOR` or 0, not compared), whether its routes are recorded
    (``record``: the ``old`` pass), and whether it trains (``training``) with the layers run
    again in the backward (``recompute``: ``trainer.recompute``, which replays what the forward
    chose)."""

    num_layers: int
    num_experts: int
    targets: BatchRoutes | HeldRows | None = None
    compare: BatchRoutes | HeldRows | None = None
    source: torch.Tensor | None = None
    record: bool = False
    training: bool = False
    recompute: bool = False
    sp: tuple[int, int] = (0, 1)
    """(rank, size) of the sequence-parallel split of the routers' rows."""


class OnDevice:
    """A host tensor, moved to the routers' device once, when first asked for there."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.device: torch.device | None = None
        self.moved: torch.Tensor | None = None

    def on(self, device) -> torch.Tensor:
        if self.moved is None or self.device != device:
            self.moved, self.device = self.host.to(device), device
        return self.moved


@dataclass
class MicroBatchRoutes:
    """One micro-batch's rows as its routers see them (``router_positions``): their batch
    positions (``-1``: padding), the experts to replay, the routes compared with and their
    sources (each moved to the routers' device once); which layers replay anything
    (``replays``); and, while recorded, the routes its routers chose (``recording``,
    ``[rows, routed layers, k]`` on their device)."""

    pos: OnDevice
    target: OnDevice | None
    compare: OnDevice | None
    source: OnDevice | None
    replays: list[bool]
    recording: torch.Tensor | None = None

    @classmethod
    def of(cls, spec: PassSpec, mb) -> MicroBatchRoutes:
        pos = router_positions(mb, *spec.sp)
        target = compare = source = None
        replays = [False] * spec.num_layers
        if spec.targets is not None:
            rows = spec.targets.rows(pos)
            target, replays = OnDevice(rows), (rows[:, :, 0] >= 0).any(0).tolist()
        if spec.compare is not None:
            compare = OnDevice(spec.compare.rows(pos))
            source = OnDevice(spec.source[pos.clamp(min=0)] * (pos >= 0))
        return cls(OnDevice(pos), target, compare, source, replays)


@dataclass
class Agreement:
    """Token-layers whose router's own top-k is the compared route (``*_agreeing``) of those
    compared (``*_compared``), per sample source; counted on the routers' device."""

    policy_agreeing: torch.Tensor
    policy_compared: torch.Tensor
    anchor_agreeing: torch.Tensor
    anchor_compared: torch.Tensor

    @classmethod
    def zeros(cls, device=None) -> Agreement:
        return cls(*(torch.zeros((), dtype=torch.long, device=device) for _ in range(4)))

    def add(self, same: torch.Tensor, src: torch.Tensor) -> None:
        """Count ``same`` (``[rows]`` bool: agreeing) by source ``src`` (``[rows]``)."""
        for kind, agreeing, compared in (
            (POLICY, self.policy_agreeing, self.policy_compared),
            (ANCHOR, self.anchor_agreeing, self.anchor_compared),
        ):
            mask = src == kind
            agreeing += (same & mask).sum()
            compared += mask.sum()

    def vector(self) -> torch.Tensor:
        """``[4]`` float64 on the host: the counts in field order (for one collective)."""
        counts = (self.policy_agreeing, self.policy_compared, self.anchor_agreeing,
                  self.anchor_compared)  # fmt: skip
        return torch.stack(counts).double().cpu()


AGREEMENT_SIZE = 4
"""The counts of :meth:`Agreement.vector`."""


@dataclass
class RecordedMicroBatch:
    """A recorded micro-batch on the host: its routers' positions and the routes they chose
    (``[rows, routed layers, k]`` :func:`route_dtype`)."""

    pos: torch.Tensor
    routes: torch.Tensor


class PassRouting:
    """The routing of one pass over a batch (module docstring), as it runs: its
    :class:`PassSpec`, the routers of the model it runs on, the running micro-batch's routes,
    what it counts (the agreement, the expert load) and what it recorded. What the routers
    count and record stays on their device, with no host synchronisation per router call; a
    micro-batch's recorded routes go to the host after its forward (one non-blocking copy)
    and are read after the pass (:meth:`held`)."""

    def __init__(self, spec: PassSpec, routers: list[RouteReplay]) -> None:
        self.spec, self.routers = spec, routers
        self.micro: MicroBatchRoutes | None = None
        self.load: torch.Tensor | None = None
        """``[layers, experts]`` int64 tokens routed to each expert."""
        self.agreement: Agreement | None = None
        self.recorded: list[RecordedMicroBatch] = []

    def routed_layers(self) -> list[int]:
        """The layers this rank's routers route (the columns of the recorded routes)."""
        return sorted({r.layer for r in self.routers})

    def begin(self, mb) -> None:
        """Before micro-batch ``mb``'s forward: its rows' routes, the routers on this pass."""
        self.micro = MicroBatchRoutes.of(self.spec, mb)
        for r in self.routers:
            r.routing = self
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def forward_done(self) -> None:
        """After a micro-batch's forward: its recorded routes to the host (non-blocking);
        a recomputation in its backward replays what the forward chose (module docstring)."""
        micro = self.micro
        if micro is not None and micro.recording is not None:
            chosen = micro.recording
            host = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=chosen.is_cuda)
            host.copy_(chosen, non_blocking=True)
            self.recorded.append(RecordedMicroBatch(micro.pos.host, host))
            micro.recording = None
        for r in self.routers:
            r.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def target(self, layer: int, device) -> torch.Tensor | None:
        """``[rows, k]`` experts to replay at ``layer`` (``-1`` rows: own top-k), ``None``
        when nothing is replayed there."""
        micro = self.micro
        if micro.target is None or not micro.replays[layer]:
            return None
        return micro.target.on(device)[:, layer].long()

    def observe(self, layer: int, free: torch.Tensor, chosen: torch.Tensor) -> None:
        """Count the load, the agreement and keep the route of one router call, on the
        routers' device (no value read back)."""
        dev, micro, spec = chosen.device, self.micro, self.spec
        pos = micro.pos.on(dev)
        if self.load is None:
            self.load = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.long, device=dev)
            self.agreement = Agreement.zeros(dev)
        real = (pos >= 0).unsqueeze(1).expand_as(chosen)
        self.load[layer].index_add_(0, chosen.reshape(-1), real.reshape(-1).long())
        if micro.compare is not None:
            want = micro.compare.on(dev)[:, layer].long()
            src = micro.source.on(dev).long() * (want[:, 0] >= 0)
            self.agreement.add((free.sort(1).values == want.sort(1).values).all(1), src)
        if spec.record:
            columns = self.routed_layers()
            if micro.recording is None:
                shape = (len(pos), len(columns), chosen.shape[1])
                micro.recording = torch.zeros(shape, dtype=route_dtype(spec.num_experts),
                                              device=dev)  # fmt: skip
            micro.recording[:, columns.index(layer)] = chosen.to(micro.recording.dtype)

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(agreement [4], load [layers, experts])`` float64 on the host (zeros when no
        router of this rank ran; :meth:`Agreement.vector`)."""
        spec = self.spec
        if self.load is None:
            zeros = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.float64)
            return torch.zeros(AGREEMENT_SIZE, dtype=torch.float64), zeros
        return self.agreement.vector(), self.load.double().cpu()

    def held(self, batch, samples: list[int], topk: int) -> HeldRoutes:
        """The recorded routes of ``samples`` of ``batch`` (this rank's shard: the samples it
        ran; other rows of its micro-batches, a stand-in's, are left out), after the pass:
        one synchronisation with the device for the pass's copies. With sequence parallelism
        each tensor-parallel rank routed a part of each micro-batch's rows: one sum over the
        tensor-parallel group completes them (each row is zero on all ranks but one)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        all_lengths = batch.seq_lengths()
        lengths = [all_lengths[i] for i in samples]
        out = HeldRoutes(list(samples), lengths, self.routed_layers(), torch.empty(0))
        shape = (sum(lengths), len(out.layers), topk)
        rows = torch.zeros(shape, dtype=route_dtype(self.spec.num_experts))
        for recorded in self.recorded:
            index = out.row_index(recorded.pos, batch)
            keep = index >= 0
            rows[index[keep]] = recorded.routes[keep]
        if self.spec.sp[1] > 1:
            sum_in_chunks(rows, parallel.tp_group())
        out.rows = rows
        self.recorded = []
        return out

    def end(self) -> None:
        """After the pass: the routers back to their own top-k, their lists emptied."""
        self.micro = None
        for r in self.routers:
            r.routing = None
            r.clear_indices()
            r.clear_router_replay_action()


COLLECTIVE_CHUNK_BYTES = 64 * 2**20
"""The most of the rank's recorded routes on its device at once (:func:`sum_in_chunks`)."""


def sum_in_chunks(rows: torch.Tensor, group) -> None:
    """Sum host ``rows`` over ``group`` in place, a chunk of at most
    :data:`COLLECTIVE_CHUNK_BYTES` on the collective device at a time (every rank of the
    group holds rows of the same shape)."""
    per_row = max(1, rows[:1].numel() * rows.element_size())
    for chunk in rows.split(max(1, COLLECTIVE_CHUNK_BYTES // per_row)):
        buf = chunk.to(parallel.collective_device())
        dist.all_reduce(buf, group=group)
        chunk.copy_(buf.cpu())


def exchange_plan(
    owner: list[int], origin: list[int], lengths: list[int], dp_size: int, dp_rank: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Which samples of a mini-batch this rank sends to and receives from each rank: the
    mini-batch's sample ``j`` (``origin[j]`` in the recorded batch, whose routes rank
    ``owner[origin[j]]`` holds) goes to the rank the update's shard gives it
    (``shard_samples`` of the mini-batch's ``lengths``). Every rank computes every rank's
    part alike. Returns ``(send[dst], receive[src])`` as mini-batch sample ids, ascending."""
    shards = shard_samples(lengths, dp_size)
    send = [[j for j in shards[dst] if owner[origin[j]] == dp_rank] for dst in range(dp_size)]
    receive = [[j for j in shards[dp_rank] if owner[origin[j]] == src] for src in range(dp_size)]
    return send, receive


def update_routes(recorded: RecordedRoutes | None, minibatch, dp_rank: int, dp_size: int,
                  group=None) -> HeldRoutes | None:  # fmt: skip
    """The routes ``recorded`` by the ``old`` pass for this rank's shard of ``minibatch`` (a
    batch selected from the recorded one: its samples' ids there are ``TrainBatch.origin``,
    itself when it has none), fetched from the ranks that hold them: one all-to-all over the
    data-parallel group of just those rows (:func:`exchange_plan`), each row crossing at most
    once; ``None`` when nothing was recorded."""
    if recorded is None:
        return None
    old = recorded
    origin = (
        minibatch.origin if minibatch.origin is not None else list(range(minibatch.num_samples))
    )
    lengths = minibatch.seq_lengths()
    send, receive = exchange_plan(old.owner, origin, lengths, dp_size, dp_rank)
    out_parts = [old.held.of_samples([origin[j] for j in ids]) for ids in send]
    got_parts = _all_to_all(out_parts, [[lengths[j] for j in ids] for ids in receive],
                            old.held.rows, group)  # fmt: skip
    mine = sorted(j for ids in receive for j in ids)
    by_sample = {}
    for ids, part in zip(receive, got_parts, strict=True):
        for j, rows in zip(ids, part.split([lengths[j] for j in ids]), strict=True):
            by_sample[j] = rows
    rows = torch.cat([by_sample[j] for j in mine]) if mine else old.held.rows[:0]
    return HeldRoutes(mine, [lengths[j] for j in mine], old.held.layers, rows)


def _all_to_all(parts: list[torch.Tensor], sizes: list[list[int]], like: torch.Tensor, group):
    """``parts[dst]`` to each rank; the parts each rank sends here (``sizes[src]`` rows each)."""
    if len(parts) == 1:
        return parts
    dev = parallel.collective_device()
    recv = [sum(s) for s in sizes]
    out = torch.empty((sum(recv), *like.shape[1:]), dtype=like.dtype, device=dev)
    dist.all_to_all_single(out, torch.cat(parts).to(dev), recv, [len(p) for p in parts],
                           group=group)  # fmt: skip
    return list(out.cpu().split(recv))


def agreement_metrics(agreement: Agreement, names: tuple[str | None, str | None]) -> dict:
    """``{name: agreeing / compared}`` per source, ``names``: the policy's and the anchors'
    metric names (left out without compared token-layers, or without a name)."""
    counted = ((names[0], agreement.policy_agreeing, agreement.policy_compared),
               (names[1], agreement.anchor_agreeing, agreement.anchor_compared))  # fmt: skip
    return {name: float(agreeing / compared) for name, agreeing, compared in counted
            if name is not None and float(compared) > 0}  # fmt: skip


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
    recompute: bool = False
    """``trainer.recompute``: an update's layers run their forward again in the backward."""

    def _new(self, model_routers, **kw) -> PassRouting:
        spec = PassSpec(self.num_layers, self.num_experts, sp=self.sp, **kw)
        return PassRouting(spec, model_routers)

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
            replay_anchors = self.anchors == "reference" or (single and self.anchors == "own")
            use = anchor if replay_anchors else torch.zeros_like(anchor)
            if self.mode == "r3":
                use = use | ~anchor
            targets = BatchRoutes(engine, use) if bool(use.any()) else None
        source = kinds.clone()
        if not single:
            source[anchor] = 0
        compare = None if engine is None else BatchRoutes(engine)
        return self._new(model_routers, targets=targets, compare=compare, source=source,
                         record=self.mode != "off")  # fmt: skip

    def ref_pass(self, batch, model_routers) -> PassRouting:
        """The reference pass: anchors replay the reference engine's routes (``r2`` / ``r3``
        unless ``anchor_routes: free``), policy samples route freely; its own routing is
        compared with the reference engine's on anchors."""
        engine = batch.token_data.get(ROUTES_KEY)
        kinds = sample_kinds(batch)
        targets = None
        if self.mode != "off" and self.anchors != "free" and engine is not None:
            targets = BatchRoutes(engine, kinds == ANCHOR)
        source = torch.where(kinds == ANCHOR, ANCHOR, 0).to(torch.int8)
        compare = None if engine is None else BatchRoutes(engine)
        return self._new(model_routers, targets=targets, compare=compare, source=source)

    def update_pass(self, minibatch, model_routers, held: HeldRoutes | None) -> PassRouting:
        """An update: replays the ``old`` pass's routes of this rank's shard (``held``, from
        :func:`update_routes`; ``r2`` / ``r3``; anchors not with ``anchor_routes: free``);
        its own routing is compared with them."""
        kinds = sample_kinds(minibatch)
        targets = compare = None
        if self.mode != "off" and held is not None:
            use = kinds != ANCHOR if self.anchors == "free" else None
            targets = HeldRows(held, minibatch, self.num_layers, use)
            compare = HeldRows(held, minibatch, self.num_layers)
        return self._new(model_routers, targets=targets, compare=compare, source=kinds,
                         training=True, recompute=self.recompute)  # fmt: skip

    def metrics(self, passes: list[PassRouting], load_pass: PassRouting | None, names) -> dict:
        """Agreement (``names``: the policy and anchor metric names) summed over ``passes``
        and the expert load of ``load_pass``, reduced over the world (collective)."""
        agree = torch.zeros(AGREEMENT_SIZE, dtype=torch.float64)
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
        out = agreement_metrics(Agreement(*flat[:AGREEMENT_SIZE]), names)
        if load_pass is not None:
            load = flat[AGREEMENT_SIZE:].view(self.num_layers, -1)
            out.update(load_metric(load, list(self.sparse)))
        return out

    def recorded(self, routing: PassRouting, batch, dp_rank: int, dp_size: int
                 ) -> RecordedRoutes:  # fmt: skip
        """The ``old`` pass's routes of this rank's data-parallel shard of ``batch`` (the
        samples it ran), and which rank holds each sample's."""
        shards = shard_samples(batch.seq_lengths(), dp_size)
        owner = [0] * batch.num_samples
        for rank, ids in enumerate(shards):
            for i in ids:
                owner[i] = rank
        return RecordedRoutes(routing.held(batch, shards[dp_rank], self.topk), owner)
