#!/usr/bin/env bash
# One task of a pyxis step on the CI cluster: the command in a container with enroot's
# isolation, made in the task's own process (slurm/ci/pyxis_srun.py runs it as the step's
# command; install_slurm.sh installs it as /usr/local/lib/armor-pyxis/enroot_standin.sh):
#
#   enroot_standin.sh IMAGE WORKDIR HOME MOUNTS -- COMMAND...
#
#   IMAGE    a directory of slurm/ci/cpu_image.sh (its rootfs skeleton and read-only layers)
#   WORKDIR  the container's working directory (--container-workdir; '' = /)
#   HOME     the home directory to mount at its path ('' = none: --no-container-mount-home)
#   MOUNTS   --container-mounts: SRC[:DST[:ro|rw]][,...] ('' = none)
#
# What it stands for: enroot's `start` of a pyxis task (mounts/10-system.fstab): a mount
# namespace of its own; the image as the root; the host's /dev (so /dev/shm), /proc and /sys;
# a fresh tmpfs on /tmp, /run and /var/lock; only MOUNTS (and HOME) from the host; the node's
# network, hostname and process ids; Slurm's task environment as it is (SLURM_PROCID, ...). The
# task's process becomes COMMAND (exec), so Slurm's signals reach it as they reach a pyxis task.
# What it cannot show: enroot's user namespace and pivot_root (a chroot as root here), image
# import (a squashfs of a registry image), enroot's hooks (NVIDIA devices and libraries,
# Mellanox, PMIx, the user's passwd entry).
set -euo pipefail
[ $# -ge 5 ] && [ "$5" = -- ] || { echo "usage: enroot_standin.sh IMAGE WORKDIR HOME MOUNTS -- COMMAND..." >&2; exit 2; }
IMAGE=$1 WORKDIR=${2:-/} HOME_DIR=$3 MOUNTS=$4
shift 5

if [ -z "${ARMOR_STANDIN_INSIDE:-}" ]; then
  # a mount namespace of our own first: nothing mounted below reaches the node
  export ARMOR_STANDIN_INSIDE=1
  exec unshare --mount --propagation private -- "$0" "$IMAGE" "$WORKDIR" "$HOME_DIR" "$MOUNTS" -- "$@"
fi
unset ARMOR_STANDIN_INSIDE

fail() { echo "enroot_standin: $*" >&2; exit 125; }
ROOT=/run/armor-ct   # on the node an empty directory; the tmpfs on it is this task's alone
mkdir -p "$ROOT"
mount -t tmpfs -o mode=0755 armor-ct "$ROOT"
cp -a "$IMAGE/rootfs/." "$ROOT/"

bind() {   # bind SRC DST [ro]
  [ -e "$1" ] || fail "mount source $1 does not exist on $(hostname)"
  if [ -d "$1" ]; then mkdir -p "$ROOT$2"; else mkdir -p "$(dirname "$ROOT$2")"; touch "$ROOT$2"; fi
  mount --rbind "$1" "$ROOT$2"
  [ "${3:-rw}" != ro ] || mount -o remount,bind,ro "$ROOT$2"
}
fresh_tmpfs() { mkdir -p "$ROOT$1"; mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs "$ROOT$1"; }

bind /dev /dev
bind /proc /proc
bind /sys /sys ro
while read -r src dst; do
  [ -n "$src" ] || continue
  if [ "$src" = tmpfs ]; then fresh_tmpfs "$dst"; else bind "$src" "$dst" ro; fi
done < "$IMAGE/layers"
for dir in /tmp /run /var/lock; do fresh_tmpfs "$dir"; done
[ -z "$HOME_DIR" ] || bind "$HOME_DIR" "$HOME_DIR"
IFS=, read -ra items <<< "$MOUNTS"
for item in "${items[@]}"; do
  [ -n "$item" ] || continue
  IFS=: read -r src dst mode <<< "$item"
  bind "$src" "${dst:-$src}" "${mode:-rw}"
done
exec chroot "$ROOT" /bin/sh -c 'cd "$1" || exit 125; shift; exec "$@"' container "$WORKDIR" "$@"
