"""The SGLang servers under ``logging.profile`` (docs/profiling.md, "The SGLang servers").

- ``nsys`` without ``orchestration.ray_address`` (``launch/profile.sh``): the servers are
  descendants of the driver, which runs under Nsight Systems, and are followed into its report
  (``--trace-fork-before-exec``) on the same timeline as the driver's phase ranges; the trainer
  ranks' ``cudaProfilerStart``/``Stop`` around the chosen steps bound the capture. Nothing to
  ask of them.
- ``nsys`` on a Ray cluster (a Slurm job: the driver is no server's ancestor): each server
  runs under its own Nsight Systems session (:meth:`ServerProfile.command`) that records only
  between ``cudaProfilerStart`` and ``Stop``, which the server calls when asked
  (``POST /start_profile {"activities": ["CUDA_PROFILER"]}`` at a chosen step's start,
  ``/stop_profile`` at its end): one report per server and step,
  ``RUN_DIR/profile/sglang_<pool><i>_<pid>*.nsys-rep``.
- ``torch``: the servers' own torch profiler for the chosen steps (``activities`` CPU and GPU),
  Chrome traces in ``RUN_DIR/profile/sglang_<pool><i>/``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

NSYS_SERVER_OPTIONS = (
    "--trace=cuda,nvtx,osrt",
    "--sample=none",
    "--capture-range=cudaProfilerApi",
    "--capture-range-end=repeat",  # every chosen step its own range and report
    "--trace-fork-before-exec=true",  # the scheduler and TP workers are the server's children
    "--force-overwrite=true",
)


@dataclass(frozen=True)
class ServerProfile:
    """How a run's SGLang servers are captured (module docstring)."""

    kind: str
    """``nsys`` | ``torch`` (``logging.profile``)."""
    steps: tuple[int, ...]
    out_dir: str
    """``RUN_DIR/profile``."""
    own_nsys: bool
    """Each server under its own Nsight Systems session (a Ray cluster)."""

    def wants(self, step: int) -> bool:
        return step in self.steps

    def command(self, command: list[str], name: str) -> list[str]:
        """``command`` of server ``name`` under its own Nsight Systems session where it needs
        one, else as it is."""
        if self.kind != "nsys" or not self.own_nsys:
            return command
        output = os.path.join(self.out_dir, f"{name}_%p")
        return ["nsys", "profile", *NSYS_SERVER_OPTIONS, f"--output={output}", *command]

    def start_payload(self, name: str) -> dict | None:
        """The ``/start_profile`` body for server ``name`` at a chosen step (``None``: nothing
        to ask, the driver's Nsight Systems session follows it)."""
        if self.kind == "nsys":
            return {"activities": ["CUDA_PROFILER"]} if self.own_nsys else None
        return {"activities": ["CPU", "GPU"], "output_dir": os.path.join(self.out_dir, name)}


def server_profile(config) -> ServerProfile | None:
    """The run's :class:`ServerProfile` (``None``: ``logging.profile`` none or dlprof)."""
    log = config.logging
    if log.profile not in ("nsys", "torch"):
        return None
    run_dir = os.path.join(config.run.output_dir, config.run.name)
    return ServerProfile(log.profile, tuple(log.profile_steps), os.path.join(run_dir, "profile"),
                         bool(config.orchestration.ray_address))  # fmt: skip
