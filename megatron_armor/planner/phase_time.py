"""Predicted seconds of each step phase (``planner/step_phases.py``) for a config, its
allocation and a device, from FLOPs, bytes and the device's peaks (``planner/devices.py``)
with stated efficiencies (:class:`Efficiency`).

``armor plan`` predicts a step from the config with a guessed workload
(:class:`WorkloadGuess`: acceptance, lengths); ``armor report`` predicts each measured step
from the work that step did (its ``rollout/*`` and ``train/*`` counts), so the ratio of
measured to predicted calibrates the efficiencies and nothing else. The models
(docs/profiling.md, "Predicted phase times"):

- decoding (``rollout/policy``, ``rollout/reference``, validation): prefill is compute
  (``2 N_act`` FLOPs per prompt token at ``prefill_mfu``); each decode iteration reads the
  engine's weights once (a mixture of experts: the experts its concurrent tokens touch,
  ``1 - (1 - k/E)^c`` of them) and every generated token reads its context's KV cache, at
  ``decode_bandwidth`` of the memory bandwidth, engines in parallel, a server's GPUs (tp)
  splitting both. Iterations: the longest response of each call, or the tokens over the
  concurrent sequences when the KV cache (or the embedded engine's batch) holds fewer;
- ``logprobs``: forward FLOPs (``planner/flops.py``) of the old pass, and of the reference
  pass when the step needs one, at ``logprob_mfu``; ``train``: ``3 x`` forward at
  ``train_mfu`` (model FLOPs: recomputation shows as a lower MFU);
- ``weight_sync`` (and ``reset``; the reference swaps of ``rollout.ref_strategy: swap``, in
  ``rollout/reference``): each engine GPU receives its share of the weights at ``push_gbps``,
  at most the transport's link;
- ``checkpoint``: its bytes (``plan.checkpoint_disk``) at ``disk_gbps`` per node;
- ``reward`` and ``driver`` are not modelled (0: measured only); under
  ``orchestration.async_rollout: one_step`` the rollout of an overlapped step is hidden and
  ``rollout/wait`` is what the updates leave of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from megatron_armor.algo.losses import needs_reference_logprobs
from megatron_armor.algo.registry import get_anchor_mode
from megatron_armor.config.rollout_traits import reference_strategy
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.config.sglang_pools import pool_specs, uses_ref_pool
from megatron_armor.planner.devices import DevicePeaks
from megatron_armor.planner.flops import forward_flops, matmul_params
from megatron_armor.planner.memory import EngineShape, GiB, param_bytes
from megatron_armor.planner.model import ModelDims
from megatron_armor.planner.step_phases import STEP_PHASES
from megatron_armor.rollout.backends import backend_of

NOT_MODELLED = ("reward", "driver")
"""Phases the predictions leave at 0: measured only."""


@dataclass(frozen=True)
class Efficiency:
    """The stated efficiencies: what share of the device's peak each kind of work reaches.
    Assumptions to be calibrated: ``armor report`` prints measured / predicted per phase."""

    train_mfu: float = 0.35
    """Model-FLOPs utilization of the updates (dense Megatron training on H100 reaches
    0.4-0.5 at long sequences; RL's varied lengths and recomputation cost some)."""
    logprob_mfu: float = 0.40
    """Of the forward-only log-prob passes."""
    prefill_mfu: float = 0.40
    """Of the engines' prefill."""
    decode_bandwidth: float = 0.55
    """Share of the memory bandwidth a decode iteration reaches (weights + KV reads)."""
    push_gbps: float = 10.0
    """GB/s of weights a push delivers into one engine GPU, the export, hand-off and the
    engine's load together (at most its link's peak): a guess for the report to calibrate."""
    network_gbps: float = 50.0
    """GB/s per GPU between nodes (a 400 Gb/s InfiniBand port per GPU)."""
    disk_gbps: float = 2.0
    """Checkpoint write GB/s per node (a parallel file system's share)."""


@dataclass(frozen=True)
class WorkloadGuess:
    """What ``armor plan`` assumes of a step it has not seen (``--assume NAME=VALUE``)."""

    acceptance: float = 0.5
    """Accepted queries / queries drawn (sets how many generation batches a step draws)."""
    rule_a_pass: float = 0.6
    """Share of the drawn queries whose policy group passes rule (a), so their reference
    samples are drawn (policy-first order)."""
    prompt_tokens: float = 256.0
    """Mean prompt tokens (DAPO-Math prompts with the template: a few hundred)."""
    response_fraction: float = 0.5
    """Mean response length / ``rollout.sampling.max_new_tokens``; each generation call's
    longest response reaches the cap."""
    val_problems_per_file: float = 34.0
    """Validation problems per ``data.val_files`` file when ``validation.max_problems`` is 0
    and a file cannot be read (the paper's AIME24, AIME25, AMC23: 30, 30, 40)."""


@dataclass(frozen=True)
class Workload:
    """One step's work; occurrences (``validations``, ``checkpoints``, ``resets``) are 0/1 for
    a measured step and the per-step rate for a planned one."""

    policy_sequences: float
    reference_sequences: float
    prompt_len: float
    policy_response_len: float
    reference_response_len: float
    policy_decode_steps: float
    reference_decode_steps: float
    trained_sequences: float
    trained_len: float
    validation_sequences: float = 0.0
    validations: float = 0.0
    checkpoints: float = 0.0
    resets: float = 0.0
    reference_calls: float = 0.0
    """Generation batches that drew reference samples (each swaps the reference in and out
    under ``rollout.ref_strategy: swap`` without a reference pool)."""
    drained: float = 1.0
    """Share of the step whose rollout holds the trainer (1 in ``off``; ``one_step``: the
    drained steps)."""


def parse_assumptions(items: list[str], cls=Efficiency, base=None):
    """``NAME=VALUE`` strings over ``cls``'s fields (an :class:`Efficiency` or a
    :class:`WorkloadGuess`, starting from ``base``); unknown names are left for the other."""
    known = {f.name for f in fields(cls)}
    values = {}
    for item in items:
        name, _, value = item.partition("=")
        if name in known:
            try:
                values[name] = float(value)
            except ValueError:
                raise ValueError(f"--assume {item}: {name} takes a number") from None
    return cls(**{**(vars(base) if base else {}), **values})


def check_assumptions(items: list[str]) -> None:
    """Every ``--assume NAME=VALUE`` names a field of :class:`Efficiency` or
    :class:`WorkloadGuess` and a positive number."""
    known = {f.name for f in fields(Efficiency)} | {f.name for f in fields(WorkloadGuess)}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in known:
            raise ValueError(f"--assume {item!r}: NAME=VALUE with NAME one of {sorted(known)}")
        try:
            ok = float(value) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--assume {item}: {name} takes a positive number")


# ------------------------------------------------------------------------------ the layout
@dataclass(frozen=True)
class Layout:
    """What the predictions need of the allocation."""

    trainer_devices: int
    engines: int
    engine_tp: int
    kv_tokens: float
    """Tokens one engine's KV cache holds (or the embedded engine's batch in sequences x
    their length); the concurrency of decoding."""
    transport: str
    nodes: int
    precision: str


def engine_layout(config: ArmorConfig) -> tuple[int, int]:
    """(policy engines, GPUs per engine): the SGLang policy pool; the embedded engine: one per
    rollout GPU group of ``rollout.sglang.tp`` (colocated: over the trainer's GPUs), one on
    the ``cpu`` layout."""
    o = config.orchestration
    if o.layout == "cpu":
        return 1, 1
    if backend_of(config).serves_over_http:
        pool = pool_specs(config)["policy"]
        return pool.num_engines, pool.tp
    tp = config.rollout.sglang.tp
    gpus = config.resolved.world_size if o.layout == "colocated" else o.rollout_gpus
    return max(1, gpus // tp), tp


def layout_of(config: ArmorConfig, dims: ModelDims, gpu_bytes: float) -> Layout:
    engines, tp = engine_layout(config)
    if backend_of(config).serves_over_http and config.orchestration.layout != "cpu":
        share = pool_specs(config)["policy"].share
        kv = EngineShape(dims, tp, share, gpu_bytes).kv_tokens() * tp
    else:  # the embedded engine decodes up to rollout.engine_batch_size rows at once
        r = config.rollout
        kv = r.engine_batch_size * (config.data.max_prompt_len + r.sampling.max_new_tokens)
    transport = config.rollout.sglang.weight_transport
    if not backend_of(config).serves_over_http:
        transport = "inprocess"
    return Layout(max(1, config.resolved.world_size), engines, tp, float(kv), transport,
                  config.orchestration.nodes, config.trainer.precision)  # fmt: skip


# ------------------------------------------------------------------------------ the models
def _expert_share(dims: ModelDims, concurrent: float) -> float:
    """Share of a mixture of experts' expert weights one decode iteration of ``concurrent``
    sequences reads: each token picks ``k`` of ``E``, so ``1 - (1 - k/E)^c`` of them."""
    if not dims.is_moe:
        return 1.0
    return 1.0 - (1.0 - dims.topk / dims.num_experts) ** max(concurrent, 1.0)


def concurrent_sequences(
    layout: Layout, sequences: float, prompt_len: float, response_len: float
) -> float:
    """Sequences one engine decodes at once: its share of ``sequences``, or what its KV cache
    (the embedded engine: its batch) holds of them."""
    return min(sequences / layout.engines, layout.kv_tokens / (prompt_len + response_len))


def decode_bytes(
    dims: ModelDims, layout: Layout, sequences: float, prompt_len: float, response_len: float,
    longest_steps: float,
) -> float:  # fmt: skip
    """Bytes one engine reads from memory to decode its share of ``sequences`` (module
    docstring, decoding): the weights once per iteration, each generated token's context of
    KV cache."""
    per_engine = sequences / layout.engines
    concurrent = concurrent_sequences(layout, sequences, prompt_len, response_len)
    iterations = max(longest_steps, per_engine * response_len / max(concurrent, 1.0))
    weight = 2 if layout.precision != "fp32" else 4
    expert = dims.decoder_expert_params()
    read = (dims.total_params() - expert + expert * _expert_share(dims, concurrent)) * weight
    kv_per_token = 2 * dims.layers * dims.kv_heads * dims.head_dim * weight
    kv_read = per_engine * response_len * (prompt_len + response_len / 2) * kv_per_token
    return iterations * read + kv_read


def decode_seconds(
    dims: ModelDims, peaks: DevicePeaks, layout: Layout, eff: Efficiency,
    sequences: float, prompt_len: float, response_len: float, longest_steps: float,
) -> float:  # fmt: skip
    """Seconds to draw ``sequences`` samples: prefill at ``prefill_mfu``, then decoding at
    ``decode_bandwidth`` of the memory bandwidth (or its FLOPs at the peak, if longer), the
    engines in parallel and each engine's GPUs splitting its work."""
    if sequences <= 0 or response_len <= 0:
        return 0.0
    per_engine = sequences / layout.engines
    traffic = decode_bytes(dims, layout, sequences, prompt_len, response_len, longest_steps)
    memory_s = traffic / (layout.engine_tp * peaks.memory_gbps * 1e9 * eff.decode_bandwidth)
    peak = _tflops(peaks, layout.precision) * 1e12 * layout.engine_tp
    prefill_s = 2 * matmul_params(dims) * per_engine * prompt_len / (peak * eff.prefill_mfu)
    decode_compute_s = 2 * matmul_params(dims) * per_engine * response_len / peak
    return prefill_s + max(memory_s, decode_compute_s)


def _tflops(peaks: DevicePeaks, precision: str) -> float:
    value = peaks.peak_tflops(precision) or peaks.peak_tflops("fp32")
    if not value:
        raise ValueError(f"device {peaks.name}: no {precision} peak in the table")
    return value


def pass_seconds(
    dims: ModelDims, peaks: DevicePeaks, layout: Layout, sequences: float, length: float,
    passes: float, mfu: float,
) -> float:  # fmt: skip
    """Seconds of ``passes`` forwards over ``sequences`` of ``length`` tokens at ``mfu``."""
    if sequences <= 0 or length <= 0:
        return 0.0
    flops = passes * sequences * forward_flops(dims, max(1, round(length)))
    return flops / (layout.trainer_devices * _tflops(peaks, layout.precision) * 1e12 * mfu)


def link_gbps(peaks: DevicePeaks, layout: Layout, eff: Efficiency) -> float:
    """The peak GB/s a weight push moves over: device memory (the embedded engine, CUDA IPC
    on the same GPU), NVLink one way (NCCL within a node), the network (across nodes), disk."""
    if layout.transport in ("inprocess", "tensor"):
        return peaks.memory_gbps
    if layout.transport == "distributed":
        return peaks.link_gbps / 2 if layout.nodes == 1 and peaks.link_gbps else eff.network_gbps
    return eff.disk_gbps * layout.nodes


def push_seconds(dims: ModelDims, peaks: DevicePeaks, layout: Layout, eff: Efficiency) -> float:
    """Each engine GPU receives its tp share of the weights (engines in parallel) at
    ``push_gbps``, or its link's peak when that is lower."""
    share = dims.total_params() * param_bytes(layout.precision) / layout.engine_tp
    return share / (min(eff.push_gbps, link_gbps(peaks, layout, eff)) * 1e9)


def swaps_reference(config: ArmorConfig) -> bool:
    """Whether each reference call swaps the reference weights into the policy servers and
    back (``rollout.ref_strategy: swap`` on SGLang without a reference pool)."""
    served = reference_strategy(config.rollout.ref_strategy, config.algo.anchor_source)
    serves = backend_of(config).serves_over_http
    return serves and served.swaps_into_policy and not uses_ref_pool(config)


# ------------------------------------------------------------------------------ a step
def predict_step(
    config: ArmorConfig, dims: ModelDims, peaks: DevicePeaks, work: Workload,
    eff: Efficiency = Efficiency(), gpu_bytes: float = 80 * GiB,
    checkpoint_bytes: float = 0.0,
) -> dict[str, float]:  # fmt: skip
    """Predicted seconds of each phase of one step (``phase/*`` keys' names)."""
    lay = layout_of(config, dims, gpu_bytes)
    decode = lambda n, r, steps: decode_seconds(dims, peaks, lay, eff, n, work.prompt_len, r, steps)  # noqa: E731
    policy = decode(work.policy_sequences, work.policy_response_len, work.policy_decode_steps)
    reference = decode(work.reference_sequences, work.reference_response_len,
                       work.reference_decode_steps)  # fmt: skip
    passes = 2.0 if needs_reference_logprobs(config.algo) else 1.0
    n, length = work.trained_sequences, work.trained_len
    logprobs = pass_seconds(dims, peaks, lay, n, length, passes, eff.logprob_mfu)
    train = pass_seconds(dims, peaks, lay, n, length, 3.0, eff.train_mfu)
    push = push_seconds(dims, peaks, lay, eff)
    if swaps_reference(config):
        reference += 2 * push * work.reference_calls
    rollout = policy + reference
    hidden = 1.0 - work.drained  # one_step: overlapped by the updates
    out = {p.name: 0.0 for p in STEP_PHASES}
    out.update({
        "rollout/policy": policy * work.drained, "rollout/reference": reference * work.drained,
        "logprobs": logprobs, "train": train, "weight_sync": push,
        "reset": work.resets * push,
        "validate": work.validations * decode(work.validation_sequences,
                                              work.policy_response_len, 0.0),
        "checkpoint": work.checkpoints * checkpoint_bytes
        / (eff.disk_gbps * 1e9 * max(1, config.orchestration.nodes)),
        "rollout/wait": hidden * max(0.0, rollout - logprobs - train),
    })  # fmt: skip
    return out


# ------------------------------------------------------------------------------ workloads
def val_problems(config: ArmorConfig, guess: WorkloadGuess) -> float:
    """Problems of one validation: ``validation.max_problems`` per file, else each file's rows
    (a parquet file's metadata), else :attr:`WorkloadGuess.val_problems_per_file`."""
    v = config.validation
    total = 0.0
    for file in config.data.val_files:
        rows = guess.val_problems_per_file
        if Path(file).is_file() and str(file).endswith(".parquet"):
            import pyarrow.parquet as pq

            rows = float(pq.ParquetFile(file).metadata.num_rows)
        total += min(rows, v.max_problems) if v.max_problems > 0 else rows
    return total


def planned_workload(config: ArmorConfig, guess: WorkloadGuess = WorkloadGuess()) -> Workload:
    """A step of ``config`` under ``guess`` (occurrences as rates per step)."""
    a, r = config.algo, config.rollout
    mode = get_anchor_mode(a.anchor)
    cap = r.gen_batch * a.max_gen_batches
    queries = min(cap, max(r.gen_batch, r.batch / guess.acceptance))
    calls = math.ceil(queries / r.gen_batch)
    response = guess.response_fraction * r.sampling.max_new_tokens
    prompt = min(guess.prompt_tokens, config.data.max_prompt_len)
    refs = queries * guess.rule_a_pass * a.ref_n if mode.draws_reference else 0.0
    v, run = config.validation, config.run
    every = lambda n: 1.0 / n if n > 0 else 0.0  # noqa: E731
    drained = 1.0
    if config.orchestration.async_rollout == "one_step":
        drained = every(a.reset.every) if a.reset.schedule != "none" else 0.0
    return Workload(
        policy_sequences=queries * mode.policy_samples(a.group_size, a.filter_policy_samples),
        reference_sequences=refs, prompt_len=prompt, policy_response_len=response,
        reference_response_len=response, policy_decode_steps=calls * r.sampling.max_new_tokens,
        reference_decode_steps=calls * r.sampling.max_new_tokens if refs else 0.0,
        trained_sequences=r.batch * a.group_size, trained_len=prompt + response,
        validation_sequences=val_problems(config, guess) * v.n_samples,
        validations=every(v.every), checkpoints=every(run.ckpt_every) or every(run.steps),
        resets=every(a.reset.every) if a.reset.schedule != "none" else 0.0,
        reference_calls=calls if refs else 0.0, drained=drained,
    )  # fmt: skip


def measured_workload(record: dict, config: ArmorConfig) -> Workload:
    """The work of one measured step: its ``metrics.jsonl`` line (docs/metrics.md)."""
    get = lambda k: float(record.get(k) or 0.0)  # noqa: E731
    policy, refs = get("rollout/policy_sequences"), get("rollout/reference_sequences")
    policy_len = get("length/policy_mean")
    ref_tokens = get("rollout/generated_tokens") - policy_len * policy
    trained_tokens = get("train/prompt_tokens") + get("train/response_tokens")
    trained = get("anchor/kept") * config.algo.group_size
    k = config.validation.n_samples
    val = sum(v for key, v in record.items() if key.startswith("val/") and key.endswith("/n"))
    return Workload(
        policy_sequences=policy, reference_sequences=refs,
        prompt_len=get("rollout/prompt_tokens") / max(policy + refs, 1.0),
        policy_response_len=policy_len, reference_response_len=ref_tokens / max(refs, 1.0),
        policy_decode_steps=get("rollout/policy_decode_steps"),
        reference_decode_steps=get("rollout/reference_decode_steps"),
        trained_sequences=trained, trained_len=trained_tokens / max(trained, 1.0),
        validation_sequences=val * k, validations=float(val > 0),
        checkpoints=float("timing/checkpoint_s" in record), resets=get("reset/performed"),
        reference_calls=get("anchor/gen_batches") if refs else 0.0,
        drained=float(record.get("async/drained", 1.0)),
    )  # fmt: skip
