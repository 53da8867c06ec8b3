#!/usr/bin/env python3
"""pyxis's container flags for ``srun`` on the CI cluster: a stand-in for pyxis/enroot.

    srun [OPTIONS] --container-image=IMAGE [--container-mounts=SRC[:DST[:ro|rw]][,...]]
         [--container-workdir=DIR] [--[no-]container-mount-home] COMMAND...

``slurm/ci/install_slurm.sh`` installs this file as ``/usr/local/bin/srun`` (ahead of Debian's
``/usr/bin/srun`` on PATH), as a GPU cluster's ``plugstack.conf`` loads pyxis: ``srun`` then
takes the flags that ``slurm/env/h100-ib.sh`` (``ARMOR_LAUNCHER=pyxis``) and docs/cluster.md
use, and ``slurm/env/cpu-container.sh`` runs that launcher on the CI cluster. Without
``--container-image`` it is Debian's ``srun``, unchanged.

With ``--container-image`` every task of the step runs its COMMAND through
``enroot_standin.sh`` (installed beside it as ``/usr/local/lib/armor-pyxis/``), which gives it
what an enroot container of a pyxis task gets (enroot's ``mounts/10-system.fstab``): a mount
namespace of its own, a fresh tmpfs on ``/tmp``, ``/run`` and ``/var/lock``, the host's
``/dev`` (so ``/dev/shm``), ``/proc`` and ``/sys``, the image's files, only the
``--container-mounts`` from the host, the home directory only with ``--container-mount-home``
(pyxis's default), the working directory ``--container-workdir``; the node's network, hostname
and process ids; and Slurm's task environment as it is. IMAGE is a directory of
``slurm/ci/cpu_image.sh`` (this machine's ``/usr`` without the Slurm clients, its ``/etc``
without Slurm's configuration and munge key, the Python installation of the project's
``.venv``), not an enroot squashfs.

Slurm's own OCI support was tried first (``srun --container=BUNDLE`` with Debian's ``runc``,
``oci.conf``): it runs each task in a container, but Slurm 22.05 writes one environment into the
bundle for every task of a step (``SLURM_PROCID=0``, ``SLURM_NODEID=0`` and the submitting
shell's ``SLURMD_NODENAME`` on every node), so ``armor doctor --all-nodes`` and the Ray nodes'
names break; a launcher in the task's own process keeps Slurm's per-task environment.

What this cannot show: importing an image (``enroot import`` of a registry or dockerd image),
enroot's user namespace and ``pivot_root`` (a ``chroot`` as root here), its hooks (the GPU and
InfiniBand devices and libraries of ``98-nvidia``/``99-mellanox``, PMIx), pyxis's named
containers and its other flags (refused here, naming the flag).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

LAUNCHER_NAME = "enroot_standin.sh"
INSTALLED_LAUNCHER = Path("/usr/local/lib/armor-pyxis") / LAUNCHER_NAME
SHORT_WITH_VALUE = set("AbcdDeiJLMmnNopqrSTtWCwxBG")
"""srun's short options that take a value (``srun --help``): the next word is theirs."""
LONG_WITH_VALUE = {
    "account", "acctg-freq", "bb", "bbf", "bcast", "bcast-exclude", "begin", "chdir",
    "cluster-constraint", "clusters", "comment", "constraint", "container", "core-spec",
    "cores-per-socket", "cpu-freq", "cpus-per-gpu", "cpus-per-task", "deadline", "delay-boot",
    "dependency", "distribution", "epilog", "error", "exclude", "export", "extra-node-info",
    "gpu-bind", "gpu-freq", "gpus", "gpus-per-node", "gpus-per-socket", "gpus-per-task", "gres",
    "gres-flags", "het-group", "hint", "input", "jobid", "job-name", "licenses", "mail-type",
    "mail-user", "mcs-label", "mem", "mem-bind", "mem-per-cpu", "mem-per-gpu", "mincpus", "mpi",
    "network", "nodelist", "nodes", "ntasks", "ntasks-per-core", "ntasks-per-gpu",
    "ntasks-per-node", "ntasks-per-socket", "output", "partition", "power", "priority",
    "profile", "prolog", "qos", "relative", "reservation", "signal", "slurmd-debug",
    "sockets-per-node", "switches", "task-epilog", "task-prolog", "thread-spec", "threads",
    "threads-per-core", "time", "time-min", "tmp", "wait", "wckey",
}  # fmt: skip
"""srun's long options that take a value (``srun --help``), when given as ``--opt VALUE``."""
PYXIS_VALUE_FLAGS = ("container-image", "container-mounts", "container-workdir")
PYXIS_SWITCHES = {"container-mount-home": True, "no-container-mount-home": False}


class StandInError(ValueError):
    """A flag or an image this stand-in does not take (the message names it and the fix)."""


def takes_value(word: str) -> bool:
    """Whether srun option ``word`` is followed by its value as the next word."""
    if word.startswith("--"):
        return "=" not in word and word[2:] in LONG_WITH_VALUE
    return len(word) == 2 and word[1] in SHORT_WITH_VALUE


def split_command(argv: list[str]) -> tuple[dict, list[str], list[str]]:
    """``({pyxis flag: value}, srun's options, the command)``: the command starts at the first
    word that is neither an option nor an option's value."""
    flags: dict = {}
    options: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        word = argv[i]
        name, eq, value = word[2:].partition("=") if word.startswith("--") else ("", "", "")
        if name in PYXIS_VALUE_FLAGS:
            if not eq:
                i += 1
                value = argv[i] if i < len(argv) else ""
            flags[name] = value
        elif name in PYXIS_SWITCHES:
            flags["mount-home"] = PYXIS_SWITCHES[name]
        elif name.startswith("container"):
            raise StandInError(f"--{name}: not taken by the CI cluster's pyxis stand-in "
                               f"(slurm/ci/pyxis_srun.py takes --{', --'.join(PYXIS_VALUE_FLAGS)} "
                               "and --[no-]container-mount-home)")  # fmt: skip
        else:
            options.append(word)
            if takes_value(word) and i + 1 < len(argv):
                i += 1
                options.append(argv[i])
        i += 1
    command = argv[i + 1 :] if i < len(argv) and argv[i] == "--" else argv[i:]
    return flags, options, command


def check_image(image: Path) -> None:
    if not (image / "layers").is_file() or not (image / "rootfs").is_dir():
        raise StandInError(f"--container-image={image}: not an image of slurm/ci/cpu_image.sh "
                           f"(no {image / 'layers'}); make it with "
                           f"`bash slurm/ci/cpu_image.sh {image}`")  # fmt: skip


def check_mounts(text: str) -> None:
    """``SRC[:DST[:ro|rw]][,...]``, each source on this host (pyxis refuses a missing one)."""
    for item in filter(None, (part.strip() for part in text.split(","))):
        parts = item.split(":")
        if len(parts) > 3 or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
            raise StandInError(f"--container-mounts: {item!r}: use SRC[:DST[:ro|rw]]")
        if not Path(parts[0]).exists():
            raise StandInError(f"--container-mounts: {parts[0]} does not exist on this host")


def launcher() -> Path:
    """``enroot_standin.sh``: the installed one, else the one beside this file (the repo's)."""
    if INSTALLED_LAUNCHER.is_file():
        return INSTALLED_LAUNCHER
    beside = Path(__file__).resolve().parent / LAUNCHER_NAME
    if beside.is_file():
        return beside
    raise StandInError(f"no {INSTALLED_LAUNCHER}: run slurm/ci/install_slurm.sh")


def container_command(flags: dict, command: list[str], home: str) -> list[str]:
    """The step's command run through ``enroot_standin.sh`` with the container's settings."""
    image = Path(flags["container-image"]).resolve()
    check_image(image)
    check_mounts(flags.get("container-mounts", ""))
    if not command:
        raise StandInError("no command to run in the container")
    mount_home = home if flags.get("mount-home", True) else ""
    return ["bash", str(launcher()), str(image), flags.get("container-workdir", ""),
            mount_home, flags.get("container-mounts", ""), "--", *command]  # fmt: skip


def real_srun() -> str:
    """Debian's ``srun``: the next one on PATH after this file."""
    me = Path(__file__).resolve()
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(folder) / "srun"
        if candidate.is_file() and os.access(candidate, os.X_OK) and candidate.resolve() != me:
            return str(candidate)
    raise StandInError("no srun on PATH besides the pyxis stand-in; install slurm-client")


def main(argv: list[str]) -> int:
    try:
        srun = real_srun()
        flags, options, command = split_command(argv)
        if "container-image" in flags:
            command = container_command(flags, command, os.environ.get("HOME", ""))
        elif set(flags) & set(PYXIS_VALUE_FLAGS):
            raise StandInError(f"--{next(iter(flags))} without --container-image")
    except StandInError as err:
        print(f"srun (pyxis stand-in, slurm/ci/pyxis_srun.py): {err}", file=sys.stderr)
        return 2
    os.execv(srun, [srun, *options, *command])
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
