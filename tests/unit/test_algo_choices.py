"""Every ``algo.*`` setting that names a choice is backed by a registry table and documented
with a row in docs/config.md, "Algorithm choices". Tier: unit."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from megatron_armor.algo import registry
from megatron_armor.config.schema import AlgoConfig

pytestmark = pytest.mark.unit

CONFIG_DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def choice_settings(cls: type, prefix: str) -> dict[str, str]:
    """``{dotted key: default}`` of every ``str`` field of ``cls`` and its nested dataclasses."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, kind = f"{prefix}.{f.name}", hints[f.name]
        if kind is str:
            out[key] = f.default
        elif dataclasses.is_dataclass(kind):
            out.update(choice_settings(kind, key))
    return out


def doc_rows() -> dict[str, str]:
    """``{setting: row}`` of the rows of docs/config.md that start with an ``algo.*`` key."""
    rows = {}
    for line in CONFIG_DOC.read_text().splitlines():
        match = re.match(r"\| `(algo\.[\w.]+)` \|", line)
        if match:
            rows.setdefault(match.group(1), line)
    return rows


def test_every_choice_setting_has_a_registry_table_holding_its_default():
    settings = choice_settings(AlgoConfig, "algo")
    assert set(settings) == set(registry.ALGO_CHOICES), (
        "a str setting of AlgoConfig needs a table in algo/registry.py ALGO_CHOICES"
    )
    for key, default in settings.items():
        assert default in registry.ALGO_CHOICES[key], f"{key} default {default!r} not registered"


@pytest.mark.parametrize("key", sorted(registry.ALGO_CHOICES))
def test_every_choice_is_documented_with_all_its_names(key):
    row = doc_rows().get(key)
    assert row is not None, f"docs/config.md 'Algorithm choices' has no row for `{key}`"
    names = re.findall(r"`([^`]+)`", row.split("|")[2])
    assert sorted(names) == sorted(registry.ALGO_CHOICES[key]), f"{key}: {row}"


def test_an_unknown_name_is_reported_with_the_setting_and_the_choices():
    with pytest.raises(ValueError, match=r"algo.anchor_source='replay'.*\['cache', 'generate'\]"):
        registry.get_anchor_source("replay")
