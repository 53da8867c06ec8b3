#!/usr/bin/env python3
"""pyxis's container flags for ``srun`` on the CI cluster: a stand-in for pyxis/enroot.

    srun [OPTIONS] --container-image=IMAGE [--container-mounts=SRC[:DST[:ro]][,...]]
         [--container-workdir=DIR] [--[no-]container-mount-home] COMMAND...

``slurm/ci/install_slurm.sh`` installs this file as ``/usr/local/bin/srun`` (ahead of Debian's
``/usr/bin/srun`` on PATH), as a GPU cluster's ``plugstack.conf`` loads pyxis: ``srun`` then
takes the flags that ``slurm/env/h100-ib.sh`` (``ARMOR_LAUNCHER=pyxis``) and docs/cluster.md
use, and ``slurm/env/cpu-container.sh`` runs that launcher on the CI cluster. Without
``--container-image`` it is Debian's ``srun``, unchanged.

With ``--container-image`` the step runs through Slurm's own OCI container support: this writes
an OCI bundle (``config.json``; its ``process`` Slurm fills in per task) and runs
``srun --container=BUNDLE`` with the other options; slurmstepd starts every task with ``runc``
(``oci.conf``, written by install_slurm.sh). What each task gets is what an enroot container
gets (enroot's ``mounts/10-system.fstab``): its own mount namespace; a fresh tmpfs on ``/tmp``,
``/run`` and ``/var/lock``; the host's ``/dev`` (so ``/dev/shm``), ``/proc`` and ``/sys``; the
node's network, hostname and process ids (no network, UTS or PID namespace); the image's files;
only the ``--container-mounts`` from the host; the home directory only with
``--container-mount-home`` (pyxis's default); the working directory ``--container-workdir``.

IMAGE is a directory made by ``slurm/ci/cpu_image.sh`` (this machine's ``/usr`` without the
Slurm clients, its ``/etc`` without Slurm's configuration and munge key, the Python installation
of the project's ``.venv``), not an enroot squashfs. What this cannot show: importing an image
(``enroot import`` of a registry or dockerd image), enroot's user namespace (the user is root
here), the GPU and InfiniBand hooks (``98-nvidia``, ``99-mellanox``: devices and driver
libraries in the container), PMIx, pyxis's named containers and its other flags (refused here,
naming the flag).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

BUNDLES = Path(os.environ.get("ARMOR_SLURM_STATE", "/var/lib/armor-slurm-ci")) / "oci-bundles"
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
ENROOT_TMPFS = ("/tmp", "/run", "/var/lock")
ALL_CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
    "CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE",
    "CAP_SYS_NICE", "CAP_AUDIT_WRITE", "CAP_SETFCAP",
]  # fmt: skip
"""The container's capabilities: the root user's, without admin ones (mounts, modules)."""


class StandInError(ValueError):
    """A flag or an image this stand-in does not take (the message names it and the fix)."""


def split_flags(argv: list[str]) -> tuple[dict, list[str]]:
    """``({flag: value}, srun's own arguments)``: pyxis's flags taken out of the options before
    the command (the first word that is neither an option nor an option's value)."""
    flags: dict = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if not word.startswith("-") or word == "--":
            rest.extend(argv[i:])
            break
        name, eq, value = word[2:].partition("=") if word.startswith("--") else ("", "", "")
        if name in PYXIS_VALUE_FLAGS:
            if not eq:
                i += 1
                value = argv[i] if i < len(argv) else ""
            flags[name] = value
        elif name in PYXIS_SWITCHES:
            flags["mount-home"] = PYXIS_SWITCHES[name]
        elif name.startswith("container-"):
            raise StandInError(f"--{name}: not taken by the CI cluster's pyxis stand-in "
                               f"(slurm/ci/pyxis_srun.py takes --{', --'.join(PYXIS_VALUE_FLAGS)} "
                               "and --[no-]container-mount-home)")  # fmt: skip
        else:
            rest.append(word)
            takes_next = (word.startswith("--") and not eq and name in LONG_WITH_VALUE) or (
                not word.startswith("--") and len(word) == 2 and word[1] in SHORT_WITH_VALUE
            )
            if takes_next and i + 1 < len(argv):
                i += 1
                rest.append(argv[i])
        i += 1
    return flags, rest


def parse_mounts(text: str) -> list[dict]:
    """``SRC[:DST[:ro|rw]][,...]`` (pyxis's ``--container-mounts``) as OCI bind mounts."""
    mounts = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        parts = item.split(":")
        if len(parts) > 3 or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
            raise StandInError(f"--container-mounts: {item!r}: use SRC[:DST[:ro|rw]]")
        src, dst = parts[0], parts[1] if len(parts) > 1 else parts[0]
        if not Path(src).exists():
            raise StandInError(f"--container-mounts: {src} does not exist on this host")
        mode = parts[2] if len(parts) == 3 else "rw"
        mounts.append(bind(src, dst, read_only=mode == "ro"))
    return mounts


def bind(src: str, dst: str, read_only: bool = False) -> dict:
    options = ["rbind", "nosuid"] + (["ro"] if read_only else [])
    return {"destination": dst, "type": "none", "source": src, "options": options}


def tmpfs(dst: str) -> dict:
    return {"destination": dst, "type": "tmpfs", "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=1777"]}  # fmt: skip


def image_mounts(image: Path) -> list[dict]:
    """The image's layers (``cpu_image.sh``'s ``layers`` file), read-only."""
    layers = image / "layers"
    if not layers.is_file() or not (image / "rootfs").is_dir():
        raise StandInError(f"--container-image={image}: not an image of slurm/ci/cpu_image.sh "
                           f"(no {layers}); make it with `bash slurm/ci/cpu_image.sh {image}`")  # fmt: skip
    mounts = []
    for line in layers.read_text().splitlines():
        src, dst = line.split()
        mounts.append(tmpfs(dst) if src == "tmpfs" else bind(src, dst, read_only=True))
    return mounts


def bundle_config(flags: dict, home: str) -> dict:
    """The OCI ``config.json`` of the container (``process.args``/``env``: Slurm's, per task)."""
    image = Path(flags["container-image"]).resolve()
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        bind("/dev", "/dev"),
        bind("/sys", "/sys", read_only=True),
        *image_mounts(image),
        *(tmpfs(path) for path in ENROOT_TMPFS),
    ]
    if flags.get("mount-home", True) and home:
        mounts.append(bind(home, home))
    mounts += parse_mounts(flags.get("container-mounts", ""))
    caps = list(ALL_CAPABILITIES)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False, "user": {"uid": os.getuid(), "gid": os.getgid()},
            "args": ["/bin/false"], "env": [], "cwd": flags.get("container-workdir") or "/",
            "capabilities": {key: caps for key in ("bounding", "effective", "permitted")},
            "noNewPrivileges": False,
        },
        "root": {"path": "rootfs", "readonly": False},
        "mounts": mounts,
        "linux": {"namespaces": [{"type": "mount"}]},
    }  # fmt: skip


def write_bundle(config: dict, image: Path) -> Path:
    """The bundle directory of ``config`` (by its content: steps with the same flags share it)
    with a copy of the image's root (``rootfs``: directories and links only, the files come
    from the image's layers; Slurm 22.05 runs the bundle's own ``rootfs``, which runc wants to be
    a directory, not a link)."""
    text = json.dumps(config, indent=1, sort_keys=True)
    path = BUNDLES / hashlib.sha256(f"{image}\n{text}".encode()).hexdigest()[:16]
    if not (path / "config.json").is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        shutil.copytree(image / "rootfs", tmp / "rootfs", symlinks=True)
        (tmp / "config.json").write_text(text)
        try:
            tmp.rename(path)
        except OSError:  # another step wrote the same bundle meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return path


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
        flags, rest = split_flags(argv)
        srun = real_srun()
        if "container-image" in flags:
            config = bundle_config(flags, os.environ.get("HOME", ""))
            image = Path(flags["container-image"]).resolve()
            rest = [f"--container={write_bundle(config, image)}", *rest]
        elif len(flags):
            raise StandInError(f"--{next(iter(flags))} without --container-image")
    except StandInError as err:
        print(f"srun (pyxis stand-in, slurm/ci/pyxis_srun.py): {err}", file=sys.stderr)
        return 2
    os.execv(srun, [srun, *rest])
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
