"""Unit tier: every ``ARMOR_*`` environment variable is parsed in one place with its range
(``megatron_armor/env_settings.py``): a bad value of any of them is named (variable, value,
range) and ``armor`` exits 2 within seconds, before Ray starts; ``slurm/armor.sbatch`` checks
them before it starts anything; the table lists every variable the project's code reads, and
docs/config.md every variable of the table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_armor import env_settings
from megatron_armor.env_settings import SETTINGS, problems, unknown, value

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
CANDIDATES = ("-5", "abc", "0", "2,x", " ")


def bad_value(name: str) -> str:
    """The first of :data:`CANDIDATES` that ``name``'s parser refuses."""
    for candidate in CANDIDATES:
        try:
            SETTINGS[name].parse(candidate)
        except ValueError:
            return candidate
    raise AssertionError(f"{name} accepts every candidate")


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_bad_value_is_named_with_its_range(name):
    bad = bad_value(name)
    (line,) = problems({name: bad})
    assert line.startswith(f"{name}={bad!r}: must be {SETTINGS[name].range}; "), line
    assert "fix or unset it" in line


def test_values_are_parsed_once_and_empty_is_unset():
    env = {"ARMOR_CALL_TIMEOUT_S": "2.5", "ARMOR_SIGNAL_LEAD_S": "", "ARMOR_PROFILE_STEPS": "2,4"}
    assert value("ARMOR_CALL_TIMEOUT_S", env) == 2.5 and value("ARMOR_SIGNAL_LEAD_S", env) is None
    assert value("ARMOR_PROFILE_STEPS", env) == [2, 4] and problems(env) == []
    assert problems({"ARMOR_CALL_TIMEOUT_S": "nan"}) and problems({"ARMOR_RAY_PORT": "65536"})
    assert unknown({"ARMOR_CALL_TIMEOUT": "5", "ARMOR_SUPERVISOR": "1:2", "PATH": "/"}) == [
        "ARMOR_CALL_TIMEOUT"
    ]


def test_every_bad_setting_at_once_exits_2_in_seconds_before_ray(tmp_path):
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()
    bad = {name: bad_value(name) for name in SETTINGS}
    env = {**os.environ, **bad, "RAY_TMPDIR": str(ray_tmp), "ARMOR_CALL_TIMEOUT": "5"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "megatron_armor.cli", "train",
                           "configs/tiny_cpu.yaml"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert time.monotonic() - start < 30 and not any(ray_tmp.iterdir())
    for name, raw in bad.items():
        assert f"armor: {name}={raw!r}: must be " in done.stderr, name
    assert "warning: ARMOR_CALL_TIMEOUT is set but nothing in the project reads it" in done.stderr
    assert "Traceback" not in done.stderr


def sbatch_function(name: str) -> str:
    text = (REPO / "slurm" / "armor.sbatch").read_text()
    return re.search(rf"^{name}\(\) {{\n.*?^}}\n", text, re.M | re.S)[0]


def test_the_batch_script_checks_the_settings_before_it_starts_anything():
    script = f"""
log() {{ echo "$*" >&2; }}
{sbatch_function("check_settings")}
check_settings
echo checked
"""
    env = {"PATH": os.environ["PATH"], "ARMOR_ROOT": str(REPO)}
    good = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env=env)  # fmt: skip
    assert good.returncode == 0 and good.stdout == "checked\n", good.stderr
    bad = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                         env={**env, "ARMOR_MAX_RESTARTS": "many"})  # fmt: skip
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout
    assert "ARMOR_MAX_RESTARTS='many': must be a whole number >= 0" in bad.stderr


CODE_FILES = ("*.py", "*.sh", "*.sbatch", "Dockerfile")


def test_the_table_lists_every_variable_the_code_reads_and_the_docs_list_the_table():
    read = set()
    for folder in ("megatron_armor", "slurm", "launch", "scripts", "tests", "docker"):
        for pattern in CODE_FILES:
            for path in (REPO / folder).rglob(pattern):
                if path.name == Path(__file__).name:  # its misspelt variable
                    continue
                read |= set(re.findall(r"\bARMOR_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    missing = read - set(SETTINGS) - set(env_settings.INTERNAL)
    assert not missing, f"ARMOR_* variables read but not in env_settings.SETTINGS: {missing}"
    docs = (REPO / "docs" / "config.md").read_text()
    assert not [n for n in SETTINGS if f"`{n}`" not in docs], "docs/config.md lacks some"
