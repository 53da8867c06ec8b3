"""The devices' peaks: tensor-core FLOP/s, memory bandwidth, GPU-to-GPU link bandwidth.

The efficiency of each step phase is measured against them (``observability/report.py``:
MFU of the log-prob passes and the updates, memory-bandwidth utilization of decoding, the
push's bytes/s against its link) and the planner predicts phase times from them
(``planner/phase_time.py``). GPU rows are the vendors' data sheets (dense tensor-core
figures: half the "with sparsity" ones; fp32 = TF32; memory = HBM; link = NVLink, total of
both directions as the sheets state it). A CPU has no sheet here: its row is measured on the
run's own machine when the run starts (:func:`cpu_peaks`: one core's fp32 matmul and copy
bandwidth, times the cores a trainer rank uses), and says so.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


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


def _timed_rate(work: float, run, seconds: float) -> float:
    """``work`` units per second of ``run()``, repeated for about ``seconds`` (best of the
    repeats: the least disturbed by other processes)."""
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        start = time.perf_counter()
        run()
        best = max(best, work / (time.perf_counter() - start))
    return best


def cpu_peaks(cores: int, seconds: float = 0.05) -> DevicePeaks:
    """Measured peaks of ``cores`` cores of this CPU: one thread's fp32 matmul FLOP/s
    (512 x 512) and copy bandwidth (64 MiB read + written), times ``cores``. A CPU's data
    sheet peak depends on its clock and vector units; this is what torch reaches on it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        flops = _timed_rate(2 * 512**3, lambda: torch.mm(a, b), seconds)
        src = torch.ones(16 * 2**20)  # 64 MiB of fp32
        dst = torch.empty_like(src)
        copy = _timed_rate(2 * src.numel() * 4, lambda: dst.copy_(src), seconds)
    finally:
        torch.set_num_threads(threads)
    return DevicePeaks(
        "cpu", {"fp32": cores * flops / 1e12}, cores * copy / 1e9, 0.0,
        source=f"measured at the run's start: {cores} core(s) x one core's torch fp32 matmul "
        "and copy rate",
    )  # fmt: skip


def peaks_from_dict(d: dict) -> DevicePeaks:
    """The inverse of :meth:`DevicePeaks.as_dict` (a run's ``report_facts.json``)."""
    return DevicePeaks(**d)
