#!/usr/bin/env bash
# The CPU cluster's container image (the `cpu-container` preset's ARMOR_CONTAINER_IMAGE): what
# `docker build -f docker/Dockerfile` + `enroot import` make for a GPU cluster, made here from
# this machine's own system instead of a registry image, for slurm/ci/pyxis_srun.py:
#
#   bash slurm/ci/cpu_image.sh DIR [PYTHON]
#
#   DIR/rootfs   the image's root: this machine's top-level layout (/bin -> usr/bin, ...), empty
#                /root, /home, /tmp, /var/tmp (the image ships no home directory)
#   DIR/usr-bin, DIR/usr-local-bin  /usr/bin and /usr/local/bin without the Slurm client
#                commands (hard links: no copy), mounted over them: like the project's image,
#                the container has no scontrol/squeue/srun
#   DIR/layers   the host directories the image holds, read-only ("SRC DST" per line; SRC
#                tmpfs: an empty directory): /usr, /etc (/etc/slurm and /etc/munge empty: no
#                Slurm configuration, no munge key), and the Python installation that
#                PYTHON (default .venv/bin/python) runs on; the project's .venv itself lives in
#                the repository, which every step mounts (ARMOR_CONTAINER_MOUNTS)
#
# Idempotent: an image of the same layers is left as it is. Needs root (hard links into /usr/bin).
set -euo pipefail

OUT=${1:?usage: cpu_image.sh DIR [PYTHON]}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${2:-$ROOT/.venv/bin/python}
SLURM_CLIENTS=(sacct sacctmgr salloc sattach sbatch sbcast scancel scontrol scrontab sdiag sinfo
  sprio squeue sreport srun sshare sstat strigger sview)

say() { echo "cpu_image: $*" >&2; }

[ -x "$PYTHON" ] || { say "no Python at $PYTHON; run scripts/bootstrap.sh first or pass PYTHON"; exit 1; }
prefix=$("$PYTHON" -c 'import sys; print(sys.base_prefix)')
layers=$(printf '%s %s\n' /usr /usr "$OUT/usr-bin" /usr/bin "$OUT/usr-local-bin" /usr/local/bin \
  /etc /etc tmpfs /etc/slurm tmpfs /etc/munge "$prefix" "$prefix")
if [ -f "$OUT/layers" ] && [ "$(cat "$OUT/layers")" = "$layers" ] && [ -d "$OUT/rootfs" ]; then
  say "$OUT is up to date"
  exit 0
fi
rm -rf "$OUT.tmp"
mkdir -p "$OUT.tmp/rootfs" "$OUT.tmp/usr-bin" "$OUT.tmp/usr-local-bin"
for entry in /*; do
  name=${entry#/}
  if [ -L "$entry" ]; then ln -s "$(readlink "$entry")" "$OUT.tmp/rootfs/$name"
  elif [ -d "$entry" ]; then mkdir -p "$OUT.tmp/rootfs/$name"; fi
done
mkdir -p "$OUT.tmp/rootfs/var/tmp" "$OUT.tmp/rootfs/run"
chmod 1777 "$OUT.tmp/rootfs/tmp" "$OUT.tmp/rootfs/var/tmp"
# /usr/bin and /usr/local/bin (the CI cluster's pyxis stand-in is /usr/local/bin/srun) by hard
# links (cp -l), without the Slurm clients
for bin in usr/bin usr/local/bin; do
  [ -d "/$bin" ] || continue
  cp -al "/$bin/." "$OUT.tmp/${bin//\//-}/" 2>/dev/null || cp -a "/$bin/." "$OUT.tmp/${bin//\//-}/"
  for name in "${SLURM_CLIENTS[@]}"; do rm -f "$OUT.tmp/${bin//\//-}/$name"; done
done
echo "$layers" > "$OUT.tmp/layers"
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
say "made $OUT (Python $prefix; no Slurm client in /usr/bin)"
