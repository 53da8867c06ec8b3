"""Where the SGLang contract tests read SGLang's sources (sglang tier: SGLang installed at its
pin, as on a GPU node): the installed package, with no download (an empty wheel cache and pip
without an index, so a download would fail)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from megatron_armor.doctor import pins

pytestmark = pytest.mark.sglang


def test_the_installed_sglang_at_its_pin_is_read_without_a_download(tmp_path, monkeypatch):
    monkeypatch.setenv("ARMOR_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    version = pins.read_pins()["sglang"].version
    src = pins.pinned_sources("sglang", "sglang", version)
    assert src == Path(importlib.util.find_spec("sglang").origin).parent
    assert (src / "srt" / "utils" / "common.py").is_file()
    assert not (tmp_path / "empty-cache").exists()  # nothing fetched
