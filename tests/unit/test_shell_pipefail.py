"""Unit tier: no shell script that runs under ``pipefail`` pipes into a reader that stops early.

``cmd | grep -q PATTERN`` (or ``| head``) exits as soon as it has what it needs; when ``cmd``
is still writing it dies of SIGPIPE, and under ``set -o pipefail`` the whole pipeline then
fails (status 141) at random: the two-node Slurm set-up found its own bridge "missing" this
way. Such readers must get the whole output first (a variable, a here-string).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EARLY_EXIT = re.compile(r"(?<!\|)\|(?!\|)\s*(grep\s+(-\w*[qm]\w*\b|--quiet|--max-count)|head\b)")


def shell_scripts() -> list[Path]:
    paths = [*REPO.glob("slurm/**/*.sh"), *REPO.glob("slurm/*.sbatch"), *REPO.glob("scripts/*.sh"),
             REPO / ".ci" / "run"]  # fmt: skip
    return sorted(p for p in paths if p.is_file() and "pipefail" in p.read_text())


def test_pipefail_scripts_never_pipe_into_a_reader_that_stops_early():
    scripts = shell_scripts()
    assert len(scripts) >= 4, scripts  # the Slurm set-up, the sbatch scripts, ray_node.sh
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
             for p in scripts for i, line in enumerate(p.read_text().splitlines(), 1)
             if not line.lstrip().startswith("#") and EARLY_EXIT.search(line)]  # fmt: skip
    assert not found, "read the whole output first (pipefail + SIGPIPE):\n" + "\n".join(found)


@pytest.mark.parametrize("line", ["ip netns list | grep -qw node", "slurmd -C | head -1",
                                  "x | grep -m1 y", "a |grep --quiet b", "a | grep -cq b"])  # fmt: skip
def test_the_check_sees_the_patterns_it_forbids(line):
    assert EARLY_EXIT.search(line)


@pytest.mark.parametrize("line", ["env | grep -E '^A' | sort", "grep -qw x <<<\"$names\"",
                                  "a || grep -q b file"])  # fmt: skip
def test_the_check_lets_whole_readers_through(line):
    assert not EARLY_EXIT.search(line)
