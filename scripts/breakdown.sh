#!/usr/bin/env bash
# Where an offloaded Ialltoallv's time goes (issue 28; docs/BENCHMARKS.md, section O): one rank
# pinned to CPU 0, its SP alone on CPU 1, for each way the SP can wait (busy-poll, the default
# with --sp-cpus; naps of 100 us; sleeping until woken), and natively on the same pinning, in
# one run. Prints each run's overlap table and its breakdown (p50/p99 per stage, and one
# process_vm_readv of the size measured beside it), and the load of the machine before and after.
#   SIZES (default 8,4K,64K,1M), ITERS (default 200), BIN (default target/release),
#   COMPUTE_US (default: the OSU method, compute = t_pure; a fixed compute longer than the
#   communication shows the rank's own time in MPI per call, post_us + wait_us)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
BIN=${BIN:-target/release}
SIZES=${SIZES:-8,4K,64K,1M}
ITERS=${ITERS:-200}
[ "$(nproc)" -ge 2 ] || { echo "breakdown: needs 2 CPUs" >&2; exit 1; }
one=(--nodes 1 --ranks-per-node 1 --sps-per-node 1 --rank-cpus 0)
bench=("$BIN/coll-bench" overlap --coll ialltoallv --sizes "$SIZES" --iters "$ITERS")
[ -n "${COMPUTE_US:-}" ] && bench+=(--compute-us "$COMPUTE_US")
echo "# load before: $(uptime)"
for mode in busy nap100 sleep native; do
  case $mode in
    busy) extra=(--sp-cpus 1) ;;
    nap100) extra=(--sp-cpus 1 --sp-arg=--poll-us=100) ;;
    sleep) extra=(--sp-cpus 1 --sp-arg=--poll-us=0) ;;
    native) extra=(--native) ;;
  esac
  echo "## $mode"
  "$BIN/service-process" launch "${one[@]}" "${extra[@]}" -- "${bench[@]}" 2>&1 | grep -v " stats: "
done
echo "# load after: $(uptime)"
