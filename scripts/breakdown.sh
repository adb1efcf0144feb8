#!/usr/bin/env bash
# Where an offloaded Ialltoallv's time goes (issue 28; docs/BENCHMARKS.md, section O): one rank
# pinned to CPU 0, its SP alone on CPU 1, for each way the SP can wait (busy-poll, the default
# with --sp-cpus; naps of 100 us; sleeping until woken), and natively on the same pinning, in
# one run. Prints each run's overlap table and its breakdown (p50/p99 per stage, and one
# process_vm_readv of the size measured beside it), and the load of the machine before and after.
#   SIZES (default 8,4K,64K,1M), ITERS (default 200), BIN (default target/release),
#   COMPUTE_US (default: the OSU method, compute = t_pure; a fixed compute longer than the
#   communication shows the rank's own time in MPI per call, post_us + wait_us),
#   COLL (default ialltoallv; iallgatherv, or ibcast with the flat design), NODES (default 1:
#   with 2, 2 nodes x 1 rank, both ranks on CPU 0 and both SPs on CPU 1, so they share it and
#   busy-poll only if asked), MODES (default "busy nap100 sleep native"),
#   WAIT (the ranks' SPOFF_WAIT; default: what launch implies, spin when each rank has a CPU
#   of its own outside the SPs'), RECV_OFFSET (coll-bench --recv-offset: the receive buffer
#   this many bytes past a page, the send buffer on one; default 0)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
BIN=${BIN:-target/release}
SIZES=${SIZES:-8,4K,64K,1M}
ITERS=${ITERS:-200}
[ "$(nproc)" -ge 2 ] || { echo "breakdown: needs 2 CPUs" >&2; exit 1; }
COLL=${COLL:-ialltoallv}
NODES=${NODES:-1}
case $NODES in 1|2) ;; *) echo "breakdown: NODES is 1 or 2" >&2; exit 2 ;; esac
[ -n "${WAIT:-}" ] && export SPOFF_WAIT=$WAIT
one=(--nodes "$NODES" --ranks-per-node 1 --sps-per-node 1 --rank-cpus 0)
bench=("$BIN/coll-bench" overlap --coll "$COLL" --sizes "$SIZES" --iters "$ITERS")
[ "$COLL" = ibcast ] && bench+=(--design flat)
[ -n "${COMPUTE_US:-}" ] && bench+=(--compute-us "$COMPUTE_US")
[ -n "${RECV_OFFSET:-}" ] && bench+=(--recv-offset "$RECV_OFFSET")
echo "# $COLL, $NODES node(s) x 1 rank; load before: $(uptime)"
for mode in ${MODES:-busy nap100 sleep native}; do
  case $mode in
    busy) extra=(--sp-cpus 1 --sp-arg=--busy-poll) ;;
    nap100) extra=(--sp-cpus 1 --sp-arg=--poll-us=100) ;;
    sleep) extra=(--sp-cpus 1 --sp-arg=--poll-us=0) ;;
    native) extra=(--native) ;;
    *) echo "breakdown: unknown mode $mode (busy, nap100, sleep, native)" >&2; exit 2 ;;
  esac
  echo "## $mode"
  "$BIN/service-process" launch "${one[@]}" "${extra[@]}" -- "${bench[@]}" 2>&1 | grep -v " stats: "
done
echo "# load after: $(uptime)"
