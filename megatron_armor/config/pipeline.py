"""Pipeline configs (``armor pipeline``): two run configs, stage 1 then stage 2.

A pipeline YAML names the run config of each stage (paths relative to the pipeline file) and
per-stage dotted overrides::

    name: tiny_pipeline
    output_dir: runs
    stage1: {config: tiny_dapo.yaml, overrides: [run.steps=150]}
    stage2: {config: tiny_cpu.yaml, overrides: []}

Command-line overrides: ``name=``, ``output_dir=``, ``stage1.config=``, ``stage2.config=`` set
the pipeline's own keys (``stage2.config=../kl/dapo_kl_k3_beta_0.1.yaml`` swaps ARMOR for a KL
baseline), ``stage1.KEY=V`` and ``stage2.KEY=V`` one stage's run config, any other ``KEY=V``
both stages'. The pipeline decides where the
stages run and what stage 2 starts from (``stage_overrides``): stage 1 in
``OUTPUT_DIR/NAME/stage1``, stage 2 in ``OUTPUT_DIR/NAME/stage2`` from the exported best
checkpoint of stage 1 ``OUTPUT_DIR/NAME/stage1_best_hf`` (policy and reference alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_armor.config.loader import ConfigError, load_config
from megatron_armor.config.schema import ArmorConfig

BEST_HF_DIR = "stage1_best_hf"
STAGES = ("stage1", "stage2")
PIPELINE_KEYS = (
    "name",
    "output_dir",
    *(f"{s}.{k}" for s in STAGES for k in ("config", "overrides")),
)


@dataclass
class StageConfig:
    """One stage: a run config and overrides on top of it."""

    config: str = ""
    """Run config YAML (relative to the pipeline file)."""
    overrides: list[str] = field(default_factory=list)
    """Dotted overrides of this stage (``run.steps=300``)."""


@dataclass
class PipelineConfig:
    """Two stages run as one job (arXiv 2607.10481 §3, §5.1: a baseline until over-optimization,
    then ARMOR from its best checkpoint)."""

    name: str = "pipeline"
    """Pipeline directory under ``output_dir`` (holds both run directories)."""
    output_dir: str = "runs"
    """Parent of the pipeline directory."""
    stage1: StageConfig = field(default_factory=StageConfig)
    """Stage 1: runs until its over-optimization detector fires or ``run.steps``."""
    stage2: StageConfig = field(default_factory=StageConfig)
    """Stage 2: from stage 1's best checkpoint as policy and reference, a fresh run."""


@dataclass
class Pipeline:
    """A resolved pipeline: its directory and the two validated run configs."""

    config: PipelineConfig
    root: Path
    stage1: ArmorConfig
    stage2: ArmorConfig

    @property
    def best_hf_dir(self) -> Path:
        return self.root / BEST_HF_DIR


def is_pipeline_file(path: str | Path) -> bool:
    """A pipeline file has a top-level ``stage1:`` key (``slurm/armor.sbatch`` uses the same rule)."""
    return any(line.startswith("stage1:") for line in Path(path).read_text().splitlines())


def load_any(path: str | Path, overrides: list[str] | None = None) -> dict[str, ArmorConfig]:
    """The run config of ``path`` as ``{"run": config}``, or a pipeline's ``{"stage1", "stage2"}``."""
    if is_pipeline_file(path):
        pipeline = load_pipeline(path, overrides)
        return {"stage1": pipeline.stage1, "stage2": pipeline.stage2}
    return {"run": load_config(path, overrides)}


def split_overrides(overrides: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``(pipeline-level, {stage: its overrides})`` from the command line (module docstring)."""
    own, per_stage = [], {stage: [] for stage in STAGES}
    for item in overrides:
        key = item.split("=", 1)[0]
        stage = key.split(".", 1)[0]
        if key in PIPELINE_KEYS:
            own.append(item)
        elif stage in STAGES and "." in key:
            per_stage[stage].append(item.removeprefix(f"{stage}."))
        else:
            for stage_list in per_stage.values():
                stage_list.append(item)
    return own, per_stage


def stage_overrides(config: PipelineConfig, stage: str) -> list[str]:
    """What the pipeline sets in a stage's run config (applied last)."""
    root = Path(config.output_dir) / config.name
    forced = [f"run.output_dir={root}", f"run.name={stage}"]
    if stage == "stage2":
        forced.append(f"trainer.model_path={root / BEST_HF_DIR}")
    return forced


def _read(path: Path, overrides: list[str]) -> PipelineConfig:
    if not path.is_file():
        raise ConfigError(f"pipeline file {path} does not exist")
    try:
        node = OmegaConf.merge(OmegaConf.structured(PipelineConfig), OmegaConf.load(path),
                               OmegaConf.from_dotlist(overrides))  # fmt: skip
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {e}; the keys are name, output_dir, stage1, stage2") from None
    return OmegaConf.to_object(node)


def _check_stage1(config: ArmorConfig, where: str) -> ArmorConfig:
    if not config.overopt.enabled or not config.overopt.stop:
        raise ConfigError(
            f"{where}: stage 1 ends when over-optimization is detected; set overopt.enabled=true "
            "and overopt.stop=true in its config"
        )
    if not config.run.keep_best.metric:  # stage 2 starts from the best validation checkpoint
        config.run.keep_best.metric = config.overopt.val_metric
    return config


def load_pipeline(path: str | Path, overrides: list[str] | None = None) -> Pipeline:
    """Resolve the pipeline file, its two run configs and all overrides (validated)."""
    path = Path(path).resolve()
    own, per_stage = split_overrides(list(overrides or []))
    config = _read(path, own)
    stages = {}
    for stage in STAGES:
        spec: StageConfig = getattr(config, stage)
        if not spec.config:
            raise ConfigError(f"{path}: {stage}.config is empty; name the stage's run config")
        stages[stage] = load_config(
            path.parent / spec.config,
            [*spec.overrides, *per_stage[stage], *stage_overrides(config, stage)],
        )
    where = f"{path} ({config.stage1.config})"
    root = Path(config.output_dir) / config.name
    return Pipeline(config, root, _check_stage1(stages["stage1"], where), stages["stage2"])
