"""Slurm tier: the CI cluster's containers (``srun --container-image``: pyxis's flags,
``slurm/ci/pyxis_srun.py``, each task through ``slurm/ci/enroot_standin.sh``) isolate a step as
an enroot container of pyxis does: a private ``/tmp``, no Slurm client, no home directory
without ``--container-mount-home``, only the mounts given, Slurm's own task environment (with the
submitting shell's ``WANDB_API_KEY``)."""

from __future__ import annotations

import os
import subprocess

import pytest

pytestmark = pytest.mark.slurm

INSIDE = r"""
set -u
echo "task $SLURM_PROCID node $SLURMD_NODENAME host $(hostname)"
echo "tmp: $(ls -A /tmp | tr '\n' ' ')"
touch "/tmp/left-by-step-$SLURM_PROCID"
for cmd in scontrol squeue sbatch srun; do command -v $cmd >/dev/null && echo "has $cmd"; done
echo "home: $(ls -A "$HOME" | tr '\n' ' ')"
echo "workdir: $(pwd)"
echo "wandb key: ${WANDB_API_KEY:-none}"
[ -e "$1" ] && echo "sees $1"
[ -e "$2" ] && echo "sees $2"
true
"""


def in_containers(*flags: str, args: tuple[str, str]) -> str:
    cmd = ["srun", "-N", "2", "--ntasks-per-node=1", "--job-name=armor-tier", *flags,
           "bash", "-c", INSIDE, "inside", *args]  # fmt: skip
    env = {**os.environ, "WANDB_API_KEY": "from-the-submitting-shell"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_every_step_is_a_container_with_enroots_isolation(two_nodes, cpu_image, tmp_path):
    mounted, hidden = tmp_path / "mounted", tmp_path / "not-mounted"
    mounted.mkdir()
    hidden.mkdir()
    (tmp_path / "host-tmp-file").touch()
    image = [f"--container-image={cpu_image}", f"--container-mounts={mounted}:{mounted}",
             f"--container-workdir={mounted}", "--no-container-mount-home"]  # fmt: skip
    # what the step's /tmp holds: the mount's top folder there (pytest's temp root may be in it)
    top = mounted.relative_to("/tmp").parts[0] if mounted.is_relative_to("/tmp") else ""
    fresh_tmp = f"tmp: {top}".rstrip()
    first = in_containers(*image, args=(str(mounted), str(hidden)))
    second = in_containers(*image, args=(str(mounted), str(hidden)))
    for out in (first, second):
        lines = [line.rstrip() for line in out.splitlines()]
        assert sorted(line for line in lines if line.startswith("task ")) == [
            "task 0 node armor-n1 host armor-n1", "task 1 node armor-n2 host armor-n2"]  # fmt: skip
        # a fresh /tmp: nothing of the host's or of the first step, only the mount point under it
        assert lines.count(fresh_tmp) == 2, out
        assert not [line for line in lines if line.startswith("has ")], out  # no Slurm client
        assert lines.count(f"workdir: {mounted}") == 2 and lines.count(f"sees {mounted}") == 2
        assert f"sees {hidden}" not in out  # only the mounts given
        assert "home: .pyenv" in lines, out  # the image's Python only, not the home directory
        # W&B's login in a container without the home directory: the submitting shell's key
        assert lines.count("wandb key: from-the-submitting-shell") == 2, out
    with_home = in_containers(f"--container-image={cpu_image}", args=("/", "/"))
    homes = [line.rstrip() for line in with_home.splitlines() if line.startswith("home: ")]
    assert len(homes) == 2 and "home: .pyenv" not in homes  # pyxis's default: home mounted


def test_a_bad_flag_or_image_is_named_before_any_step(cluster, cpu_image, tmp_path):
    for flags, named in (([f"--container-image={tmp_path}"], "not an image of"),
                         (["--container-name=x", f"--container-image={cpu_image}"],
                          "--container-name"),
                         ([f"--container-image={cpu_image}", "--container-mounts=/nope:/x"],
                          "/nope does not exist")):  # fmt: skip
        done = subprocess.run(["srun", *flags, "true"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and named in done.stderr, done.stderr
