"""``armor plan CONFIG [key=value ...] [--model NAME|DIR] [--gpu-mem-gib 80] [--device GPU]
[--assume NAME=VALUE ...] [--checkpoint CKPT] [--lengths RUN_DIR]``: preflight check.

Prints per-GPU memory per phase (weights, grads, optimizer, activations, logits, SGLang share;
a mixture-of-experts model adds its all-to-all buffers and its active parameters), the size of
one checkpoint and the disk peak during a save, the layout-rule findings and a verdict naming
the largest term; then each step phase's predicted seconds on ``--device`` with the workload
and efficiencies assumed (``planner/phase_plan.py``). With ``--checkpoint`` (a run checkpoint
``step_XXXXXX``, or a run directory: its newest complete one), also the layouts of the config's
allocation (``trainer.world_size``) the model admits, whether the checkpoint resumes at each and
whether each fits (``planner/resume.py``). Exit code 0 when the plan fits (and the checkpoint
resumes at the configured layout), 1 when it does not (or a rule fails), 2 on a
config/model/checkpoint error: run it before sbatch. ``--lengths RUN_DIR`` adds a projection of
the rollout time partial rollouts would save on the config's layout, from that run's response
lengths (``planner/tail.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_armor.config import ConfigError, load_config
from megatron_armor.config.resume_layout import read_saved_layout
from megatron_armor.orchestration.run.checkpoints import latest_checkpoint
from megatron_armor.orchestration.run.resume_check import model_shape_problem
from megatron_armor.planner.model import PRESETS
from megatron_armor.planner.plan import make_plan
from megatron_armor.planner.resume import resume_report


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="estimate per-GPU memory and check the parallel layout")
    p.add_argument("file", help="YAML config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.tp=2")
    p.add_argument(
        "--model",
        default=None,
        help=f"HF model dir / config.json or a preset ({', '.join(PRESETS)}); "
        "default: trainer.model_path",
    )
    p.add_argument("--gpu-mem-gib", type=float, default=None,
                   help="memory of one GPU (GiB); default: orchestration.gpu_memory_gib (80)")  # fmt: skip
    p.add_argument("--checkpoint", default=None,
                   help="a run checkpoint (or run directory: its newest): the layouts of this "
                   "allocation it resumes at")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the terms as JSON")
    p.add_argument("--device", default="H100 SXM",
                   help="GPU of the predicted phase times (planner/devices.py); the cpu layout "
                   "measures this machine's CPU")  # fmt: skip
    p.add_argument("--assume", action="append", default=[], metavar="NAME=VALUE",
                   help="an efficiency or workload assumption of the predicted phase times "
                   "(planner/phase_time.py), e.g. train_mfu=0.3 or acceptance=0.4")  # fmt: skip
    p.add_argument("--lengths", default=None, metavar="RUN_DIR",
                   help="project the rollout time partial rollouts save (async_rollout=bounded, "
                   "max_staleness 2 and 4) from this run's response lengths")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.gpu_mem_gib is not None and not args.gpu_mem_gib > 0:
            raise ValueError(
                f"--gpu-mem-gib={args.gpu_mem_gib:g}: must be the memory of one GPU in GiB, > 0 "
                "(e.g. 80 for an H100, 141 for an H200)"
            )
        config = load_config(args.file, args.overrides)
        gib = args.gpu_mem_gib or config.orchestration.gpu_memory_gib
        plan = make_plan(config, model=args.model, gpu_mem_gib=gib)
        resume = _resume_lines(args, config, gib) if args.checkpoint else None
        times = phase_times(config, plan.model, args.device, args.assume, gib)
        tail = tail_projection(config, plan, args.lengths) if args.lengths else None
    except (ConfigError, ValueError, OSError) as e:
        print(f"armor plan: {e}", file=sys.stderr)
        return 2
    lines, resumes = resume or ([], True)
    if args.json:
        print(json.dumps({**_as_dict(plan), "phase_times": times.as_dict(),
                          **({"resume": lines} if resume else {}), **_tail_dict(tail)},
                         indent=2))  # fmt: skip
    else:
        print("\n".join([plan.report(), times.report(), *lines,
                         *([tail.report()] if tail else [])]))  # fmt: skip
    return 0 if plan.fits and resumes else 1


def _resume_lines(args: argparse.Namespace, config, gib: float) -> tuple[list[str], bool]:
    """``planner.resume.resume_report`` of ``--checkpoint`` (a checkpoint of another model
    shape, or one that records no layout, is a ``ValueError``)."""
    path = Path(args.checkpoint)
    if not (path / "trainer").is_dir():
        path = latest_checkpoint(path) or path
    saved = read_saved_layout(path)
    if saved is None:
        raise ValueError(
            f"--checkpoint {args.checkpoint}: {path} holds no trainer checkpoint that records its "
            "parallel layout (trainer/dist/common.pt); name a run checkpoint step_XXXXXX or its "
            "run directory"
        )
    wrong = model_shape_problem(path, config.trainer.model_path)
    if wrong is not None:
        raise ValueError(f"--checkpoint {args.checkpoint}: {wrong}")
    return resume_report(config, saved, str(path), args.model, gib)


def phase_times(config, dims, device: str, assume: list[str], gpu_mem_gib: float):
    """The predicted step (``planner/phase_plan.py``) on ``device``, or on this machine's CPU
    (measured now) for the ``cpu`` layout, under the ``--assume`` values."""
    from megatron_armor.planner.devices import cpu_peaks
    from megatron_armor.planner.phase_plan import make_phase_plan, plan_device
    from megatron_armor.planner.phase_time import (
        Efficiency,
        WorkloadGuess,
        check_assumptions,
        parse_assumptions,
    )

    check_assumptions(assume)
    if config.orchestration.layout == "cpu":
        from megatron_armor.orchestration.actors.placement import plan_layout

        peaks = cpu_peaks(plan_layout(config).threads)
    else:
        peaks = plan_device(device)
    eff, guess = parse_assumptions(assume, Efficiency), parse_assumptions(assume, WorkloadGuess)
    return make_phase_plan(config, dims, peaks, eff, guess, gpu_mem_gib)


def tail_projection(config, plan, run_dir: str):
    """``--lengths``: the :class:`~megatron_armor.planner.tail.TailProjection` of ``run_dir``'s
    response lengths on ``config``'s engines (their KV cache in ``plan``) and
    ``max_new_tokens``."""
    from megatron_armor.planner.tail import (
        engine_slots,
        project_tail,
        requests_per_engine,
        run_lengths,
    )

    lengths, run_max_new = run_lengths(run_dir)
    return project_tail(lengths, run_max_new, config.rollout.sampling.max_new_tokens,
                        requests_per_engine(config),
                        engine_slots(config, plan, lengths, run_max_new))  # fmt: skip


def _tail_dict(tail) -> dict:
    if tail is None:
        return {}
    return {"tail_projection": {
        "requests_per_engine": tail.requests_per_engine, "slots": tail.slots,
        "samples": tail.samples,
        "synchronous_decode_steps": tail.synchronous,
        "bounded_decode_steps": {str(k): v for k, v in tail.windowed.items()},
        "bounded_saved_fraction": {str(k): tail.saved(k) for k in tail.windowed},
    }}  # fmt: skip


def _as_dict(plan) -> dict:
    name, size = plan.largest_term
    return {
        "model": plan.model.name,
        "parameters": plan.model.total_params(),
        "active_parameters": plan.model.active_params(),
        "phases_gib": {p: {k: v / 2**30 for k, v in t.items()} for p, t in plan.phases.items()},
        "peak_phase": plan.peak_phase,
        "largest_term": name,
        "largest_term_gib": size / 2**30,
        "fits": plan.fits,
        "checkpoint_gib": plan.checkpoint_bytes / 2**30,
        "checkpoint_peak_gib": plan.checkpoint_peak_bytes / 2**30,
        "findings": [str(f) for f in plan.findings],
        "verdict": plan.verdict(),
    }
