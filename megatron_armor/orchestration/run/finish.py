"""The end of a finished run: its summary table and plots (``armor train`` and each stage of
``armor pipeline``)."""

from __future__ import annotations


def finish(run_dir) -> None:
    """The summary table and the plots of a finished run."""
    from megatron_armor.observability.metrics import read_metrics
    from megatron_armor.observability.plot import plot_run
    from megatron_armor.observability.summary import write_summary
    from megatron_armor.orchestration.run.checkpoints import read_best

    plots = plot_run(run_dir)
    extra = {"plots": str(plots[0].parent) if plots else "none",
             "metrics": f"{run_dir}/metrics.jsonl", "tensorboard": f"{run_dir}/tb"}  # fmt: skip
    best = read_best(run_dir)
    if best is not None:
        extra["best_checkpoint"] = best
    fired = [r["step"] for r in read_metrics(run_dir) if r.get("overopt/fired")]
    if fired:
        extra["overoptimization_detected_at_step"] = fired[0]
    write_summary(run_dir, extra)
