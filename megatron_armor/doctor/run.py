"""The checks ``armor doctor`` runs, in order, each with the fix for an unexpected failure."""

from __future__ import annotations

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.doctor import node, sglang_check
from megatron_armor.doctor.report import Check, CheckResult, run_check

GPU_DOCS = "see docs/gpu.md"


def checks(config: ArmorConfig) -> list[Check]:
    """Every check for ``config``; on a CPU machine the GPU ones report ``n/a``."""
    return [
        Check("versions", node.versions, "pip install -r requirements.txt"),
        Check("GPUs", node.gpus, f"check the driver with nvidia-smi; {GPU_DOCS}"),
        Check("pinned GPU stack", node.stack_pins, f"use docker/Dockerfile; {GPU_DOCS}"),
        Check(
            f"TE FP8 GEMM ({config.trainer.fp8.recipe})",
            lambda: node.te_fp8_gemm(config),
            "install Transformer Engine for this torch: pip install --no-build-isolation "
            "-r requirements-gpu-build.txt",
        ),
        Check(
            "CUDA IPC (2 processes)",
            node.cuda_ipc,
            "run in one container with --ipc=host; CUDA_VISIBLE_DEVICES must match",
        ),  # fmt: skip
        Check(
            "NCCL all-reduce",
            node.nccl_all_reduce,
            "rerun with NCCL_DEBUG=INFO; check nvidia-smi topo -m and NCCL_P2P_DISABLE",
        ),  # fmt: skip
        Check(
            f"SGLang + {config.rollout.sglang.weight_transport} weight update",
            lambda: sglang_check.sglang_round_trip(config),
            f"read the server log in the message; {GPU_DOCS}",
        ),
        Check(
            "trainer step",
            lambda: node.trainer_step(config),
            "run the dist test tier; check megatron-core 0.16.1 is installed",
        ),  # fmt: skip
    ]


def selected(config: ArmorConfig, names: list[str] | None = None) -> list[Check]:
    """The checks whose names start with one of ``names`` (case-insensitive; ``None``: all);
    a name that selects nothing is a ``ValueError`` listing the checks."""
    every = checks(config)
    if not names:
        return every
    unknown = [n for n in names if not any(c.name.lower().startswith(n.lower()) for c in every)]
    if unknown:
        raise ValueError(
            f"--check {unknown[0]!r} names no check; the checks: {', '.join(c.name for c in every)}"
        )
    return [c for c in every if any(c.name.lower().startswith(n.lower()) for n in names)]


def run_all(config: ArmorConfig, names: list[str] | None = None) -> list[CheckResult]:
    return [run_check(check) for check in selected(config, names)]
