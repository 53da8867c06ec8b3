"""A frozen Ray node is a lost one: the driver's probe of its own raylet and of the GCS.

A raylet or GCS that dies ends the driver (Ray's core exits it; ``cli/supervise.py`` names the
loss). One that stops answering (``SIGSTOP``, a node deep in swap, a wedged process) ends
nothing: Ray's GCS marks a silent raylet dead only after its health checks, and a driver
whose calls wait on it waits on. So the driver runs :class:`ControlPlaneProbe`, a thread that
asks the GCS every ``RAY_health_check_period_ms`` whether the driver's node is alive
(``GcsClient.check_alive``, bounded by ``RAY_health_check_timeout_ms``):

- the GCS answers that the node is dead (its raylet missed ``RAY_health_check_failure_threshold``
  health checks in a row): the raylet is lost;
- the GCS does not answer ``RAY_health_check_failure_threshold`` probes in a row: the GCS is
  lost.

Either is said once on the run log and reported to the ``armor`` parent (``lost`` through the
pipe, ``supervisor_pipe.py``), which kills the driver with every process it started and exits
75, as for a killed raylet. The three settings are Ray's own (read by its GCS for the
raylets' health checks); :func:`health_check_environment` tightens their defaults for the
local Ray head a run starts (:data:`HEALTH_CHECKS`: a silent raylet is declared dead after
about ``threshold x (period + timeout)`` = 25 s instead of Ray's 65 s). A cluster started
outside the run (``orchestration.ray_address``, ``slurm/armor.sbatch``) keeps the values its
GCS was started with.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_armor.supervisor_pipe import tell_supervisor

HEALTH_CHECKS = {
    "RAY_health_check_period_ms": "2000",  # Ray 2.60's default: 3000
    "RAY_health_check_timeout_ms": "3000",  # 10000
    "RAY_health_check_failure_threshold": "5",  # 5
}
"""Ray's health-check settings (``src/ray/common/ray_config_def.h``) for a run's own head."""


def health_check_environment() -> None:
    """:data:`HEALTH_CHECKS` as defaults of this process's environment (the local Ray head
    and its GCS inherit it; a value set by the user wins)."""
    for key, value in HEALTH_CHECKS.items():
        os.environ.setdefault(key, value)


@dataclass(frozen=True)
class ProbeSettings:
    """Seconds between probes, seconds a probe waits, failures in a row that lose the GCS."""

    period_s: float
    timeout_s: float
    threshold: int

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> ProbeSettings:
        def number(key: str) -> float:
            return float(environ.get(key) or HEALTH_CHECKS[key])

        return cls(number("RAY_health_check_period_ms") / 1000,
                   number("RAY_health_check_timeout_ms") / 1000,
                   max(int(number("RAY_health_check_failure_threshold")), 1))  # fmt: skip


class ProbeVerdict:
    """The probe's answers in order; :meth:`observe` returns ``(part, description)`` of what
    is lost, or ``None``."""

    def __init__(self, settings: ProbeSettings, node: str, gcs: str) -> None:
        self.settings, self.node, self.gcs = settings, node, gcs
        self.failures = 0

    def observe(self, alive: bool | None) -> tuple[str, str] | None:
        """``alive``: the GCS's answer for the driver's node, ``None`` when it gave none."""
        s = self.settings
        if alive is None:
            self.failures += 1
            if self.failures < s.threshold:
                return None
            return ("GCS", f"Ray's GCS at {self.gcs}: it answered none of {self.failures} probes "
                    f"in a row ({s.timeout_s:g}s each, {s.period_s:g}s apart): stopped, wedged "
                    "or its node out of reach")  # fmt: skip
        self.failures = 0
        if alive:
            return None
        return ("raylet", f"Ray's raylet of node {self.node}: the GCS marked it dead, its "
                "health checks unanswered (RAY_health_check_*): the raylet is stopped, wedged "
                "or its node deep in swap")  # fmt: skip


class ControlPlaneProbe:
    """The thread that probes the driver's node and the GCS (module docstring); :meth:`stop`
    before the driver leaves Ray (a disconnected client answers nothing)."""

    def __init__(self, settings: ProbeSettings) -> None:
        import ray
        from ray._private import worker

        self.node = ray.get_runtime_context().get_node_id()
        self.gcs = worker.global_worker.gcs_client
        where = f"{self.node} at {ray.util.get_node_ip_address()}"
        self.verdict = ProbeVerdict(settings, where, self.gcs.address)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="armor-ray-probe", daemon=True)

    @classmethod
    def start(cls) -> ControlPlaneProbe:
        probe = cls(ProbeSettings.from_environment(os.environ))
        probe.thread.start()
        return probe

    def run(self) -> None:
        while not self.stopped.wait(self.verdict.settings.period_s):
            lost = self.verdict.observe(self.ask())
            if lost and not self.stopped.is_set():
                part, text = lost
                print(f"control plane: lost {text}", flush=True)
                tell_supervisor("lost", f"{part} {text}")
                return

    def ask(self) -> bool | None:
        import ray

        try:
            alive = self.gcs.check_alive([ray.NodeID.from_hex(self.node)],
                                         timeout=self.verdict.settings.timeout_s)  # fmt: skip
        except Exception:  # noqa: BLE001 - any failure of the call is a probe unanswered
            return None
        return bool(alive[0])

    def stop(self) -> None:
        self.stopped.set()
