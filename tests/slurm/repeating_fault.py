#!/usr/bin/env python3
"""A training driver whose every start meets the same fault at step 2, for the Slurm tier's
requeue-loop test; used as ``ARMOR_DRIVER="python repeating_fault.py train"``.

It runs as ``armor train`` does: the real ``armor`` parent (``cli/supervise.py``, which
records each exit 75 in the run's ``requeues.jsonl`` and ends a loop with exit 70) runs it as
its driver, inside the real ``slurm/armor.sbatch`` (which requeues the job on exit 75), on the
run directory of the job's config (``load_config``). It stands for a driver whose trainer rank
dies at the same step after every resume (a deterministic crash, a bad setting) without
training: it reports the phase and the cause a real one reports (``loop.requeue_cause``) and
exits 75. What it cannot show is that a real fault repeats with the same cause; the unit tier
checks how the cause is made (``tests/unit/test_driver_watch.py``) and the e2e tier the causes
of real faults (``tests/e2e/test_driver_watch_e2e.py``).
"""

from __future__ import annotations

import sys

from megatron_armor.cli import CHECKPOINT_ON_SIGNAL, supervise
from megatron_armor.supervisor_pipe import adopt_pipe, report_phase, tell_supervisor

CAUSE = "TrainerWorker 0 failed (ActorDiedError)"


def main(args: list[str]) -> int:
    from megatron_armor.config import load_config
    from megatron_armor.orchestration.run.session import run_dir_of

    adopt_pipe()
    overrides = [a for a in args[2:] if "=" in a and not a.startswith("-")]
    run_dir = run_dir_of(load_config(args[1], overrides))
    run_dir.mkdir(parents=True, exist_ok=True)
    tell_supervisor("run_dir", run_dir)
    report_phase("step", 2)
    print(f"armor train: fault at step 2: {CAUSE[:-1]}: the stand-in's crash); exiting 75 for "
          "a requeue", file=sys.stderr, flush=True)  # fmt: skip
    tell_supervisor("cause", CAUSE)
    tell_supervisor("exit", 75)
    return 75


if __name__ == "__main__":
    if supervise.wanted(None, CHECKPOINT_ON_SIGNAL):
        sys.exit(supervise.supervise(sys.argv[1:]))
    sys.exit(main(sys.argv[1:]))
