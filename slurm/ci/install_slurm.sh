#!/usr/bin/env bash
# Install (when missing) and start a single-node Slurm cluster for CI: munge + slurmctld + slurmd
# from Debian packages, no systemd. Idempotent: a running, idle cluster is left as it is.
#
# Needs root and apt-get (for the install). Exits non-zero, saying why, when it cannot.
# Settings (environment):
#   ARMOR_SLURM_CONF   slurm.conf to write            (default /etc/slurm/slurm.conf)
#   ARMOR_SLURM_WAIT_S seconds to wait for the node    (default 60)
set -euo pipefail

CONF=${ARMOR_SLURM_CONF:-/etc/slurm/slurm.conf}
WAIT_S=${ARMOR_SLURM_WAIT_S:-60}
LOG_DIR=/var/log/slurm
NODE=$(hostname -s)

say() { echo "install_slurm: $*" >&2; }
die() { say "$*"; exit 1; }

have_slurm() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
  && command -v sbatch >/dev/null && command -v munged >/dev/null; }

install_packages() {
  have_slurm && return 0
  [ "$(id -u)" -eq 0 ] || die "Slurm is not installed and this is not root (uid $(id -u)); run as root or install slurm-wlm and munge yourself"
  command -v apt-get >/dev/null || die "Slurm is not installed and apt-get is absent; install slurm-wlm and munge with this system's package manager"
  say "installing slurm-wlm and munge from Debian packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || die "apt-get update failed (no network to the Debian mirror?)"
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null \
    || die "apt-get install slurm-wlm munge failed"
  have_slurm || die "slurm-wlm installed but slurmctld/slurmd/sbatch/munged are not on PATH"
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  munge_ok && return 0
  [ "$(id -u)" -eq 0 ] || die "munged is not running and this is not root"
  if [ ! -s /etc/munge/munge.key ]; then
    say "creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null; then mungekey --create --force
    else dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none; fi
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
  chmod 0400 /etc/munge/munge.key
  chmod 0755 /run/munge
  # Run as the munge user, as its systemd unit would; --force cleans a stale socket.
  runuser -u munge -- munged --force
  for _ in $(seq 1 20); do munge_ok && return 0; sleep 0.25; done
  die "munged did not start; see /var/log/munge/munged.log"
}

node_line() {
  # slurmd -C prints this host's real topology; keep CPUs/sockets/cores and a memory a
  # little under the total so the node is never marked invalid for memory.
  local line mem
  line=$(slurmd -C | head -1)
  mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
  echo "$line" | sed -E "s/RealMemory=[0-9]+/RealMemory=${mem}/; s/^NodeName=[^ ]+/NodeName=${NODE} NodeAddr=127.0.0.1/"
}

write_conf() {
  local node cpus
  node=$(node_line)
  cpus=$(echo "$node" | sed -nE 's/.*CPUs=([0-9]+).*/\1/p')
  mkdir -p "$(dirname "$CONF")" /var/spool/slurmctld /var/spool/slurmd "$LOG_DIR"
  local tmp="$CONF.tmp.$$"
  cat > "$tmp" <<CONF
# Single-node CI cluster written by slurm/ci/install_slurm.sh (no systemd, no cgroups).
ClusterName=armor-ci
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Requeued jobs wait cred_expire seconds before they may start again (default 120).
AuthInfo=cred_expire=10
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
JobRequeue=1
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
KillWait=10
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
${node} State=UNKNOWN
PartitionName=ci Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
  mv "$tmp" "$CONF"
  say "wrote $CONF (node ${NODE}, ${cpus} CPUs)"
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_daemons() {
  pid_alive /run/slurmctld.pid || { say "starting slurmctld"; slurmctld -f "$CONF"; }
  for _ in $(seq 1 40); do scontrol ping >/dev/null 2>&1 && break; sleep 0.25; done
  scontrol ping >/dev/null 2>&1 || die "slurmctld does not answer; see ${LOG_DIR}/slurmctld.log"
  pid_alive /run/slurmd.pid || { say "starting slurmd"; slurmd -f "$CONF"; }
}

node_state() { sinfo -h -n "$NODE" -o '%t' 2>/dev/null | head -1; }

wait_idle() {
  local deadline=$((SECONDS + WAIT_S)) state=""
  while [ $SECONDS -lt $deadline ]; do
    state=$(node_state)
    case "$state" in
      idle|mix|alloc) say "node ${NODE} is ${state}"; return 0 ;;
      down*|drain*|fail*) scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  die "node ${NODE} not idle after ${WAIT_S}s (state '${state}'); see ${LOG_DIR}/slurmd.log"
}

main() {
  install_packages
  start_munge
  if scontrol ping >/dev/null 2>&1 && [ -f "$CONF" ] && pid_alive /run/slurmd.pid; then
    say "slurmctld and slurmd already running"
  else
    [ "$(id -u)" -eq 0 ] || die "Slurm daemons are not running and this is not root"
    if [ -f "$CONF" ] && ! grep -q 'slurm/ci/install_slurm.sh' "$CONF"; then
      die "$CONF exists and was not written by this script; set ARMOR_SLURM_CONF to another path"
    fi
    write_conf
    start_daemons
  fi
  wait_idle
}

main "$@"
