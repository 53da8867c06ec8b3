"""What ``armor report`` needs of a run that ``metrics.jsonl`` does not hold:
``RUN_DIR/report_facts.json``, written by the driver each time the run starts.

The hardware (the trainer's device, the driver's host and CPU), the devices' peaks
(``planner/devices.py``: a GPU's data sheet, or the CPU measured then), the precision the
passes run in, the model's dimensions (for FLOPs and bytes, so the report needs no model
directory), the devices an end-to-end tokens/s/GPU divides by, and the software versions.
"""

from __future__ import annotations

import json
import os
import platform
import socket
from dataclasses import asdict
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from megatron_armor.observability.throughput import compute_precision, e2e_devices
from megatron_armor.planner.devices import DevicePeaks, cpu_peaks, gpu_peaks, peaks_from_dict
from megatron_armor.planner.model import ModelDims, load_model_dims

FACTS_FILE = "report_facts.json"
SOFTWARE = ("torch", "megatron-core", "ray", "sglang", "transformer-engine")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def software_versions() -> dict[str, str]:
    """Installed versions of the packages a throughput figure depends on (absent: left out)."""
    out = {}
    for name in SOFTWARE:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def device_peaks(layout: str, device_name: str, cores_per_rank: int) -> DevicePeaks | None:
    """A GPU's data-sheet peaks, or a CPU's measured now (``cpu`` layout); ``None`` for a GPU
    the table does not know."""
    if layout == "cpu":
        return cpu_peaks(max(1, cores_per_rank))
    return gpu_peaks(device_name)


def run_facts(config, device_name: str, cores_per_rank: int) -> dict:
    """The facts of this start of the run (see the module docstring)."""
    t = config.trainer
    try:
        dims = asdict(load_model_dims(t.model_path))
    except (OSError, ValueError, KeyError):
        dims = None  # a model the planner does not know: no FLOPs or bytes in the report
    peaks = device_peaks(config.orchestration.layout, device_name, cores_per_rank)
    return {
        "written": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "device_name": device_name,
        "cpu": {"model": cpu_model(), "logical_cores": os.cpu_count(),
                "cores_per_trainer_rank": cores_per_rank},
        "devices": e2e_devices(config),
        "precision": compute_precision(t.precision, t.fp8.enabled),
        "peaks": peaks.as_dict() if peaks else None,
        "model": dims,
        "software": software_versions(),
    }  # fmt: skip


def write_facts(run_dir: str | Path, facts: dict) -> Path:
    """``RUN_DIR/report_facts.json`` (atomically)."""
    path = Path(run_dir) / FACTS_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(facts, indent=2) + "\n")
    tmp.replace(path)
    return path


def read_facts(run_dir: str | Path) -> dict:
    """The run's facts; a clear error when the run has none (one started before this file
    existed: start it again, or write it with ``run_facts``)."""
    path = Path(run_dir) / FACTS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: armor train writes it when a run starts; resume the run "
            "once (run.steps as it is) to write it"
        )
    return json.loads(path.read_text())


def facts_peaks(facts: dict) -> DevicePeaks | None:
    return peaks_from_dict(facts["peaks"]) if facts.get("peaks") else None


def facts_model(facts: dict) -> ModelDims | None:
    return ModelDims(**facts["model"]) if facts.get("model") else None
