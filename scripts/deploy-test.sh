#!/usr/bin/env bash
# make deploy-test: a real multi-node cluster on this machine, made of network namespaces this
# script creates and removes. Per node a host namespace (host name nodeI) and a DPU namespace
# (nodeI-dpu), each with its own address on a test bridge; SPs run in the DPU namespaces, MPI
# ranks in the host namespaces, started by Open MPI's own mpirun through an rsh agent that enters
# a namespace. Runs the per-collective correctness programs (every byte compared with PMPI_*
# inside the programs, SP counters checked), the overlap benchmark offloaded and native, and
# faults (an SP and a rank killed mid-run), then checks that nothing is left behind.
#
#   scripts/deploy-test.sh               the full run (make deploy-test)
#   DEPLOY_SHORT=1 scripts/deploy-test.sh   a short run (make test runs it): fewer configurations
#                                        and cases, still both faults
# Needs root (namespaces). BIN (default target/release) holds service-process, coll-bench and
# libhost_shim.so. Other knobs: CASES (conform cases per job), SEED, DEPLOY_SAME_KERNEL=1 (SPs
# attach to the ranks with cma instead of UCX grants), DEPLOY_HOST_COPIES=0 (turn the blocking
# allgathers' host copies off in the ranks), DEPLOY_JOB_ENV="-x VAR=VALUE ..." (more for the ranks),
# KEEP_RUN_DIR=1 (keep the logs), DEPLOY_ONLY=rejoin|fault-sp with ROUNDS=N (that phase alone, N
# times: to chase a rare failure), DEPLOY_ONLY=srun-sps|mcast (the Slurm or multicast phase alone). docs/DEPLOY.md says what it proves and what not.
# Prints one summary line at the end:
#   deploy-test: N jobs, M offloaded, K faults handled, 0 left behind, in S s
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
BIN=${BIN:-target/release}
SP=$(realpath -m "$BIN/service-process")
BENCH=$(realpath -m "$BIN/coll-bench")
SHIM=$(realpath -m "$BIN/libhost_shim.so")
SHORT=${DEPLOY_SHORT:-0}
started=$(date +%s)
. scripts/deploy/netns.sh
. scripts/deploy/sps.sh
. scripts/deploy/slurm.sh
. scripts/deploy/srun_sps.sh

for b in "$SP" "$BENCH" "$SHIM"; do
  [ -e "$b" ] || dt_die "$b is missing; run 'make build' first"
done
for c in mpirun mpicc openssl; do
  command -v "$c" >/dev/null || dt_die "'$c' is missing (scripts/deps.sh installs Open MPI)"
done
DT_PREFIX="spdt$$-"
dt_preflight_netns

RUN=$(mktemp -d /tmp/spoff-deploy.XXXXXX)
chmod 0700 "$RUN"
mkdir -p "$RUN/ompi" "$RUN/progs"
DT_KEY=$RUN/cluster.key
dt_make_key "$DT_KEY"
TAG=$(dt_key_tag "$DT_KEY")
DT_SERVE_ARGS=(--ucx=off --heartbeat-ms 500 --peer-timeout-ms 4000)
DT_JOB_ENV=()
DT_SP_ENV=()
DT_SOCK_DIR=$RUN/sock   # the SPs' Unix sockets when mpirun starts them (private per DPU)
mkdir -p "$DT_SOCK_DIR"
jobs_run=0 jobs_offloaded=0 faults=0 failures=0

# count_strays: after an orderly end of the SPs and jobs nothing runs in our namespaces any
# more; whatever does was left behind (added to `strays`, listed).
strays=0
count_strays() {
  local pids
  pids=$(dt_ns_pids | tr '\n' ' ' | sed 's/ *$//')
  [ -n "$pids" ] || return 0
  echo "deploy-test: processes left in the namespaces: $pids" >&2
  ps -o pid,args -p "${pids// /,}" 2>/dev/null | cut -c1-150 >&2
  strays=$((strays + $(wc -w <<< "$pids")))
}

# teardown: stops everything of this run and removes it; sets `left` to what it then still
# finds of the run (namespaces, processes, sockets, shared-memory segments), each reported.
teardown() {
  set +e
  local pid
  dt_slurm_down
  [ "${orderly:-0}" = 1 ] && count_strays
  left=$strays
  for pid in $DT_SP_LAUNCHER "${DT_SP_PIDS[@]}" "${DT_DRAINERS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  for pid in $DT_SP_LAUNCHER "${DT_SP_PIDS[@]}" "${DT_DRAINERS[@]}"; do wait "$pid" 2>/dev/null; done
  DT_SP_LAUNCHER=""
  DT_SP_PIDS=() DT_DRAINERS=()
  dt_cluster_down
  local ns procs socks segs
  ns=$(dt_ns_left)
  [ -z "$ns" ] || { echo "deploy-test: namespaces left: $ns" >&2; left=$((left + $(wc -w <<< "$ns"))); }
  # Processes of this run: anything whose command line names the run directory.
  procs=$(dt_pids_naming "$RUN" | tr '\n' ' ' | sed 's/ $//')
  if [ -n "$procs" ]; then
    echo "deploy-test: processes left: $procs" >&2
    left=$((left + $(wc -w <<< "$procs")))
    # shellcheck disable=SC2086
    kill -KILL $procs 2>/dev/null
  fi
  socks=$(find "$RUN" -type s 2>/dev/null)
  [ -z "$socks" ] || { echo "deploy-test: sockets left: $socks" >&2; left=$((left + $(wc -w <<< "$socks"))); }
  segs=$(ls /dev/shm 2>/dev/null | grep "^spoff-$TAG-" || true)
  [ -z "$segs" ] || { echo "deploy-test: segments left: $segs" >&2; left=$((left + $(wc -w <<< "$segs"))); }
  rm -f /dev/shm/spoff-"$TAG"-*
  if [ "${KEEP_RUN_DIR:-0}" = 1 ]; then echo "deploy-test: run directory kept: $RUN" >&2; else rm -rf "$RUN"; fi
  set -e
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "${torn_down:-0}" = 0 ]; then teardown; fi
  exit "$rc"
}
trap cleanup EXIT
# Never end silently: a command that fails outside a test says where.
set -E
trap 'rc=$?; [[ $- != *e* ]] || echo "deploy-test: FAILED: unexpected error (status $rc) at line $LINENO: $BASH_COMMAND" >&2' ERR
trap 'echo "deploy-test: interrupted" >&2; exit 130' INT TERM

say() { echo "deploy-test: $*"; }
fail() { echo "deploy-test: FAIL: $*" >&2; failures=$((failures + 1)); }


# Compile the checking programs once.
for p in conform legal_mix a2a_check ag_check bcast_check; do
  mpicc -O1 -Wall -pthread -o "$RUN/progs/$p" "crates/host-shim/tests/progs/$p.c" ||
    dt_die "cannot compile $p.c"
done
dt_write_agent "$RUN/agent"
dt_mpirun_base

# sps_up N K / sps_down: the SPs of an N x K cluster, started the way this build allows.
sps_up() {
  if [ "$launcher_mode" = 1 ]; then dt_sps_launch "$@"; else dt_sps_start "$@"; fi
}
sps_down() {
  if [ "$launcher_mode" = 1 ]; then dt_sps_unlaunch; else dt_sps_stop; fi
}

# Whether placement comes from MPI itself (issue 17: `service-process cluster` exists) or still
# from the description's ranks_per_node (uniform block mappings only).
place_from_mpi=0
"$SP" cluster --help >/dev/null 2>&1 && place_from_mpi=1
# Whether SPs can be started by a launcher (serve --sp-id auto, wait-ready) and reached by their
# hosts over TCP (host_addr): then the description comes from `cluster init`, the SPs from
# mpirun across the DPU namespaces, and the ranks reach them over TCP.
launcher_mode=0
if "$SP" wait-ready --help >/dev/null 2>&1 && "$SP" serve --help 2>&1 | grep -q -- '--hosts-same-kernel'; then
  launcher_mode=1
  DT_HOST_TCP=1
  if [ "${DEPLOY_SAME_KERNEL:-0}" = 1 ]; then
    # Hosts over TCP, but the SP may attach to them (cma), as on one kernel.
    DT_SERVE_ARGS=(--hosts-same-kernel --ucx=off --heartbeat-ms 500 --peer-timeout-ms 4000)
    DT_JOB_ENV=(-x SPOFF_HOSTS_SAME_KERNEL=1)
  else
    # As on a real cluster: the SP cannot attach to a host over TCP; memory is granted through
    # UCX (rkeys), the SPs move it with UCX over the test network.
    # UCX kept to TCP (UCX_TLS=tcp) on both sides, so the bytes cross the test network too
    # rather than shared memory between processes of this one machine.
    # Host copies stay on (the ranks' default): the SP hands a blocking allgather's intra-node
    # copy to a rank only when it pinned the source's process, which it cannot over TCP from
    # another machine; there it moves the bytes itself (see docs/DEPLOY.md).
    DT_SERVE_ARGS=(--ucx=on --heartbeat-ms 500 --peer-timeout-ms 4000)
    DT_SP_ENV=(-x UCX_TLS=tcp)
    # shellcheck disable=SC2206
    DT_JOB_ENV=(-x UCX_TLS=tcp -x "SPOFF_HOST_COPIES=${DEPLOY_HOST_COPIES:-1}" ${DEPLOY_JOB_ENV:-})
  fi
fi

echo "== deploy-test: a cluster of network namespaces on one machine"
cat <<'EOF'
What this proves: SPs and ranks on separate "machines" as far as the network and host names go.
Each host and each DPU is a network namespace with its own address and UTS host name, joined by
a bridge; SP-SP traffic is TCP between DPU namespaces; jobs are started by Open MPI's own mpirun
(and Slurm's srun when installed) across the host namespaces through an rsh agent, with only
the shim preloaded and a credential issued from the cluster key.
EOF
if [ "$launcher_mode" = 1 ]; then
  cat <<'EOF'
The SPs are started by mpirun across the DPU namespaces (serve --sp-id auto) and waited on
with `wait-ready`; every rank reaches its SP over TCP (host_addr).
EOF
  if [ "$place_from_mpi" = 1 ]; then
    echo "The description comes from \`service-process cluster init\`; every rank places itself from MPI"
    echo "(host name, shared-memory group), so any mapping works."
  else
    echo "This build has no placement from MPI yet: the description is written by this script, and"
    echo "only uniform block mappings are run."
  fi
  if [ "${DEPLOY_SAME_KERNEL:-0}" = 1 ]; then
    echo "DEPLOY_SAME_KERNEL=1: the SPs attach to the ranks' memory (cross-memory attach), as on one kernel."
  else
    cat <<'EOF'
As on a real cluster the SPs do not attach to the ranks: memory is granted through UCX (rkeys)
and moved by UCX kept to TCP (UCX_TLS=tcp), through the namespaces' network stack.
EOF
  fi
else
  echo "This build has no launcher/TCP mode yet: each SP is started with ip netns exec, ranks reach"
  echo "it over its Unix socket, and placement comes from the description's layout."
fi
cat <<'EOF'
What it does not prove: all namespaces share one kernel and one memory, so no byte crosses a
wire (cross-memory attach or the kernel's TCP loopback between namespaces stand in for RDMA);
no BlueField, host-DPU link or exported memory keys; same-kernel timing is not a network's.
EOF

# dt_job LABEL EXPECT TIMEOUT MAPPING OFFLOAD -- PROGRAM ARGS...
#   EXPECT ok|fail; MAPPING "2+2" (mpirun; ranks per node, node1 first), "rankfile:FILE"
#   (mpirun --rankfile) or "srun:NODES:NP[:PER_NODE]" (Slurm's srun --mpi=pmix; without
#   PER_NODE, Slurm's own distribution);
#   OFFLOAD 1 (shim preloaded, SP posts must grow) or 0 (native).
# Output in $RUN/job-LABEL.{out,err}; sets job_rc, job_posts.
dt_job() {
  local label=$1 expect=$2 secs=$3 mapping=$4 offload=$5
  shift 6
  local launcher=() np=0 n i
  case "$mapping" in
    rankfile:*)
      local rf=${mapping#rankfile:}
      np=$(grep -c '^rank' "$rf")
      : > "$RUN/hosts-all"
      for i in $(seq 1 "$DT_NODES"); do echo "node$i slots=8" >> "$RUN/hosts-all"; done
      launcher=("${DT_MPIRUN[@]}" -np "$np" --rankfile "$rf" --hostfile "$RUN/hosts-all") ;;
    srun:*)
      local per
      IFS=: read -r _ n np per <<< "$mapping"
      launcher=(srun -N "$n" -n "$np" --mpi=pmix ${per:+--ntasks-per-node="$per"}) ;;
    *)
      dt_hostfile "$RUN/hosts-$label" "$mapping"
      for n in ${mapping//+/ }; do np=$((np + n)); done
      launcher=("${DT_MPIRUN[@]}" -np "$np" --hostfile "$RUN/hosts-$label" --map-by slot) ;;
  esac
  if [ "$offload" = 1 ]; then
    dt_offload_opts "$np"
    if [ "${launcher[0]}" = srun ]; then
      # srun hands its own environment to the tasks: the job's variables, and the preload for
      # the tasks only.
      local xs=() x
      for x in "${DT_JOB_ENV[@]}"; do [ "$x" = -x ] || xs+=("$x"); done
      launcher=(env "SPOFF_CLUSTER=$DT_CLUSTER" "SPOFF_JOB_CREDENTIAL=$DT_CRED" "${xs[@]}" "${launcher[@]}"
        "--export=ALL,LD_PRELOAD=$SHIM")
    else
      launcher+=("${DT_OFFLOAD[@]}")
    fi
  fi
  local before=0
  [ "$offload" = 1 ] && before=$(dt_counter posts)
  set +e
  ip netns exec "$DT_FAB" timeout -k 5 "$secs" "${launcher[@]}" "$@" \
    > "$RUN/job-$label.out" 2> "$RUN/job-$label.err" < /dev/null
  job_rc=$?
  set -e
  jobs_run=$((jobs_run + 1))
  job_posts=0
  if [ "$offload" = 1 ] && [ ${#DT_SP_PIDS[@]} -gt 0 ]; then
    job_posts=$(( $(dt_counter posts) - before ))
  fi
  if [ "$expect" = ok ]; then
    if [ "$job_rc" -ne 0 ]; then
      fail "$label: exit status $job_rc"
      tail -n 8 "$RUN/job-$label.out" "$RUN/job-$label.err" >&2
      return 1
    fi
    if [ "$offload" = 1 ]; then
      if [ "$job_posts" -le 0 ]; then fail "$label: not offloaded (SP posts did not grow)"; return 1; fi
      jobs_offloaded=$((jobs_offloaded + 1))
    fi
  fi
  return 0
}

# dt_check LABEL PATTERN COUNT: the job's stdout has COUNT lines matching PATTERN.
dt_check() {
  local got
  got=$(grep -c -E "$2" "$RUN/job-$1.out" || true)
  if [ "$got" -ne "$3" ]; then
    fail "$1: expected $3 lines matching '$2', got $got"
    grep -E 'FAIL|fail' "$RUN/job-$1.out" | head -5 >&2 || true
    return 1
  fi
}

cases=${CASES:-$([ "$SHORT" = 1 ] && echo 8 || echo 40)}
seed=${SEED:-$(date +%s)}
say "seed $seed, $cases conform cases per job"

# correctness N K MAPPING: the checking programs on one mapping of a running N x K cluster.
correctness() {
  local n=$1 k=$2 mapping=$3 label np=0 x
  case "$mapping" in
    rankfile:*) np=$(grep -c '^rank' "${mapping#rankfile:}") ;;
    srun:*) np=$(cut -d: -f3 <<< "$mapping") ;;
    *) for x in ${mapping//+/ }; do np=$((np + x)); done ;;
  esac
  local tag="${n}n${k}k-${mapping##*/}"
  tag=${tag//+/_}
  tag=${tag//:/_}
  label="conform-$tag"
  if dt_job "$label" ok 300 "$mapping" 1 -- "$RUN/progs/conform" --cases "$cases" --seed "$seed" \
    --timeout 30 --mixed-in-place; then
    dt_check "$label" ': ok, ' "$np" && say "$label: $np ranks ok, $job_posts posts"
  fi
  [ "$SHORT" = 1 ] && return 0
  label="legal_mix-$tag"
  if dt_job "$label" ok 120 "$mapping" 1 -- "$RUN/progs/legal_mix" mixed 2; then
    dt_check "$label" 'ok \(' "$np" && say "$label: $np ranks ok, $job_posts posts"
  fi
  for p in a2a_check ag_check bcast_check; do
    label="$p-$tag"
    if dt_job "$label" ok 120 "$mapping" 1 -- "$RUN/progs/$p" 2; then
      dt_check "$label" 'all ok' 1 && say "$label: ok, $job_posts posts"
    fi
  done
}

# mcast_phase: the multicast Bcast and Allgather across the namespace cluster
# (SPOFF_BCAST_DESIGN=mcast, SPOFF_IALLGATHER_DESIGN=mcast). One
# rank on each of two nodes: an SP never lands its own chunks, and the only other SP with a
# rank is on the other node, so every chunk landed crossed the bridge between the DPU
# namespaces as a multicast datagram (TTL 1 out of the SP's peer address). The job must be
# byte-correct (conform against PMPI_Bcast and PMPI_Allgather), take the multicast designs,
# and land chunks.
mcast_phase() {
  local label=mcast landed sent
  landed=$(dt_counter mcast_chunks_landed)
  sent=$(dt_counter mcast_datagrams_sent)
  local saved=("${DT_JOB_ENV[@]}")
  DT_JOB_ENV+=(-x SPOFF_BCAST_DESIGN=mcast -x SPOFF_IALLGATHER_DESIGN=mcast)
  if dt_job "$label" ok 300 1+1 1 -- "$RUN/progs/conform" --cases "$cases" --seed "$seed" \
    --timeout 30 --colls bcast,ibcast,allgather,iallgather; then
    dt_check "$label" ': ok, ' 2 || true
  fi
  DT_JOB_ENV=("${saved[@]}")
  if grep -q -E '_DESIGN=mcast:' "$RUN/job-$label.err" "$RUN/job-$label.out" 2>/dev/null; then
    fail "$label: a multicast design was not taken: $(grep -h -m1 -E '_DESIGN=mcast:' "$RUN/job-$label.err" "$RUN/job-$label.out" | cut -c1-200)"
  fi
  landed=$(( $(dt_counter mcast_chunks_landed) - landed ))
  sent=$(( $(dt_counter mcast_datagrams_sent) - sent ))
  if [ "$landed" -gt 0 ] && [ "$sent" -gt 0 ]; then
    say "$label: 2 ranks on 2 nodes ok; $sent datagrams multicast, $landed chunks landed across the DPU namespaces"
  else
    fail "$label: no multicast crossed the namespaces ($sent datagrams sent, $landed chunks landed)"
  fi
}

# dt_conns I dpu|host: established TCP connections in node I's DPU namespace whose far end is
# a DPU (SP to SP) or a host (a rank to its SP).
dt_conns() {
  ip netns exec "$(dt_ns_dpu "$1")" ss -tnH state established |
    awk -v net="$DT_NET." -v kind="$2" '{
      split($4, a, ":"); if (index(a[1], net) != 1) next
      last = substr(a[1], length(net) + 1) + 0
      if ((kind == "dpu" && last >= 100) || (kind == "host" && last >= 10 && last < 100)) c++
    } END {print c+0}'
}

# show_connections: while a job runs, the established TCP connections of each DPU namespace
# (SP to SP, and hosts to their SP when they reach it over TCP).
show_connections() {
  local mapping=$1 i label=conns
  dt_hostfile "$RUN/hosts-$label" "$mapping"
  local np=0 x; for x in ${mapping//+/ }; do np=$((np + x)); done
  dt_offload_opts "$np"
  local base t
  base=$(dt_counter posts)
  ip netns exec "$DT_FAB" timeout -k 5 300 "${DT_MPIRUN[@]}" -np "$np" --hostfile "$RUN/hosts-$label" \
    --map-by slot "${DT_OFFLOAD[@]}" "$RUN/progs/conform" --cases 100000 --seed "$seed" --timeout 30 \
    > "$RUN/job-$label.out" 2>&1 < /dev/null &
  local job=$!
  for t in $(seq 1 300); do
    [ "$(dt_counter posts)" -gt "$base" ] && break
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  echo "-- established TCP connections in the DPU namespaces while a job runs:"
  local mesh=0 hosts=0
  for i in $(seq 1 "$DT_NODES"); do
    echo "   node$i-dpu ($(dt_addr_dpu "$i")):"
    ip netns exec "$(dt_ns_dpu "$i")" ss -tnp state established | tail -n +2 | sed 's/^/     /'
    mesh=$((mesh + $(dt_conns "$i" dpu)))
    hosts=$((hosts + $(dt_conns "$i" host)))
    # A Unix connection's accepting end lives in the connecting side's namespace: the host's.
    echo "   node$i: Unix-socket connections to SPs (same-kernel path): $(ip netns exec "$(dt_ns_host "$i")" ss -xp | grep -c "$RUN/sp" || true)"
  done
  kill -TERM "$job" 2>/dev/null || true
  wait "$job" 2>/dev/null || true
  say "SP-SP connections seen: $mesh (ends in DPU namespaces), host-SP TCP connections: $hosts"
  [ "$mesh" -gt 0 ] || fail "no SP-to-SP TCP connection between DPU namespaces was seen"
  [ "${DT_HOST_TCP:-0}" = 0 ] || [ "$hosts" -gt 0 ] || fail "no host-to-SP TCP connection was seen"
}

# dt_job_bg LABEL SECS MAPPING -- PROGRAM ARGS...: an offloaded job in the background (job_pid).
dt_job_bg() {
  local label=$1 secs=$2 mapping=$3 np=0 x
  shift 4
  dt_hostfile "$RUN/hosts-$label" "$mapping"
  for x in ${mapping//+/ }; do np=$((np + x)); done
  dt_offload_opts "$np"
  ip netns exec "$DT_FAB" timeout -k 5 "$secs" "${DT_MPIRUN[@]}" -np "$np" --hostfile "$RUN/hosts-$label" \
    --map-by slot "${DT_OFFLOAD[@]}" "$@" > "$RUN/job-$label.out" 2> "$RUN/job-$label.err" < /dev/null &
  job_pid=$!
  jobs_run=$((jobs_run + 1))
}

# dt_wait_posts SP_ID BASE: until that SP's posts exceed BASE (bounded: 60 s), or the job ended.
dt_wait_posts() {
  local t
  for t in $(seq 1 600); do
    [ "$(dt_counter_of "$1" posts)" -gt "$2" ] 2>/dev/null && return 0
    kill -0 "$job_pid" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

# dt_fault_end LABEL WHAT T0 BOUND: the job must end with an error within BOUND seconds of T0.
dt_fault_end() {
  local label=$1 what=$2 t0=$3 bound=$4 rc
  while kill -0 "$job_pid" 2>/dev/null && [ $(( $(date +%s) - t0 )) -le "$bound" ]; do sleep 0.2; done
  if kill -0 "$job_pid" 2>/dev/null; then
    echo "deploy-test: $label: still running $bound s after $what; its processes:" >&2
    # shellcheck disable=SC2046
    ps -o pid,ppid,stat,wchan:20,args -p "$(dt_ns_pids | tr '\n' ',' | sed 's/,$//')" 2>/dev/null | cut -c1-160 >&2
    # Which rank waits on what: every thread's stack of every rank still running (gdb, when
    # installed), kept in the run directory, the innermost frames shown here.
    local p
    if command -v gdb >/dev/null; then
      for p in $(dt_ns_pids); do
        case "$(readlink "/proc/$p/exe" 2>/dev/null)" in "$RUN"/progs/*) ;; *) continue ;; esac
        timeout 30 gdb -p "$p" -batch -ex 'thread apply all bt 12' > "$RUN/stacks-$label-$p.txt" 2>&1 || true
        echo "deploy-test: $label: rank process $p ($(ip netns identify "$p" 2>/dev/null | sed "s/^$DT_PREFIX//")), stacks in $RUN/stacks-$label-$p.txt:" >&2
        grep -E '^(Thread|#[0-9] )' "$RUN/stacks-$label-$p.txt" | cut -c1-150 | head -24 | sed 's/^/   /' >&2
      done
      KEEP_RUN_DIR=1
    fi
  fi
  set +e
  wait "$job_pid"
  rc=$?
  set -e
  local secs=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq 0 ]; then
    fail "$label: the job ended with status 0 after $what"
  elif [ "$secs" -gt "$bound" ]; then
    fail "$label: the job took $secs s (bound $bound s) to end after $what"
  else
    faults=$((faults + 1))
    local why
    why=$(cat "$RUN/job-$label.err" "$RUN/job-$label.out" | grep -m1 -E '^host-shim: |Assertion|exited on signal' ||
      true)
    say "$label: $what -> the job ended with status $rc in $secs s: $(cut -c1-140 <<< "$why")"
  fi
}

# fault_kill_sp N K MAPPING: an SP killed (SIGKILL) while its ranks run collectives.
fault_kill_sp() {
  # The first SP of the last node: it serves a rank in every mapping used here.
  # Each round's logs apart (job-fault-sp-N.*): a round that outlives its bound keeps its own.
  DT_FAULT_SP_ROUND=$(( ${DT_FAULT_SP_ROUND:-0} + 1 ))
  local mapping=$3 label=fault-sp-$DT_FAULT_SP_ROUND victim=$(( ($1 - 1) * $2 ))
  dt_wait_gone "$RUN/progs/conform" 30 || fail "$label: ranks of an earlier job still run 30 s after it ended"
  local base
  base=$(dt_counter_of "$victim" posts) || { fail "$label: SP $victim does not answer stats"; return; }
  dt_job_bg "$label" 180 "$mapping" -- "$RUN/progs/conform" --cases 100000 --seed "$seed" --timeout 60
  dt_wait_posts "$victim" "$base" || { fail "$label: SP $victim never served a post"; wait "$job_pid" || true; return; }
  kill -0 "$job_pid" 2>/dev/null || { fail "$label: the job ended before the fault"; wait "$job_pid" || true; return; }
  # The fault is for an offloaded job: one that runs natively (its SPs were not there at its
  # MPI_Init) would run on untouched by the kill. Said as such, not as a timeout.
  if grep -q 'offload is off for this job' "$RUN/job-$label.err" 2>/dev/null; then
    fail "$label: the job runs natively: $(grep -m1 'offload is off' "$RUN/job-$label.err" | cut -c1-160)"
    kill -TERM "$job_pid" 2>/dev/null || true
    wait "$job_pid" 2>/dev/null || true
    return
  fi
  local t0
  t0=$(date +%s)
  kill -KILL "${DT_SP_PIDS[victim]}"
  wait "${DT_SP_PIDS[victim]}" 2>/dev/null || true
  DT_SP_FAULTED=1
  unset "DT_SP_PIDS[victim]"
  # A killed SP cannot remove its socket file; the next SP of that id would.
  rm -f "$RUN/sp$victim.sock"
  dt_fault_end "$label" "SP $victim (${DT_SP_NAMES[victim]}) killed" "$t0" 60
}

# fault_kill_rank MAPPING: a rank killed (SIGKILL) mid-run; the SPs must survive it, forget the
# job, and serve the next one.
fault_kill_rank() {
  local mapping=$1 label=fault-rank
  dt_wait_gone "$RUN/progs/conform" 30 || fail "$label: ranks of an earlier job still run 30 s after it ended"
  local base
  base=$(dt_counter_of 0 posts) || { fail "$label: SP 0 does not answer stats"; return; }
  dt_job_bg "$label" 180 "$mapping" -- "$RUN/progs/conform" --cases 100000 --seed "$seed" --timeout 60
  dt_wait_posts 0 "$base" || { fail "$label: SP 0 never served a post"; wait "$job_pid" || true; return; }
  # A rank of this job: its environment holds this job's credential (a rank of the job before,
  # still exiting, must not be the victim: this job would then run on untouched until its
  # timeout, as it did in two full runs: 'the job took 180 s', all its ranks busy).
  local victim cred=SPOFF_JOB_CREDENTIAL=$DT_CRED
  victim=$(dt_pids_naming "$RUN/progs/conform" | while read -r p; do
    if [ "$(readlink "/proc/$p/exe" 2>/dev/null)" = "$RUN/progs/conform" ] &&
      { tr '\0' '\n' < "/proc/$p/environ"; } 2>/dev/null | grep -qxF "$cred"; then echo "$p"; fi
  done | tail -1)
  [ -n "$victim" ] || { fail "$label: no rank process found"; wait "$job_pid" || true; return; }
  local host
  host=$(ip netns identify "$victim" 2>/dev/null || true)
  kill -0 "$job_pid" 2>/dev/null || { fail "$label: the job ended before the fault"; wait "$job_pid" || true; return; }
  local t0
  t0=$(date +%s)
  kill -KILL "$victim"
  dt_fault_end "$label" "rank pid $victim (in ${host#"$DT_PREFIX"}) killed" "$t0" 60
  local id
  for id in "${!DT_SP_PIDS[@]}"; do
    kill -0 "${DT_SP_PIDS[id]}" 2>/dev/null || fail "$label: SP $id died with the rank"
  done
  local t jobs=1
  for t in $(seq 1 100); do
    jobs=$(dt_counter jobs_at_exit)
    [ "$jobs" -eq 0 ] && break
    sleep 0.1
  done
  [ "$jobs" -eq 0 ] || fail "$label: the SPs still hold $jobs jobs 10 s after the rank's job ended"
}

# rejoin_phase ROUNDS: site daemons on 2 nodes x 2 SPs, started one by one (as systemd's
# spoff-sp@ would on each DPU, not by a launcher that ends them all when one dies). Each round
# kills SPs of node 2 (SIGKILL: a DPU that reboots says nothing; round 1 one SP, later rounds
# both at once) under a job that uses them, which must end with an error within the bound, and
# starts them again: every running SP must take them back (its peers_joined counter), the next
# job must use them, and a job on node 1 only, running through every round, must never notice.
rejoin_phase() {
  local rounds=$1 round t label victims v id want joined
  echo "== site daemons: 2 nodes x 2 SPs started one by one; SPs of node 2 killed and started again under running jobs ($rounds rounds)"
  dt_sps_start 2 2
  local stop=$RUN/rejoin-b.stop b_pid
  rm -f "$stop"
  dt_job_bg rejoin-bystander 600 2 -- "$RUN/progs/conform" --cases 1000000 --seed "$seed" --timeout 60 --until "$stop"
  b_pid=$job_pid
  want=0
  for round in $(seq 1 "$rounds"); do
    if [ "$round" = 1 ]; then victims=(2); else victims=(2 3); fi
    label=rejoin-$round
    local base
    base=$(dt_counter_of 2 posts) || { fail "$label: SP 2 does not answer stats"; break; }
    dt_job_bg "$label" 180 2+2 -- "$RUN/progs/conform" --cases 100000 --seed "$seed" --timeout 60
    dt_wait_posts 2 "$base" || { fail "$label: SP 2 never served a post"; wait "$job_pid" || true; break; }
    local t0
    t0=$(date +%s)
    for v in "${victims[@]}"; do kill -KILL "${DT_SP_PIDS[v]}"; done
    for v in "${victims[@]}"; do wait "${DT_SP_PIDS[v]}" 2>/dev/null || true; done
    dt_fault_end "$label" "SPs ${victims[*]} of node2-dpu killed" "$t0" 60
    for v in "${victims[@]}"; do dt_sp_spawn "$v"; done
    for v in "${victims[@]}"; do dt_sp_await "$v" 60; done
    want=$((want + ${#victims[@]}))
    # Node 1's SPs count every SP that joined again; a restarted SP forms its mesh at start.
    for id in 0 1; do
      joined=0
      for t in $(seq 1 100); do
        joined=$(dt_counter_of "$id" peers_joined) || joined=0
        [ "$joined" -ge "$want" ] && break
        sleep 0.2
      done
      [ "$joined" -ge "$want" ] || fail "$label: SP $id took back $joined SPs, not $want, 20 s after the restart"
    done
    base=$(dt_counter_of 2 posts) || { fail "$label: SP 2 does not answer stats"; break; }
    correctness 2 2 2+2
    [ "$(dt_counter_of 2 posts)" -gt "$base" ] 2>/dev/null || fail "$label: the restarted SP 2 served no post of the next job"
    say "$label: SPs ${victims[*]} rejoined; SP 0 and 1 count $want joins; the next job used them"
  done
  touch "$stop"
  local rc=0 t1
  t1=$(date +%s)
  while kill -0 "$b_pid" 2>/dev/null && [ $(( $(date +%s) - t1 )) -le 120 ]; do sleep 0.2; done
  wait "$b_pid" || rc=$?
  if [ "$rc" -ne 0 ]; then
    fail "rejoin-bystander: the job on node 1 ended with status $rc while node 2's SPs restarted"
    tail -n 5 "$RUN/job-rejoin-bystander.out" "$RUN/job-rejoin-bystander.err" >&2
  else
    dt_check rejoin-bystander ': ok, ' 2 &&
      say "rejoin-bystander: the job on node 1 ran through $rounds rounds of restarts on node 2: $(grep -m1 ': ok, ' "$RUN/job-rejoin-bystander.out")"
  fi
  dt_sps_stop
}

# bench N_RANKS_MAPPING: the Ialltoallv overlap benchmark, offloaded and natively, on the same
# mapping, and the comparison.
bench() {
  local mapping=$1 sizes iters
  if [ "$SHORT" = 1 ]; then sizes=64K,1M; iters=(--iters 5 --warmup 2); else sizes=4K,64K,1M; iters=(--iters 20 --warmup 3); fi
  local args=(overlap --coll ialltoallv --sizes "$sizes" "${iters[@]}" --compute-us 2000)
  if dt_job bench-offload ok 300 "$mapping" 1 -- "$BENCH" "${args[@]}" --json "$RUN/bench-offload.json" &&
    dt_job bench-native ok 300 "$mapping" 0 -- "$BENCH" "${args[@]}" --json "$RUN/bench-native.json"; then
    echo "-- Ialltoallv overlap on the namespace cluster ($mapping ranks), compute 2000 us; ranks and"
    echo "   SPs share this machine's cores: it shows the offload at work across namespaces, not a"
    echo "   network's or a DPU's speed (coll-bench labels the ranks' nodes from SPOFF_NODES, unset here):"
    "$BENCH" compare --native "$RUN/bench-native.json" --offload "$RUN/bench-offload.json" | sed 's/^/   /'
  fi
}

# slurm_phase N: Slurm on the N host namespaces (slurmctld in the fabric, a slurmd per host),
# the correctness programs started by `srun --mpi=pmix` on the running cluster.
slurm_phase() {
  local n=$1
  if [ "${DEPLOY_SLURM:-1}" = 0 ]; then say "Slurm: skipped (DEPLOY_SLURM=0)"; return 0; fi
  # The full run installs Slurm when missing; the short one (make test) uses it if it is there.
  if ! dt_slurm_available && { [ "$SHORT" = 1 ] || ! dt_slurm_install; }; then
    say "Slurm: skipped (not installed; apt-get install slurmd slurmctld slurm-client)"
    return 0
  fi
  echo "== Slurm: slurmctld in the fabric namespace, slurmd in each of the $n host namespaces"
  if ! dt_slurm_up "$n"; then
    fail "Slurm: the daemons did not come up"
    dt_slurm_down
    return 0
  fi
  slurm_ran=1
  correctness "$n" "$DT_K" "srun:$n:$((2 * n)):2"
  [ "$place_from_mpi" = 1 ] && correctness "$n" "$DT_K" "srun:$n:$((2 * n))"
  [ "$launcher_mode" = 1 ] && srun_sps_phase "$n"
  dt_slurm_down
}

# phase N K MAPPINGS...: a cluster of N nodes x K SPs; the correctness programs on each mapping.
phase() {
  local n=$1 k=$2; shift 2
  echo "== $n nodes, $k SP(s) per DPU"
  sps_up "$n" "$k"
  local m
  for m in "$@"; do correctness "$n" "$k" "$m"; done
}

run_all() {
  local uniform2=2+2 uniform4=1+1+1+1 r
  # One phase alone, ROUNDS times (to chase a fault's rare failure): not a test of its own.
  case "${DEPLOY_ONLY:-}" in
    "") ;;
    rejoin) dt_cluster_up 2; rejoin_phase "${ROUNDS:-2}"; return ;;
    mcast) dt_cluster_up 2; sps_up 2 2; mcast_phase; sps_down; return ;;
    srun-sps) dt_cluster_up 2; sps_up 2 2; slurm_phase 2; sps_down; return ;;
    fault-sp)
      dt_cluster_up 4
      for r in $(seq 1 "${ROUNDS:-3}"); do sps_up 4 2; fault_kill_sp 4 2 2+2+2+2; sps_down; done
      return ;;
    *) dt_die "DEPLOY_ONLY=$DEPLOY_ONLY: expected rejoin, fault-sp, srun-sps or mcast" ;;
  esac
  if [ "$SHORT" = 1 ]; then
    dt_cluster_up 2
    echo "-- namespaces: $(ip netns list | awk '{print $1}' | grep "^$DT_PREFIX" | sed "s/^$DT_PREFIX//" | tr '\n' ' ')"
    phase 2 2 "$uniform2"
    [ "$place_from_mpi" = 1 ] && correctness 2 2 3+1
    mcast_phase
    slurm_phase 2
    show_connections "$uniform2"
    bench 1+1
    fault_kill_rank "$uniform2"
    fault_kill_sp 2 2 "$uniform2"
    sps_down
    sps_up 2 2
    fault_kill_sp 2 2 "$uniform2"
    sps_down
    rejoin_phase 2
    return
  fi
  dt_cluster_up 2
  echo "-- namespaces: $(ip netns list | awk '{print $1}' | grep "^$DT_PREFIX" | sed "s/^$DT_PREFIX//" | tr '\n' ' ')"
  phase 2 1 "$uniform2"
  bench 1+1
  sps_down
  phase 2 2 "$uniform2"
  [ "$place_from_mpi" = 1 ] && correctness 2 2 3+1
  mcast_phase
  slurm_phase 2
  show_connections "$uniform2"
  fault_kill_rank "$uniform2"
  fault_kill_sp 2 2 "$uniform2"
  sps_down
  rejoin_phase 4
  count_strays
  dt_cluster_down
  dt_cluster_up 4
  phase 4 1 "$uniform4"
  if [ "$place_from_mpi" = 1 ]; then
    correctness 4 1 1+2+1
    printf 'rank 0=node1 slot=0\nrank 1=node3 slot=0\nrank 2=node1 slot=1\nrank 3=node2 slot=0\nrank 4=node4 slot=0\nrank 5=node3 slot=1\n' > "$RUN/rankfile"
    correctness 4 1 "rankfile:$RUN/rankfile"
  fi
  sps_down
  phase 4 2 2+2+2+2
  [ "$place_from_mpi" = 1 ] && correctness 4 2 1+2+1
  show_connections 2+2+2+2
  fault_kill_sp 4 2 2+2+2+2
  sps_down
  # The killed SP's job once outlived the bound here (issue 25; not seen again in 26 rounds of
  # DEPLOY_ONLY=fault-sp): more rounds, each on a fresh cluster of SPs.
  for r in $(seq 2 "${FAULT_ROUNDS:-6}"); do
    sps_up 4 2
    fault_kill_sp 4 2 2+2+2+2
    sps_down
  done
}

if [ "$place_from_mpi" = 0 ]; then
  say "placement still comes from the description (no 'service-process cluster'): uniform block mappings only"
fi
run_all
torn_down=1 orderly=1
teardown
secs=$(( $(date +%s) - started ))
echo "deploy-test: $jobs_run jobs, $jobs_offloaded offloaded, $faults faults handled, $left left behind, in $secs s"
if [ "$failures" -ne 0 ] || [ "$left" -ne 0 ] || [ "$DT_STOP_PROBLEMS" -ne 0 ]; then
  echo "deploy-test: FAILED ($failures failures, $left left behind, $DT_STOP_PROBLEMS SPs not stopped cleanly)" >&2
  exit 1
fi
