"""Load a run config: YAML with at most one ``base:`` parent, dotted overrides, validation.

OmegaConf structured configs do the merge and type checks; this module adds the ``base:``
rule, error messages that name the file and the key, and saving the resolved config.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from megatron_armor.config.ranges import print_range_warnings
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.config.validate import validate


class ConfigError(ValueError):
    """A config problem; the message names the key, the value and the fix."""


def _load_yaml(path: Path):
    """``OmegaConf.load`` with YAML errors (syntax, duplicate keys) as ``file:line:column``."""
    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(
            f"{where}: YAML error: {problem}; fix the file (each key may appear once per section)"
        ) from None


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()):
    """The YAML at ``path`` merged over its ``base:`` parent (one level, resolved recursively);
    ``chain`` holds the files that named it as their base, so a cycle is shown as it runs."""
    if path in chain:
        raise ConfigError(
            f"{chain[0]}: `base:` cycle: {_chain_text(chain + (path,))}; remove the `base:` "
            "that points back"
        )
    if len(chain) > 8:
        raise ConfigError(
            f"{chain[0]}: `base:` chain deeper than 8 files: {_chain_text(chain + (path,))}"
        )
    if not path.is_file():
        via = f" (the `base:` of {chain[-1]})" if chain else ""
        raise ConfigError(f"config file {path} does not exist{via}")
    node = _load_yaml(path)
    if not OmegaConf.is_dict(node):
        raise ConfigError(
            f"{path}: top level must be a mapping of sections, got {type(node).__name__}"
        )
    base = node.pop("base", None)
    if base is None:
        return [(path, node)]
    if not isinstance(base, str):
        raise ConfigError(f"{path}: `base:` must be one file path (a string), got {base!r}")
    parent = (path.parent / base).resolve()
    return _read_yaml(parent, chain + (path,)) + [(path, node)]


def _chain_text(chain: tuple[Path, ...]) -> str:
    """``a.yaml -> b.yaml -> a.yaml``, each file relative to the first one's directory."""
    root = chain[0].parent

    def name(p: Path) -> str:
        try:
            return str(p.relative_to(root))
        except ValueError:
            return str(p)

    return " -> ".join(name(p) for p in chain)


def _merge(schema, node, where: str):
    try:
        return OmegaConf.merge(schema, node)
    except ConfigKeyError as e:
        raise ConfigError(
            f"{where}: unknown key `{e.full_key}`; check the spelling against "
            f"`armor config show` or megatron_armor/config/schema.py"
        ) from None
    except ValidationError as e:
        raise ConfigError(
            f"{where}: bad value for `{e.full_key}`: {e.msg.splitlines()[0]}"
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {e}") from None


def yaml_off_as_off(config: ArmorConfig) -> None:
    """YAML reads a bare ``off`` as ``false``, which a string field then holds as ``'False'``:
    for a setting whose names include ``off`` (``validate.CHOICES``) that is the name ``off``."""
    from megatron_armor.config.validate import CHOICES

    for key, names in CHOICES.items():
        section, _, name = key.rpartition(".")
        node = config
        for part in section.split("."):
            node = getattr(node, part)
        if "off" in names and getattr(node, name) == "False":
            setattr(node, name, "off")


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    check_inputs: bool = False,
) -> ArmorConfig:
    """Resolve ``path`` (and its ``base:``) plus dotted ``overrides`` into a validated config;
    ``check_inputs`` also checks the model directory and data files it names
    (``config/inputs.py``: ``armor train`` does, before anything starts)."""
    cfg = OmegaConf.structured(ArmorConfig)
    if path is not None:
        for file, node in _read_yaml(Path(path).resolve()):
            cfg = _merge(cfg, node, str(file))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like `section.key=value`")
        try:
            node = OmegaConf.from_dotlist([item])
        except (OmegaConfBaseException, yaml.YAMLError) as e:
            raise ConfigError(f"override {item!r}: cannot be parsed ({e})") from None
        cfg = _merge(cfg, node, f"override {item!r}")
    config: ArmorConfig = OmegaConf.to_object(cfg)
    yaml_off_as_off(config)
    try:
        validate(config, inputs=check_inputs)
    except ValueError as e:
        raise ConfigError(f"{path or '<defaults>'}: {e}") from None
    print_range_warnings(config)  # valid, but far outside a useful range: said, not refused
    return config


def as_run(config: ArmorConfig):
    """``config`` as an OmegaConf tree with the numbers a run uses for ``trainer.world_size``
    and ``algo.alpha`` (``config.resolved``) where they say ``auto``: what the run directory's
    ``config.yaml`` records."""
    node = OmegaConf.structured(config)
    decided = config.resolved
    node.trainer.world_size, node.algo.alpha = decided.world_size, decided.alpha
    return node


def to_yaml(config: ArmorConfig) -> str:
    """The validated config as YAML (:func:`as_run`)."""
    return OmegaConf.to_yaml(as_run(config))


def save_config(config: ArmorConfig, run_dir: str | Path) -> Path:
    """Write the resolved config to ``run_dir/config.yaml``."""
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_yaml(config))
    return out
