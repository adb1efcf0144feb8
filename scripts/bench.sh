#!/usr/bin/env bash
# Runs the Ialltoallv overlap benchmark offloaded and natively on the same emulated layout
# (2 nodes x 1 rank), with the SPs pinned on their own core, and prints the comparison.
#   scripts/bench.sh --demo   short run, prints the comparison (make demo)
#   scripts/bench.sh          full run, also writes docs/BENCHMARKS.md (make bench)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
BIN=target/release
SP=$BIN/service-process
BENCH=$BIN/coll-bench
for b in "$SP" "$BENCH" "$BIN/libhost_shim.so"; do
  [ -e "$b" ] || { echo "bench: $b is missing; run 'make build' first" >&2; exit 1; }
done

demo=0
[ "${1:-}" = "--demo" ] && demo=1
if [ $demo -eq 1 ]; then
  sizes=${SIZES:-4K,64K,1M}
  iters=(--iters 20 --warmup 3)
else
  sizes=${SIZES:-1K,4K,16K,64K,256K,1M,4M}
  iters=()
fi

ncpu=$(nproc)
if [ "$ncpu" -ge 2 ]; then
  # The ranks share the first cores; the last core is reserved for the SPs (the DPU's cores).
  rank_cpus="0-$((ncpu - 2))"
  sp_cpus="$((ncpu - 1))"
  split="ranks on CPUs $rank_cpus, SPs on CPU $sp_cpus (of $ncpu)"
else
  rank_cpus=0
  sp_cpus=0
  split="one CPU: ranks and SPs share it (overlap cannot be measured meaningfully)"
fi
layout=(--nodes 2 --ranks-per-node 1 --rank-cpus "$rank_cpus")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

echo "== machine: $ncpu CPUs; $split"
echo "== native Open MPI (same layout and pinning, no SPs, no shim)"
"$SP" launch "${layout[@]}" --native -- \
  "$BENCH" overlap --coll ialltoallv --sizes "$sizes" "${iters[@]}" --json "$out/native.json"
echo "== offloaded through the service processes"
"$SP" launch "${layout[@]}" --sp-cpus "$sp_cpus" -- \
  "$BENCH" overlap --coll ialltoallv --sizes "$sizes" "${iters[@]}" --json "$out/offload.json"
echo "== comparison (same run, same machine)"
"$BENCH" compare --native "$out/native.json" --offload "$out/offload.json"

if [ $demo -eq 0 ]; then
  mkdir -p docs
  {
    echo "# Benchmarks"
    echo
    echo "Written by \`make bench\` ($(date -u +%Y-%m-%d)). Offloaded and native are measured in the"
    echo "same run on the same emulated layout; compare ratios, not absolute times (shared machine)."
    echo
    echo "## Ialltoallv overlap (OSU method), 2 nodes x 1 rank"
    echo
    echo "- Machine: $ncpu CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')), $(free -g | awk '/Mem:/{print $2}') GiB."
    echo "- Split: $split."
    echo "- Command: \`make bench\` (scripts/bench.sh)."
    echo
    "$BENCH" compare --native "$out/native.json" --offload "$out/offload.json" --markdown
    if [ -f docs/BENCHMARKS.notes.md ]; then
      echo
      cat docs/BENCHMARKS.notes.md
    fi
  } > docs/BENCHMARKS.md
  echo "wrote docs/BENCHMARKS.md"
fi
