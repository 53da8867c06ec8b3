#!/usr/bin/env bash
# Install (when missing) and start the CI Slurm cluster: munge + slurmctld + slurmd from Debian
# packages, no systemd. Two nodes by default: armor-n1 and armor-n2, each a set of namespaces
# made by slurm/ci/netns_nodes.sh (own hostname, own address on a bridge in a private subnet,
# own spool/log dirs) running its own slurmd, with slurmctld on the host at the bridge address.
# Where namespaces are refused, one node (this host, 127.0.0.1), and the reason is written to
# $ARMOR_SLURM_STATE/topology for the slurm tier to report. Idempotent: a running cluster of
# the same configuration is left as it is; jobs of earlier runs are left to the tests.
#
#   install_slurm.sh [up]   install, write slurm.conf, start the daemons, wait for idle nodes
#   install_slurm.sh down   stop slurmctld, every slurmd, the namespace nodes and munged
#
# Containers: slurm/ci/pyxis_srun.py as /usr/local/bin/srun gives srun pyxis's --container-*
# flags, each task then a container with enroot's isolation (slurm/ci/enroot_standin.sh, in
# /usr/local/lib/armor-pyxis/; the `cpu-container` preset, docs/slurm.md "CI cluster").
# Preemption: partition `ci` (the default) is preempted by jobs of partition `ci-urgent`
# (PreemptMode=REQUEUE, GraceTime).
#
# Needs root and apt-get (for the install). Exits non-zero, saying why, when it cannot.
# Settings (environment):
#   ARMOR_SLURM_CONF     slurm.conf to write                        (default /etc/slurm/slurm.conf)
#   ARMOR_SLURM_WAIT_S   seconds to wait for the nodes               (default 60)
#   ARMOR_SLURM_TOPOLOGY two-node | single-node                     (default two-node)
#   ARMOR_SLURM_STATE    per-node dirs and the topology file        (default /var/lib/armor-slurm-ci)
set -euo pipefail
# The daemons started here must not hold a caller's descriptors (e.g. a `flock` lock file);
# 255 is the script bash is reading.
for fd in /proc/$$/fd/*; do fd=${fd##*/}; [ "$fd" -le 2 ] || [ "$fd" = 255 ] || eval "exec ${fd}>&-" 2>/dev/null || true; done

CONF=${ARMOR_SLURM_CONF:-/etc/slurm/slurm.conf}
WAIT_S=${ARMOR_SLURM_WAIT_S:-60}
export ARMOR_SLURM_STATE=${ARMOR_SLURM_STATE:-/var/lib/armor-slurm-ci}
LOG_DIR=/var/log/slurm
HOST=$(hostname -s)
NETNS="$(cd "$(dirname "$0")" && pwd)/netns_nodes.sh"
SLURMD_PID=/var/spool/slurmd/slurmd.pid   # inside each node's spool dir for namespace nodes
PYXIS_STANDIN=/usr/local/bin/srun           # slurm/ci/pyxis_srun.py, installed by `up`
STANDIN_LIB=/usr/local/lib/armor-pyxis      # and its slurm/ci/enroot_standin.sh
STANDIN_MARK="pyxis's container flags for \`\`srun\`\` on the CI cluster"
GRACE_S=${ARMOR_SLURM_GRACE_S:-60}         # GraceTime of partition ci when ci-urgent preempts it

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

node_resources() {
  # slurmd -C prints this host's real topology; keep CPUs/sockets/cores and a memory a
  # little under the total so a node is never marked invalid for memory.
  local mem topo
  mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
  topo=$(slurmd -C)   # read whole: piped into head, slurmd could die of SIGPIPE (pipefail)
  sed -E "1!d; s/RealMemory=[0-9]+/RealMemory=${mem}/; s/^NodeName=[^ ]+ //; s/ UpTime=.*//" <<<"$topo"
}

node_lines() {
  # NODE_LINES / NODE_NAMES / CTL_ADDR of the chosen topology.
  local res name ip
  res=$(node_resources)
  NODE_LINES="" NODE_NAMES=""
  if [ "$TOPOLOGY" = two-node ]; then
    CTL_ADDR=$(bash "$NETNS" controller-ip)
    while read -r name ip; do
      NODE_LINES+="NodeName=${name} NodeAddr=${ip} ${res} State=UNKNOWN"$'\n'
      NODE_NAMES+="${NODE_NAMES:+,}${name}"
    done < <(bash "$NETNS" node-line)
  else
    CTL_ADDR=127.0.0.1
    NODE_LINES="NodeName=${HOST} NodeAddr=127.0.0.1 ${res} State=UNKNOWN"$'\n'
    NODE_NAMES=$HOST
  fi
}

render_conf() {
  node_lines
  cat <<CONF
# CI cluster (${TOPOLOGY}) written by slurm/ci/install_slurm.sh (no systemd, no cgroups).
ClusterName=armor-ci
SlurmctldHost=${HOST}(${CTL_ADDR})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Requeued jobs wait cred_expire seconds before they may start again (default 120).
AuthInfo=cred_expire=10
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=${SLURMD_PID}
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
JobRequeue=1
# jobs of partition ci-urgent preempt those of ci: SIGTERM to the job's steps, GraceTime
# seconds for them to end, then the job is requeued (docs/slurm.md)
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
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
${NODE_LINES}PartitionName=ci Nodes=${NODE_NAMES} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=1 GraceTime=${GRACE_S}
PartitionName=ci-urgent Nodes=${NODE_NAMES} MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=2 PreemptMode=OFF
CONF
}

choose_topology() {
  # TOPOLOGY and the topology file the slurm tier reads (with the reason for one node).
  local why=""
  mkdir -p "$ARMOR_SLURM_STATE"
  TOPOLOGY=${ARMOR_SLURM_TOPOLOGY:-two-node}
  if [ "$TOPOLOGY" = two-node ] && ! why=$(bash "$NETNS" check 2>&1); then
    say "two namespace nodes cannot be made ($why); starting a single-node cluster"
    TOPOLOGY=single-node
    echo "single-node: ${why}" > "$ARMOR_SLURM_STATE/topology"
    return 0
  fi
  case "$TOPOLOGY" in
    two-node) echo "two-node" > "$ARMOR_SLURM_STATE/topology" ;;
    single-node) echo "single-node: ARMOR_SLURM_TOPOLOGY=single-node was chosen" > "$ARMOR_SLURM_STATE/topology" ;;
    *) die "ARMOR_SLURM_TOPOLOGY=$TOPOLOGY: use two-node or single-node" ;;
  esac
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pid_file() {
  # SIGTERM the daemon of pid file $1, then SIGKILL after 10 s.
  pid_alive "$1" || return 0
  local pid
  pid=$(cat "$1")
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.25; done
  kill -KILL "$pid" 2>/dev/null || true
}

stop_daemons() {
  stop_pid_file /run/slurmctld.pid
  stop_pid_file "$SLURMD_PID"
  bash "$NETNS" down
}

daemons_running() {
  # (two nodes: no Slurm client runs before the bridge exists; see netns_nodes.sh net)
  [ "$TOPOLOGY" != two-node ] || bash "$NETNS" has-net || return 1
  scontrol ping >/dev/null 2>&1 || return 1
  if [ "$TOPOLOGY" = two-node ]; then
    local name
    for name in ${NODE_NAMES//,/ }; do pid_alive "$ARMOR_SLURM_STATE/$name/spool/slurmd.pid" || return 1; done
  else
    pid_alive "$SLURMD_PID"
  fi
}

start_daemons() {
  mkdir -p /var/spool/slurmctld /var/spool/slurmd "$LOG_DIR"
  [ "$TOPOLOGY" != two-node ] || bash "$NETNS" net
  pid_alive /run/slurmctld.pid || { say "starting slurmctld"; slurmctld -f "$CONF"; }
  for _ in $(seq 1 40); do scontrol ping >/dev/null 2>&1 && break; sleep 0.25; done
  scontrol ping >/dev/null 2>&1 || die "slurmctld does not answer; see ${LOG_DIR}/slurmctld.log"
  if [ "$TOPOLOGY" = two-node ]; then
    bash "$NETNS" up "$CONF"
  else
    pid_alive "$SLURMD_PID" || { say "starting slurmd"; slurmd -f "$CONF"; }
  fi
}

nodes_state() { sinfo -h -o '%n %t' 2>/dev/null; }

wait_idle() {
  # Every node idle, mixed or allocated (jobs of earlier runs are the tests' to cancel).
  local deadline=$((SECONDS + WAIT_S)) state="" bad
  while [ $SECONDS -lt $deadline ]; do
    state=$(nodes_state)
    bad=$(echo "$state" | awk '$2 !~ /^(idle|mix|alloc)$/ {print $1}')
    if [ -n "$state" ] && [ -z "$bad" ]; then say "nodes: $(echo "$state" | tr '\n' ' ')"; return 0; fi
    for node in $bad; do scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true; done
    sleep 0.5
  done
  die "nodes not idle after ${WAIT_S}s (sinfo: $(echo "$state" | tr '\n' ' ')); see ${LOG_DIR}/slurmd.log or ${ARMOR_SLURM_STATE}/<node>/log/slurmd.log"
}

install_standin() {
  # pyxis's srun flags (slurm/ci/pyxis_srun.py); an srun there that is not ours stays
  if [ -e "$PYXIS_STANDIN" ] && ! grep -qF "$STANDIN_MARK" "$PYXIS_STANDIN"; then
    die "$PYXIS_STANDIN exists and is not slurm/ci/pyxis_srun.py; remove it or install pyxis"
  fi
  mkdir -p "$STANDIN_LIB"
  install -m 0755 "$(dirname "$0")/enroot_standin.sh" "$STANDIN_LIB/enroot_standin.sh"
  install -m 0755 "$(dirname "$0")/pyxis_srun.py" "$PYXIS_STANDIN.tmp.$$"
  mv "$PYXIS_STANDIN.tmp.$$" "$PYXIS_STANDIN"
}

remove_standin() {
  [ -e "$PYXIS_STANDIN" ] && grep -qF "$STANDIN_MARK" "$PYXIS_STANDIN" || return 0
  rm -rf "$PYXIS_STANDIN" "$STANDIN_LIB"
}

up() {
  install_packages
  start_munge
  choose_topology
  local wanted
  node_lines
  wanted=$(render_conf)
  if [ -f "$CONF" ] && [ "$wanted" = "$(cat "$CONF")" ] && daemons_running; then
    say "slurmctld and slurmd (${TOPOLOGY}) already running"
  else
    [ "$(id -u)" -eq 0 ] || die "Slurm daemons are not running and this is not root"
    if [ -f "$CONF" ] && ! grep -q 'slurm/ci/install_slurm.sh' "$CONF"; then
      die "$CONF exists and was not written by this script; set ARMOR_SLURM_CONF to another path"
    fi
    stop_daemons
    mkdir -p "$(dirname "$CONF")"
    echo "$wanted" > "$CONF.tmp.$$" && mv "$CONF.tmp.$$" "$CONF"
    say "wrote $CONF (${TOPOLOGY}: ${NODE_NAMES})"
    start_daemons
  fi
  install_standin
  wait_idle
}

down() {
  [ -f "$CONF" ] && grep -q 'slurm/ci/install_slurm.sh' "$CONF" || die "$CONF was not written by this script; nothing stopped"
  stop_daemons
  stop_pid_file /run/munge/munged.pid
  remove_standin
  say "Slurm daemons, namespace nodes and munged stopped; the pyxis stand-in removed"
}

case "${1:-up}" in
  up) up ;;
  down) down ;;
  *) die "usage: install_slurm.sh [up|down]" ;;
esac
