"""The embedded ``torch`` rollout engine: batched KV-cache sampling over an HF-format model.

The CPU default (quick start, tests) and usable on one GPU. It loads an HF directory with
``transformers`` (offline), samples with its own loop over the model's KV cache
(``DynamicCache``), and records per-token log-probs of the temperature-scaled distribution
(see :mod:`megatron_armor.rollout.sampling`), so they equal a teacher-forced forward.

Batching: the ``len(prompts) * n`` rows are decoded in chunks of ``max_batch`` rows. In a
chunk each distinct prompt is prefilled once (left-padded, ``attention_mask`` zero on pads,
``position_ids = cumsum(mask) - 1``) and its KV cache is repeated for its ``n`` rows; rows
that hit a stop token leave the batch. The KV cache of each layer is a buffer grown
``kv_block`` tokens at a time (:class:`BufferedKVLayer`): a decode step writes one token's
keys and values into it, where ``DynamicCache`` concatenates the whole cache again (at the
tiny config's shape that copy was ~13% of generation time). The attention mask is one
buffer per chunk (prompt mask, then ones), passed as a view. Decode steps of Qwen2 and
Llama models skip the HF module machinery (:mod:`megatron_armor.rollout.decode_step`: the
same operations on the same parameters; prefill keeps the HF forward). Seeds: one ``torch.Generator``
per call, so the same seed, prompts, ``n`` and ``max_batch`` give the same samples on the
same device.

Weight sets: ``policy`` is the loaded model; ``ref`` is a second model created on the first
``update_weights(..., weights="ref")`` (a copy of the policy, then overwritten).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from megatron_armor.config.model_overrides import resolve_model_overrides
from megatron_armor.heartbeat import beat
from megatron_armor.rollout.decode_step import DecodeStep, decode_step_for
from megatron_armor.rollout.protocol import (
    GenerationOutput,
    PartialRequest,
    RolloutEngine,
    SamplingParams,
    window_finish_reason,
    window_limits,
)
from megatron_armor.rollout.sampling import sample_next_tokens, scaled_log_probs
from megatron_armor.types import RoutedExperts

WEIGHT_SETS = ("policy", "ref")


@dataclass
class _Chunk:
    """Decode state of one chunk: ``B`` rows, prompts left-padded to a common length.

    ``rows``: ``[B]`` index of each live row in the chunk; ``mask``: ``[B, L + max_new]``, the
    prompt's mask then ones (generated tokens are never padding), of which the first
    ``width`` columns cover the tokens fed so far; ``positions``: ``[B]`` position id of the
    next input token.
    """

    rows: torch.Tensor
    mask: torch.Tensor
    width: int
    positions: torch.Tensor
    cache: DynamicCache


class BufferedKVLayer(DynamicLayer):
    """One attention layer's KV cache in a buffer that grows ``block`` tokens at a time.

    The ``DynamicLayer`` contract (``keys``/``values`` ``[B, H, T, D]`` of the ``T`` cached
    tokens, ``update`` returns them with the new ones appended) without its concatenation per
    call: ``update`` copies the new tokens into free room and ``keys``/``values`` are views of
    the filled part. When an update does not fit, the buffer is copied once into one with room
    for ``block`` tokens more, at most up to ``limit`` (the longest sequence the chunk can
    reach) unless the input itself is longer. Row selection (finished rows leaving, prompts
    repeated for their samples), repetition, cropping, reset and offloading act on the buffers.
    """

    def __init__(self, limit: int, block: int) -> None:
        super().__init__()
        self.limit, self.block, self.length = limit, block, 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states=None, *args, **kwargs):
        values = key_states if value_states is None else value_states
        self.device, self.dtype, self.is_initialized = key_states.device, key_states.dtype, True
        self._k = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[-1]))
        self._v = values.new_empty((*values.shape[:2], 0, values.shape[-1]))
        self.length = 0
        self._view()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._k.shape[-2]:
            self._grow(max(end, min(self.limit, end + self.block)))
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self._view()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.batch_select_indices(beam_idx.to(self._k.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._k = self._k.repeat_interleave(repeats, dim=0)
            self._v = self._v.repeat_interleave(repeats, dim=0)
            self._view()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (``DynamicLayer.crop``'s convention)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass minus the number of tokens to drop")
        if self.is_initialized and tokens_to_remove:
            self.length = max(0, self.length + tokens_to_remove)
            self._view()

    def reset(self) -> None:
        """Empty the cache (the next update starts new buffers, of its own batch size)."""
        self._k = self._v = self.keys = self.values = None
        self.length, self.is_initialized = 0, False

    def offload(self) -> None:
        if self.is_initialized:
            self._move("cpu")

    def prefetch(self) -> None:
        if self.is_initialized and self._k.device != self.device:
            self._move(self.device)

    def _move(self, device) -> None:
        self._k = self._k.to(device, non_blocking=True)
        self._v = self._v.to(device, non_blocking=True)
        self._view()

    def _grow(self, capacity: int) -> None:
        def grown(buf: torch.Tensor) -> torch.Tensor:
            out = buf.new_empty((*buf.shape[:2], capacity, buf.shape[-1]))
            out[:, :, : self.length] = buf[:, :, : self.length]
            return out

        self._k, self._v = grown(self._k), grown(self._v)

    def _view(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]


def load_hf_model(
    model_dir: str, device: str, dtype: torch.dtype, overrides: dict | None = None
) -> PreTrainedModel:
    """Load an HF causal LM from a local directory (never the network), in eval mode, with
    ``overrides`` (``trainer.model_overrides``) set on its config as SGLang sets them
    (``config/model_overrides.py``: the RoPE base the trainer scores with)."""
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        for key, value in resolve_model_overrides(config.to_dict(), overrides or {}).items():
            setattr(config, key, value)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, config=config, dtype=dtype, local_files_only=True
        )
    except OSError as err:
        raise FileNotFoundError(
            f"rollout: cannot load an HF model from model_dir={model_dir!r} ({err}); "
            "point trainer.model_path at a directory with config.json and *.safetensors"
        ) from err
    return model.to(device).eval()


def stop_ids_of(model: PreTrainedModel) -> set[int]:
    """EOS ids from the model's config and generation config (they always end a sample)."""
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else list(eos))
    return ids


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device):
    """Left-pad token lists. Returns ``(ids [B, L], mask [B, L], position_ids [B, L])``."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("rollout: got an empty prompt; every prompt needs >= 1 token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


class TorchEngine(RolloutEngine):
    """Embedded engine (see the module docstring)."""

    def __init__(
        self,
        model_dir: str,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch: int = 64,
        kv_block: int = 256,
        fast_decode: bool = True,
        model_overrides: dict | None = None,
        return_routed_experts: bool = False,
    ) -> None:
        """``model_overrides``: ``trainer.model_overrides`` (:func:`load_hf_model`).
        ``return_routed_experts``: a mixture-of-experts model's outputs carry the experts
        every position was routed to (``GenerationOutput.routed_experts``,
        :class:`RouteCapture`); nothing for a dense model.
        ``kv_block``: tokens of KV-cache room added at a time (:class:`BufferedKVLayer`);
        0 keeps transformers' ``DynamicCache``, which concatenates per decode step.
        ``fast_decode``: decode steps through :class:`~megatron_armor.rollout.decode_step.DecodeStep`
        where the model's family has one (prefill always runs the HF forward); ``False`` runs
        every step through the HF forward."""
        if max_batch < 1:
            raise ValueError(f"rollout.engine_batch_size={max_batch} must be >= 1")
        if kv_block < 0:
            raise ValueError(f"rollout: kv_block={kv_block} must be >= 0 (0: DynamicCache)")
        self.model_dir = model_dir
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.kv_block = kv_block
        self.fast_decode = fast_decode
        self.return_routed_experts = return_routed_experts
        self._decode_steps: dict[str, DecodeStep | None] = {}
        self._models: dict[str, PreTrainedModel] = {
            "policy": load_hf_model(model_dir, device, dtype, model_overrides)
        }
        self._versions: dict[str, int] = {"policy": 0}
        self._released = False
        policy = self._models["policy"]
        self.stop_ids = stop_ids_of(policy)
        pad = getattr(policy.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else min(self.stop_ids, default=0)
        forward_params = inspect.signature(policy.forward).parameters
        # transformers 5 renamed ``past_key_values`` to ``cache``; support both spellings.
        self._cache_kw = "cache" if "cache" in forward_params else "past_key_values"

    # ------------------------------------------------------------------ weights
    def weight_version(self, weights: str = "policy") -> int:
        self._model(weights)
        return self._versions[weights]

    def has_weights(self, weights: str) -> bool:
        """True when weight set ``weights`` is loaded."""
        return weights in self._models

    def parameter_names(self) -> list[str]:
        """HF names :meth:`update_weights` accepts (``state_dict`` keys, tied ones included)."""
        return list(self._models["policy"].state_dict().keys())

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        weights: str = "policy",
    ) -> None:
        """Copy HF-named full tensors into weight set ``weights``; record ``version``.

        Any subset of the model's names may be sent (a bucketed stream calls this per bucket);
        an unknown name or a shape mismatch raises before the version is recorded. The first
        update of ``ref`` creates it as a copy of ``policy``.
        """
        if weights not in WEIGHT_SETS:
            raise ValueError(f"rollout: weights={weights!r} is not one of {WEIGHT_SETS}")
        if weights not in self._models:
            self._models[weights] = copy.deepcopy(self._models["policy"])
        targets = self._models[weights].state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in named_tensors:
                _copy_checked(targets, name, tensor)
        self._versions[weights] = int(version)

    def drop_weights(self, weights: str) -> None:
        """Free weight set ``weights`` (not ``policy``)."""
        if weights == "policy":
            raise ValueError("rollout: the policy weight set cannot be dropped")
        self._models.pop(weights, None)
        self._versions.pop(weights, None)
        self._decode_steps.pop(weights, None)

    def state_tensors(self, weights: str = "policy") -> list[tuple[str, torch.Tensor]]:
        """Detached ``(name, tensor)`` pairs of weight set ``weights`` (shared storage)."""
        return [(k, v.detach()) for k, v in self._model(weights).state_dict().items()]

    # ------------------------------------------------------------------ memory / health
    def health(self) -> bool:
        return not self._released and "policy" in self._models

    def release_memory(self) -> None:
        """On a GPU move every weight set to CPU and empty the CUDA cache; no-op on CPU."""
        if self.device.type == "cpu" or self._released:
            return
        for model in self._models.values():
            model.to("cpu")
        torch.cuda.empty_cache()
        self._released = True

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Move the weight sets back to the engine's device after :meth:`release_memory`
        (the engine's cache lives per call: every tag takes everything back)."""
        if not self._released:
            return
        for model in self._models.values():
            model.to(self.device)
        self._released = False

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        weights: str = "policy",
    ) -> list[list[GenerationOutput]]:
        if n < 1:
            raise ValueError(f"rollout: n={n} samples per prompt must be >= 1")
        rows = [i for i in range(len(prompts)) for _ in range(n)]
        results: list[list[GenerationOutput]] = [[] for _ in prompts]
        for prompt_index, (tokens, logps, routes, version, seconds) in zip(
            rows, self._sample_rows(prompts, rows, params, weights), strict=True
        ):
            out = self._output(tokens, logps, params, version, routes)
            out.seconds = seconds
            results[prompt_index].append(out)
        return results

    def generate_window(
        self,
        requests: list[PartialRequest],
        params: SamplingParams,
        window_tokens: int,
        weights: str = "policy",
    ) -> list[GenerationOutput]:
        """One window of a partial rollout (``RolloutEngine.generate_window``): each request's
        prompt and response so far are prefilled under the current weights (its KV cache
        computed anew, as SGLang recomputes a retracted request's), then it decodes up to its
        limit (:func:`~megatron_armor.rollout.protocol.window_limits`). The rows of one call
        share one ``torch.Generator`` (``params.seed``), as in :meth:`generate`."""
        limits = window_limits(requests, params, window_tokens)
        rows, inputs, seen = [], [], {}
        for r in requests:  # requests with the same tokens share their prefill, as in generate
            key = (*r.prompt_ids, -1, *r.response_ids)
            if key not in seen:
                seen[key] = len(inputs)
                inputs.append(list(r.prompt_ids) + list(r.response_ids))
            rows.append(seen[key])
        room = dataclasses.replace(params, max_new_tokens=max(limits, default=1))
        sampled = self._sample_rows(inputs, rows, room, weights, limits)
        stops = self.stop_ids.union(params.stop_token_ids)
        out = []
        for request, (tokens, logps, routes, version, seconds) in zip(
            requests, sampled, strict=True
        ):
            stopped = bool(tokens) and tokens[-1] in stops
            total = len(request.response_ids) + len(tokens)
            reason = window_finish_reason(stopped, total, params)
            experts = None if routes is None else RoutedExperts.from_array(routes.numpy())
            out.append(GenerationOutput(tokens, logps, reason, version, experts, seconds=seconds))
        return out

    def _sample_rows(
        self,
        inputs: list[list[int]],
        rows: list[int],
        params: SamplingParams,
        weights: str,
        limits: list[int] | None = None,
    ) -> list[tuple]:
        """Decode one sample per entry of ``rows`` (an index into ``inputs``), in chunks of
        ``max_batch`` rows, each up to ``params.max_new_tokens`` tokens or its entry of
        ``limits``: ``(tokens, logprobs, routes, version, seconds)`` per row (``seconds``
        from the call's start to its last token)."""
        if self._released:
            raise RuntimeError("rollout: engine memory is released; call resume_memory() first")
        model = self._model(weights)
        version = self._versions[weights]
        capture = RouteCapture.of(model) if self.return_routed_experts else None
        step = self._decode_step(weights) if capture is None else None  # hooks need HF forwards
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        out, called = [], time.perf_counter()
        try:
            for start in range(0, len(rows), self.max_batch):
                chunk = rows[start : start + self.max_batch]
                chunk_limits = None if limits is None else limits[start : start + self.max_batch]
                outs = self._generate_chunk(
                    model, step, inputs, chunk, params, generator, capture, chunk_limits
                )
                out += [(tokens, logps, routes, version, end - called)
                        for tokens, logps, routes, end in outs]  # fmt: skip
        finally:
            if capture is not None:
                capture.close()
        return out

    def teacher_forced_logprobs(
        self, prompt: list[int], response: list[int], temperature: float, weights: str = "policy"
    ) -> list[float]:
        """``log_softmax(logits / T)`` of each response token after ``prompt + response[:t]``."""
        ids = torch.tensor([prompt + response], dtype=torch.long, device=self.device)
        with torch.no_grad():
            logits = self._model(weights)(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        logp = scaled_log_probs(logits, temperature)
        target = torch.tensor(response, dtype=torch.long, device=self.device)
        return logp.gather(-1, target.unsqueeze(-1)).squeeze(-1).tolist()

    # ------------------------------------------------------------------ internals
    def _model(self, weights: str) -> PreTrainedModel:
        if weights not in self._models:
            raise KeyError(
                f"rollout: weight set {weights!r} is not loaded (loaded: {sorted(self._models)}); "
                f"call update_weights(..., weights={weights!r}) first"
            )
        return self._models[weights]

    def _decode_step(self, weights: str) -> DecodeStep | None:
        """The :class:`DecodeStep` of weight set ``weights`` (``None``: decode through the HF
        forward, with ``fast_decode=False`` or for a model family it does not mirror)."""
        if not self.fast_decode:
            return None
        if weights not in self._decode_steps:
            self._decode_steps[weights] = decode_step_for(self._models[weights])
        return self._decode_steps[weights]

    def _output(
        self, tokens, logps, params: SamplingParams, version: int, routes=None
    ) -> GenerationOutput:
        stops = self.stop_ids.union(params.stop_token_ids)
        reason = "stop" if tokens and tokens[-1] in stops else "length"
        experts = None if routes is None else RoutedExperts.from_array(routes.numpy())
        return GenerationOutput(tokens, logps, reason, version, experts)

    def _new_cache(self, model, limit: int) -> DynamicCache:
        """A ``DynamicCache`` whose full-attention layers are :class:`BufferedKVLayer` (other
        layer kinds, e.g. sliding-window, and ``kv_block=0`` keep transformers' own)."""
        cache = DynamicCache(config=model.config)
        if self.kv_block:
            cache.layers = [
                BufferedKVLayer(limit, self.kv_block) if type(layer) is DynamicLayer else layer
                for layer in cache.layers
            ]
        return cache

    def _forward(self, model, ids, chunk: _Chunk, positions) -> torch.Tensor:
        """Run ``ids`` ``[B, S]`` through ``model`` on the chunk's cache; last logits ``[B, V]``."""
        out = model(
            input_ids=ids,
            attention_mask=chunk.mask[:, : chunk.width],
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: chunk.cache},
        )
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def _generate_chunk(
        self, model, step, prompts, chunk_prompts, params, generator, capture, limits=None
    ):
        """Decode one chunk; returns per row ``(token_ids, logprobs, routes, ended)``: ``routes``
        ``[prompt + response - 1, layers, k]`` with a :class:`RouteCapture`, else ``None``;
        ``ended`` the ``time.perf_counter()`` of its last token.
        ``limits``: each row's most new tokens (default: ``params.max_new_tokens``)."""
        distinct = sorted(set(chunk_prompts))
        ids, mask, positions = left_pad([prompts[i] for i in distinct], self.pad_id, self.device)
        width = ids.shape[1]
        chunk = _Chunk(
            rows=torch.arange(len(distinct), device=self.device),
            mask=torch.cat([mask, mask.new_ones((mask.shape[0], params.max_new_tokens))], dim=1),
            width=width,
            positions=positions[:, -1] + 1,
            cache=self._new_cache(model, width + params.max_new_tokens),
        )
        logits = self._forward(model, ids, chunk, positions)
        prefill = None if capture is None else capture.take(*ids.shape)
        # Share each prompt's prefill between its rows.
        expand = torch.tensor([distinct.index(i) for i in chunk_prompts], device=self.device)
        chunk.cache.reorder_cache(expand)
        chunk.mask, chunk.positions, logits = (
            chunk.mask[expand],
            chunk.positions[expand],
            logits[expand],
        )
        chunk.rows = torch.arange(len(chunk_prompts), device=self.device)
        row_limits = None if limits is None else torch.tensor(limits, device=self.device)
        decoded = self._decode(model, step, chunk, logits, params, generator, capture, row_limits)
        if capture is None:
            return [(t, lp, None, end) for t, lp, _, end in decoded]
        out = []
        for i, (tokens, logps, fed, end) in zip(chunk_prompts, decoded, strict=True):
            prompt = prefill[distinct.index(i), width - len(prompts[i]) :]
            routes = torch.cat([prompt, fed[: max(len(tokens) - 1, 0)]])
            out.append((tokens, logps, routes, end))
        return out

    def _decode(
        self,
        model,
        step,
        chunk: _Chunk,
        logits,
        params: SamplingParams,
        generator,
        capture=None,
        limits: torch.Tensor | None = None,
    ):
        """Sample up to ``max_new_tokens`` per row (``limits[row]`` when given) from the
        prefill's ``logits``; each further token goes through ``step`` (a :class:`DecodeStep`)
        or, when ``None``, the HF forward. Per row ``(tokens, logprobs, routes of the fed
        tokens, ended)`` (routes ``None`` without ``capture``; ``ended``: the
        ``time.perf_counter()`` of its last token)."""
        num_rows = chunk.rows.numel()
        fed = None if capture is None else capture.empty(num_rows, params.max_new_tokens)
        tokens = torch.zeros(
            (num_rows, params.max_new_tokens), dtype=torch.long, device=self.device
        )
        logps = torch.zeros(
            (num_rows, params.max_new_tokens), dtype=torch.float32, device=self.device
        )
        lengths = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        ended = [0.0] * num_rows  # time.perf_counter() at each row's last token
        stops = torch.tensor(sorted(self.stop_ids.union(params.stop_token_ids)), device=self.device)
        for t in range(params.max_new_tokens):
            beat()  # a token decoded: progress the driver's call deadline sees
            next_tokens, next_logps = sample_next_tokens(logits, params, generator)
            tokens[chunk.rows, t], logps[chunk.rows, t] = next_tokens, next_logps
            lengths[chunk.rows] = t + 1
            live = ~torch.isin(next_tokens, stops)
            if limits is not None:  # a row whose window is used up leaves like a stopped one
                live &= limits[chunk.rows] > t + 1
            if t + 1 == params.max_new_tokens or not bool(live.any()):
                break
            if not bool(live.all()):
                now = time.perf_counter()
                for row in chunk.rows[~live].tolist():
                    ended[row] = now
                keep = live.nonzero().squeeze(-1)
                chunk.cache.batch_select_indices(keep)
                chunk.rows, chunk.mask, chunk.positions = (
                    chunk.rows[keep],
                    chunk.mask[keep],
                    chunk.positions[keep],
                )
                next_tokens = next_tokens[keep]
            chunk.width += 1
            ids, positions = next_tokens.unsqueeze(-1), chunk.positions.unsqueeze(-1)
            if step is None:
                logits = self._forward(model, ids, chunk, positions)
            else:
                logits = step(ids, chunk.mask[:, : chunk.width], positions, chunk.cache)
            if capture is not None:
                fed[chunk.rows.cpu(), t] = capture.take(len(ids), 1)[:, 0]
            chunk.positions = chunk.positions + 1
        now = time.perf_counter()
        for row in chunk.rows.tolist():
            ended[row] = now
        lengths_list, tokens_list, logps_list = lengths.tolist(), tokens.tolist(), logps.tolist()
        rows = zip(tokens_list, logps_list, lengths_list, ended, strict=True)
        return [
            (t[:n], lp[:n], None if fed is None else fed[i], end)
            for i, (t, lp, n, end) in enumerate(rows)
        ]


class RouteCapture:
    """The experts a mixture-of-experts model's routers choose, read by forward hooks on each
    sparse layer's router (transformers 5's ``Qwen3MoeTopKRouter``: softmax of the router
    logits, then top-k — the trainer's selection rule; it returns ``(logits, scores,
    indices)``). :meth:`take` after a forward: ``[batch, seq, layers, k]`` int16, zeros at
    dense layers (as SGLang reports them)."""

    def __init__(self, model: PreTrainedModel, gates: list[tuple[int, torch.nn.Module]]):
        self.num_layers = len(model.model.layers)
        self.topk = int(model.config.num_experts_per_tok)
        self._last: dict[int, torch.Tensor] = {}
        self._hooks = [gate.register_forward_hook(self._hook(i)) for i, gate in gates]

    @staticmethod
    def of(model: PreTrainedModel) -> RouteCapture | None:
        """The capture of ``model``'s routers, ``None`` for a dense model."""
        layers = getattr(getattr(model, "model", None), "layers", None) or []
        gates = [
            (i, layer.mlp.gate)
            for i, layer in enumerate(layers)
            if hasattr(getattr(layer, "mlp", None), "gate") and hasattr(layer.mlp.gate, "top_k")
        ]
        return RouteCapture(model, gates) if gates else None

    def _hook(self, layer: int):
        def keep(module, args, output):
            self._last[layer] = output[2]

        return keep

    def empty(self, rows: int, seq: int) -> torch.Tensor:
        return torch.zeros(rows, seq, self.num_layers, self.topk, dtype=torch.int16)

    def take(self, rows: int, seq: int) -> torch.Tensor:
        """The routes of the last forward over ``[rows, seq]`` tokens."""
        out = self.empty(rows, seq)
        for layer, ids in self._last.items():
            out[:, :, layer] = ids.reshape(rows, seq, self.topk).to("cpu", torch.int16)
        self._last.clear()
        return out

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


_EXPERT_WEIGHT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fused_expert_view(targets: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The part of a fused expert tensor that checkpoint tensor ``name`` fills, or ``None``.

    transformers 5 holds a MoE layer's experts fused (``Qwen3MoeExperts``): ``gate_up_proj``
    ``[E, 2I, H]`` (expert ``e``'s gate rows, then its up rows: its forward splits the output
    in two halves) and ``down_proj`` ``[E, H, I]``; the trainer sends the checkpoint's
    per-expert names (``mlp.experts.{e}.gate_proj.weight``, ...), as on disk."""
    match = _EXPERT_WEIGHT.match(name)
    if match is None:
        return None
    prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
    fused = targets.get(f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
    if fused is None or fused.dim() != 3 or expert >= fused.shape[0]:
        return None
    if proj == "down_proj":
        return fused[expert]
    half = fused.shape[1] // 2
    return fused[expert, :half] if proj == "gate_proj" else fused[expert, half:]


def _copy_checked(targets: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> None:
    """``targets[name].copy_(tensor)`` with a clear error on an unknown name or shape (an
    expert's weight goes into its slice of the fused tensor: :func:`fused_expert_view`)."""
    target = targets.get(name)
    if target is None:
        target = fused_expert_view(targets, name)
    if target is None:
        near = [k for k in targets if k.split(".")[-1] == name.split(".")[-1]][:3]
        raise KeyError(
            f"rollout: update_weights got unknown tensor {name!r}; expected HF names such as {near}. "
            "Send HF-named tensors (the trainer's export_weights converts Megatron names)"
        )
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"rollout: update_weights tensor {name!r} has shape {tuple(tensor.shape)}, the engine "
            f"expects {tuple(target.shape)}; send full (tensor-parallel gathered) tensors"
        )
    target.data.copy_(tensor)
