"""Metric sinks: JSONL always, TensorBoard and Weights & Biases when enabled.

Every training step produces one flat dict of ``namespace/name -> float`` (docs/metrics.md
lists them). :class:`MetricsLogger` writes it as one line of ``run_dir/metrics.jsonl``
(``{"step": s, "wall_time": t, ...}``), to TensorBoard event files under ``run_dir/tb`` and,
when asked, to W&B. On resume, lines of steps that will be recomputed are dropped first
(:func:`truncate_metrics`) so the file always holds one line per step. A checkpoint carries
the line of its own step (:func:`metrics_record`), so a kill between the checkpoint and the
line costs nothing: the resume writes the line back (``Session.restore``).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def _clean(value: Any) -> float:
    """The value as a float; NaN and inf stay what they are (``json`` writes them as ``NaN``,
    ``Infinity``, ``-Infinity`` and reads them back), never silently ``null``."""
    return float(value)


def non_finite_keys(metrics: dict[str, Any]) -> list[str]:
    """The keys of ``metrics`` whose value is a NaN or an infinity, sorted."""
    return sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All step records of ``run_dir/metrics.jsonl`` in file order (missing file -> ``[]``).

    A last line without its newline is an append cut short by a kill: it is left out (the
    step's checkpoint, if any, carries the line); a damaged line anywhere else is an error."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):  # no newline after it: a torn append
                break
            raise ValueError(f"{path}:{number} is not a JSON line ({e}); the file was edited "
                             "or damaged: restore it or delete the line") from None  # fmt: skip
    return records


def metrics_record(step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """The line of ``step``: ``{"step", "wall_time", <metric>: float, ...}``, keys sorted, in
    types the checkpoint's safe loader accepts; a non-finite value is kept as it is."""
    clean = {k: _clean(v) for k, v in sorted(metrics.items())}
    return {"step": int(step), "wall_time": time.time(), **clean}


WALL_CLOCK_KEYS = ("timing/", "phase/", "perf/", "wall_time", "reward/verify_seconds",
                   "mem/", "disk/", "watch/memory", "watch/disk", "async/rollout_wait",
                   "async/trainer_wait", "async/overlap", "faults/")  # fmt: skip
"""Prefixes of the metrics that depend on the wall clock or on the machine's state (host
memory, the file system: ``mem/*``, ``disk/*`` and their watchers); all others are
reproducible."""


def without_wall_clock(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` less its wall-clock metrics: what an exact resume must reproduce."""
    return {k: v for k, v in record.items() if not k.startswith(WALL_CLOCK_KEYS)}


def truncate_metrics(run_dir: str | Path, last_step: int) -> int:
    """Drop records with ``step > last_step`` (a resume recomputes them); returns kept count."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    kept = [r for r in read_metrics(run_dir) if int(r.get("step", 0)) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)
    return len(kept)


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Name ``path`` in an ``OSError`` raised by the writes inside: a failed ``write``,
    ``flush`` or ``close`` carries no file name, and a full disk is reported with the file
    that met it (``orchestration/run/disk_space.full_disk_error``)."""
    try:
        yield
    except OSError as err:
        if err.filename is not None or err.errno is None:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err


def _quiet_tensorboard_writer_threads() -> None:
    """Keep the traceback of a failed write of TensorBoard's writer thread out of the log.

    The thread keeps the error, and the sink's next ``flush`` or ``close`` raises it in the
    driver, which names it (a full disk: ``DiskFullError`` with the file and the intact
    checkpoint); the thread also re-raises it, and Python's default hook would print its
    traceback beside that message. Other threads' errors go to the hook there was before."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    previous = threading.excepthook
    if getattr(previous, "_armor_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        thread = args.thread
        if isinstance(thread, _AsyncWriterThread) and thread.exception is args.exc_value:
            return  # raised again by the writer's next flush or close
        previous(args)

    hook._armor_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class _TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        _quiet_tensorboard_writer_threads()
        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.log_dir = log_dir

    def rewind(self, last_step: int) -> None:
        """A new event file whose first event purges every step after ``last_step``: readers
        (TensorBoard's ``EventAccumulator``) drop the abandoned trajectory's events."""
        from torch.utils.tensorboard import SummaryWriter

        with writing(self.log_dir):
            self.writer.close()
            self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=last_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with writing(self.log_dir):
            for key, value in metrics.items():
                if value is not None:
                    self.writer.add_scalar(key, value, global_step=step)
            self.writer.flush()

    def close(self) -> None:
        with writing(self.log_dir):
            self.writer.close()


WANDB_ID_FILE = "wandb_run_id"
"""The run directory's W&B run id: a requeued job continues that W&B run (``resume="allow"``)."""


@dataclass(frozen=True)
class WandbSettings:
    """Where a run logs in W&B (``logging.wandb_*``, docs/metrics.md)."""

    project: str = "megatron_armor"
    entity: str = ""
    group: str = ""
    mode: str = "online"


def wandb_run_id(run_dir: Path, generate) -> str:
    """The id kept in ``RUN_DIR/wandb_run_id``; a new one from ``generate()`` is written there
    first (atomically), so every later start of the run directory continues the same W&B run."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = generate()
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id


class _WandbSink:
    def __init__(self, settings: WandbSettings, name: str, run_dir: Path, config: dict | None):
        try:
            import wandb
        except ImportError:
            raise RuntimeError(
                "logging.wandb=true but the `wandb` package is not installed; "
                "`pip install -r requirements-wandb.txt` or set logging.wandb=false"
            ) from None
        self.wandb = wandb
        self.init_args = dict(
            project=settings.project,
            entity=settings.entity or None,
            group=settings.group or None,
            mode=settings.mode,
            name=name,
            id=wandb_run_id(run_dir, lambda: secrets.token_hex(6)),
            dir=str(run_dir),
            config=config,
        )
        self.run = self._init(resume="allow")

    def _init(self, **resume):
        # a Settings object per init: wandb.init records the resume choice in it
        settings = self.wandb.Settings(console="off")  # the job's own log keeps the console
        return self.wandb.init(settings=settings, **resume, **self.init_args)

    def rewind(self, last_step: int) -> None:
        """Continue the W&B run from ``last_step + 1``: W&B ignores a ``log(step=)`` below its
        last step, so the run is rewound (``resume_from``, W&B's own) and its later steps go."""
        self.run.finish()
        self.run = self._init(resume_from=f"{self.init_args['id']}?_step={last_step + 1}")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Write one record per step to every enabled sink.

    Args:
        run_dir: the run directory (``metrics.jsonl`` and ``tb/`` live there).
        tensorboard: also write TensorBoard event files.
        wandb: also log to W&B (clear error when ``wandb`` is not installed).
        wandb_project / run_name / config: W&B run identity and the resolved config.
        wandb_settings: entity, group and mode (its project overrides ``wandb_project``).
    """

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "megatron_armor",
        run_name: str = "armor",
        config: dict | None = None,
        wandb_settings: WandbSettings | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.sinks: list[Any] = []
        if tensorboard:
            self.sinks.append(_TensorBoardSink(self.run_dir / "tb"))
        if wandb:
            settings = wandb_settings or WandbSettings(project=wandb_project)
            self.sinks.append(_WandbSink(settings, run_name, self.run_dir, config))

    def log(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Append ``metrics`` for ``step``; returns the cleaned metrics that were written."""
        return self.write(metrics_record(step, metrics))

    def rewind(self, last_step: int) -> int:
        """Forget every step after ``last_step`` (a resume from an older checkpoint recomputes
        them) in ``metrics.jsonl`` and, when it held any, in TensorBoard and W&B; returns the
        number of steps dropped."""
        before = len(read_metrics(self.run_dir)) if self.path.is_file() else 0
        dropped = before - truncate_metrics(self.run_dir, last_step)
        if dropped:
            for sink in self.sinks:
                sink.rewind(last_step)
        return dropped

    def write(self, record: dict[str, Any]) -> dict[str, float]:
        """Append a :func:`metrics_record` line to every sink; returns its metrics."""
        step = int(record["step"])
        clean = {k: v for k, v in record.items() if k not in ("step", "wall_time")}
        with writing(self.path), self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.log(step, clean)
        return clean

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
