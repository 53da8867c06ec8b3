"""The pinned GPU stack agrees with itself: the metadata of the pinned wheels (fetched with
``pip download --no-deps`` into ``~/.cache/megatron_armor/wheels``, never installed) against the
pins of requirements.txt, requirements-gpu.txt and requirements-gpu-build.txt."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from megatron_armor.doctor import pins

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def stack():
    """(pins, ranges, {name: Requires-Dist}) of the pinned stack."""
    pinned = pins.read_pins()
    return pinned, pins.read_ranges(), pins.pinned_requires(pinned)


def test_pinned_wheels_agree_with_the_pins(stack):
    pinned, ranges, requires = stack
    assert set(pins.WHEELS_WITH_METADATA) <= set(requires)
    assert pins.check_pins(pinned, ranges, requires) == []
    assert "torch" not in pins.read_pins(pins.COMMON_REQUIREMENTS)  # GPU installs pick torch


def test_disagreeing_pins_are_named_with_the_fix(stack):
    pinned, ranges, requires = stack

    def problems(name: str, **change) -> str:
        changed = {**pinned, name: dataclasses.replace(pinned[name], **change)}
        return "\n".join(pins.check_pins(changed, ranges, requires))

    assert re.search(r"sglang==\S+ requires torch==\S+, but .* pins torch==2\.13\.0",
                     problems("torch", version="2.13.0"))  # fmt: skip
    assert "megatron-core==0.16.1 requires transformer-engine" in problems(
        "transformer-engine", version="2.20.2"
    )
    assert "use transformer-engine[pytorch,core_cu13]" in problems(
        "transformer-engine", extras=frozenset({"core_cu12"})
    )
    assert "transformer-engine-torch" in problems("transformer-engine-torch", version="2.10.0")


def test_the_container_installs_the_pinned_files():
    dockerfile = (pins.REPO / "docker/Dockerfile").read_text()
    assert f"ARG PYTHON_VERSION={pins.CONTAINER_PYTHON}" in dockerfile
    for path in pins.STACK:
        assert f"-r {path.name}" in dockerfile, f"docker/Dockerfile does not install {path.name}"
    assert "--no-build-isolation -r requirements-gpu-build.txt" in dockerfile
    preset = (pins.REPO / "slurm/env/h100-ib.sh").read_text()
    assert "ARMOR_CONTAINER_IMAGE" in preset and "megatron-armor" in preset


def test_unreachable_index_fails_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("ARMOR_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no site index / find-links
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(pins.PinsUnavailable, match="check the network / PIP_INDEX_URL"):
        pins.fetch_wheel("sglang-router", "0.3.2", timeout_s=60)
