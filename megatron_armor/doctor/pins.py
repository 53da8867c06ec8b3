"""The pinned GPU stack (``requirements-gpu.txt``) and the metadata of its wheels.

The pins are one decision kept in one file; this module reads them, fetches the pinned wheels
for the container's platform (``pip download --no-deps``, CPython :data:`CONTAINER_PYTHON`,
manylinux x86_64) into a cache, and checks that the wheels' own ``Requires-Dist`` agree with
the pins: SGLang's exact ``torch``, megatron-core's Transformer Engine range, the CUDA major of
the TE core extra against the CUDA build SGLang's kernels are made for, and every exact pin of
one package against the ranges of another. Nothing is installed; wheels are unpacked only.
"""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
GPU_REQUIREMENTS = REPO / "requirements-gpu.txt"
COMMON_REQUIREMENTS = REPO / "requirements.txt"
"""Installed on CPU and GPU machines alike (megatron-core's pin lives here)."""
GPU_BUILD_REQUIREMENTS = REPO / "requirements-gpu-build.txt"
"""Transformer Engine's torch extension, compiled against the pinned torch."""
STACK = (COMMON_REQUIREMENTS, GPU_REQUIREMENTS, GPU_BUILD_REQUIREMENTS)
CONTAINER_PYTHON = "3.12"
"""CPython of ``docker/Dockerfile`` (its ``PYTHON_VERSION``): the wheels fetched are for it."""
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64")
WHEELS_WITH_METADATA = ("sglang", "sglang-router", "transformer-engine", "megatron-core")
"""Pinned packages published as wheels (torch's 0.5 GB wheel and TE's sdist are not fetched)."""
CHECKED_EXTRAS = {"megatron-core": frozenset({"dev"}), "transformer-engine": frozenset({"pytorch"})}
"""megatron-core names the Transformer Engine range it is tested with in its ``dev`` extra; TE's
``pytorch`` extra names its torch extension (installed from requirements-gpu-build.txt)."""


class PinsUnavailable(RuntimeError):
    """A pinned wheel could not be fetched (PyPI unreachable, or the pin does not exist)."""


def cache_dir() -> Path:
    """``$ARMOR_CACHE`` or ``~/.cache/megatron_armor``; wheels go under ``wheels/``."""
    root = os.environ.get("ARMOR_CACHE") or Path.home() / ".cache" / "megatron_armor"
    return Path(root) / "wheels"


@dataclass(frozen=True)
class Pin:
    name: str
    """Canonical project name (``transformer-engine``)."""
    version: str
    extras: frozenset[str]


def read_pins(*paths: Path) -> dict[str, Pin]:
    """``name==version`` lines of requirements files (comments and ranges left out); by
    default the GPU stack (:data:`STACK`)."""
    pins = {}
    lines = [line for p in paths or STACK for line in p.read_text().splitlines()]
    for line in lines:
        text = line.split("#", 1)[0].strip()
        if not text or text.startswith("-"):
            continue
        req = Requirement(text)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            name = canonicalize_name(req.name)
            pins[name] = Pin(name, exact[0], frozenset(req.extras))
    return pins


def read_ranges(*paths: Path) -> dict[str, Requirement]:
    """Every requirement of the files (default: the GPU stack), by canonical name."""
    out = {}
    for path in paths or STACK:
        for line in path.read_text().splitlines():
            text = line.split("#", 1)[0].strip()
            if text and not text.startswith("-"):
                req = Requirement(text)
                out[canonicalize_name(req.name)] = req
    return out


def pinned_sources(module: str, name: str, version: str) -> Path:
    """The sources of package ``module`` at the pin ``name==version``: the installed package
    where it is installed at that version (a GPU node, the sglang tier's virtualenv: nothing is
    downloaded), else the pinned wheel, unpacked (:func:`fetch_wheel`)."""
    import importlib.metadata
    import importlib.util

    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed == version:
        return Path(importlib.util.find_spec(module).origin).parent
    return fetch_wheel(name, version) / module


def fetch_wheel(name: str, version: str, timeout_s: float = 300.0) -> Path:
    """The unpacked wheel ``name==version`` for the container's platform, from the cache or
    PyPI (``pip download --no-deps``). Raises :class:`PinsUnavailable` naming the fix."""
    target = (
        cache_dir() / f"{canonicalize_name(name)}-{version}-cp{CONTAINER_PYTHON.replace('.', '')}"
    )
    if (target / ".complete").exists():
        return target
    download = target.with_name(target.name + ".download")
    download.mkdir(parents=True, exist_ok=True)
    _pip_download(f"{name}=={version}", download, timeout_s)
    wheels = sorted(download.glob("*.whl"))
    if not wheels:
        raise PinsUnavailable(f"pip download {name}=={version} gave no wheel in {download}")
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    with zipfile.ZipFile(wheels[0]) as archive:
        archive.extractall(staging)
    (staging / ".complete").write_text(wheels[0].name)
    try:
        staging.rename(target)  # atomic: a concurrent fetch sees all of it or nothing
    except OSError:  # another process finished first (or a partial dir of a killed run)
        if not (target / ".complete").exists():
            shutil.rmtree(target)
            staging.rename(target)
        else:
            shutil.rmtree(staging)
    shutil.rmtree(download, ignore_errors=True)  # the unpacked copy is what is read
    return target


def _pip_download(spec: str, dest: Path, timeout_s: float) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        *platforms, "--python-version", CONTAINER_PYTHON, "--implementation", "cp",
        "--dest", str(dest), spec,
    ]  # fmt: skip
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        raise PinsUnavailable(
            f"pip download {spec} took over {timeout_s:.0f}s: PyPI is unreachable or slow; "
            f"check the network / PIP_INDEX_URL, or copy the wheel into {dest}"
        ) from err
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-3:])
        raise PinsUnavailable(
            f"pip download {spec} failed ({tail}); check the network / PIP_INDEX_URL or the pin "
            f"in {GPU_REQUIREMENTS.name}"
        )


def wheel_requires(wheel_dir: Path) -> list[Requirement]:
    """``Requires-Dist`` of an unpacked wheel."""
    (metadata,) = wheel_dir.glob("*.dist-info/METADATA")
    message = email.parser.Parser().parsestr(metadata.read_text())
    return [Requirement(r) for r in message.get_all("Requires-Dist") or []]


def applies(req: Requirement, extras: frozenset[str] = frozenset()) -> bool:
    """Whether ``req`` is installed on the container (Linux x86_64, CPython 3.12) with
    ``extras`` of its parent asked for."""
    if req.marker is None:
        return True
    env = default_environment() | {
        "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
        "python_version": CONTAINER_PYTHON, "python_full_version": CONTAINER_PYTHON + ".0",
        "implementation_name": "cpython",
    }  # fmt: skip
    wanted = {"", *extras}
    return any(req.marker.evaluate(env | {"extra": extra}) for extra in wanted)


def cuda_major_of(requires: list[Requirement]) -> set[int]:
    """CUDA majors a package's requirements are built for (``foo-cu13``, ``foo[cu13]``)."""
    found = set()
    for req in requires:
        for text in (req.name, *req.extras):
            found |= {int(m) for m in re.findall(r"cu(\d\d)\b", text.replace("_", "-"))}
    return found


def check_pins(pins: dict[str, Pin], ranges: dict[str, Requirement], requires: dict) -> list[str]:
    """Disagreements between the pins and the wheels' ``requires`` (``{name: [Requirement]}``
    of the fetched wheels); empty when the stack installs as pinned."""
    problems = []
    for owner, reqs in requires.items():
        for req in reqs:
            if applies(req, pins[owner].extras | CHECKED_EXTRAS.get(owner, frozenset())):
                problems += _disagreement(owner, req, pins, ranges)
    problems += _te_cuda_extra(pins, requires)
    return problems


def _disagreement(owner: str, req: Requirement, pins: dict[str, Pin], ranges: dict) -> list[str]:
    name = canonicalize_name(req.name)
    pinned = pins.get(name)
    if pinned is not None and not req.specifier.contains(pinned.version, prereleases=True):
        return [
            f"{owner}=={pins[owner].version} requires {req}, but requirements-gpu.txt pins "
            f"{name}=={pinned.version}: set the pin to a version in '{req.specifier}'"
        ]
    ours = ranges.get(name)
    exact = [s.version for s in req.specifier if s.operator == "=="]
    if pinned is None and ours is not None and exact and not ours.specifier.contains(exact[0]):
        return [
            f"{owner}=={pins[owner].version} requires {req}, outside our '{ours}': widen it in "
            "requirements.txt / requirements-gpu.txt"
        ]
    return []


def _te_cuda_extra(pins: dict[str, Pin], requires: dict) -> list[str]:
    """TE's ``core_cuXX`` extra must match the CUDA major SGLang's kernels are built for."""
    te, sglang = pins.get("transformer-engine"), requires.get("sglang", [])
    if te is None:
        return []
    te_majors = {int(m) for e in te.extras for m in re.findall(r"core[_-]cu(\d\d)", e)}
    sglang_majors = cuda_major_of([r for r in sglang if applies(r)])
    if te_majors and sglang_majors and te_majors != sglang_majors:
        return [
            f"transformer-engine extras {sorted(te.extras)} build for CUDA {sorted(te_majors)}, "
            f"sglang=={pins['sglang'].version} for CUDA {sorted(sglang_majors)}: use "
            f"transformer-engine[pytorch,core_cu{min(sglang_majors)}]"
        ]
    return []


def pinned_requires(pins: dict[str, Pin], timeout_s: float = 300.0) -> dict[str, list]:
    """``{name: Requires-Dist}`` of every pinned wheel in :data:`WHEELS_WITH_METADATA`."""
    return {
        name: wheel_requires(fetch_wheel(name, pins[name].version, timeout_s))
        for name in WHEELS_WITH_METADATA
        if name in pins
    }


def installed_mismatches(pins: dict[str, Pin]) -> list[str]:
    """Installed distributions whose version differs from the pin (absent ones left out)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pin in pins.values():
        try:
            found = version(pin.name)
        except PackageNotFoundError:
            continue
        if Version(found).base_version != Version(pin.version).base_version:
            out.append(f"{pin.name} {found} installed, {pin.version} pinned")
    return out
