#!/usr/bin/env bash
# Namespace "nodes" for the CI Slurm cluster: each node is a network namespace (a veth to a
# bridge this script creates, its own address in a private test subnet, no default route),
# plus the UTS namespace (its own hostname) and mount namespace (its own slurmd spool and log
# directories, an /etc/hosts naming every node) of the slurmd started in it. Traffic between
# nodes and slurmctld stays on that bridge.
#
#   netns_nodes.sh check          exit 0 when namespaces, veth pairs and bridges can be made
#   netns_nodes.sh net            the bridge (with the controller's address) and the namespaces
#   netns_nodes.sh up CONF        the same, then one slurmd per node (slurm.conf CONF)
#   netns_nodes.sh down           stop the nodes' slurmd, delete the namespaces and the bridge
#   netns_nodes.sh pids NODE      PIDs of every process running on NODE (its network namespace)
#
# Settings (environment): ARMOR_SLURM_NODES (node names, default "armor-n1 armor-n2"),
# ARMOR_SLURM_SUBNET (first three octets of the /24, default 10.217.17), ARMOR_SLURM_BRIDGE
# (default armorbr0), ARMOR_SLURM_STATE (per-node directories, default /var/lib/armor-slurm-ci).
set -euo pipefail
# The slurmd started here must not hold a caller's descriptors (e.g. a `flock` lock file);
# 255 is the script bash is reading.
for fd in /proc/$$/fd/*; do fd=${fd##*/}; [ "$fd" -le 2 ] || [ "$fd" = 255 ] || eval "exec ${fd}>&-" 2>/dev/null || true; done

NODES=(${ARMOR_SLURM_NODES:-armor-n1 armor-n2})
SUBNET=${ARMOR_SLURM_SUBNET:-10.217.17}
BRIDGE=${ARMOR_SLURM_BRIDGE:-armorbr0}
STATE=${ARMOR_SLURM_STATE:-/var/lib/armor-slurm-ci}
IFACE=armor0   # the node's end of its veth, the same name on every node

say() { echo "netns_nodes: $*" >&2; }
die() { say "$*"; exit 1; }

controller_ip() { echo "$SUBNET.1"; }
node_ip() {   # node_ip INDEX (0-based) -> its address on the bridge
  echo "$SUBNET.$((11 + $1))"
}

check() {
  # Make and remove a throw-away namespace, veth pair and bridge; say what was refused.
  local ns="armor-check-$$" out
  [ "$(id -u)" -eq 0 ] || die "namespaces need root (uid $(id -u))"
  command -v ip >/dev/null && command -v unshare >/dev/null || die "ip (iproute2) and unshare (util-linux) are needed"
  if ! out=$(ip netns add "$ns" 2>&1); then die "network namespaces refused: $out"; fi
  if ! out=$(ip link add "ac$$a" type veth peer name "ac$$b" 2>&1); then
    ip netns del "$ns"; die "veth pairs refused: $out"
  fi
  ip link del "ac$$a"
  if ! out=$(ip link add "acbr$$" type bridge 2>&1); then ip netns del "$ns"; die "bridges refused: $out"; fi
  ip link del "acbr$$"
  if ! out=$(ip netns exec "$ns" unshare --uts --mount --propagation private true 2>&1); then
    ip netns del "$ns"; die "UTS/mount namespaces refused: $out"
  fi
  ip netns del "$ns"
}

make_bridge() {
  ip route del blackhole "$SUBNET.0/24" 2>/dev/null || true
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$(controller_ip)/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
}

write_hosts() {
  # /etc/netns/<node>/hosts: bound over /etc/hosts inside the node (as `ip netns exec` does).
  local node=$1 i
  mkdir -p "/etc/netns/$node"
  {
    echo "127.0.0.1 localhost"
    echo "$(controller_ip) $(hostname -s)"
    for i in "${!NODES[@]}"; do echo "$(node_ip "$i") ${NODES[$i]}"; done
  } > "/etc/netns/$node/hosts"
}

make_node() {
  local i=$1 node=${NODES[$1]} host_end="av${1}$$"
  has_netns "$node" || ip netns add "$node"
  if ! ip netns exec "$node" ip link show "$IFACE" >/dev/null 2>&1; then
    ip link add "$host_end" type veth peer name "$IFACE" netns "$node"
    ip link set "$host_end" master "$BRIDGE" up
  fi
  ip netns exec "$node" ip addr replace "$(node_ip "$i")/24" dev "$IFACE"
  ip netns exec "$node" ip link set "$IFACE" up
  ip netns exec "$node" ip link set lo up
  write_hosts "$node"
  mkdir -p "$STATE/$node/spool" "$STATE/$node/log"
}

slurmd_pid_file() { echo "$STATE/$1/spool/slurmd.pid"; }

start_slurmd() {
  # slurmd in the node's network namespace (nsenter: /sys and its cgroup mounts stay as they
  # are), with its own hostname, /etc/hosts and spool/log dirs (bind mounts in a private mount
  # namespace); it daemonizes and keeps the namespaces alive.
  local node=$1 conf=$2 pid_file
  pid_file=$(slurmd_pid_file "$node")
  if [ -s "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; then return 0; fi
  say "starting slurmd on $node ($(node_ip "$3"), log $STATE/$node/log/slurmd.log)"
  nsenter --net="/run/netns/$node" unshare --uts --mount --propagation private -- bash -c '
    set -e
    hostname "$1"
    mount --bind "/etc/netns/$1/hosts" /etc/hosts
    mount --bind "$2/spool" /var/spool/slurmd
    mount --bind "$2/log" /var/log/slurm
    exec slurmd -N "$1" -f "$3"' slurmd-ns "$node" "$STATE/$node" "$conf"
}

net() {
  # Before any Slurm daemon or client uses the subnet: without the bridge its addresses
  # would be routed off this machine.
  local i
  make_bridge
  for i in "${!NODES[@]}"; do make_node "$i"; done
}

up() {
  local conf=${1:?usage: netns_nodes.sh up SLURM_CONF} i
  mkdir -p /var/spool/slurmd /var/log/slurm
  net
  for i in "${!NODES[@]}"; do start_slurmd "${NODES[$i]}" "$conf" "$i"; done
}

# Whole outputs are read before matching: `cmd | grep -q` under pipefail fails at random when
# grep exits on its match while cmd still writes (SIGPIPE, status 141).
has_net() {
  local addrs
  addrs=$(ip addr show dev "$BRIDGE" 2>/dev/null) || return 1
  [[ $addrs == *"inet $(controller_ip)/"* ]]
}

has_netns() {   # has_netns NODE: whether the network namespace NODE exists
  local names
  names=$(ip netns list) || return 1
  grep -qw "^$1" <<<"$names"
}

stop_slurmd() {
  local pid_file pid
  pid_file=$(slurmd_pid_file "$1")
  [ -s "$pid_file" ] || return 0
  pid=$(cat "$pid_file")
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.25; done
  kill -KILL "$pid" 2>/dev/null || true
}

down() {
  local node pid
  for node in "${NODES[@]}"; do
    stop_slurmd "$node"
    if has_netns "$node"; then
      for pid in $(ip netns pids "$node"); do kill -KILL "$pid" 2>/dev/null || true; done
      ip netns del "$node"
    fi
    rm -rf "/etc/netns/$node"
  done
  ! ip link show "$BRIDGE" >/dev/null 2>&1 || ip link del "$BRIDGE"
  # slurm.conf still names the subnet: its packets are dropped here, never routed elsewhere.
  ip route replace blackhole "$SUBNET.0/24"
  say "namespace nodes and bridge $BRIDGE removed (blackhole route for $SUBNET.0/24)"
}

case "${1:-}" in
  check) check ;;
  net) net ;;
  has-net) has_net ;;
  up) up "${2:-}" ;;
  down) down ;;
  pids) ip netns pids "${2:?usage: netns_nodes.sh pids NODE}" ;;
  controller-ip) controller_ip ;;
  node-line) for i in "${!NODES[@]}"; do echo "${NODES[$i]} $(node_ip "$i")"; done ;;
  *) die "usage: netns_nodes.sh check|net|has-net|up CONF|down|pids NODE|controller-ip|node-line" ;;
esac
