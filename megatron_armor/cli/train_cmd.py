"""``armor train CONFIG [key=value ...] [--resume auto|none|PATH]``: run ARMOR end to end.

Exit codes: 0 done; 2 bad config or input file (named before Ray starts: config values, the
model directory and its weights, the tokenizer, the data files, a resumed checkpoint of
another model), a run directory in use by another run, or no resumable checkpoint; 3 a step
accepted too few queries (``AcceptanceError``, below ``algo.min_batch_fraction`` of
``rollout.batch`` or any short step with ``algo.on_short_batch=error``): change a setting the
message names and resume, a requeue would meet the same queries; 75 (``EX_TEMPFAIL``) requeue
me: a SIGTERM/SIGINT/SIGUSR1 arrived, the current step finished and a checkpoint was written
(or, during start-up, nothing was written; a call that did not finish within
``orchestration.stop_wait_s`` of the signal is left behind), or a fault the run cannot recover
from in place (a trainer rank died or was stuck past its call deadline;
``orchestration/actors/faults.py``, ``call_watch.py``; Ray's raylet or GCS lost, named by
the ``armor`` process that runs the driver, ``cli/supervise.py``) — the job resumes from the newest
complete checkpoint (``--resume auto`` is the default); 65 (``EX_DATAERR``) training diverged:
``trainer.max_skipped_updates`` updates in a row had a non-finite loss or gradient norm, a
checkpoint of the last applied weights was written and the error names the settings to change
(never requeued: the same settings would diverge again); 69 (``EX_UNAVAILABLE``) workers kept
dying: more than ``run.max_recoveries`` replaced within ``run.recovery_window`` steps (never
requeued); 74 (``EX_IOERR``) the run's disk is full (a checkpoint, an anchor file, the metrics;
never requeued: free space first);
anything else is a failure."""

from __future__ import annotations

import argparse
import sys

from megatron_armor.config import ConfigError, load_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train with ARMOR (Ray orchestrator)")
    p.add_argument("config", help="YAML config (may name one `base:` parent)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.steps=20")
    p.add_argument("--resume", default=None,
                   help="auto (newest checkpoint of the run, default: run.resume) | none | PATH")  # fmt: skip
    p.add_argument("--no-summary", action="store_true", help="skip the end-of-run table and plots")
    p.set_defaults(run=run)


def stopping_errors() -> tuple[type, ...]:
    """The named errors that end a run with their own exit code (:func:`exit_code_of`)."""
    from megatron_armor.orchestration.actors.faults import RecoveryLimitError
    from megatron_armor.orchestration.run.checkpoints import CheckpointError
    from megatron_armor.orchestration.run.run_lock import RunDirLocked
    from megatron_armor.orchestration.step.update_guard import DivergedError
    from megatron_armor.reward.pool import RewardPoolError

    return (RunDirLocked, CheckpointError, DivergedError, RecoveryLimitError, RewardPoolError)


def exit_code_of(err: BaseException) -> int:
    """74 disk full, 65 diverged, 69 workers that keep dying, 1 a scoring pool that cannot
    start its workers, 2 a refused run directory or checkpoint."""
    from megatron_armor.orchestration.actors.faults import EXIT_RECOVERY_LIMIT, RecoveryLimitError
    from megatron_armor.orchestration.run.disk_space import EXIT_NO_SPACE, DiskFullError
    from megatron_armor.orchestration.step.update_guard import EXIT_DIVERGED, DivergedError
    from megatron_armor.reward.pool import RewardPoolError

    codes = ((DiskFullError, EXIT_NO_SPACE), (DivergedError, EXIT_DIVERGED),
             (RecoveryLimitError, EXIT_RECOVERY_LIMIT), (RewardPoolError, 1))  # fmt: skip
    return next((code for cls, code in codes if isinstance(err, cls)), 2)


def report_stop(prog: str, err: BaseException) -> int:
    """Print ``err`` (its class named, but for a refused start: exit 2; raised in a Ray actor:
    the actor's own error, without the remote traceback) and return its code."""
    code = exit_code_of(err)
    shown = getattr(err, "cause", None) or err
    named = f"{type(shown).__name__}: " if code != 2 else ""
    print(f"{prog}: {named}{shown}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, args.overrides, check_inputs=True)
    except ConfigError as e:
        print(f"armor train: {e}", file=sys.stderr)
        return 2
    from megatron_armor.planner.plan import colocated_memory_problem

    problem = colocated_memory_problem(config)  # the memory plan, before Ray starts
    if problem:
        print(f"armor train: {args.config}: {problem}", file=sys.stderr)
        return 2
    from megatron_armor.orchestration.actors.placement import ray_environment

    ray_environment(config)  # before Ray is imported (it reads some settings at import)
    from megatron_armor.orchestration.run.finish import finish
    from megatron_armor.orchestration.run.run_state import EXIT_REQUEUE
    from megatron_armor.orchestration.run.session import run_dir_of
    from megatron_armor.orchestration.step.loop import train

    try:
        code = train(config, args.resume or config.run.resume)
    except stopping_errors() as e:
        return report_stop("armor train", e)
    if code == 0 and not args.no_summary:
        finish(run_dir_of(config))
    elif code == EXIT_REQUEUE:
        print(f"armor train: interrupted; resume with `armor train {args.config} --resume auto`")
    return code
