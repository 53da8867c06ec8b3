"""Data contracts between rollout, reward, algorithm and trainer (docs/architecture.md).

Rollout produces :class:`Sample` objects grouped into :class:`Group`; the trainer consumes a
:class:`TrainBatch`. Nothing else crosses that line. All containers are plain dataclasses of
Python lists / torch tensors so they pickle cheaply across Ray; the CPU tensors of a
:class:`TrainBatch` and of :class:`NamedTensorList` travel as numpy arrays
(:func:`tensor_to_wire`).
"""

from __future__ import annotations

import base64
import math
import warnings
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import chain

import numpy as np
import torch


class SampleSource(StrEnum):
    """Which weights generated a sample."""

    POLICY = "policy"
    REFERENCE = "reference"


@dataclass
class RoutedExperts:
    """The experts a mixture-of-experts engine routed each position of a sample to, kept
    compactly: ``[positions, layers, k]`` expert ids as ``uint8`` (up to 256 experts) or
    ``int16``, base64 text (a sample pickles cheaply and a checkpoint of a batch in flight
    keeps it as JSON). Position ``t`` is the forward pass over token ``t`` of prompt + response
    (the last token is never fed back, so ``positions = len(prompt) + len(response) - 1``);
    a dense layer of a partly sparse model holds zeros (docs/rollout.md)."""

    data: str
    """base64 of the ids' bytes (C order)."""
    dtype: str
    """``uint8`` | ``int16``."""
    shape: list[int]
    """``[positions, layers, k]``."""

    @staticmethod
    def from_array(ids: np.ndarray) -> RoutedExperts:
        """Compact ``ids`` (``[positions, layers, k]``, any integer dtype, values in
        ``[0, 32767]``): ``uint8`` when every id is below 256, else ``int16``."""
        if ids.ndim != 3:
            raise ValueError(f"routed experts: expected [positions, layers, k], got {ids.shape}")
        top = int(ids.max()) if ids.size else 0
        if ids.size and (int(ids.min()) < 0 or top > np.iinfo(np.int16).max):
            raise ValueError(f"routed experts: ids outside [0, 32767] (max {top})")
        dtype = np.uint8 if top < 256 else np.int16
        raw = np.ascontiguousarray(ids, dtype=dtype).tobytes()
        return RoutedExperts(base64.b64encode(raw).decode("ascii"), np.dtype(dtype).name,
                             [int(d) for d in ids.shape])  # fmt: skip

    def array(self) -> np.ndarray:
        """The ids as ``[positions, layers, k]`` (this object's compact dtype)."""
        raw = np.frombuffer(base64.b64decode(self.data), dtype=np.dtype(self.dtype))
        return raw.reshape(self.shape)

    @property
    def positions(self) -> int:
        return self.shape[0]


@dataclass
class Sample:
    """One response to one query.

    ``response_logprobs`` are the engine's per-token log-probs (len == len(response_ids)): the
    trainer recomputes old/ref log-probs itself (docs/algorithm.md, mixed optimization); these
    measure the mismatch between the two and are the behaviour log-probs of
    ``algo.rollout_correction`` (docs/algorithm.md, rollout correction).
    """

    query_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float] = field(default_factory=list)
    source: SampleSource = SampleSource.POLICY
    weight_version: int = 0
    finish_reason: str = "stop"  # "stop" | "length" | "abort"
    score: float = 0.0  # reward used for advantages (incl. overlong penalty)
    acc: bool = False  # correctness, used for acceptance
    response_text: str = ""
    ground_truth: str = ""
    data_source: str = ""
    scored: bool = False
    """``score`` and ``acc`` were set before the reward step: a cached anchor's reward,
    remembered from when it was drawn (``rollout/reference.py``, anchor cache); not scored again."""
    routed_experts: RoutedExperts | None = None
    """A mixture-of-experts engine's routes of every position (``None``: not asked for, or a
    dense model)."""
    response_versions: list[int] = field(default_factory=list)
    """The weight version that produced each response token, for a sample generated across
    weight pushes (a partial rollout continued under newer weights, docs/orchestration.md,
    "Bounded staleness"); empty: every token came from ``weight_version``. ``weight_version``
    is then the version of the last token."""

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    def token_versions(self) -> list[int]:
        """The weight version of each response token (``[len(response_ids)]``)."""
        if self.response_versions:
            return list(self.response_versions)
        return [self.weight_version] * len(self.response_ids)

    @property
    def oldest_version(self) -> int:
        """The version of the sample's oldest token (``weight_version`` when it has none)."""
        return min(self.response_versions, default=self.weight_version)


@dataclass
class Group:
    """The samples of one accepted query.

    ``anchor_index`` is the position of the anchor in ``samples`` (``None`` when the group
    has no anchor: ``anchor: none`` and ``anchor: filter_only``). ``advantages`` has one
    entry per sample once computed (docs/algorithm.md, advantages).
    """

    query_id: str
    samples: list[Sample]
    anchor_index: int | None = None
    advantages: list[float] = field(default_factory=list)

    @property
    def scores(self) -> list[float]:
        return [s.score for s in self.samples]

    def is_anchor(self, i: int) -> bool:
        return self.anchor_index is not None and i == self.anchor_index


def sample_from_dict(d: dict) -> Sample:
    """The :class:`Sample` of ``dataclasses.asdict`` (after a JSON round trip: a checkpoint's
    batch in flight)."""
    routes = d.get("routed_experts")
    return Sample(**{**d, "source": SampleSource(d["source"]),
                     "routed_experts": RoutedExperts(**routes) if routes else None})  # fmt: skip


def group_from_dict(d: dict) -> Group:
    """The :class:`Group` of ``dataclasses.asdict`` (after a JSON round trip)."""
    return Group(**{**d, "samples": [sample_from_dict(x) for x in d["samples"]]})


# --- tensors between processes ----------------------------------------------------------

# numpy has no bfloat16 or float8: such tensors travel as integers of the same width
_WIRE_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}


def tensor_to_wire(t: torch.Tensor) -> tuple:
    """``t`` as ``(numpy array, dtype name or None)`` for pickling.

    Pickle protocol 5 hands a numpy array's memory over as an out-of-band buffer, which Ray's
    object store moves without copying; a torch tensor pickles through ``torch.save`` of its
    storage, one archive per tensor (a call carrying 1.6 MB in 20 tensors between two Ray
    actors took about 3x as long). A tensor off the CPU is left to torch's own pickling."""
    t = t.detach()
    if t.device.type != "cpu":
        return t, None
    t = t.contiguous()
    view = _WIRE_VIEW.get(t.dtype)
    if view is None:
        return t.numpy(), None
    return t.view(view).numpy(), str(t.dtype).removeprefix("torch.")


def tensor_from_wire(array, dtype: str | None, read_only: bool = False) -> torch.Tensor:
    """The tensor of :func:`tensor_to_wire`, in memory of its own: an array still backed by
    the sender's read-only shared memory is copied first (writing to it would crash) unless
    ``read_only`` (the caller never writes it in place: the processes of a node then share
    Ray's one copy of it)."""
    if isinstance(array, torch.Tensor):
        return array
    if not array.flags.writeable:
        if not read_only:
            array = np.array(array, copy=True)
        else:
            with warnings.catch_warnings():  # torch warns that the tensor is not writable
                warnings.simplefilter("ignore", UserWarning)
                t = torch.from_numpy(array)
            return t.view(getattr(torch, dtype)) if dtype else t
    t = torch.from_numpy(array)
    return t.view(getattr(torch, dtype)) if dtype else t


def _named_tensors_from_wire(items: list) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor_from_wire(array, dtype)) for name, array, dtype in items]


class NamedTensorList(list):
    """``[(name, tensor)]`` (exported weights) whose CPU tensors pickle as numpy arrays
    (:func:`tensor_to_wire`); it unpickles as a plain list of ``(name, tensor)``."""

    def __reduce__(self):
        return _named_tensors_from_wire, ([(n, *tensor_to_wire(t)) for n, t in self],)


class PerTokenData:
    """Mixin: the per-token training data ``token_data`` (name -> ``[T]`` tensor, aligned with
    the tokens) also read and written as attributes (``batch.old_logprobs``).

    :func:`pack_groups` decides the names; the trainer moves the
    mapping as one (``trainer/batching.py`` slices every entry alike) and the loss takes the
    entries as keyword arguments (``algo.losses.compute_policy_loss``). A new per-token loss
    input is one more entry in :func:`pack_groups` plus the loss argument that reads it.
    """

    token_data: dict[str, torch.Tensor]

    def __getattr__(self, name: str):
        data = self.__dict__.get("token_data")
        if data is not None and name in data:
            return data[name]
        raise AttributeError(f"{type(self).__name__!r} has no attribute or token data {name!r}")

    def __setattr__(self, name: str, value) -> None:
        data = self.__dict__.get("token_data")
        if data is not None and name in data:
            data[name] = value
        else:
            super().__setattr__(name, value)


@dataclass
class TrainBatch(PerTokenData):
    """A packed mini-batch of samples for the trainer.

    Sequences are packed back to back along one dimension of ``total`` tokens
    (prompt + response for every sample). Per-token tensors are aligned with ``tokens``:
    entry ``t`` describes the prediction of ``tokens[t]`` from the prefix before it, so the
    first token of every sequence has ``loss_mask == 0``.

    - ``tokens`` ``[total]`` int64, ``position_ids`` ``[total]`` int64 (restart per sample)
    - ``cu_seqlens`` ``[n + 1]`` int32 sample boundaries (offsets into ``tokens``)
    - ``sample_index`` ``[total]`` int64 (which sample each token belongs to)
    - ``token_data``: the per-token loss inputs ``[total]`` (made by :func:`pack_groups`):
      ``loss_mask`` float (1 on response tokens), ``advantages`` float (the sample's
      advantage on its response tokens), ``old_logprobs`` / ``ref_logprobs`` float (0 where
      unused / not yet computed), ``is_anchor`` bool (response tokens of anchor samples),
      ``engine_logprobs`` float (the engine's log-prob of each response token, NaN for a sample
      that came without them, 0 off the responses); for a mixture-of-experts policy also
      ``routed_experts`` (:data:`ROUTES_KEY`): ``[total, layers, k]`` routes, not loss inputs
      (:data:`ROUTE_KEYS`)
    - ``origin``: for a batch made by :meth:`select`, the ids of its samples in the batch the
      first :meth:`select` was made from (the trainer finds the routes its ``old`` pass
      recorded by them, ``trainer/routing_replay.py``; not pickled)
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    sample_index: torch.Tensor
    token_data: dict[str, torch.Tensor]
    origin: list[int] | None = None

    @property
    def num_samples(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def seq_lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def __reduce__(self):
        """Pickled with its tensors as numpy arrays (:func:`tensor_to_wire`): a step's batch
        goes to every trainer rank through Ray's object store."""
        fields = (self.tokens, self.position_ids, self.cu_seqlens, self.sample_index)
        data = {key: tensor_to_wire(value) for key, value in self.token_data.items()}
        return _train_batch_from_wire, ([tensor_to_wire(t) for t in fields], data)

    def select(self, sample_ids: list[int]) -> TrainBatch:
        """A new packed batch holding only ``sample_ids`` (in that order)."""
        bounds = self.cu_seqlens.tolist()
        pieces = [torch.arange(bounds[i], bounds[i + 1]) for i in sample_ids]
        index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
        lengths = torch.tensor([bounds[i + 1] - bounds[i] for i in sample_ids], dtype=torch.int32)
        cu = torch.zeros(len(sample_ids) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        new_sample_index = torch.repeat_interleave(torch.arange(len(sample_ids)), lengths.long())
        origin = (
            [self.origin[i] for i in sample_ids] if self.origin is not None else list(sample_ids)
        )
        return TrainBatch(
            tokens=self.tokens[index],
            position_ids=self.position_ids[index],
            cu_seqlens=cu,
            sample_index=new_sample_index,
            token_data={key: value[index] for key, value in self.token_data.items()},
            origin=origin,
        )


def _train_batch_from_wire(fields: list, data: dict) -> TrainBatch:
    """The routes (:data:`ROUTE_KEYS`, the largest entries of a MoE batch, only ever read:
    indexed into copies) stay in the sender's shared memory: one copy per node, not per rank."""
    tokens, position_ids, cu_seqlens, sample_index = (tensor_from_wire(*f) for f in fields)
    token_data = {
        key: tensor_from_wire(*value, read_only=key in ROUTE_KEYS) for key, value in data.items()
    }
    return TrainBatch(tokens, position_ids, cu_seqlens, sample_index, token_data)


def engine_logprobs(samples: list[Sample], spans: torch.Tensor) -> torch.Tensor:
    """``[total]`` float32: each response token's engine log-prob (``Sample.response_logprobs``),
    NaN for the tokens of a sample whose log-probs are missing or of another length, 0 on
    prompts; ``spans`` ``[n, 2]`` holds each sample's (prompt, response) lengths."""
    values: list[float] = []
    for sample, (prompt, response) in zip(samples, spans.tolist(), strict=True):
        lps = sample.response_logprobs
        values += [0.0] * prompt
        values += lps if len(lps) == response else [math.nan] * response
    return torch.tensor(values, dtype=torch.float32)


ROUTES_KEY = "routed_experts"
"""``token_data`` entry (when a sample came with routes): ``[total, layers, k]``, the experts
the engine that drew each sample routed each token through, ``uint8`` when every id is below
255 (:data:`NO_ROUTE_U8` where none), else ``int16`` (``-1`` where none); none: the last token
of a sample, a sample without routes. :func:`route_ids` reads either; docs/trainer.md,
"Routing replay"."""
ROUTE_KEYS = (ROUTES_KEY,)
"""The ``token_data`` entries that are routes, not loss inputs."""
NO_ROUTE_U8 = 255
"""The "no route" id of ``uint8`` routes (``int16`` ones use ``-1``)."""


def route_ids(routes: torch.Tensor) -> torch.Tensor:
    """``routes`` (:data:`ROUTES_KEY` rows, ``uint8`` or ``int16``) as ``int32`` with ``-1``
    where none."""
    out = routes.int()
    if routes.dtype == torch.uint8:
        out[routes == NO_ROUTE_U8] = -1
    return out


def has_route(routes: torch.Tensor) -> torch.Tensor:
    """``[rows]`` bool: the rows of ``routes`` (``[rows, layers, k]``) that hold a route."""
    first = routes[:, 0, 0]
    return first != NO_ROUTE_U8 if routes.dtype == torch.uint8 else first >= 0


def routed_experts(samples: list[Sample], spans: torch.Tensor) -> torch.Tensor | None:
    """``[total, layers, k]`` routes of the packed ``samples`` (:data:`ROUTES_KEY`: ``uint8``
    when every id is below 255, else ``int16``), or ``None`` when no sample has routes. A
    sample's routes cover its positions but the last (``Sample.routed_experts``); a sample
    without routes, or whose routes do not cover prompt + response - 1 positions of the first
    routed sample's ``[layers, k]``, gets none."""
    shape = next((s.routed_experts.shape[1:] for s in samples if s.routed_experts), None)
    if shape is None:
        return None
    arrays = []
    for sample, length in zip(samples, spans.sum(1).tolist(), strict=True):
        routes = sample.routed_experts
        fits = routes is not None and list(routes.shape) == [length - 1, *shape]
        arrays.append(routes.array() if fits else None)
    top = max((int(a.max()) for a in arrays if a is not None and a.size), default=0)
    narrow = top < NO_ROUTE_U8
    dtype, none = (np.uint8, NO_ROUTE_U8) if narrow else (np.int16, -1)
    out = np.full((int(spans.sum()), *shape), none, dtype=dtype)
    start = 0
    for ids, length in zip(arrays, spans.sum(1).tolist(), strict=True):
        if ids is not None:
            out[start : start + length - 1] = ids
        start += length
    return torch.from_numpy(out)


def pack_groups(groups: list[Group]) -> TrainBatch:
    """Pack every sample of ``groups`` into one :class:`TrainBatch` (advantages must be set).

    Per token: the sample's prompt then response ids, positions from 0 in each sample,
    ``loss_mask`` 1 on response tokens, the sample's advantage times the mask, ``is_anchor``
    on the anchor's response tokens, the engine's log-probs (:func:`engine_logprobs`), zeros
    for the log-probs the trainer fills in; the engines' routes when samples have them
    (:func:`routed_experts`)."""
    samples, advantages, anchors, lengths = [], [], [], []
    for group in groups:
        if len(group.advantages) != len(group.samples):
            raise ValueError(
                f"group {group.query_id!r} has {len(group.samples)} samples but "
                f"{len(group.advantages)} advantages; compute advantages before packing"
            )
        for i, sample in enumerate(group.samples):
            samples.append(sample)
            advantages.append(group.advantages[i])
            anchors.append(group.is_anchor(i))
            lengths += (len(sample.prompt_ids), len(sample.response_ids))
    n = len(samples)
    spans = torch.tensor(lengths, dtype=torch.long).view(n, 2)  # [sample, (prompt, response)]
    per_sample = spans.sum(1)
    total = int(per_sample.sum())
    tokens = torch.tensor(
        list(chain.from_iterable(chain(s.prompt_ids, s.response_ids) for s in samples)),
        dtype=torch.long,
    )
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(per_sample, 0)
    sample_index = torch.repeat_interleave(torch.arange(n), per_sample)
    position_ids = torch.arange(total) - cu[:-1].long()[sample_index]
    # 0 on each prompt's tokens, 1 on each response's
    loss_mask = torch.repeat_interleave(torch.tensor([0.0, 1.0]).repeat(n), spans.flatten())
    token_data = {
        "loss_mask": loss_mask,
        "advantages": torch.tensor(advantages, dtype=torch.float32)[sample_index] * loss_mask,
        "old_logprobs": torch.zeros(total),
        "ref_logprobs": torch.zeros(total),
        "is_anchor": torch.tensor(anchors, dtype=torch.bool)[sample_index] & (loss_mask > 0),
        "engine_logprobs": engine_logprobs(samples, spans),
    }
    routes = routed_experts(samples, spans)
    if routes is not None:
        token_data[ROUTES_KEY] = routes
    return TrainBatch(
        tokens=tokens,
        position_ids=position_ids,
        cu_seqlens=cu,
        sample_index=sample_index,
        token_data=token_data,
    )
