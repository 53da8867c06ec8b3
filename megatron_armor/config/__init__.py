"""Typed config tree (schema), loader with ``base:`` + dotted overrides, validation."""

from megatron_armor.config.loader import ConfigError, load_config, save_config, to_yaml
from megatron_armor.config.schema import ArmorConfig

__all__ = ["ArmorConfig", "ConfigError", "load_config", "save_config", "to_yaml"]
