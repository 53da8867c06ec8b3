"""The devices' peaks: tensor-core FLOP/s, memory bandwidth, GPU-to-GPU link bandwidth.

The efficiency of each step phase is measured against them (``observability/report.py``:
MFU of the log-prob passes and the updates, memory-bandwidth utilization of decoding, the
push's bytes/s against its link) and the planner predicts phase times from them
(``planner/phase_time.py``). GPU rows are the vendors' data sheets (dense tensor-core
figures: half the "with sparsity" ones; fp32 = TF32; memory = HBM; link = NVLink, total of
both directions as the sheets state it). A CPU has no sheet here:
its row is the nominal fp32 rate of its clock and vector unit and a copy rate measured when
the run starts, times the cores a trainer rank uses (:func:`cpu_peaks`), and says so.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class DevicePeaks:
    """One device's peaks; ``source`` says where they come from."""

    name: str
    tflops: dict[str, float] = field(default_factory=dict)
    """Dense tensor-core TFLOP/s per precision (``bf16``, ``fp16``, ``fp8``, ``fp32``)."""
    memory_gbps: float = 0.0
    """Memory bandwidth, GB/s (HBM; a CPU's measured copy bandwidth)."""
    link_gbps: float = 0.0
    """GPU-to-GPU bandwidth, GB/s, both directions together (NVLink); 0 where there is none."""
    source: str = "data sheet"

    def peak_tflops(self, precision: str) -> float | None:
        return self.tflops.get(precision)

    def as_dict(self) -> dict:
        return asdict(self)


GPU_PEAKS: dict[str, DevicePeaks] = {
    "H100 SXM": DevicePeaks("H100 SXM", {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "fp32": 494.7}, 3350.0, 900.0),
    "H100 NVL": DevicePeaks("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "fp32": 417.5}, 3900.0, 600.0),
    "H100 PCIe": DevicePeaks("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "fp32": 378.0}, 2000.0, 600.0),
    "H200": DevicePeaks("H200", {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "fp32": 494.7}, 4800.0, 900.0),
    "A100": DevicePeaks("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}, 2039.0, 600.0),
}  # fmt: skip
"""Per GPU. H100 SXM5 80 GB: HBM3 3.35 TB/s, NVLink 4 900 GB/s; H100 NVL 94 GB: 3.9 TB/s,
NVLink bridge 600 GB/s; H100 PCIe 80 GB: HBM2e 2.0 TB/s; H200 141 GB: HBM3e 4.8 TB/s; A100
SXM 80 GB: 2.039 TB/s, NVLink 3 600 GB/s."""


def gpu_key(device_name: str) -> str | None:
    """The :data:`GPU_PEAKS` row of a ``torch.cuda.get_device_name()`` string (``None``:
    unknown)."""
    name = device_name.upper()
    if "H100" in name:
        return "H100 PCIe" if "PCIE" in name else "H100 NVL" if "NVL" in name else "H100 SXM"
    if "H200" in name or "GH200" in name:
        return "H200"
    if "A100" in name:
        return "A100"
    return None


def gpu_peaks(device_name: str) -> DevicePeaks | None:
    """The data-sheet peaks of a GPU by its device name, or ``None`` when unknown."""
    key = gpu_key(device_name)
    return GPU_PEAKS[key] if key else None


CPU_FLOPS_PER_CYCLE = {"avx512f": 32, "avx2": 32, "sse2": 8}
"""fp32 FLOPs per cycle of one core by its widest vector flag: two FMA units of 8 fp32 lanes
(AVX2, and AVX-512 on parts that split it in two halves); Intel parts with two 512-bit FMA
units reach twice this. SSE2: 4 lanes, 2 units, no FMA."""


def cpu_flops_per_core(cpuinfo: str) -> float:
    """Nominal fp32 FLOP/s of one core from ``/proc/cpuinfo``'s text: its clock (``cpu MHz``)
    times :data:`CPU_FLOPS_PER_CYCLE` of its widest vector flag (0 when unknown)."""
    mhz = flags = None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "cpu MHz" and mhz is None:
            mhz = float(value)
        elif key.strip() == "flags" and flags is None:
            flags = set(value.split())
    if not mhz or not flags:
        return 0.0
    per_cycle = next((n for flag, n in CPU_FLOPS_PER_CYCLE.items() if flag in flags), 0)
    return mhz * 1e6 * per_cycle


def copy_gbps(mib: int = 128, repeats: int = 2) -> float:
    """One thread's copy rate of ``mib`` MiB (read + written, larger than the caches), the
    best of ``repeats``: measured, so a busy machine measures low."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(mib * 2**18)  # fp32
        dst = torch.empty_like(src)
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = max(best, 2 * src.numel() * 4 / (time.perf_counter() - start))
    finally:
        torch.set_num_threads(threads)
    return best / 1e9


def cpu_peaks(cores: int, cpuinfo: str | None = None, copy: float | None = None) -> DevicePeaks:
    """``cores`` cores of this CPU: the nominal fp32 FLOP/s of :func:`cpu_flops_per_core`
    and one core's measured copy rate (:func:`copy_gbps`), each times ``cores``."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.is_file() else ""
    per_core = copy_gbps() if copy is None else copy
    return DevicePeaks(
        "cpu", {"fp32": cores * cpu_flops_per_core(cpuinfo) / 1e12}, cores * per_core, 0.0,
        source=f"{cores} core(s): fp32 nominal (clock x FLOPs per cycle of its vector unit), "
        "memory a copy measured at the run's start",
    )  # fmt: skip


def peaks_from_dict(d: dict) -> DevicePeaks:
    """The inverse of :meth:`DevicePeaks.as_dict` (a run's ``report_facts.json``)."""
    return DevicePeaks(**d)
