"""What the orchestrator checkpoints besides the trainer, and the preemption signals.

:class:`RunState` holds everything a resume needs to continue *exactly*: the step counter,
the data sampler position, the Python/torch RNG states of the driver, the reset schedule,
the weight versions, the count of non-finite updates in a row, and each rollout engine's
reference-sampler state (the anchor cache and the reference weight version). Sampling seeds are derived from ``(seed, step, batch)``,
so these states are enough to regenerate the same samples.

SIGTERM (preemption, ``scancel``), SIGINT (Ctrl-C) and SIGUSR1 (Slurm's ``--signal``) set a
flag; the loop finishes the current step, writes a checkpoint and exits with
:data:`EXIT_REQUEUE` (75, ``EX_TEMPFAIL``) so a batch script can ``scontrol requeue`` the job.
"""

from __future__ import annotations

import pickle
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

EXIT_REQUEUE = 75
STATE_FILE = "orchestrator.pt"


@dataclass
class RunState:
    """The orchestrator's part of a checkpoint, in types the safe loader accepts (ints, floats,
    strings, lists, tuples, dicts, tensors): ``torch.load(weights_only=True)`` never runs code
    from a checkpoint file."""

    step: int = 0
    policy_version: int = 0
    ref_version: int = 0
    sampler: dict = field(default_factory=dict)
    reset: dict = field(default_factory=dict)
    rollout: list[dict] = field(default_factory=list)
    watch: dict = field(default_factory=dict)
    """Keep-best and over-optimization detector state (``run_watch.py``)."""
    skipped_in_a_row: int = 0
    """Optimizer updates skipped in a row for a non-finite loss or gradient norm, up to this
    step (``orchestration/step/update_guard.py``): a resume keeps counting toward
    ``trainer.max_skipped_updates``; 0 in checkpoints that predate it."""
    metrics_line: dict = field(default_factory=dict)
    """The ``metrics.jsonl`` line of ``step`` (``metrics_record``), written back on resume when a
    kill came between the checkpoint and the line; ``{}`` in checkpoints that predate it."""
    pending: dict = field(default_factory=dict)
    """The next step's rollout, drawn during this step (``orchestration.async_rollout:
    one_step``, ``async_rollout.collected_state``); ``{}`` when none is in flight."""
    python_rng: Any = None
    torch_rng: Any = None

    def capture_rng(self) -> None:
        self.python_rng = random.getstate()  # (version, tuple of 625 ints, gauss or None)
        self.torch_rng = torch.get_rng_state()

    def restore_rng(self) -> None:
        if self.python_rng is not None:
            version, internal, gauss = self.python_rng
            random.setstate((int(version), tuple(internal), gauss))
        if self.torch_rng is not None:
            torch.set_rng_state(self.torch_rng)

    def save(self, checkpoint_dir: str | Path) -> Path:
        path = Path(checkpoint_dir) / STATE_FILE
        torch.save(self.__dict__, path)
        return path

    @classmethod
    def load(cls, checkpoint_dir: str | Path) -> RunState:
        """The state saved in ``checkpoint_dir``; a file that needs more than the safe loader
        (a crafted or foreign pickle) is refused with :class:`pickle.UnpicklingError`."""
        path = Path(checkpoint_dir) / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} missing: {checkpoint_dir} is not an orchestrator checkpoint"
            )
        try:
            saved = torch.load(path, weights_only=True)
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(
                f"{path} holds objects the safe loader (torch.load weights_only=True) refuses: "
                f"{str(e).splitlines()[0]}; it was not written by this version of the recipe "
                "(or was tampered with): resume from another checkpoint"
            ) from None
        return cls(**saved)


class StopSignal:
    """Remember a SIGTERM/SIGINT/SIGUSR1 so the loop can checkpoint at the end of the step.

    Use it as a context manager around the whole run, so that the handler is in place before
    anything starts, and :meth:`guarded` around start-up code that would replace it.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: int | None = None
        self.received_at = 0.0  # time.monotonic() of the first signal
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def install(self) -> StopSignal:
        """Take over the signals (again after start-up code that installs its own handler)."""
        for sig in self.SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        return self

    @contextmanager
    def guarded(self) -> Iterator[None]:
        """Keep this handler while the body runs: start-up code that installs its own handler
        for these signals (``ray.init`` installs one that exits at once) is refused, as Ray's
        own ``DeferSigint`` does it, by a ``signal.signal`` that leaves them alone; and the
        signals are blocked meanwhile, so a handler installed below Python (Ray's core worker
        installs absl's failure signal handler, which covers SIGTERM and aborts) never sees
        one: a signal that arrives stays pending and reaches this handler when the body ends.
        The end unblocks them also when the caller held them from its first line
        (:func:`~megatron_armor.orchestration.actors.ray_node.held_stop_signals`)."""
        original = signal.signal

        def keep_ours(signum, handler):
            if signum in self.SIGNALS:
                return self._handle
            return original(signum, handler)

        signal.signal = keep_ours
        signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        try:
            yield
        finally:
            signal.signal = original
            self.install()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received_at = time.monotonic()
        self.received = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
