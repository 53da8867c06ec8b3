#!/usr/bin/env python3
"""A training driver that checkpoints on a stop signal, for the Slurm tier's plain-``scancel``
test; used as ``ARMOR_DRIVER="python checkpointing_driver.py"`` inside the real
``slurm/armor.sbatch``.

It stands for ``armor train`` waiting in a step: on SIGTERM or SIGUSR1 it says what the real
driver says once its checkpoint is written and exits 75 (a requeue request), at once. What it
cannot show is the checkpoint itself or how long a real one takes within Slurm's ``KillWait``:
the real driver's signal handling is the e2e and Slurm tiers' (``tests/slurm/test_signals.py``).
"""

from __future__ import annotations

import signal
import sys
import time


def main() -> int:
    stopped: list[str] = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda num, _frame: stopped.append(signal.Signals(num).name))
    print("armor train: starting (stand-in); waiting for a stop signal", flush=True)
    deadline = time.monotonic() + 600
    while not stopped and time.monotonic() < deadline:
        time.sleep(0.1)
    if not stopped:
        print("no stop signal within 600 s", flush=True)
        return 1
    print(f"{stopped[0]}: checkpoint of step 1 written (stand-in); exiting 75 (requeue to "
          "resume)", flush=True)  # fmt: skip
    return 75


if __name__ == "__main__":
    sys.exit(main())
