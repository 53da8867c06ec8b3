"""``armor report RUN_DIR``: one markdown page and its PNGs on where a run's time went.

``RUN_DIR/report/report.md`` with ``phases.png`` (seconds per phase, stacked, step by step),
``tokens_per_s_per_gpu.png`` (NeMo-RL's end-to-end tokens/s/GPU per step) and
``predicted_vs_measured.png`` (per phase, the planner's prediction for the work done beside
the measurement). The page holds the run's hardware, layout and config hash, its figures in
the peers' definitions, every phase's seconds, efficiency and prediction, a per-step table,
the profiles in ``RUN_DIR/profile`` and the peers' published figures (:data:`PEER_FIGURES`, theirs, with sources and dates).
Every figure comes from ``observability/step_figures.py``; docs/profiling.md walks through it.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from megatron_armor.observability.facts import facts_model, facts_peaks, read_facts
from megatron_armor.observability.metrics import read_metrics
from megatron_armor.observability.step_figures import (
    SUM_TOLERANCE,
    RunContext,
    step_figures,
    summary,
    training_steps,
)
from megatron_armor.planner.phase_time import NOT_MODELLED, engine_layout
from megatron_armor.planner.step_phases import STEP_PHASES

REPORT_DIR = "report"
FIGURES = ("phases.png", "tokens_per_s_per_gpu.png", "predicted_vs_measured.png")


@dataclass(frozen=True)
class PeerFigure:
    """A figure a peer published: theirs, in their definition, with where and when."""

    framework: str
    model: str
    gpus: str
    mode: str
    figure: str
    definition: str
    source: str
    date: str


NEMO_RL_PAGE = "https://github.com/NVIDIA-NeMo/RL/blob/69c7ca117/docs/about/performance-summary.md"
VERL_PAGE = "https://github.com/verl-project/verl/blob/890dfc3eb/docs/advance/v1_async_trainer.md"
PRIME_RL_DIR = "https://github.com/PrimeIntellect-ai/prime-rl/tree/8718eb143/benchmarks/baselines"
NEMO_RL_DEF = "tokens/s/GPU: trained batch's tokens / step time / all GPUs (mean of 5 steps)"
PEER_FIGURES = (
    PeerFigure("NeMo-RL v0.6", "Qwen3-30B-A3B, GRPO, 4k", "32 H100", "on-policy", "1,102 tokens/s/GPU (step 192 s)", NEMO_RL_DEF, NEMO_RL_PAGE, "2026-04-29"),
    PeerFigure("NeMo-RL v0.6", "Qwen3-30B-A3B, GRPO, 4k", "32 H100", "1-step off", "1,414 tokens/s/GPU (step 152 s)", NEMO_RL_DEF, NEMO_RL_PAGE, "2026-04-29"),
    PeerFigure("NeMo-RL v0.6", "Qwen3-235B-A22B, GRPO, 8k", "128 H100", "on-policy", "58.9 tokens/s/GPU (step 395 s)", NEMO_RL_DEF, NEMO_RL_PAGE, "2026-04-29"),
    PeerFigure("NeMo-RL v0.6", "DeepSeek V3, GRPO, 1.5k", "256 H100", "on-policy", "12.1 tokens/s/GPU (step 134 s)", NEMO_RL_DEF, NEMO_RL_PAGE, "2026-04-29"),
    PeerFigure("verl", "Qwen3.5-35B-A3B, DAPO-Math, 32k", "24 H100 (2 hybrid + 1 rollout node)", "separate_async, switch", "16,445 tokens/s aggregate", "aggregate tokens/s of the job; verl's perf/throughput divides the same tokens by the GPUs", VERL_PAGE, "2026-08-21"),
    PeerFigure("prime-rl", "Qwen3-0.6B, full RL trainer, 16k", "1 H100", "trainer only", "11,896 tokens/s, MFU 11.1%", "trained tokens / forward-backward-optimizer time (no generation)", PRIME_RL_DIR, "2026-01-15"),
)  # fmt: skip
"""Read from the peers' repositories at the commits named in the sources."""


def config_hash(run_dir: Path) -> str:
    """sha256 of the run's resolved ``config.yaml`` (first 12 hex digits)."""
    return hashlib.sha256((run_dir / "config.yaml").read_bytes()).hexdigest()[:12]


def load_context(run_dir: Path) -> tuple[RunContext, dict]:
    """The run's config (its ``config.yaml``), model and peaks (``report_facts.json``)."""
    from megatron_armor.config import load_config

    facts = read_facts(run_dir)
    config = load_config(run_dir / "config.yaml")
    gib = config.orchestration.gpu_memory_gib
    ctx = RunContext(config, facts_model(facts), facts_peaks(facts), int(facts["devices"]),
                     facts.get("precision", ""), gib * 2**30)  # fmt: skip
    return ctx, facts


def report_figures(run_dir: str | Path) -> tuple[RunContext, dict, list[dict], dict]:
    """``(context, facts, per-step figures, their summary)`` of a run directory."""
    run_dir = Path(run_dir)
    steps = training_steps(read_metrics(run_dir))
    if not steps:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl has no training step to report")
    ctx, facts = load_context(run_dir)
    rows = [step_figures(r, ctx) for r in steps]
    return ctx, facts, rows, summary(rows)


# ---------------------------------------------------------------------------- the page
def _num(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}"


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"


def run_table(run_dir: Path, ctx: RunContext, facts: dict) -> list[str]:
    c, peaks = ctx.config, ctx.peaks
    t, o = c.trainer, c.orchestration
    engines, engine_tp = engine_layout(c)
    world = c.resolved.world_size
    dp = max(1, world // (t.tp * t.pp * t.cp))
    peak = "unknown device: no efficiencies, no predictions"
    if peaks:
        tflops = ", ".join(f"{k} {v:.3g}" for k, v in peaks.tflops.items())
        peak = (
            f"{peaks.name}: {tflops} TFLOP/s, memory {peaks.memory_gbps:,.0f} GB/s ({peaks.source})"
        )
    model = facts.get("model") or {}
    gpus = "" if o.layout == "cpu" else f" x {o.gpus_per_node} GPUs"
    return [
        "| what | this run |", "|---|---|",
        f"| hardware | {facts['device_name']} on {facts['host']}; CPU {facts['cpu']['model']} ({facts['cpu']['logical_cores']} logical cores) |",
        f"| peaks | {peak} |",
        f"| layout | {o.layout}, {o.nodes} node(s){gpus}; trainer {world} rank(s): tp {t.tp}, pp {t.pp}, cp {t.cp}, dp {dp}, ep {t.ep}; rollout {c.rollout.backend}, {engines} engine(s) of tp {engine_tp}; async_rollout {o.async_rollout} |",
        f"| devices (per-GPU figures divide by) | {facts['devices']} |",
        f"| model | {model.get('name', t.model_path)}, {t.precision}{' (fp8)' if t.fp8.enabled else ''} |",
        f"| config | `config.yaml` sha256 {config_hash(run_dir)} |",
        f"| software | {', '.join(f'{k} {v}' for k, v in facts.get('software', {}).items())} |",
        f"| facts written | {facts['written']} |",
    ]  # fmt: skip


def peers_table(s: dict) -> list[str]:
    th = s["throughput"]
    return [
        "| definition | this run (mean of steps) | what it divides |", "|---|---|---|",
        f"| NeMo-RL tokens/s/GPU (`perf/e2e_tokens_per_s_per_gpu`) | {_num(th['nemo_rl_tokens_per_s_per_gpu'], 1)} (last 5 steps: {_num(s['last5_nemo_rl'], 1)}) | trained batch's prompt + response tokens / whole step (`timing/step_s`) / every device of the job |",
        f"| verl `perf/throughput` | {_num(th['verl_throughput'], 1)} | the same tokens (attention mask) / `timing_raw['step']` / the resource pools' GPUs |",
        f"| prime-rl trainer `perf/throughput` per GPU | {_num(th['prime_rl_tokens_per_s_per_gpu'], 1)} | trained tokens / the updates' seconds (`phase/train_s`) / trainer devices |",
        f"| prime-rl MFU (the updates) | {_pct(s['efficiency']['train_mfu'])} | model FLOPs of the updates / seconds / trainer devices / peak |",
    ]  # fmt: skip


EFFICIENCY_OF = {"logprobs": ("logprobs_mfu", "MFU"), "train": ("train_mfu", "MFU"),
                 "rollout/policy": ("decode_bandwidth_util", "memory-bandwidth util. (all decoding)"),
                 "weight_sync": ("push_gb_per_s", "GB/s")}  # fmt: skip


def phases_table(s: dict) -> list[str]:
    lines = ["| phase | seconds / step | share | efficiency | predicted s | measured / predicted |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for phase in STEP_PHASES:
        measured = s["phases"][phase.name] or 0.0
        predicted = s["predicted"][phase.name] if s["predicted"] else None
        eff = ""
        if phase.name in EFFICIENCY_OF:
            key, unit = EFFICIENCY_OF[phase.name]
            value = s["efficiency"][key]
            eff = f"{_num(value, 2)} {unit}" if unit == "GB/s" else f"{_pct(value)} {unit}"
        ratio = "not modelled" if phase.name in NOT_MODELLED else "n/a"
        if predicted:
            ratio = _num(measured / predicted, 2)
        lines.append(f"| {phase.name} | {measured:.4f} | {measured / s['step_s']:.1%} | {eff} | "
                     f"{_num(predicted, 4)} | {ratio} |")  # fmt: skip
    lines.append(f"| **step** (`timing/step_s`) | {s['step_s']:.4f} | 100% | | "
                 f"{_num(sum(s['predicted'].values()), 4) if s['predicted'] else 'n/a'} | |")  # fmt: skip
    return lines


def overlap_lines(s: dict) -> list[str]:
    """``one_step``: the rollout drawn beside the updates, which no phase of the step holds."""
    if s["overlap_s"] is None:
        return []
    return [f"`orchestration.async_rollout: one_step`: the next step's rollout ran beside the "
            f"updates for {s['overlap_s']:.4f} s a step (`async/overlap_s`); only the wait for "
            "it (`rollout/wait`) and the drained steps' rollouts are seconds of the step.", ""]  # fmt: skip


def steps_table(rows: list[dict]) -> list[str]:
    names = " | ".join(p.name for p in STEP_PHASES)
    lines = [f"| step | `timing/step_s` | phases sum | tokens/s/GPU | {names} |",
             "|" + "---|" * (4 + len(STEP_PHASES))]  # fmt: skip
    for r in rows:
        cells = " | ".join(f"{r['phases'][p.name]:.3f}" for p in STEP_PHASES)
        lines.append(f"| {r['step']} | {r['step_s']:.3f} | {r['phase_sum_s']:.3f} | "
                     f"{r['throughput']['nemo_rl_tokens_per_s_per_gpu']:.1f} | {cells} |")  # fmt: skip
    return lines


def context_table() -> list[str]:
    lines = ["| framework | model | GPUs | mode | their figure | their definition | source | date |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in PEER_FIGURES:
        lines.append(f"| {p.framework} | {p.model} | {p.gpus} | {p.mode} | {p.figure} | "
                     f"{p.definition} | [{p.framework}]({p.source}) | {p.date} |")  # fmt: skip
    return lines


def markdown(run_dir: Path, ctx: RunContext, facts: dict, rows: list[dict], s: dict) -> str:
    eff = ", ".join(f"{k}={v:g}" for k, v in asdict(ctx.efficiency).items())
    worst = max(abs(r["phase_sum_s"] - r["step_s"]) / r["step_s"] for r in rows)
    parts = [
        f"# Throughput report: {run_dir.name}", "",
        f"`armor report {run_dir}`, {datetime.now(UTC).date().isoformat()}; {s['steps']} "
        "training steps of `metrics.jsonl` (docs/profiling.md explains every figure).", "",
        "## The run", "", *run_table(run_dir, ctx, facts), "",
        "## Throughput in the peers' definitions", "", *peers_table(s), "",
        "## Where the time goes", "",
        f"Means over the steps. Every second of a step is in one phase (`phase/*`); the "
        f"phases sum to `timing/step_s` within {worst:.2%} at the worst step (tolerance "
        f"{SUM_TOLERANCE:.0%}). Predicted: the planner's seconds for the work each step did, "
        f"on the peaks above, with {eff} (`planner/phase_time.py`).", "",
        *phases_table(s), "", *overlap_lines(s), "![seconds per phase](phases.png)", "",
        "![tokens/s/GPU](tokens_per_s_per_gpu.png)", "",
        "![predicted vs measured](predicted_vs_measured.png)", "",
        "## Per step", "", *steps_table(rows), "",
        "## Profiles", "", *profile_lines(run_dir), "",
        "## The peers' published figures (theirs, for context)", "",
        "Each in its own definition, on its own model and hardware; only a row in the same "
        "definition, model and hardware compares with this run.", "", *context_table(), "",
    ]  # fmt: skip
    return "\n".join(parts)


# ---------------------------------------------------------------------------- the figures
def draw_figures(out: Path, rows: list[dict], s: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    paths = []
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = [0.0] * len(rows)
    colors = plt.get_cmap("tab20").colors  # one color per phase (tab10 would repeat)
    for i, phase in enumerate(STEP_PHASES):
        values = [r["phases"][phase.name] for r in rows]
        if any(values):
            ax.bar(steps, values, bottom=bottom, label=phase.name, color=colors[i])
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.plot(steps, [r["step_s"] for r in rows], "k.", label="timing/step_s")
    ax.set(xlabel="step", ylabel="seconds", title="where each step's time went")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    paths.append(_save(fig, out / FIGURES[0]))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, [r["throughput"]["nemo_rl_tokens_per_s_per_gpu"] for r in rows], "o-")
    ax.set(
        xlabel="step", ylabel="tokens/s/GPU", title="end-to-end tokens/s/GPU (NeMo-RL's definition)"
    )
    paths.append(_save(fig, out / FIGURES[1]))
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [p.name for p in STEP_PHASES if s["phases"][p.name]]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [s["phases"][n] for n in names], 0.4, label="measured")
    if s["predicted"]:
        ax.bar([i + 0.2 for i in x], [s["predicted"][n] for n in names], 0.4, label="predicted")
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="seconds per step (mean)", title="predicted against measured")
    ax.legend()
    paths.append(_save(fig, out / FIGURES[2]))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


PROFILE_DIR = "profile"
NSYS_REPORTS = ("*.nsys-rep", "*.qdrep")


def gather_profiles(run_dir: Path, sources: list[str | Path]) -> list[Path]:
    """Copy the Nsight Systems reports of ``sources`` (``launch/profile.sh``'s ``--out``) into
    ``RUN_DIR/profile/``, beside the torch traces and the SGLang servers' reports written
    there; the copies' paths."""
    target = run_dir / PROFILE_DIR
    copied = []
    for source in map(Path, sources):
        if source.resolve() == target.resolve():
            continue
        for pattern in NSYS_REPORTS:
            for report in sorted(source.glob(pattern)):
                target.mkdir(parents=True, exist_ok=True)
                copied.append(Path(shutil.copy2(report, target / report.name)))
    return copied


def profile_lines(run_dir: Path) -> list[str]:
    """The page's list of the run's profiles (``RUN_DIR/profile/``), or why there are none."""
    files = sorted(p for p in (run_dir / PROFILE_DIR).rglob("*") if p.is_file())
    if not files:
        return ["No profile in `profile/`: `launch/profile.sh` or `logging.profile` captures "
                "chosen steps (docs/profiling.md)."]  # fmt: skip
    lines = ["| file | MB |", "|---|---|"]
    for path in files:
        lines.append(f"| `{path.relative_to(run_dir)}` | {path.stat().st_size / 1e6:.1f} |")
    return lines


def write_report(
    run_dir: str | Path, out: str | Path | None = None, gather: list[str | Path] = ()
) -> list[Path]:
    """Write the page and its PNGs into ``out`` (default ``RUN_DIR/report``), after copying
    the Nsight Systems reports of ``gather`` into ``RUN_DIR/profile``; their paths."""
    run_dir = Path(run_dir)
    gather_profiles(run_dir, list(gather))
    ctx, facts, rows, s = report_figures(run_dir)
    out = Path(out) if out else run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    page = out / "report.md"
    page.write_text(markdown(run_dir, ctx, facts, rows, s))
    return [page, *draw_figures(out, rows, s)]
