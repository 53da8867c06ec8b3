"""docs/gpu.md's downloads for nodes without PyPI resolve the whole pinned GPU stack: each
``pip download`` line of the page (run as the page writes it, ``$platforms`` and all, through a
shell whose ``pip`` records its arguments) is resolved by ``pip install --dry-run --report``
with the same options: the wheels' metadata only (``--use-feature=fast-deps``: HTTP range
requests, no multi-GB wheel comes down), for the page's Python and platforms. The sdist line is
checked on the index (the pinned version has a source distribution; preparing its metadata
would install torch for its build). Needs PyPI; each resolution is kept for a day under
``$ARMOR_CACHE/resolve`` (default ``~/.cache/megatron_armor``). Tier: unit."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from doc_commands import FENCE  # noqa: E402

pytestmark = pytest.mark.unit

PAGE = REPO / "docs" / "gpu.md"
CACHE = Path(os.environ.get("ARMOR_CACHE", Path.home() / ".cache" / "megatron_armor")) / "resolve"
RESOLVE_TIMEOUT_S = 900
INDEX = "https://pypi.org/simple"
RECORD_PIP = 'pip() { [ "$1" = download ] && printf "%s\\0" "${@:2}" >> "$PIP_CALLS" && echo >> "$PIP_CALLS"; true; }'


def download_block() -> str:
    """The page's shell block of ``pip download`` lines, up to ``# on the node:``."""
    for match in FENCE.finditer(PAGE.read_text()):
        if "pip download" in match.group(2):
            return match.group(2).split("# on the node:")[0]
    raise AssertionError(f"{PAGE} has no `pip download` block")


def download_calls(tmp_path: Path) -> list[list[str]]:
    """The arguments of every ``pip download`` of the block, as bash expands them."""
    calls = tmp_path / "calls"
    done = subprocess.run(["bash", "-c", f"set -e\n{RECORD_PIP}\n{download_block()}"],
                          cwd=REPO, env={**os.environ, "PIP_CALLS": str(calls)},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in calls.read_text().split("\n") if line]
    return [[a for a in line.split("\0") if a] for line in lines]


def without_destination(args: list[str]) -> list[str]:
    """``args`` without ``-d DIR`` (a dry run writes nothing)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("-d", "--dest"):
            skip = True
        else:
            out.append(arg)
    return out


def resolve(args: list[str], tmp_path: Path) -> dict:
    """``pip install --dry-run --report`` of ``args`` (cached for the day, keyed by the args and
    the requirement files they name)."""
    named = [REPO / a for a in args if (REPO / a).is_file()]
    key = hashlib.sha256(json.dumps(args).encode() + b"".join(p.read_bytes() for p in named)
                         + time.strftime("%Y-%m-%d").encode()).hexdigest()[:24]  # fmt: skip
    cached = CACHE / f"{key}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--use-feature=fast-deps", "--target", str(tmp_path / "target"), "--report",
           str(report), "--index-url", INDEX, *args]  # fmt: skip
    env = {**os.environ, "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": "", "PIP_CONSTRAINT": "",
           "PIP_CONFIG_FILE": os.devnull}  # fmt: skip
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=RESOLVE_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"resolving {args} took over {RESOLVE_TIMEOUT_S}s: check the network to PyPI")
    assert done.returncode == 0, (
        f"docs/gpu.md: pip download {' '.join(args)}\n{done.stderr[-3000:]}"
    )
    CACHE.mkdir(parents=True, exist_ok=True)
    cached.write_text(report.read_text())
    return json.loads(report.read_text())


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            out[canonical(name.split("[")[0])] = version.strip()
    return out


def test_the_gpu_stack_resolves_for_the_pages_platforms_without_downloading_it(tmp_path):
    stack = next(c for c in download_calls(tmp_path) if "requirements-gpu.txt" in c)
    report = resolve(without_destination(stack), tmp_path)
    got = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    for name, version in pins(REPO / "requirements-gpu.txt").items():
        assert got.get(name) == version, f"{name}: {got.get(name)} resolved, {version} pinned"
    assert "megatron-core" in got and "ray" in got  # requirements.txt came along


def test_the_build_tools_resolve_and_te_torch_has_its_sdist(tmp_path):
    calls = download_calls(tmp_path)
    source = next(c for c in calls if "--no-binary" in c)
    assert source[source.index("--no-binary") + 1] == "transformer-engine-torch", source
    ((name, version),) = pins(REPO / "requirements-gpu-build.txt").items()
    with urllib.request.urlopen(f"{INDEX}/{name}/", timeout=60) as page:
        files = page.read().decode()
    assert f"{name.replace('-', '_')}-{version}.tar.gz" in files, f"no sdist of {name}=={version}"
    tools = next(c for c in calls if "setuptools" in c)
    report = resolve(without_destination(tools), tmp_path)
    assert {"setuptools", "wheel", "packaging", "pybind11"} <= {
        canonical(i["metadata"]["name"]) for i in report["install"]}  # fmt: skip
