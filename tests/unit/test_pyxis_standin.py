"""The CI cluster's pyxis stand-in (``slurm/ci/pyxis_srun.py``): pyxis's flags taken out of an
``srun`` command line before its command, whatever srun's own options around them, and the
command wrapped into ``enroot_standin.sh``; flags it does not take are refused by name. The
containers themselves run in the slurm tier (``tests/slurm/test_containers.py``). Tier: unit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "slurm" / "ci"))
from pyxis_srun import StandInError, container_command, split_command  # noqa: E402

pytestmark = pytest.mark.unit


def test_docs_doctor_line_splits_into_srun_options_flags_and_command():
    argv = ["-N", "4", "--ntasks-per-node=1", "--gpus-per-node", "8",
            "--container-image=/img", "--container-mounts", "/r:/r", "--container-workdir=/r",
            "--no-container-mount-home", "armor", "doctor", "--all-nodes", "--container-x"]  # fmt: skip
    flags, options, command = split_command(argv)
    assert flags == {"container-image": "/img", "container-mounts": "/r:/r",
                     "container-workdir": "/r", "mount-home": False}  # fmt: skip
    assert options == ["-N", "4", "--ntasks-per-node=1", "--gpus-per-node", "8"]
    assert command == ["armor", "doctor", "--all-nodes", "--container-x"]  # the command's own


def test_the_command_runs_through_the_launcher_with_the_containers_settings(tmp_path):
    image = tmp_path / "image"
    (image / "rootfs").mkdir(parents=True)
    (image / "layers").write_text("/usr /usr\n")
    flags = {"container-image": str(image), "container-mounts": f"{tmp_path}:/data:ro"}
    wrapped = container_command(flags, ["python", "-V"], home="/home/u")
    assert wrapped[1].endswith("enroot_standin.sh")
    assert wrapped[2:] == [str(image), "", "/home/u", f"{tmp_path}:/data:ro", "--", "python", "-V"]
    flags["mount-home"] = False
    assert container_command(flags, ["true"], home="/home/u")[4] == ""  # no home


def test_a_pyxis_flag_it_does_not_take_is_refused_by_name():
    with pytest.raises(StandInError, match="--container-name: not taken"):
        split_command(["--container-name=x", "true"])


def test_an_image_not_made_by_cpu_image_sh_is_refused_naming_the_script(tmp_path):
    with pytest.raises(StandInError, match="not an image of slurm/ci/cpu_image.sh"):
        container_command({"container-image": str(tmp_path)}, ["true"], home="")
