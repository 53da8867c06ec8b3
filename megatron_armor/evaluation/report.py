"""Evaluation tables: a markdown table for people and a JSON file for scripts."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def markdown_table(results: Mapping[str, Mapping[str, float]], k: int) -> str:
    """``| benchmark | n | avg@k | pass@k | maj@k |`` with ``k`` written out, percentages."""
    lines = [
        f"| benchmark | n | avg@{k} | pass@{k} | maj@{k} |",
        "|---|---:|---:|---:|---:|",
    ]
    for bench, r in results.items():
        lines.append(
            f"| {bench} | {int(r['n'])} | {100 * r['avg@k']:.1f} | "
            f"{100 * r['pass@k']:.1f} | {100 * r['maj@k']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def write_report(
    results: Mapping[str, Mapping[str, float]],
    out_dir: str | Path,
    k: int,
    meta: Mapping[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write ``eval.md`` and ``eval.json`` into ``out_dir``; returns their paths.

    ``eval.json``: ``{"k": k, "results": {bench: {metric: value}}, "meta": {...}}`` (metric
    values are fractions in [0, 1]; the markdown shows percentages).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    md_lines = [f"# Evaluation (k = {k})", ""]
    md_lines += [f"- {key}: {value}" for key, value in meta.items()]
    md_path, json_path = out / "eval.md", out / "eval.json"
    md_path.write_text("\n".join(md_lines) + "\n\n" + markdown_table(results, k))
    payload = {"k": k, "results": {b: dict(r) for b, r in results.items()}, "meta": meta}
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return md_path, json_path
