"""`armor compare` specs and reports on synthetic run directories with known answers. Tier: unit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_armor.compare.report import build_report, write_report
from megatron_armor.compare.runner import pending_runs, slurm_command
from megatron_armor.compare.spec import SpecError, load_spec
from megatron_armor.orchestration.run.checkpoints import write_manifest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
VAL = "val/tiny/avg@4"


def write_spec(tmp: Path, **extra) -> Path:
    pq.write_table(pa.table({"x": list(range(10))}), tmp / "train.parquet")
    spec = {"name": "synth", "output_dir": str(tmp / "runs"),
            "config": str(REPO / "configs" / "tiny_cpu.yaml"), "seeds": [1, 2, 3],
            "overrides": [f"data.train_files=[{tmp / 'train.parquet'}]", "run.steps=4"],
            "variants": {"a": [], "b": ["algo.anchor=none", "algo.ratio=standard"]},
            "pairs": [["a", "b"]], **extra}  # fmt: skip
    path = tmp / "spec.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def write_run(run_dir: Path, seed: int, shift: float, reset: bool) -> None:
    """val 0.2, 0.4 + e, 0.5 + e at steps 0, 2, 4 (e = 0.01 * seed - shift); anchors on 1, 2."""
    e = 0.01 * seed - shift
    records = [{"step": 0, VAL: 0.2}]
    for step in (1, 2, 3, 4):
        r = {"step": step, "reward/policy_mean": 0.1 * step, "anchor/acceptance_rate": 0.5,
             "kl/exact_reverse": 0.01 * step, "reset/performed": float(reset and step == 2)}  # fmt: skip
        if step in (2, 4):
            r[VAL] = (0.4 if step == 2 else 0.5) + e
        records.append(r)
    run_dir.mkdir(parents=True)
    last = run_dir / "checkpoints" / "step_000004"  # finished: a checkpoint of the last step
    last.mkdir(parents=True)
    (last / "meta.json").write_text("{}")
    write_manifest(last, 4)  # complete: its manifest is written last
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    anchors = run_dir / "anchors"
    anchors.mkdir()
    rows = {1: [("q1", True), ("q2", False), ("q9", None)], 2: [("q2", True), ("q3", True)]}
    for step, queries in rows.items():
        lines = [{"type": "stats", "step": step}]
        for qid, kept in queries:
            reason = "all_correct" if kept is None else "accepted"
            lines.append({"type": "query", "query_id": qid, "reason": reason, "kept": bool(kept)})
        (anchors / f"step_{step:06d}.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")


@pytest.fixture
def synth(tmp_path):
    spec = load_spec(write_spec(tmp_path))
    for run in spec.runs:
        write_run(run.run_dir, run.seed, shift=0.0 if run.variant == "a" else 0.1,
                  reset=run.variant == "a")  # fmt: skip
    return spec


def test_spec_expands_variants_over_seeds_with_the_same_seed_per_index(tmp_path):
    spec = load_spec(write_spec(tmp_path))
    assert [r.label for r in spec.runs] == [f"{v}/seed_{s}" for v in "ab" for s in (1, 2, 3)]
    b2 = spec.runs[4]
    assert "run.seed=2" in b2.overrides and "algo.anchor=none" in b2.overrides
    assert b2.run_dir == tmp_path / "runs" / "synth" / "b" / "seed_2"
    assert b2.train_args()[0].endswith("configs/tiny_cpu.yaml")


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "compare").glob("*.yaml")), ids=str)
def test_repository_specs_are_valid(path):
    spec = load_spec(path)  # every run's config loaded and validated
    assert spec.runs and all(r.run_dir.parent.parent == spec.root for r in spec.runs)
    if path.stem.startswith("referee_filter"):
        controls = {"dapo", "dapo_filter_g", "dapo_filter_g1", "armor", "armor_standard_ratio"}
        assert len(spec.seeds) >= 3 and controls <= set(spec.variants) and spec.pairs


@pytest.mark.parametrize(
    "extra, match",
    [({"seeds": []}, "seeds=\\[\\]"), ({"pairs": [["a", "zz"]]}, "among the variants"),
     ({"variants": {"a": ["algo.anchor=bogus"], "b": []}}, "variant 'a' \\(seed 1\\).*algo.anchor"),
     ({"colour": 1}, "unknown top-level keys \\['colour'\\]")],
)  # fmt: skip
def test_bad_specs_name_the_key_and_the_fix(tmp_path, extra, match):
    with pytest.raises(SpecError, match=match):
        load_spec(write_spec(tmp_path, **extra))


def test_report_summaries_have_the_known_values(synth):
    report = build_report(synth)
    a = report["variants"]["a"]["validation"][VAL]
    assert a["steps"] == [0, 2, 4] and a["n_seeds"] == 3
    np.testing.assert_allclose(a["mean"], [0.2, 0.42, 0.52])
    assert a["summary"]["final"]["mean"] == pytest.approx(0.52)
    assert a["summary"]["best"]["mean"] == pytest.approx(0.52)
    # AUC of 0.2, 0.4 + e, 0.5 + e over steps 0..4: (1.5 + 3e) / 4, mean e = 0.02
    assert a["summary"]["auc"]["mean"] == pytest.approx((1.5 + 0.06) / 4)
    assert report["variants"]["a"]["resets"] == [2] and report["variants"]["b"]["resets"] == []


def test_coverage_counts_distinct_accepted_and_kept_queries(synth):
    training = build_report(synth)["variants"]["a"]["training"]
    assert training["coverage_accepted"]["mean"] == pytest.approx([0.2, 0.3])  # q1 q2 | + q3
    assert training["coverage_trained"]["mean"] == pytest.approx([0.1, 0.3])  # q1 | + q2 q3
    assert training["kl_to_ref"]["metric_key"] == "kl/exact_reverse"
    assert training["train_reward"]["final"]["mean"] == pytest.approx(0.4)


def test_coverage_is_over_the_train_limit_prompts(tmp_path):
    spec = load_spec(write_spec(tmp_path, overrides=[
        f"data.train_files=[{tmp_path / 'train.parquet'}]", "run.steps=4", "data.train_limit=5"]))  # fmt: skip
    for run in spec.runs:
        write_run(run.run_dir, run.seed, shift=0.0, reset=False)
    training = build_report(spec)["variants"]["a"]["training"]
    assert training["coverage_accepted"]["mean"] == pytest.approx([0.4, 0.6])  # of 5, not 10


def test_paired_comparison_of_a_constant_gap(synth):
    pairs = [p for p in build_report(synth)["pairs"] if p["metric"] == VAL]
    assert {p["summary"] for p in pairs} == {"final", "best", "auc"}
    final = next(p for p in pairs if p["summary"] == "final")
    assert (final["a"], final["b"], final["n"]) == ("a", "b", 3)
    assert final["mean_diff"] == pytest.approx(0.1)
    assert (final["ci_low"], final["ci_high"]) == pytest.approx((0.1, 0.1))
    assert final["p_value"] == pytest.approx(0.25) and final["min_p_value"] == 0.25


def test_write_report_puts_markdown_json_and_pngs_in_one_folder(synth, tmp_path):
    out = write_report(synth, "armor compare spec.yaml", tmp_path / "report")
    names = {p.name for p in out.iterdir()}
    assert {"report.json", "report.md", "val_tiny_avg4.png", "coverage_accepted.png"} <= names
    md = (out / "report.md").read_text()
    assert "armor compare spec.yaml" in md and "n = 3" in md and "0.250" in md
    assert "0.520 [" in md  # final mean with its interval


def test_pending_runs_skip_done_runs_and_the_array_lists_the_rest(synth):
    import shutil

    for run in synth.runs[1:]:
        shutil.rmtree(run.run_dir / "checkpoints")
    pending = pending_runs(synth)
    assert [i for i, _, _ in pending] == [1, 2, 3, 4, 5]
    assert all(status == "partial" for _, _, status in pending)
    cmd = slurm_command(synth, ["--partition=gpu"])
    assert cmd[:2] == ["sbatch", "--array=1,2,3,4,5"] and cmd[-3] == "--partition=gpu"
    assert cmd[-2].endswith("slurm/compare_array.sbatch")
    args = (Path(cmd[-1]) / "4.args").read_text().splitlines()
    assert args == synth.runs[4].train_args() and not (Path(cmd[-1]) / "0.args").exists()


def test_partial_comparisons_report_the_seeds_that_ran(synth, tmp_path):
    """Seeds not started yet are left out (and pairs use the shared seeds); a variant without
    any started seed is absent."""
    import shutil

    shutil.rmtree(synth.runs[5].run_dir)  # b / seed 3: not started
    shutil.rmtree(synth.runs[4].run_dir / "checkpoints")  # b / seed 2: unfinished
    report = build_report(synth)
    b = report["variants"]["b"]["validation"][VAL]
    assert report["variants"]["b"]["seeds"] == [1, 2] and b["n_seeds"] == 2  # in the band
    assert b["per_seed"]["seeds"] == [1] and b["summary"]["final"]["n"] == 1  # not summarised
    assert report["pairs"] == []  # one finished seed shared
    assert report["unfinished"] == ["b/seed_2", "b/seed_3"]
    for run in synth.runs_of("a"):
        shutil.rmtree(run.run_dir)
    report = build_report(synth)
    assert set(report["variants"]) == {"b"} and report["pairs"] == []
    out = write_report(synth, out_dir=tmp_path / "partial")  # renders without the variant
    assert "**Unfinished runs**" in (out / "report.md").read_text()


def test_compare_slurm_passes_the_options_after_dashdash_to_sbatch_with_a_task_limit(
    tmp_path, monkeypatch
):
    """The documented order, through the CLI parser, with a recording ``sbatch`` on PATH."""
    from megatron_armor.cli import main as armor_main

    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch.calls"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {calls}\necho 123\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("ARMOR_ROOT", str(REPO))
    spec = write_spec(tmp_path)
    argv = ["compare", str(spec), "--slurm", "--max-parallel", "2", "--", "-N", "2",
            "--gpus-per-node=8", "-t", "48:00:00"]  # fmt: skip
    assert armor_main(argv) == 0
    sent = calls.read_text().splitlines()
    assert sent[:2] == ["--array=0,1,2,3,4,5%2", "--job-name=cmp-synth"]
    assert sent[2:6] == ["-N", "2", "--gpus-per-node=8", "-t"] and sent[6] == "48:00:00"
    assert sent[-2] == str(REPO / "slurm" / "compare_array.sbatch")
    with pytest.raises(SystemExit):  # `--` where nothing takes the rest
        armor_main(["plan", str(spec), "--", "-N", "2"])
