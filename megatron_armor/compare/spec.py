"""A comparison spec: named variants (a config + dotted overrides) run over the same seeds.

.. code-block:: yaml

    name: referee_filter_tiny          # directory under output_dir
    output_dir: runs/compare
    config: ../tiny_cpu.yaml           # every variant's config unless it names its own
    seeds: [1, 2, 3]                   # run.seed: data order, sampling, init per seed
    overrides: [run.steps=60]          # applied to every variant, before the variant's own
    variants:
      dapo: [algo.anchor=none, algo.ratio=standard]
      armor: []
      other: {config: ../other.yaml, overrides: [...]}
    pairs: [[armor, dapo]]             # paired comparisons in the report (A - B)

Paths are relative to the spec file. Run ``(variant, seed)`` lives in
``output_dir/name/variant/seed_<seed>`` (``run.output_dir`` and ``run.name`` set by the spec;
``run.seed = seed``), so every variant sees the same data order for a seed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from megatron_armor.config import ConfigError, load_config
from megatron_armor.orchestration.run.checkpoints import list_checkpoints

SPEC_KEYS = {"name", "output_dir", "config", "seeds", "overrides", "variants", "pairs"}


class SpecError(ValueError):
    """A comparison spec problem; the message names the spec key, the value and the fix."""


@dataclass(frozen=True)
class RunSpec:
    """One ``armor train`` run of a comparison."""

    variant: str
    seed: int
    config: Path
    overrides: tuple[str, ...]
    run_dir: Path

    @property
    def label(self) -> str:
        return f"{self.variant}/seed_{self.seed}"

    def train_args(self) -> list[str]:
        """``CONFIG k=v ...`` for ``armor train`` (options such as ``--resume`` go after)."""
        return [str(self.config), *self.overrides]


@dataclass(frozen=True)
class CompareSpec:
    """The parsed spec: ``runs`` in variant-major order (the Slurm array index order)."""

    name: str
    root: Path
    seeds: tuple[int, ...]
    variants: tuple[str, ...]
    pairs: tuple[tuple[str, str], ...]
    runs: tuple[RunSpec, ...] = field(repr=False)

    @property
    def report_dir(self) -> Path:
        return self.root / "report"

    def runs_of(self, variant: str) -> list[RunSpec]:
        return [r for r in self.runs if r.variant == variant]


def _variant(name: str, value, default_config: Path | None, here: Path) -> tuple[Path, list[str]]:
    if value is None:
        value = []
    if isinstance(value, list):
        value = {"overrides": value}
    if not isinstance(value, dict) or set(value) - {"config", "overrides"}:
        raise SpecError(
            f"variants.{name}: expected a list of overrides or {{config:, overrides:}}, got {value!r}"
        )
    config = (here / value["config"]).resolve() if "config" in value else default_config
    if config is None:
        raise SpecError(f"variants.{name}: no config; set `config:` at the top or in the variant")
    return config, [str(o) for o in value.get("overrides") or []]


def _seeds(value) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(s, int) for s in value):
        raise SpecError(f"seeds={value!r}: give a non-empty list of integers, e.g. [1, 2, 3]")
    if len(set(value)) != len(value):
        raise SpecError(f"seeds={value!r}: each seed once")
    return tuple(value)


def _pairs(value, variants: dict) -> tuple[tuple[str, str], ...]:
    pairs = []
    for pair in value or []:
        if not isinstance(pair, list) or len(pair) != 2 or not set(pair) <= set(variants):
            raise SpecError(
                f"pairs: {pair!r} must be [A, B] with A and B among the variants {sorted(variants)}"
            )
        pairs.append((str(pair[0]), str(pair[1])))
    return tuple(pairs)


def load_spec(path: str | Path, check_configs: bool = True) -> CompareSpec:
    """Parse and check a spec; with ``check_configs`` every run's config is loaded and validated."""
    path = Path(path).resolve()
    if not path.is_file():
        raise SpecError(f"comparison spec {path} does not exist")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(raw, dict) or set(raw) - SPEC_KEYS:
        raise SpecError(f"{path}: unknown top-level keys {sorted(set(raw) - SPEC_KEYS)}; "
                        f"use {sorted(SPEC_KEYS)}")  # fmt: skip
    name, here = str(raw.get("name") or path.stem), path.parent
    variants = raw.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise SpecError(f"{path}: `variants:` must map names to overrides (at least one)")
    root = Path(raw.get("output_dir", "runs/compare")) / name
    default_config = (here / raw["config"]).resolve() if raw.get("config") else None
    seeds, common = _seeds(raw.get("seeds")), [str(o) for o in raw.get("overrides") or []]
    runs = []
    for variant, value in variants.items():
        config, own = _variant(variant, value, default_config, here)
        for seed in seeds:
            placement = [f"run.seed={seed}", f"run.output_dir={root / variant}",
                         f"run.name=seed_{seed}"]  # fmt: skip
            run_dir = root / variant / f"seed_{seed}"
            runs.append(RunSpec(variant, seed, config, (*common, *own, *placement), run_dir))
    spec = CompareSpec(name, root, seeds, tuple(variants), _pairs(raw.get("pairs"), variants),
                       tuple(runs))  # fmt: skip
    if check_configs:
        for run in spec.runs:
            run_config(run)
    return spec


@functools.lru_cache(maxsize=256)
def run_config(run: RunSpec):
    """The validated :class:`ArmorConfig` of one run (errors name the variant and seed; cached:
    treat it as read-only)."""
    try:
        return load_config(run.config, list(run.overrides))
    except ConfigError as e:
        raise SpecError(f"variant {run.variant!r} (seed {run.seed}): {e}") from None


def run_status(run: RunSpec, steps: int) -> str:
    """``done`` (a checkpoint of the last step), ``partial`` (started) or ``new``."""
    saved = [step for step, _ in list_checkpoints(run.run_dir)]
    if saved and max(saved) >= steps:
        return "done"
    return "partial" if run.run_dir.exists() else "new"
