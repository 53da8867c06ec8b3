"""Every ``ARMOR_*`` environment variable the project reads, parsed in one place with its range.

:data:`SETTINGS` lists each variable once: what it means, what reads it (``armor``, the Slurm
and launch scripts, the test harness) and the values it takes. ``armor`` checks the whole
environment when it starts (``cli/__init__.py``), and ``slurm/armor.sbatch`` does the same
before it starts Ray (``python3 -m megatron_armor.env_settings``): a bad value exits 2 with one
line per variable naming it, the value and the range (``ARMOR_CALL_TIMEOUT_S='-5': must be a
number of seconds > 0``), so a typo never becomes a run that times out every call or a
setting silently replaced by its default. An ``ARMOR_*`` name no part of the project reads is
a warning (a misspelt variable). Python code reads a value through :func:`value`, never
``os.environ`` itself. docs/config.md ("Environment variables") is this table in prose.

Standard library only (bottom layer): the batch script runs this module with the host's
``python3``, outside the run's virtualenv or container.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Setting:
    """One variable: its parser (raises ``ValueError``), the range in words, what it does and
    what reads it."""

    parse: Callable[[str], object]
    range: str
    meaning: str
    read_by: str


def seconds(low: float, inclusive: bool = False) -> Callable[[str], float]:
    """A number of seconds above ``low`` (or equal to it, ``inclusive``)."""

    def parse(text: str) -> float:
        number = float(text)
        if number != number or number in (float("inf"), float("-inf")):
            raise ValueError(text)
        if number < low or (number == low and not inclusive):
            raise ValueError(text)
        return number

    return parse


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """A whole number in ``[low, high]`` (no upper bound: ``high`` None)."""

    def parse(text: str) -> int:
        number = int(text.strip())
        if number < low or (high is not None and number > high):
            raise ValueError(text)
        return number

    return parse


def integers(low: int) -> Callable[[str], list[int]]:
    """A comma-separated list of whole numbers ``>= low`` (``2`` or ``2,4``)."""
    one = integer(low)
    return lambda text: [one(part) for part in text.split(",")]


def choice(*names: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in names:
            raise ValueError(text)
        return text

    return parse


def text(value: str) -> str:
    """Any non-empty text (a path, a command, extra arguments)."""
    if not value.strip():
        raise ValueError(value)
    return value


def env_preset(name: str) -> str:
    """A preset of ``slurm/env/`` (``slurm/env/NAME.sh``)."""
    if not (REPO / "slurm" / "env" / f"{name}.sh").is_file():
        raise ValueError(name)
    return name


def presets() -> str:
    names = sorted(p.stem for p in (REPO / "slurm" / "env").glob("*.sh"))
    return "one of " + ", ".join(names) if names else "a file slurm/env/NAME.sh"


FLAG = "0 or 1"
SECONDS = "a number of seconds > 0"
WHOLE_SECONDS = "a whole number of seconds >= 1"
PORT = "a port number in [1, 65535]"
TEXT = "any non-empty text"
SLURM = "slurm/armor.sbatch"
LAUNCH = "launch/local.sh"
TESTS = "the test harness (scripts/test.sh, tests/)"
CI_SLURM = "the CI Slurm cluster (slurm/ci/)"

SETTINGS: dict[str, Setting] = {
    # read by armor itself
    "ARMOR_CALL_TIMEOUT_S": Setting(
        seconds(0), SECONDS, "a cap on every call deadline, unset: "
        "orchestration.call_deadline_cap_s alone", "armor"),
    "ARMOR_SIGNAL_LEAD_S": Setting(
        integer(1), WHOLE_SECONDS, "the seconds between the time-limit signal and the job's "
        "end, 600 by default", f"{SLURM}, armor"),
    "ARMOR_SUPERVISE": Setting(
        choice("0", "1"), FLAG, "0 to run the driver in the `armor` process itself, "
        "unwatched (cli/supervise.py)", "armor"),
    "ARMOR_NVTX": Setting(
        choice("0", "1"), FLAG, "1 to mark NVTX ranges from the start (launch/profile.sh)", "armor"),
    "ARMOR_CACHE": Setting(
        text, TEXT, "the directory of downloaded wheels (~/.cache/megatron_armor)",
        "armor doctor"),
    "ARMOR_REQUEUE_REPEATS": Setting(
        integer(1), "a whole number >= 1", "the exits 75 in a row at the same step with the "
        "same cause after which the run exits 70 instead, 3 by default", "armor"),
    "ARMOR_ROOT": Setting(
        text, TEXT, "the repository (default: the submit directory)",
        f"{SLURM}, launch/, armor compare --slurm"),
    # Slurm and launch scripts
    "ARMOR_ENV": Setting(env_preset, presets(), "the cluster preset slurm/env/NAME.sh", SLURM),
    "ARMOR_LAUNCHER": Setting(
        choice("none", "pyxis", "apptainer"), "none, pyxis or apptainer",
        "how the job's processes enter the container", SLURM),
    "ARMOR_CONTAINER_IMAGE": Setting(text, TEXT, "the container image (pyxis, apptainer)", SLURM),
    "ARMOR_CONTAINER_MOUNTS": Setting(text, TEXT, "the container's bind mounts", SLURM),
    "ARMOR_HOST_PYTHON": Setting(text, TEXT, "the batch host's Python for "
                                 "slurm/lib/detached_srun.py (outside the container)", SLURM),  # fmt: skip
    "ARMOR_APPTAINER_ARGS": Setting(text, TEXT, "arguments of `apptainer exec`", SLURM),
    "ARMOR_PYXIS_ARGS": Setting(text, TEXT, "extra srun arguments under pyxis", SLURM),
    "ARMOR_PYTHON": Setting(text, TEXT, "the Python that runs armor and Ray", f"{SLURM}, launch/"),
    "ARMOR_RAY": Setting(text, TEXT, "the `ray` command", f"{SLURM}, launch/"),
    "ARMOR_DRIVER": Setting(text, TEXT, "the training command instead of `armor train`",
                            f"{SLURM}, launch/"),  # fmt: skip
    "ARMOR_NODE_IFACE": Setting(text, TEXT, "the network interface whose IPv4 address Ray uses", SLURM),
    "ARMOR_LOG_ROOT": Setting(text, TEXT, "where the job directories go (logs/slurm)", SLURM),
    "ARMOR_MAX_RESTARTS": Setting(
        integer(0), "a whole number >= 0", "the most requeues of one job (50)", SLURM),
    "ARMOR_REQUEUE_EXIT_CODE": Setting(
        integer(1, 255), "a whole number in [1, 255]", "the driver's exit code that requeues "
        "the job (75)", SLURM),
    "ARMOR_DRIVER_STOP_GRACE_S": Setting(
        integer(0), "a whole number of seconds >= 0", "the grace between SIGTERM and SIGKILL of "
        "a driver stopped after a lost node (20)", SLURM),
    "ARMOR_RAY_STOP_GRACE_S": Setting(
        integer(0), "a whole number of seconds >= 0", "the wait for Ray's nodes to stop (30)",
        SLURM),
    "ARMOR_RAY_JOIN_TIMEOUT_S": Setting(
        integer(1), WHOLE_SECONDS, "the bound on the nodes joining the Ray cluster (300)",
        SLURM),
    "ARMOR_RAY_START_TIMEOUT_S": Setting(
        integer(1), WHOLE_SECONDS, "the bound on the local Ray head starting (120)", LAUNCH),
    "ARMOR_RAY_PORT": Setting(integer(1, 65535), PORT, "the GCS port", f"{SLURM}, {LAUNCH}"),
    "ARMOR_RAY_DASHBOARD": Setting(choice("0", "1"), FLAG, "1 to start Ray's dashboard",
                                   f"{SLURM}, {LAUNCH}"),  # fmt: skip
    "ARMOR_RAY_DASHBOARD_PORT": Setting(integer(1, 65535), PORT, "the dashboard's port (8265)",
                                        f"{SLURM}, {LAUNCH}"),  # fmt: skip
    "ARMOR_RAY_NUM_CPUS": Setting(integer(1), "a whole number >= 1", "the CPUs Ray advertises",
                                  f"{SLURM}, {LAUNCH}"),  # fmt: skip
    "ARMOR_RAY_NUM_GPUS": Setting(integer(0), "a whole number >= 0", "the GPUs Ray advertises per "
                                  "node", f"{SLURM}, {LAUNCH}"),  # fmt: skip
    "ARMOR_RAY_OBJECT_STORE_MB": Setting(
        integer(80), "a whole number >= 80 (Ray's minimum object store)",
        "the object store per node in MiB", SLURM),
    "ARMOR_RAY_TEMP_DIR": Setting(text, TEXT, "Ray's temp directory", f"{SLURM}, {LAUNCH}"),
    "ARMOR_PROFILE": Setting(choice("none", "torch", "nsys"), "none, torch or nsys",
                             "the profiler of the trainer ranks", SLURM),  # fmt: skip
    "ARMOR_PROFILE_STEPS": Setting(integers(1), "whole numbers >= 1, comma-separated",
                                   "the steps profiled (2)", SLURM),  # fmt: skip
    "ARMOR_PROFILE_RANKS": Setting(integers(0), "whole numbers >= 0, comma-separated",
                                   "the trainer ranks profiled (0)", SLURM),  # fmt: skip
    "ARMOR_LOG_DIR": Setting(text, TEXT, "where ray-head.log goes", LAUNCH),
    "ARMOR_KEEP_RAY": Setting(choice("0", "1"), FLAG, "1 to leave the head running", LAUNCH),
    "ARMOR_JOB_ID": Setting(text, TEXT, "the Ray job's submission id", "launch/submit_job.sh"),
    "ARMOR_WORKING_DIR": Setting(text, TEXT, "a directory uploaded as the job's working_dir",
                                 "launch/submit_job.sh"),  # fmt: skip
    "ARMOR_DRY_RUN": Setting(choice("0", "1"), FLAG, "1 to print the profiler command",
                             "launch/profile.sh"),  # fmt: skip
    # set up and tests
    "ARMOR_VENV": Setting(text, TEXT, "the virtualenv scripts/bootstrap.sh makes (.venv)",
                          "scripts/bootstrap.sh"),  # fmt: skip
    "ARMOR_SGLANG_VENV": Setting(text, TEXT, "the SGLang tier's virtualenv",
                                 "scripts/sglang_env.sh"),  # fmt: skip
    "ARMOR_SGLANG_TIER": Setting(choice("auto", "0", "1"), "auto, 0 or 1",
                                 "whether the SGLang tier runs", TESTS),  # fmt: skip
    "ARMOR_SLURM_KEEP": Setting(choice("0", "1"), FLAG, "1 to leave the CI cluster up", TESTS),
    "ARMOR_TINY_DIR": Setting(text, TEXT, "the tiny model and data (artifacts/tiny)",
                              f"scripts/quickstart.sh, {TESTS}"),  # fmt: skip
    "ARMOR_TINY_MOE_DIR": Setting(text, TEXT, "the tiny MoE model and data", TESTS),
    "ARMOR_STANDIN_MARK_DIR": Setting(text, TEXT, "the SGLang stand-in's marks", TESTS),
    "ARMOR_STANDIN_WEDGE_AT_VERSION": Setting(integer(0), "a whole number >= 0",
                                              "the weight version the stand-in wedges at", TESTS),  # fmt: skip
    "ARMOR_TEST_GONE": Setting(text, TEXT, "a unit test's marker", TESTS),
    "ARMOR_SLURM_STATE": Setting(text, TEXT, "the CI cluster's state directory", CI_SLURM),
    "ARMOR_SLURM_CONF": Setting(text, TEXT, "the CI cluster's slurm.conf", CI_SLURM),
    "ARMOR_SLURM_TOPOLOGY": Setting(choice("two-node", "single-node"), "two-node or single-node",
                                    "the CI cluster's nodes", CI_SLURM),  # fmt: skip
    "ARMOR_SLURM_WAIT_S": Setting(integer(1), WHOLE_SECONDS, "the bound on the CI cluster starting",
                                  CI_SLURM),  # fmt: skip
    "ARMOR_SLURM_NODES": Setting(text, TEXT, "the CI cluster's node names", CI_SLURM),
    "ARMOR_SLURM_BRIDGE": Setting(text, TEXT, "the CI cluster's bridge", CI_SLURM),
    "ARMOR_SLURM_SUBNET": Setting(text, TEXT, "the CI cluster's subnet", CI_SLURM),
    "ARMOR_SLURM_GRACE_S": Setting(integer(1), WHOLE_SECONDS, "the GraceTime of the CI cluster's "
                                   "preempted partition", CI_SLURM),  # fmt: skip
}  # fmt: skip
"""Every ``ARMOR_*`` variable read anywhere in the project."""

INTERNAL = ("ARMOR_SUPERVISOR", "ARMOR_SLURM_JOB_STATES", "ARMOR_STANDIN_INSIDE")
"""Set by the project for its own processes, never by a user: by ``armor`` for its child
(``supervisor_pipe.ENV``), by ``slurm/armor.sbatch`` for the run lock (the job states file,
``run/run_lock.py``), by the CI's container stand-in for its second stage
(``slurm/ci/enroot_standin.sh``)."""


def problems(environ: Mapping[str, str]) -> list[str]:
    """One line per variable of :data:`SETTINGS` set in ``environ`` to a value out of its
    range: the variable, the value, the range and what it is for."""
    found = []
    for name, setting in SETTINGS.items():
        raw = environ.get(name, "")
        if not raw:  # empty is unset, as the scripts' ${VAR:-default} read it
            continue
        try:
            setting.parse(raw)
        except ValueError:
            found.append(f"{name}={raw!r}: must be {setting.range}; {name} is "
                         f"{setting.meaning}, read by {setting.read_by}; fix or unset it")  # fmt: skip
    return found


def unknown(environ: Mapping[str, str]) -> list[str]:
    """``ARMOR_*`` names in ``environ`` that no part of the project reads (misspelt?)."""
    return sorted(k for k in environ if k.startswith("ARMOR_") and k not in SETTINGS
                  and k not in INTERNAL)  # fmt: skip


def value(name: str, environ: Mapping[str, str] | None = None):
    """The parsed value of ``name`` (``None`` when unset or empty); a bad value raises the
    ``ValueError`` that :func:`problems` names at start."""
    raw = (os.environ if environ is None else environ).get(name, "")
    return SETTINGS[name].parse(raw) if raw else None


def report(environ: Mapping[str, str], prog: str) -> int:
    """Print the problems (and warnings) of ``environ`` on stderr; 2 when there are
    problems, else 0."""
    for name in unknown(environ):
        print(f"{prog}: warning: {name} is set but nothing in the project reads it (the ARMOR_* "
              "variables: docs/config.md, 'Environment variables')", file=sys.stderr)  # fmt: skip
    bad = problems(environ)
    for line in bad:
        print(f"{prog}: {line}", file=sys.stderr)
    return 2 if bad else 0


if __name__ == "__main__":
    sys.exit(report(os.environ, "armor settings"))
