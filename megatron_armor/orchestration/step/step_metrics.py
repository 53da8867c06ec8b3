"""Per-step metrics computed by the orchestrator (docs/metrics.md lists every key).

Rewards and lengths are split by source: ``policy`` = every on-policy sample generated this
step (before the acceptance filter: the training-reward curve of the paper's Fig. 1),
``batch_policy`` = the on-policy samples of the kept groups (what was trained on), ``anchor``
= the inserted anchors.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import torch

from megatron_armor.algo.kl import kl_k1, kl_k3
from megatron_armor.observability.metrics import writing
from megatron_armor.orchestration.step.anchor_rollout import RolloutResult
from megatron_armor.types import Group, Sample, SampleSource, TrainBatch


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def sample_metrics(prefix: str, samples: list[Sample]) -> dict[str, float]:
    """``reward/<prefix>_mean|acc`` and ``length/<prefix>_mean|max|clip_frac`` (if any samples)."""
    if not samples:
        return {}
    lengths = [s.response_len for s in samples]
    return {
        f"reward/{prefix}_mean": _mean([s.score for s in samples]),
        f"reward/{prefix}_acc": _mean([float(s.acc) for s in samples]),
        f"length/{prefix}_mean": _mean(lengths),
        f"length/{prefix}_max": float(max(lengths)),
        f"length/{prefix}_clip_frac": _mean([float(s.finish_reason == "length") for s in samples]),
    }


def split_groups(groups: list[Group]) -> tuple[list[Sample], list[Sample]]:
    """(on-policy samples, anchors) of the trained groups."""
    policy, anchors = [], []
    for g in groups:
        for i, s in enumerate(g.samples):
            (anchors if g.is_anchor(i) else policy).append(s)
    return policy, anchors


def rollout_metrics(result: RolloutResult) -> dict[str, float]:
    """``anchor/*`` (``anchor/short_batch``: 1 when the step trains on fewer than
    ``rollout.batch`` groups), ``reward/*`` and ``length/*`` of one step's rollout, and
    ``perf/reference_prefetched``."""
    m = dict(result.stats.as_metrics())
    seen = max(result.stats.queries_seen, 1)
    for reason in ("all_correct", "all_wrong", "no_ref_correct"):
        m[f"anchor/rejected_{reason}_frac"] = m[f"anchor/rejected_{reason}"] / seen
    m["anchor/kept"] = float(len(result.groups))
    m["anchor/short_batch"] = float(result.short_batch)
    m["anchor/reference_first"] = float(result.reference_first)
    m["perf/reference_prefetched"] = float(result.reference_prefetched)
    m["rollout/generated_tokens"] = float(result.generated_tokens)
    m["rollout/prompt_tokens"] = float(result.prompt_tokens)
    m["rollout/policy_sequences"] = float(result.policy_sequences)
    m["rollout/reference_sequences"] = float(result.reference_sequences)
    m["rollout/policy_decode_steps"] = float(result.policy_decode_steps)
    m["rollout/reference_decode_steps"] = float(result.reference_decode_steps)
    policy, anchors = split_groups(result.groups)
    m.update(sample_metrics("policy", result.policy_samples))
    m.update(sample_metrics("batch_policy", policy))
    m.update(sample_metrics("anchor", anchors))
    advantages = [a for g in result.groups for a in g.advantages]
    if advantages:
        m["reward/advantage_abs_mean"] = _mean([abs(a) for a in advantages])
    for key, value in result.reward_stats.items():
        m[key if "/" in key else f"reward/{key}"] = float(value)
    return m


def logprob_mismatch_metrics(batch: TrainBatch, with_ref: bool) -> dict[str, float]:
    """The engine's log-probs (``engine_logprobs`` of the batch) against the trainer's, per
    source: on-policy tokens against ``old_logprobs`` (checks the weight sync), anchor tokens
    against ``ref_logprobs`` (checks that the anchors came from the trainer's current
    reference — after a reset, from the new one). ``rollout/<source>_logprob_absdiff_mean|max``
    is ``|lp_e - lp_b|``; ``rollout/<source>_mismatch_k1|k3`` estimate ``KL(pi_engine ||
    pi_trainer)`` from the engine's samples (``algo/kl.py``: ``k1 = lp_e - lp_b``,
    ``k3 = rho - 1 - log rho`` with ``rho = pi_b / pi_e``), the mismatch that
    ``algo.rollout_correction`` weights for (docs/metrics.md)."""
    engine = batch.engine_logprobs
    mask = batch.loss_mask > 0
    out: dict[str, float] = {}
    parts = [("policy", mask & ~batch.is_anchor, batch.old_logprobs)]
    if with_ref:
        parts.append(("anchor", mask & batch.is_anchor, batch.ref_logprobs))
    for name, sel, trainer_lp in parts:
        if sel.any():
            diff = (engine[sel] - trainer_lp[sel]).abs()
            out[f"rollout/{name}_logprob_absdiff_mean"] = float(diff.mean())
            out[f"rollout/{name}_logprob_absdiff_max"] = float(diff.max())
            lp_e, lp_b = engine[sel].double(), trainer_lp[sel].double()
            out[f"rollout/{name}_mismatch_k1"] = float(kl_k1(lp_e, lp_b).mean())
            out[f"rollout/{name}_mismatch_k3"] = float(kl_k3(lp_e, lp_b).mean())
    return out


PER_UPDATE_FLAGS = ("train/skipped",)
"""Per-update flags that the step counts instead (``update_guard.skip_metrics``)."""


def reduce_update_metrics(updates: list[dict[str, float]]) -> dict[str, float]:
    """Combine per-mini-batch trainer metrics: maxima for ``*_max``, last ``lr``, else the
    mean (a skipped update's non-finite values included: the step's mean is then non-finite
    too); the flags of :data:`PER_UPDATE_FLAGS` are left to the caller."""
    out: dict[str, float] = {}
    keys = {k for u in updates for k in u} - set(PER_UPDATE_FLAGS)
    for key in sorted(keys):
        values = [float(u[key]) for u in updates if u.get(key) is not None]
        if not values:
            continue
        if key.endswith("_max"):
            out[key] = max(values)
        elif key == "lr" or key.endswith("/lr"):
            out[key] = values[-1]
        else:
            out[key] = sum(values) / len(values)
    out["train/updates"] = float(len(updates))
    return out


def write_anchor_file(run_dir: str | Path, step: int, result: RolloutResult) -> Path:
    """``run_dir/anchors/step_XXXXXX.jsonl``: one ``stats`` line, then one line per query seen.

    Query lines: ``query_id``, ``gen_batch``, ``reason`` (accepted | all_correct | all_wrong |
    no_reference_correct), correct counts of policy and reference samples, the response
    lengths of its policy samples (``policy_lengths``: ``armor plan --lengths`` reads them),
    ``kept`` (accepted
    and among the first ``B``), for kept groups ``policy_versions`` (the policy weight versions
    that generated their on-policy samples) and, with an anchor, ``anchor_len``,
    ``anchor_score`` and ``anchor_version`` (the reference weight version that generated it).
    """
    path = Path(run_dir) / "anchors" / f"step_{step:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    anchors = {
        g.query_id: g.samples[g.anchor_index] for g in result.groups if g.anchor_index is not None
    }
    policy_versions = {
        g.query_id: sorted({s.weight_version for s in g.samples if s.source == SampleSource.POLICY})
        for g in result.groups
    }
    lines = [json.dumps({"type": "stats", "step": step, **result.stats.as_metrics()})]
    for record in result.records:
        record = {"type": "query", **record}
        if record.get("kept"):
            record["policy_versions"] = policy_versions[record["query_id"]]
        anchor = anchors.get(record["query_id"]) if record.get("kept") else None
        if anchor is not None:
            record.update(anchor_len=anchor.response_len, anchor_score=anchor.score,
                          anchor_version=anchor.weight_version)  # fmt: skip
        lines.append(json.dumps(record))
    tmp = path.with_suffix(".tmp")
    with writing(path):
        tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    path.with_name(path.name + ".gz").unlink(missing_ok=True)  # a resumed run redoes the step
    return path


def exact_kl_mask(batch: TrainBatch, samples: int, positions: int) -> torch.Tensor | None:
    """``[total]`` bool over ``batch``: ``positions`` evenly spaced response tokens of each of
    a few evenly spaced on-policy samples — the tokens of the trainer's exact-KL diagnostic.
    ``None`` when the batch has no on-policy response token."""
    bounds = batch.cu_seqlens.tolist()
    n, owner = batch.num_samples, batch.sample_index
    per_sample = lambda flags: torch.zeros(n).index_add_(0, owner, flags.float()) > 0  # noqa: E731
    on_policy = (per_sample(batch.loss_mask != 0) & ~per_sample(batch.is_anchor)).nonzero()
    on_policy = on_policy.squeeze(1).tolist()
    if not on_policy or samples < 1 or positions < 1:
        return None
    take = min(samples, len(on_policy))
    mask = torch.zeros(batch.num_tokens, dtype=torch.bool)
    for i in (on_policy[(k * len(on_policy)) // take] for k in range(take)):
        response = (batch.loss_mask[bounds[i] : bounds[i + 1]] > 0).nonzero().squeeze(1) + bounds[i]
        keep = min(positions, len(response))
        mask[response[[(k * len(response)) // keep for k in range(keep)]]] = True
    return mask


def exact_kl_batch(batch: TrainBatch, samples: int, positions: int) -> TrainBatch | None:
    """The samples of :func:`exact_kl_mask` as a batch of their own whose ``loss_mask`` keeps
    only the diagnostic's tokens (the input of ``trainer.exact_kl``)."""
    mask = exact_kl_mask(batch, samples, positions)
    if mask is None:
        return None
    bounds = batch.cu_seqlens.tolist()
    ids = [i for i in range(batch.num_samples) if mask[bounds[i] : bounds[i + 1]].any()]
    small = batch.select(ids)
    small.loss_mask = torch.cat([mask[bounds[i] : bounds[i + 1]] for i in ids]).to(
        batch.loss_mask.dtype
    )
    return small


def compress_anchor_files(run_dir: str | Path, up_to_step: int) -> list[Path]:
    """Gzip ``anchors/step_XXXXXX.jsonl`` of steps ``<= up_to_step`` into
    ``step_XXXXXX.jsonl.gz`` (JSON lines shrink about tenfold: a 2,000-step run at the paper's
    scale keeps ~0.1 MB a step instead of ~0.85 MB); returns the new files. The session calls it
    with the step of the checkpoint before the one just written, so the files of the newest
    checkpoint interval stay plain and no resume ever rewrites a compressed step."""
    done = []
    for path in sorted((Path(run_dir) / "anchors").glob("step_*.jsonl")):
        if int(path.name[len("step_") : -len(".jsonl")]) > up_to_step:
            continue
        out = path.with_name(path.name + ".gz")
        tmp = out.with_suffix(".tmp")
        with path.open("rb") as src, gzip.open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        tmp.replace(out)
        path.unlink()
        done.append(out)
    return done


def anchor_file_steps(run_dir: str | Path) -> list[int]:
    """The steps that have an anchor file, plain or gzipped, in order."""
    names = (p.name for p in (Path(run_dir) / "anchors").glob("step_*.jsonl*"))
    return sorted({int(n[len("step_") :].split(".")[0]) for n in names if not n.endswith(".tmp")})


def read_anchor_file(run_dir: str | Path, step: int) -> list[dict]:
    """The records of ``anchors/step_XXXXXX.jsonl`` (or of its ``.gz``)."""
    path = Path(run_dir) / "anchors" / f"step_{step:06d}.jsonl"
    if path.is_file():
        text = path.read_text()
    else:
        with gzip.open(path.with_name(path.name + ".gz"), "rt") as f:
            text = f.read()
    return [json.loads(line) for line in text.splitlines() if line]
