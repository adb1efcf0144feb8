# The emulated cluster of scripts/deploy-test.sh: network namespaces, their links, the rsh agent
# that enters them, and their removal. Sourced, not run. Every name made here starts with
# $DT_PREFIX (unique per run), so removal touches nothing of anyone else's.
#
# Per node i (1..N): a host namespace "${DT_PREFIX}node$i" (UTS host name node$i, address
# $DT_NET.$((10+i))) and a DPU namespace "${DT_PREFIX}node$i-dpu" (host name node$i-dpu,
# address $DT_NET.$((100+i))); a fabric namespace "${DT_PREFIX}fab" holds the bridge br0
# ($DT_NET.1, where mpirun runs) and one veth pair per host and DPU namespace. No namespace has
# a default route, so no test packet can leave the machine.

DT_NET=${DT_NET:-10.77.0}
DT_CIDR="$DT_NET.0/24"
DT_FAB=""          # the fabric namespace, once made
DT_NAMESPACES=()   # every namespace made, in creation order
DT_ETC_NETNS=()    # /etc/netns/NS directories made (the fabric's host names)

dt_die() { echo "deploy-test: FAILED: $*" >&2; exit 1; }

# Checks what making namespaces needs; a clear message and exit 1 otherwise.
dt_preflight_netns() {
  [ "$(id -u)" -eq 0 ] || dt_die "needs root (network and UTS namespaces); run it as root (CI does)"
  command -v ip >/dev/null || dt_die "no 'ip' command (iproute2): cannot make network namespaces"
  command -v unshare >/dev/null || dt_die "no 'unshare' (util-linux): cannot give a namespace its host name"
  command -v ss >/dev/null || dt_die "no 'ss' (iproute2): cannot show the connections"
  local probe="${DT_PREFIX}probe"
  ip netns add "$probe" 2>/dev/null ||
    dt_die "'ip netns add' fails here (no CAP_SYS_ADMIN, or no network namespaces in this kernel/container)"
  local uts_ok=1
  ip netns exec "$probe" unshare --uts sh -c 'hostname dt-probe' 2>/dev/null || uts_ok=0
  ip -n "$probe" link add dtprobe0 type bridge 2>/dev/null || uts_ok=2
  ip netns del "$probe"
  [ $uts_ok -eq 1 ] || {
    [ $uts_ok -eq 0 ] && dt_die "cannot set a host name in a new UTS namespace (unshare --uts)"
    dt_die "cannot make a bridge inside a network namespace"
  }
}

dt_ns_host() { echo "${DT_PREFIX}node$1"; }
dt_ns_dpu() { echo "${DT_PREFIX}node$1-dpu"; }
dt_addr_host() { echo "$DT_NET.$((10 + $1))"; }
dt_addr_dpu() { echo "$DT_NET.$((100 + $1))"; }

# dt_ns_add NAME: a namespace with its loopback up.
dt_ns_add() {
  ip netns add "$1" || dt_die "cannot create network namespace $1"
  DT_NAMESPACES+=("$1")
  ip -n "$1" link set lo up
}

# dt_link NS VETH_IN_FABRIC ADDR: a veth pair from the fabric's bridge to eth0 of NS.
dt_link() {
  local ns=$1 fabend=$2 addr=$3
  ip -n "$DT_FAB" link add "$fabend" type veth peer name eth0 netns "$ns" ||
    dt_die "cannot create the veth pair $fabend <-> $ns/eth0"
  ip -n "$DT_FAB" link set "$fabend" master br0 up
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
}

# dt_cluster_up N: the fabric and N nodes (host + DPU namespaces).
dt_cluster_up() {
  local n=$1 i
  DT_FAB="${DT_PREFIX}fab"
  dt_ns_add "$DT_FAB"
  ip -n "$DT_FAB" link add br0 type bridge || dt_die "cannot create the bridge in $DT_FAB"
  ip -n "$DT_FAB" addr add "$DT_NET.1/24" dev br0
  ip -n "$DT_FAB" link set br0 up
  # Names for the fabric's resolver: `ip netns exec` bind-mounts /etc/netns/NS/hosts over
  # /etc/hosts for commands run in NS (e.g. `cluster init --dpu-suffix -dpu` resolving nodeI-dpu).
  mkdir -p "/etc/netns/$DT_FAB"
  DT_ETC_NETNS+=("/etc/netns/$DT_FAB")
  {
    echo "127.0.0.1 localhost"
    echo "$DT_NET.1 fabric"
    for i in $(seq 1 "$n"); do
      echo "$(dt_addr_host "$i") node$i"
      echo "$(dt_addr_dpu "$i") node$i-dpu"
    done
  } > "/etc/netns/$DT_FAB/hosts"
  for i in $(seq 1 "$n"); do
    dt_ns_add "$(dt_ns_host "$i")"
    dt_link "$(dt_ns_host "$i")" "h$i" "$(dt_addr_host "$i")"
    dt_ns_add "$(dt_ns_dpu "$i")"
    dt_link "$(dt_ns_dpu "$i")" "d$i" "$(dt_addr_dpu "$i")"
  done
  # Every namespace reaches every other one (the bridge needs a moment to forward: wait for it,
  # with a bound, rather than sleep).
  for i in $(seq 1 "$n"); do
    dt_wait_ping "$DT_FAB" "$(dt_addr_host "$i")"
    dt_wait_ping "$(dt_ns_host "$i")" "$(dt_addr_dpu "$i")"
  done
  if ip -n "$DT_FAB" route show default | grep -q .; then dt_die "the fabric has a default route"; fi
}

# dt_wait_ping NS ADDR: until NS reaches ADDR over TCP (a refused connect proves the path), or 10 s.
dt_wait_ping() {
  local ns=$1 addr=$2 t said
  for t in $(seq 1 100); do
    said=$(ip netns exec "$ns" timeout 1 bash -c "exec 3<>/dev/tcp/$addr/9" 2>&1 || true)
    case "$said" in *refused*) return 0 ;; esac
    sleep 0.1
  done
  dt_die "namespace $ns cannot reach $addr over the test bridge"
}

# dt_write_agent FILE: the rsh agent Open MPI's mpirun calls as `AGENT HOST COMMAND...`: it runs
# COMMAND in HOST's namespace under HOST's own host name (a UTS namespace of its own); on a DPU
# with a private tmpfs at $DT_SOCK_DIR holding the directories SUBDIRS (the SPs' Unix sockets
# are SOCKET_DIR/ID/host.sock, as systemd's RuntimeDirectory makes them). dt_write_agent FILE
# [SUBDIRS].
dt_write_agent() {
  cat > "$1" <<EOF
#!/bin/sh
# rsh agent of deploy-test run $DT_PREFIX: enter the namespace of host \$1 and run the rest there.
host=\$1; shift
case "\$host" in
  node[0-9]*) ;;
  *) echo "deploy-test agent: unknown host \$host" >&2; exit 255 ;;
esac
case "\$host" in
  # A DPU: its SPs' Unix sockets in a directory of its own (each DPU is its own machine; \`ip netns
  # exec\` gives the command a private mount namespace, where this tmpfs stays).
  *-dpu) exec ip netns exec "${DT_PREFIX}\$host" unshare --uts sh -c \
    'hostname "\$0" && mount -t tmpfs -o mode=0755 none "$DT_SOCK_DIR" &&
     for d in ${2:-}; do mkdir -m 0755 "$DT_SOCK_DIR/\$d"; done && exec sh -c "\$*"' "\$host" "\$@" ;;
  *) exec ip netns exec "${DT_PREFIX}\$host" unshare --uts sh -c 'hostname "\$0" && exec sh -c "\$*"' "\$host" "\$@" ;;
esac
EOF
  chmod 0755 "$1"
}

# dt_in NODE_NAME CMD...: run CMD in the namespace of NODE_NAME (node3, node3-dpu) under its
# host name.
dt_in() {
  local name=$1; shift
  ip netns exec "${DT_PREFIX}$name" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$name" "$@"
}

# The pids of processes whose command line names PATH (ours: PATH is this run's directory).
dt_pids_naming() {
  local f pid
  for f in /proc/[0-9]*/cmdline; do
    pid=${f#/proc/}; pid=${pid%/cmdline}
    [ "$pid" != "$$" ] && [ "$pid" != "$BASHPID" ] || continue
    if { tr '\0' ' ' < "$f"; } 2>/dev/null | grep -q -F "$1"; then echo "$pid"; fi
  done
  return 0
}

# dt_wait_gone EXE SECS: until no process in our namespaces runs EXE (bounded); false if some
# still do. A job's ranks (children of daemonized orteds) and a launcher's SPs can outlive their
# mpirun by a moment: a fault injected then could hit a process of the job before.
dt_wait_gone() {
  local t p any
  for t in $(seq 1 $(($2 * 10))); do
    any=0
    for p in $(dt_ns_pids); do
      [ "$(readlink "/proc/$p/exe" 2>/dev/null)" = "$1" ] && { any=1; break; }
    done
    [ "$any" = 0 ] && return 0
    sleep 0.1
  done
  return 1
}

# The processes in our namespaces.
dt_ns_pids() {
  local ns
  for ns in "${DT_NAMESPACES[@]}"; do
    ip netns pids "$ns" 2>/dev/null || true
  done
}

# dt_cluster_down: kills every process left in our namespaces (by pid), removes the namespaces
# (their veths and the bridge go with them). Safe to call twice.
dt_cluster_down() {
  local pids round
  for round in 1 2 3 4 5 6 7 8 9 10; do
    pids=$(dt_ns_pids)
    [ -n "$pids" ] || break
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    sleep 0.2
  done
  local ns
  for ns in "${DT_NAMESPACES[@]}"; do
    ip netns del "$ns" 2>/dev/null || true
  done
  DT_NAMESPACES=()
  for ns in "${DT_ETC_NETNS[@]}"; do rm -rf "$ns"; done
  DT_ETC_NETNS=()
  DT_FAB=""
}

# Our namespaces still listed by `ip netns list`, and /etc/netns directories of ours (should
# print nothing).
dt_ns_left() {
  ip netns list | awk '{print $1}' | grep "^${DT_PREFIX}" || true
  ls -d /etc/netns/"${DT_PREFIX}"* 2>/dev/null || true
}
