# Service processes and MPI jobs of scripts/deploy-test.sh. Sourced after netns.sh.
#
# Globals read: RUN (the private run directory), SP, SHIM, BENCH (binaries), DT_FAB.
# SP sets: DT_NODES, DT_K, DT_CLUSTER (the description), DT_KEY, DT_SP_PIDS (pid by SP id).

DT_SP_PIDS=()
DT_SP_NAMES=()     # the DPU host name each SP runs on
DT_SP_PORT_BASE=${DT_SP_PORT_BASE:-7100}
DT_HOST_PORT_BASE=${DT_HOST_PORT_BASE:-7200}
DT_DRAINERS=()     # background readers of the SPs' output
DT_STOP_PROBLEMS=0 # SPs that did not stop cleanly (no STATS, jobs held, socket left, SIGKILL needed)

# dt_make_key FILE: a new cluster key (64 hex digits, mode 0600), as `launch` writes one.
dt_make_key() {
  (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' > "$1" && echo >> "$1")
  chmod 0600 "$1"
}

# The short public tag of the key (names of its shared-memory segments: /dev/shm/spoff-TAG-*):
# the first 6 bytes of HMAC-SHA256(key, le64(len) || "spoff cluster tag"), as ClusterKey::tag.
dt_key_tag() {
  printf '\x11\x00\x00\x00\x00\x00\x00\x00spoff cluster tag' |
    openssl dgst -sha256 -mac HMAC -macopt "hexkey:$(tr -d '\n' < "$1")" |
    awk '{print substr($NF, 1, 12)}'
}

# dt_write_cluster FILE NODES K: the cluster description: node i's host name node$i, its SPs on
# its DPU's address (peer port DT_SP_PORT_BASE + index, hosts' port DT_HOST_PORT_BASE + index).
dt_write_cluster() {
  local file=$1 n=$2 k=$3 i j id sock sep=""
  {
    echo "{"
    echo "  \"nodes\": $n,"
    echo "  \"sps_per_node\": $k,"
    echo "  \"ranks_per_node\": ${DT_RPN:-null},"
    echo "  \"layout\": \"block\","
    echo "  \"sps\": ["
    for i in $(seq 0 $((n - 1))); do
      for j in $(seq 0 $((k - 1))); do
        id=$((i * k + j))
        # SPs started by mpirun keep their sockets in their DPU's private directory.
        sock=$RUN/sp$id.sock
        [ "${DT_HOST_TCP:-0}" = 1 ] && sock=$DT_SOCK_DIR/$id/host.sock
        printf '%s    {"id": %d, "node": %d, "index": %d, "peer_addr": "%s:%d", "host_socket": "%s"' \
          "$sep" "$id" "$i" "$j" "$(dt_addr_dpu $((i + 1)))" $((DT_SP_PORT_BASE + j)) "$sock"
        if [ "${DT_HOST_TCP:-0}" = 1 ]; then
          printf ', "host_addr": "%s:%d"' "$(dt_addr_dpu $((i + 1)))" $((DT_HOST_PORT_BASE + j))
        fi
        printf '}'
        sep=$',\n'
      done
    done
    echo
    echo "  ],"
    printf '  "hosts": ['
    sep=""
    for i in $(seq 1 "$n"); do printf '%s"node%d"' "$sep" "$i"; sep=", "; done
    echo "]"
    echo "}"
  } > "$file"
}

# dt_sps_start NODES K: writes the description and starts N x K SPs, each in its DPU's
# namespace under the DPU's host name, then waits until every one said READY (bounded).
dt_sps_start() {
  DT_NODES=$1 DT_K=$2
  DT_CLUSTER=$RUN/cluster-${DT_NODES}x$DT_K.json
  dt_write_cluster "$DT_CLUSTER" "$DT_NODES" "$DT_K"
  DT_SP_PIDS=() DT_SP_NAMES=() DT_SP_FDS=()
  local id
  for id in $(seq 0 $((DT_NODES * DT_K - 1))); do dt_sp_spawn "$id"; done
  for id in "${!DT_SP_PIDS[@]}"; do dt_sp_await "$id" 30; done
  echo "deploy-test: $((DT_NODES * DT_K)) SPs ready ($DT_NODES DPUs x $DT_K), each in its DPU namespace"
}

# dt_sp_spawn ID: starts SP ID of DT_CLUSTER alone, as a site daemon of its DPU would run
# (systemd's spoff-sp@): in the DPU's namespace under its host name, with the SPs' environment
# (DT_SP_ENV, without mpirun's -x); its stdout through a fifo (dt_sp_await reads it).
dt_sp_spawn() {
  local id=$1 node=$(( $1 / DT_K + 1 )) fifo=$RUN/sp$1.fifo x envs=()
  for x in "${DT_SP_ENV[@]}"; do [ "$x" = -x ] || envs+=("$x"); done
  rm -f "$fifo" && mkfifo "$fifo"
  # A simple command in the background: $! is the SP's own pid (ip, unshare, sh and env exec).
  ip netns exec "$(dt_ns_dpu "$node")" unshare --uts sh -c 'hostname "$0" && exec "$@"' \
    "node$node-dpu" env "${envs[@]}" "$SP" serve --cluster "$DT_CLUSTER" --sp-id "$id" --key "$DT_KEY" \
    "${DT_SERVE_ARGS[@]}" > "$fifo" 2>> "$RUN/sp$id.err" &
  DT_SP_PIDS[id]=$!
  DT_SP_NAMES[id]="node$node-dpu"
  exec {fd}< "$fifo"
  DT_SP_FDS[id]=$fd
}

# dt_sp_await ID SECS: until SP ID said READY (bounded), then its stdout (its STATS line at
# exit) drains into $RUN/spID.out.
dt_sp_await() {
  local id=$1 fd=${DT_SP_FDS[$1]} line
  if ! read -r -t "$2" -u "$fd" line || [ "$line" != "READY sp=$id" ]; then
    tail -5 "$RUN/sp$id.err" >&2
    dt_die "SP $id on ${DT_SP_NAMES[id]} did not become ready within $2 s (said: ${line:-nothing})"
  fi
  cat <&"$fd" > "$RUN/sp$id.out" &
  DT_DRAINERS+=($!)
  exec {fd}<&-
}

# dt_sock ID: the Unix socket of SP ID in the running description.
dt_sock() {
  if [ "${DT_HOST_TCP:-0}" = 1 ]; then echo "$DT_SOCK_DIR/$1/host.sock"; else echo "$RUN/sp$1.sock"; fi
}

# dt_sps_stop: SIGTERM to every live SP, waited on (bounded), then SIGKILL.
dt_sps_stop() {
  local id pid t
  for id in "${!DT_SP_PIDS[@]}"; do
    pid=${DT_SP_PIDS[id]}
    kill -TERM "$pid" 2>/dev/null || true
  done
  for id in "${!DT_SP_PIDS[@]}"; do
    pid=${DT_SP_PIDS[id]}
    for t in $(seq 1 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      echo "deploy-test: SP $id did not stop within 10 s of SIGTERM; killing it" >&2
      DT_STOP_PROBLEMS=$((DT_STOP_PROBLEMS + 1))
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
  for pid in "${DT_DRAINERS[@]}"; do wait "$pid" 2>/dev/null || true; done
  DT_DRAINERS=()
  # Every SP stopped this way said its counters, holds no job any more, and removed its socket.
  for id in "${!DT_SP_PIDS[@]}"; do
    if ! grep -q '^STATS .*"jobs_at_exit":0,' "$RUN/sp$id.out"; then
      echo "deploy-test: SP $id stopped without STATS or still holding jobs: $(cut -c1-100 "$RUN/sp$id.out")" >&2
      DT_STOP_PROBLEMS=$((DT_STOP_PROBLEMS + 1))
    fi
    if [ -e "$(dt_sock "$id")" ]; then
      echo "deploy-test: SP $id left its socket $(dt_sock "$id")" >&2
      DT_STOP_PROBLEMS=$((DT_STOP_PROBLEMS + 1))
    fi
  done
  DT_SP_PIDS=()
}

# The counters of the SPs that answer now, one JSON line each (`service-process stats --json`,
# asked from the fabric namespace). The record an SP that does not answer left when it stopped
# or at its last job's end (`stats` prints it too, marked by "as_of_unix"/"stopped_at_unix") is
# not an answer: counting it made a fault round read an old SP's posts as the new one's, or a
# silent SP's as 0, and kill its SP before the job had reached it (issue 25).
dt_live_stats() {
  { ip netns exec "$DT_FAB" "$SP" stats --cluster "$DT_CLUSTER" --key "$DT_KEY" --json 2>/dev/null || true; } |
    { grep -v -E '"(as_of|stopped_at)_unix"' || true; }
}
# Sum of one counter over every SP that answers.
dt_counter() {
  { grep -o "\"$1\":[0-9]*" <<< "$(dt_live_stats)" || true; } | cut -d: -f2 | awk '{s+=$1} END{print s+0}'
}
# dt_counter_of SP NAME: that counter of one SP as it answers now, asked up to 10 times over 5 s;
# nothing (status 1) if it never answers, never a guess.
dt_counter_of() {
  local t line
  for t in $(seq 1 10); do
    line=$({ grep "\"sp\":$1[,}]" <<< "$(dt_live_stats)" || true; } | head -1)
    if [ -n "$line" ]; then
      { grep -o "\"$2\":[0-9]*" <<< "$line" || echo ":0"; } | head -1 | cut -d: -f2
      return 0
    fi
    sleep 0.5
  done
  return 1
}

# dt_hostfile FILE SPEC: SPEC is "a+b+c" ranks per node (node1 gets a slots, ...).
dt_hostfile() {
  local file=$1 spec=$2 i=1 n
  : > "$file"
  for n in ${spec//+/ }; do
    echo "node$i slots=$n" >> "$file"
    i=$((i + 1))
  done
}

# The mpirun options every job of the emulated cluster uses: started in the fabric namespace,
# its daemons in the host namespaces through the agent, all MPI traffic on the test subnet.
dt_mpirun_base() {
  DT_MPIRUN=(mpirun --mca plm_rsh_agent "$RUN/agent" --mca plm_rsh_no_tree_spawn 1
    --mca oob_tcp_if_include "$DT_CIDR" --mca btl_tcp_if_include "$DT_CIDR"
    --mca btl self,tcp --mca pml ob1 --mca orte_tmpdir_base "$RUN/ompi"
    --bind-to none --oversubscribe)
}

# dt_offload_opts WORLD: the options (DT_OFFLOAD; the credential alone in DT_CRED) that offload a job: the shim preloaded, the description and a
# job credential of WORLD ranks (issued from the cluster key, as a resource manager would).
dt_offload_opts() {
  local world=$1
  DT_CRED=$("$SP" credential --key "$DT_KEY" --world-size "$world") || dt_die "cannot issue a job credential"
  DT_OFFLOAD=(-x "LD_PRELOAD=$SHIM" -x "SPOFF_CLUSTER=$DT_CLUSTER" -x "SPOFF_JOB_CREDENTIAL=$DT_CRED"
    "${DT_JOB_ENV[@]}")
}

# --- Per-job SPs started by a real launcher (issue 17: serve --sp-id auto, wait-ready) -------

DT_SP_LAUNCHER=""  # the pid of the mpirun that runs the SPs

# dt_init_cluster NODES K: the description from `service-process cluster init`: a host file
# (node1..nodeN) and a DPU map (nodeI -> its DPU namespace's address); checked.
dt_init_cluster() {
  local n=$1 k=$2 i
  DT_CLUSTER=$RUN/cluster-${n}x$k.json
  : > "$RUN/nodes"
  for i in $(seq 1 "$n"); do echo "node$i" >> "$RUN/nodes"; done
  # Each DPU is its host's name + "-dpu", resolved by the fabric's resolver (its /etc/hosts).
  ip netns exec "$DT_FAB" "$SP" cluster init --hosts-file "$RUN/nodes" --dpu-suffix -dpu \
    --sps-per-node "$k" --peer-port "$DT_SP_PORT_BASE" --host-port "$DT_HOST_PORT_BASE" \
    --socket-dir "$DT_SOCK_DIR" -o "$DT_CLUSTER" 2> "$RUN/cluster-init.err" ||
    { cat "$RUN/cluster-init.err" >&2; dt_die "service-process cluster init failed"; }
  "$SP" cluster check "$DT_CLUSTER" > "$RUN/cluster-check.out" 2>&1 ||
    { cat "$RUN/cluster-check.out" >&2; dt_die "service-process cluster check refused the description"; }
}

# dt_sps_launch NODES K: the SPs of a job, started by Open MPI's mpirun across the DPU
# namespaces (K per DPU, `serve --sp-id auto`: node from --node, index from the launcher's
# local rank), waited on with `service-process wait-ready` (bounded); DT_SP_PIDS from the
# processes found in each DPU namespace.
dt_sps_launch() {
  DT_NODES=$1 DT_K=$2
  if "$SP" cluster --help >/dev/null 2>&1; then
    dt_init_cluster "$DT_NODES" "$DT_K"
  else
    DT_CLUSTER=$RUN/cluster-${DT_NODES}x$DT_K.json
    DT_HOST_TCP=1 dt_write_cluster "$DT_CLUSTER" "$DT_NODES" "$DT_K"
  fi
  # Each DPU's private socket directory gets a directory per SP id (only its own are used).
  dt_write_agent "$RUN/agent" "$(seq -s ' ' 0 $((DT_NODES * DT_K - 1)))"
  local i app=()
  if grep -q '"dpus"' "$DT_CLUSTER"; then
    # The description names the DPUs: one line, K per DPU, each finds its id by its host name.
    : > "$RUN/dpu-hosts"
    for i in $(seq 1 "$DT_NODES"); do echo "node$i-dpu slots=$DT_K" >> "$RUN/dpu-hosts"; done
    app=(--hostfile "$RUN/dpu-hosts" --map-by "ppr:$DT_K:node" "$SP" serve --cluster "$DT_CLUSTER"
      --key "$DT_KEY" --sp-id auto "${DT_SERVE_ARGS[@]}")
  else
    # No DPU names in the description: one application context per DPU, its node by --node.
    for i in $(seq 1 "$DT_NODES"); do
      [ "$i" -gt 1 ] && app+=(:)
      app+=(-np "$DT_K" -H "node$i-dpu:$DT_K" "$SP" serve --cluster "$DT_CLUSTER" --key "$DT_KEY"
        --sp-id auto --node "node$i" "${DT_SERVE_ARGS[@]}")
    done
  fi
  # The SPs of the set before must be gone (see dt_wait_gone).
  dt_wait_gone "$SP" 30 || dt_die "SPs of the set before still run 30 s after it was stopped"
  DT_SP_LAUNCH_LINE="mpirun ${app[*]}"
  # A simple command in the background: $! is mpirun's own pid.
  # Each set's output apart (sps-N-K-L.*: L counts the sets started), kept for a later look.
  DT_SP_LAUNCHES=$(( ${DT_SP_LAUNCHES:-0} + 1 ))
  DT_SP_LOG=$RUN/sps-$DT_NODES-$DT_K-$DT_SP_LAUNCHES
  ip netns exec "$DT_FAB" "${DT_MPIRUN[@]}" "${DT_SP_ENV[@]}" "${app[@]}" > "$DT_SP_LOG.out" \
    2> "$DT_SP_LOG.err" < /dev/null &
  DT_SP_LAUNCHER=$!
  if ! ip netns exec "$DT_FAB" "$SP" wait-ready --cluster "$DT_CLUSTER" --key "$DT_KEY" \
    --timeout-secs 60 > "$RUN/wait-ready.out" 2>&1; then
    cat "$RUN/wait-ready.out" >&2
    tail -5 "$DT_SP_LOG.err" >&2
    dt_die "the SPs started by mpirun did not all become ready"
  fi
  DT_SP_PIDS=() DT_SP_NAMES=()
  local pid id local_rank
  for i in $(seq 1 "$DT_NODES"); do
    for pid in $(ip netns pids "$(dt_ns_dpu "$i")"); do
      [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$SP" ] || continue
      local_rank=$({ tr '\0' '\n' < "/proc/$pid/environ"; } 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_LOCAL_RANK=//p' || true)
      [ -n "$local_rank" ] || continue
      id=$(( (i - 1) * DT_K + local_rank ))
      DT_SP_PIDS[id]=$pid
      DT_SP_NAMES[id]="node$i-dpu"
    done
  done
  [ ${#DT_SP_PIDS[@]} -eq $((DT_NODES * DT_K)) ] ||
    dt_die "found ${#DT_SP_PIDS[@]} SP processes in the DPU namespaces, expected $((DT_NODES * DT_K))"
  # Exactly one process per SP id: a second (an SP of the set before, still exiting) would make
  # a fault hit the wrong process.
  local found=0
  for i in $(seq 1 "$DT_NODES"); do
    for pid in $(ip netns pids "$(dt_ns_dpu "$i")"); do
      [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$SP" ] && found=$((found + 1))
    done
  done
  [ "$found" -eq $((DT_NODES * DT_K)) ] ||
    dt_die "found $found SP processes in the DPU namespaces for $((DT_NODES * DT_K)) SPs"
  echo "deploy-test: $((DT_NODES * DT_K)) SPs ready ($DT_NODES DPUs x $DT_K), started by mpirun across the DPU namespaces; $(head -1 "$RUN/wait-ready.out")"
  local line=${DT_SP_LAUNCH_LINE//$RUN/RUN}
  echo "   (${line//$SP/service-process})"
}

# dt_sps_unlaunch: SIGTERM to the SPs' mpirun, which passes it to the SPs; waited on (bounded).
# Every SP must have printed its counters holding no job (unless one was killed).
dt_sps_unlaunch() {
  [ -n "$DT_SP_LAUNCHER" ] || return 0
  local t out=$DT_SP_LOG.out want=${#DT_SP_PIDS[@]}
  if [ "${DT_SP_FAULTED:-0}" = 1 ]; then
    # An SP was killed: its mpirun aborts the SP job by itself (as for any process that dies).
    # Let it finish first (bounded): a SIGTERM arriving while it tears the job down made
    # Open MPI 4.1's mpirun segfault now and then, leaving its orteds and SPs behind.
    for t in $(seq 1 100); do kill -0 "$DT_SP_LAUNCHER" 2>/dev/null || break; sleep 0.1; done
  fi
  kill -TERM "$DT_SP_LAUNCHER" 2>/dev/null || true
  for t in $(seq 1 150); do kill -0 "$DT_SP_LAUNCHER" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$DT_SP_LAUNCHER" 2>/dev/null; then
    echo "deploy-test: the SPs' mpirun did not stop within 15 s of SIGTERM; killing it" >&2
    DT_STOP_PROBLEMS=$((DT_STOP_PROBLEMS + 1))
    kill -KILL "$DT_SP_LAUNCHER" 2>/dev/null || true
  fi
  wait "$DT_SP_LAUNCHER" 2>/dev/null || true
  DT_SP_LAUNCHER=""
  [ "${DT_SP_FAULTED:-0}" = 1 ] && want=0   # an SP was killed: its mpirun ended the others
  DT_SP_FAULTED=0
  local clean
  clean=$(grep -c '^STATS .*"jobs_at_exit":0,' "$out" || true)
  if [ "$clean" -lt "$want" ]; then
    echo "deploy-test: $clean of $want SPs stopped printing their counters with no job held" >&2
    DT_STOP_PROBLEMS=$((DT_STOP_PROBLEMS + 1))
  fi
  DT_SP_PIDS=()
}
