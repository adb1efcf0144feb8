#!/usr/bin/env bash
# Ialltoallv overlap, offloaded and native, on the same emulated layout (2 nodes x 1 rank), in
# one run, and the comparison. Two experiments (see docs/BENCHMARKS.md for why two):
#   A. the OSU method (compute = t_pure), one core per rank, SPs on whatever core is free;
#   B. a fixed compute longer than the communication, SPs on a reserved core, the ranks
#      sharing the other cores: what the host still pays (post_us + wait_us) and the overlap.
# The full run adds C-E (Iallgatherv overlap, late arrivals, the simulator) and F: inter-node
# bytes per Allgatherv call (ring of MPI_Sendrecv vs offloaded vs the minimum, 2 nodes x 2
# ranks, block and cyclic), measured with `coll-bench traffic`.
#   scripts/bench.sh --demo   short run, prints the comparisons (make demo)
#   scripts/bench.sh          full run, also writes docs/BENCHMARKS.md (make bench)
#   scripts/bench.sh --traffic-only   only section F (inter-node traffic), printed as Markdown;
#                                     writes no file
#   scripts/bench.sh --staged-only    only section G (staged Ibcast and Iallgather, each design
#                                     vs native at 1, 2 and 4 ranks per node), printed as
#                                     Markdown; writes no file
#   scripts/bench.sh --packed-only    only section H (a non-contiguous datatype, which the
#                                     offloaded path packs), printed as Markdown; writes no file
#   scripts/bench.sh --mcast-only     only section M (the multicast Ibcast and Iallgather beside
#                                     native and another design, with drops, and bytes per call),
#                                     printed as Markdown; writes no file
#   scripts/bench.sh --allreduce-only only section R (the SPs' Iallreduce beside native: the OSU
#                                     method and a fixed compute, SPs on a reserved CPU), printed
#                                     as Markdown; writes no file
#   scripts/bench.sh --mpich-only     only section I (Ialltoallv overlap, the setup of B, under
#                                     MPICH beside Open MPI: coll-bench-mpich, Hydra and the
#                                     MPICH-ABI shim), printed as Markdown; writes no file
# BIN (default target/release) is where service-process, coll-bench and the shim are.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
BIN=${BIN:-target/release}
SP=$BIN/service-process
BENCH=$BIN/coll-bench
for b in "$SP" "$BENCH" "$BIN/libhost_shim.so"; do
  [ -e "$b" ] || { echo "bench: $b is missing; run 'make build' first" >&2; exit 1; }
done

demo=0
traffic_only=0
staged_only=0
packed_only=0
mpich_only=0
mcast_only=0
allreduce_only=0
case "${1:-}" in
  --demo) demo=1 ;;
  --traffic-only) traffic_only=1 ;;
  --staged-only) staged_only=1 ;;
  --packed-only) packed_only=1 ;;
  --mpich-only) mpich_only=1 ;;
  --mcast-only) mcast_only=1 ;;
  --allreduce-only) allreduce_only=1 ;;
  "") ;;
  *) echo "bench: unknown option $1 (expected --demo, --traffic-only, --staged-only, --packed-only, --mpich-only, --mcast-only or --allreduce-only)" >&2; exit 2 ;;
esac
if [ $demo -eq 1 ]; then
  sizes=${SIZES:-4K,64K,1M}
  iters=(--iters 20 --warmup 3)
else
  sizes=${SIZES:-1K,4K,16K,64K,256K,1M,4M}
  iters=(--iters 60 --warmup 6)
fi
compute_us=${COMPUTE_US:-5000}

ncpu=$(nproc)
last=$((ncpu - 1))
if [ "$ncpu" -ge 3 ]; then
  a_ranks="0,1"; b_ranks="0-$((last - 1))"
elif [ "$ncpu" -eq 2 ]; then
  a_ranks="0,1"; b_ranks="0"
else
  echo "bench: needs at least 2 CPUs (has $ncpu)" >&2; exit 1
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
base=(--nodes 2 --ranks-per-node 1)
# SPs on a reserved CPU stand for DPU cores: they poll, as DPU service processes do, so a
# rank's post does not pay for waking a sleeping SP (serve --poll-us; 100 us between looks).
reserved_sps=(--sp-cpus "$last" --sp-arg=--poll-us=100)

# F. Inter-node bytes per Allgatherv call, 2 nodes x 2 ranks, block and cyclic layouts: a ring
# of MPI_Sendrecv (counted by the ranks), the offloaded call (the SPs' bytes_inter_node
# counters) and the computed minimum. The data volume does not depend on timing, so few calls.
traffic_run() {
  for layout in block cyclic; do
    "$SP" launch --nodes 2 --ranks-per-node 2 --layout "$layout" -- \
      "$BENCH" traffic --coll allgatherv --sizes 64K,1M --iters 5 \
      --service-process "$SP" --json "$out/f-$layout.json" \
      2> >(grep -v '^sp [0-9]* stats' >&2)
  done
}
traffic_markdown() {
  echo "Inter-node bytes per call (bytes = each rank's block). \`ring_B\`: an allgatherv written in"
  echo "coll-bench as a ring of \`MPI_Sendrecv\` (native, not offloaded), bytes the ranks sent to a"
  echo "rank of another node, counted by the ranks. \`offload_B\`: the offloaded \`MPI_Allgatherv\`,"
  echo "the change of the SPs' \`bytes_inter_node\` counters (\`service-process stats\`) around the"
  echo "calls. \`min_B\`: computed, not measured: the sum of the blocks times (nodes - 1), each"
  echo "block entering each other node once. Both results are checked byte for byte (validated)."
  echo
  "$BENCH" traffic-table --markdown "$out/f-block.json" "$out/f-cyclic.json"
}

# G. The staged Ibcast (issue 4's designs): native, flat and hierarchical at 1, 2 and 4 ranks
# per node on 2 nodes; the SPs on a reserved CPU (they stand for DPU cores), the ranks on the
# others; a fixed compute as in B, and the pure latency (the OSU first phase) of each.
staged_sizes=${STAGED_SIZES:-4K,64K,1M,4M}
staged_rpns=${STAGED_RPNS:-1 2 4}
staged_designs() { # collective
  if [ "$1" = iallgather ]; then echo "flat hier lb"; else echo "flat hier"; fi
}
staged_run() { # collective
  local coll=$1 rpn design
  for rpn in $staged_rpns; do
    echo "-- $coll, 2 nodes x $rpn ranks: native"
    "$SP" launch --nodes 2 --ranks-per-node "$rpn" --native --rank-cpus "$b_ranks" -- \
      "$BENCH" overlap --coll "$coll" --sizes "$staged_sizes" "${iters[@]}" \
      --compute-us "$compute_us" --json "$out/g-$coll-$rpn-native.json" \
      2> >(grep -v '^sp [0-9]* stats' >&2)
    for design in $(staged_designs "$coll"); do
      echo "-- $coll, 2 nodes x $rpn ranks: $design"
      "$SP" launch --nodes 2 --ranks-per-node "$rpn" --rank-cpus "$b_ranks" "${reserved_sps[@]}" -- \
        "$BENCH" overlap --coll "$coll" --design "$design" --sizes "$staged_sizes" "${iters[@]}" \
        --compute-us "$compute_us" --json "$out/g-$coll-$rpn-$design.json" \
        2> >(grep -v '^sp [0-9]* stats' >&2)
    done
  done
}
staged_markdown() { # collective
  local coll=$1 rpn
  echo "Ranks on CPUs $b_ranks, SPs reserved on CPU $last and polling every 100 us (\`serve --poll-us=100\`), compute ${compute_us} us of CPU time per iteration;"
  echo "pure_us is the latency without compute, overlap_pct the OSU formula with that compute,"
  echo "host_us the time the ranks spent in the post and wait calls. One group of columns per"
  echo "design (\`coll-bench overlap --design\`, which sets \`SPOFF_BCAST_DESIGN\` or"
  echo "\`SPOFF_IALLGATHER_DESIGN\`; \`lb\` is the load-balanced allgather of section C)."
  local offloads
  for rpn in $staged_rpns; do
    echo
    echo "### $coll, 2 nodes x $rpn ranks per node"
    echo
    offloads=()
    for design in $(staged_designs "$coll"); do
      offloads+=(--offload "$out/g-$coll-$rpn-$design.json")
    done
    "$BENCH" compare --native "$out/g-$coll-$rpn-native.json" "${offloads[@]}" --markdown
  done
}

# H. A non-contiguous datatype (coll-bench --datatype strided: 8 data bytes, then an 8-byte
# hole), which the offloaded path packs on the host before the post and unpacks in the wait;
# Ialltoallv and Ibcast, the setup of B (fixed compute, SPs reserved and polling).
packed_sizes=${PACKED_SIZES:-4K,64K,1M}
packed_run() {
  for coll in ialltoallv ibcast; do
    for mode in native offload; do
      local extra=()
      if [ $mode = native ]; then extra=(--native); else extra=("${reserved_sps[@]}"); fi
      "$SP" launch "${base[@]}" --rank-cpus "$b_ranks" "${extra[@]}" -- \
        "$BENCH" overlap --coll "$coll" --sizes "$packed_sizes" "${iters[@]}" \
        --compute-us "$compute_us" --datatype strided --json "$out/h-$coll-$mode.json" \
        2> >(grep -v '^sp [0-9]* stats' >&2)
    done
  done
}
packed_markdown() {
  for coll in ialltoallv ibcast; do
    echo "$coll, \`--datatype strided\`:"
    echo
    "$BENCH" compare --native "$out/h-$coll-native.json" --offload "$out/h-$coll-offload.json" --markdown
    echo
  done
}

# I. Ialltoallv overlap under MPICH beside Open MPI: the setup of B (fixed compute, SPs reserved
# and polling), the same benchmark built against each MPI (coll-bench, coll-bench-mpich); the
# launcher finds each binary's MPI and runs mpirun or mpiexec.mpich with the matching shim.
mpich_sizes=${MPICH_SIZES:-4K,64K,1M}
mpich_run() {
  local mpi bench mode extra
  [ -e "$BIN/coll-bench-mpich" ] && [ -e "$BIN/libhost_shim_mpich.so" ] || {
    echo "bench: $BIN/coll-bench-mpich or libhost_shim_mpich.so is missing; run 'make build' first" >&2
    exit 1
  }
  for mpi in openmpi mpich; do
    bench=$BENCH; [ $mpi = mpich ] && bench=$BIN/coll-bench-mpich
    for mode in native offload; do
      if [ $mode = native ]; then extra=(--native); else extra=("${reserved_sps[@]}"); fi
      echo "-- ialltoallv under $mpi: $mode"
      "$SP" launch "${base[@]}" --rank-cpus "$b_ranks" "${extra[@]}" -- \
        "$bench" overlap --coll ialltoallv --sizes "$mpich_sizes" "${iters[@]}" \
        --compute-us "$compute_us" --json "$out/i-$mpi-$mode.json" \
        2> >(grep -v '^sp [0-9]* stats' >&2)
    done
  done
}
mpich_intro() {
  echo "The setup of B for the same benchmark built against each MPI (\`coll-bench\` and"
  echo "\`coll-bench-mpich\`, \`make build\` builds both); \`service-process launch\` finds each"
  echo "binary's MPI and runs \`mpirun\` with \`libhost_shim.so\` or Hydra's \`mpiexec.mpich\` with"
  echo "\`libhost_shim_mpich.so\`. Native is each MPI's own \`MPI_Ialltoallv\`. Read \`host_us\`"
  echo "(the time the ranks spent in MPI calls instead of computing), as in B."
}
mpich_markdown() {
  local mpi
  for mpi in openmpi mpich; do
    if [ $mpi = openmpi ]; then
      echo "Open MPI $(mpirun --version | head -1 | awk '{print $NF}') (\`coll-bench\`, \`mpirun\`, \`libhost_shim.so\`):"
    else
      echo "MPICH $(mpiexec.mpich --version | awk '/Version:/{print $2; exit}') (\`coll-bench-mpich\`, Hydra's \`mpiexec.mpich\`, \`libhost_shim_mpich.so\`):"
    fi
    echo
    "$BENCH" compare --native "$out/i-$mpi-native.json" --offload "$out/i-$mpi-offload.json" --markdown
    echo
  done
}

# M. The multicast Ibcast and Iallgather (issue 26): native, the other design (the staged flat
# Ibcast, the load-balanced Iallgather) and the multicast design with 0, 1 and 10 % of the
# datagrams dropped on the receive side (`serve --mcast-drop-rate`), at 2 nodes x 1 rank (each
# SP serves one rank: a drop costs the fetch ring's read of the neighbour's buffer), the SPs on
# a reserved CPU and polling; then the bytes each design moves per call, from the SPs'
# counters, at 2 nodes x 2 ranks and 4 nodes x 2 ranks.
mcast_sizes=${MCAST_SIZES:-4K,64K,1M,4M}
mcast_other() { # collective: the design the multicast one is set beside
  if [ "$1" = iallgather ]; then echo lb; else echo flat; fi
}
mcast_run() {
  local coll other dr nodes design
  for coll in ibcast iallgather; do
    other=$(mcast_other "$coll")
    echo "-- $coll, 2 nodes x 1 rank: native"
    "$SP" launch --nodes 2 --ranks-per-node 1 --native --rank-cpus "$b_ranks" -- \
      "$BENCH" overlap --coll "$coll" --sizes "$mcast_sizes" "${iters[@]}" \
      --compute-us "$compute_us" --json "$out/m-$coll-native.json" 2> >(grep -v '^sp [0-9]* stats' >&2)
    echo "-- $coll, 2 nodes x 1 rank: $other"
    "$SP" launch --nodes 2 --ranks-per-node 1 --rank-cpus "$b_ranks" "${reserved_sps[@]}" -- \
      "$BENCH" overlap --coll "$coll" --design "$other" --sizes "$mcast_sizes" "${iters[@]}" \
      --compute-us "$compute_us" --json "$out/m-$coll-$other.json" 2> >(grep -v '^sp [0-9]* stats' >&2)
    for dr in 0 1 10; do
      echo "-- $coll, 2 nodes x 1 rank: mcast, $dr % dropped"
      "$SP" launch --nodes 2 --ranks-per-node 1 --rank-cpus "$b_ranks" "${reserved_sps[@]}" \
        --sp-arg=--mcast-drop-rate="$dr" -- \
        "$BENCH" overlap --coll "$coll" --design mcast --sizes "$mcast_sizes" "${iters[@]}" \
        --compute-us "$compute_us" --json "$out/m-$coll-mcast-$dr.json" \
        2> >(grep -v '^sp [0-9]* stats' >&2)
    done
    for nodes in 2 4; do
      for design in "$other" mcast; do
        echo "-- bytes per call: $coll 64 KiB per rank, $nodes nodes x 2 ranks: $design"
        "$SP" launch --nodes "$nodes" --ranks-per-node 2 -- \
          "$BENCH" overlap --coll "$coll" --design "$design" --sizes 64K --iters 20 --warmup 2 \
          > /dev/null 2> "$out/m-traffic-$coll-$nodes-$design.err" ||
          { cat "$out/m-traffic-$coll-$nodes-$design.err" >&2; return 1; }
      done
    done
  done
}
mcast_markdown() {
  local coll other nodes design
  echo "Ranks on CPUs $b_ranks, SPs reserved on CPU $last and polling every 100 us, compute"
  echo "${compute_us} us per iteration. Column groups: the other design (\`flat\`, the staged"
  echo "Ibcast; \`lb\`, the load-balanced Iallgather), then \`mcast\`, \`mcast-2\` and \`mcast-3\`:"
  echo "the multicast design with 0, 1 and 10 % of the datagrams dropped by the receive workers"
  echo "before the bitmap (\`serve --mcast-drop-rate\`), recovered by the fetch ring. The cost of"
  echo "drops is \`mcast-2\`'s (1 %) and \`mcast-3\`'s (10 %) pure_us against \`mcast\`'s."
  for coll in ibcast iallgather; do
    other=$(mcast_other "$coll")
    echo
    echo "### $coll, 2 nodes x 1 rank"
    echo
    "$BENCH" compare --native "$out/m-$coll-native.json" --offload "$out/m-$coll-$other.json" \
      --offload "$out/m-$coll-mcast-0.json" --offload "$out/m-$coll-mcast-1.json" \
      --offload "$out/m-$coll-mcast-10.json" --markdown
  done
  echo
  echo "### Bytes per call"
  echo
  echo "64 KiB per rank (\`coll-bench overlap --sizes 64K\`, both phases), from the SPs' counters at"
  echo "exit, divided by the calls (the posts over the ranks), per rank where it says so. \`sent\`:"
  echo "datagram bytes the SPs multicast (headers included); \`received\`: datagram bytes their"
  echo "sockets took in, all SPs (an SP also takes in its own multicasts, looped back); \`across"
  echo "nodes\`: bytes of the SPs' copies and chunk moves whose two ends are on different nodes"
  echo "(\`bytes_inter_node\`: the other designs' deliveries, the multicast designs' fetches);"
  echo "\`copied\`: every byte the datapath copied into ranks' buffers (the multicast designs' local"
  echo "copies and fetches; the landings of multicast chunks are not copies). A ring allgather"
  echo "puts (P-1) x 64 KiB on the wire per rank."
  echo
  echo "| collective | nodes x ranks | design | calls | sent/call/rank | received/call | across nodes/call | copied/call |"
  echo "|---|---|---|---|---|---|---|---|"
  for coll in ibcast iallgather; do
    other=$(mcast_other "$coll")
    for nodes in 2 4; do
      for design in "$other" mcast; do
        python3 - "$out/m-traffic-$coll-$nodes-$design.err" "$nodes" "$design" "$coll" <<'PY'
import json, sys
path, nodes, design, coll = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
sps = [json.loads(l.split(': ', 1)[1]) for l in open(path) if l.startswith('sp ') and ' stats: ' in l]
ranks = nodes * 2
calls = sum(s['posts'] for s in sps) / ranks
t = lambda k: sum(s.get(k, 0) for s in sps) / max(calls, 1)
print(f"| {coll} | {nodes} x 2 | {design} | {calls:.0f} | {t('mcast_bytes_sent') / ranks:.0f} "
      f"| {t('mcast_bytes_received'):.0f} | {t('bytes_inter_node'):.0f} "
      f"| {t('bytes_copied'):.0f} |")
PY
      done
    done
  done
}

# R. The SPs' Iallreduce (issue 27, `SPOFF_ALLREDUCE_DESIGN=sp-tree`) beside native, 2 nodes x
# 1 rank, the ranks on CPUs $b_ranks and the SPs reserved on CPU $last and polling: the OSU method
# (compute = the slowest rank's t_pure) and a fixed compute (what the host still pays per call:
# post_us + wait_us). 64-bit integer sums, every result checked.
allreduce_sizes=${ALLREDUCE_SIZES:-8,4K,64K,1M}
allreduce_run() {
  local kind extra
  for kind in osu fixed; do
    extra=(); [ $kind = fixed ] && extra=(--compute-us "$compute_us")
    echo "-- iallreduce, 2 nodes x 1 rank, $kind: native"
    "$SP" launch --nodes 2 --ranks-per-node 1 --native --rank-cpus "$b_ranks" -- \
      "$BENCH" overlap --coll iallreduce --sizes "$allreduce_sizes" "${iters[@]}" "${extra[@]}" \
      --json "$out/r-$kind-native.json" 2> >(grep -v '^sp [0-9]* stats' >&2)
    echo "-- iallreduce, 2 nodes x 1 rank, $kind: sp-tree"
    "$SP" launch --nodes 2 --ranks-per-node 1 --rank-cpus "$b_ranks" "${reserved_sps[@]}" -- \
      "$BENCH" overlap --coll iallreduce --design sp-tree --sizes "$allreduce_sizes" \
      "${iters[@]}" "${extra[@]}" --json "$out/r-$kind-sp-tree.json" \
      2> >(grep -v '^sp [0-9]* stats' >&2)
  done
}
allreduce_markdown() {
  echo "Ranks on CPUs $b_ranks, SPs reserved on CPU $last and polling every 100 us; MPI_INT64_T"
  echo "sums of SIZE bytes, every result checked against the sum computed on each rank."
  echo
  echo "### The OSU method (compute = the slowest rank's pure time)"
  echo
  "$BENCH" compare --native "$out/r-osu-native.json" --offload "$out/r-osu-sp-tree.json" --markdown
  echo
  echo "### A fixed compute of ${compute_us} us (host_us: the host's time in MPI per call)"
  echo
  "$BENCH" compare --native "$out/r-fixed-native.json" --offload "$out/r-fixed-sp-tree.json" --markdown
}

if [ $allreduce_only -eq 1 ]; then
  echo "== R. the SPs' Iallreduce; 2 nodes x 1 rank, SPs reserved on CPU $last"
  allreduce_run
  echo
  allreduce_markdown
  exit 0
fi

if [ $mcast_only -eq 1 ]; then
  echo "== M. the multicast Ibcast and Iallgather; 2 nodes x 1 rank, SPs reserved on CPU $last"
  mcast_run
  echo
  mcast_markdown
  exit 0
fi

run() { # name, collective, launch options..., -- coll-bench options...
  local name=$1 coll=$2; shift 2
  local opts=()
  while [ "$1" != "--" ]; do opts+=("$1"); shift; done
  shift
  "$SP" launch "${base[@]}" "${opts[@]}" -- \
    "$BENCH" overlap --coll "$coll" --sizes "$sizes" "${iters[@]}" "$@" --json "$out/$name.json" \
    2> >(grep -v '^sp [0-9]* stats' >&2)
}

if [ $staged_only -eq 1 ]; then
  echo "== G. staged Ibcast and Iallgather; 2 nodes x {$staged_rpns} ranks, by design"
  staged_run ibcast
  staged_run iallgather
  echo
  staged_markdown ibcast
  echo
  staged_markdown iallgather
  exit 0
fi

if [ $packed_only -eq 1 ]; then
  echo "== H. a non-contiguous datatype (strided), compute ${compute_us} us, SPs reserved on CPU $last"
  packed_run
  echo
  packed_markdown
  exit 0
fi

if [ $mpich_only -eq 1 ]; then
  echo "== I. Ialltoallv under MPICH and Open MPI, compute ${compute_us} us, ranks on CPUs $b_ranks, SPs reserved on CPU $last"
  mpich_run
  echo
  mpich_intro
  echo
  mpich_markdown
  exit 0
fi

if [ $traffic_only -eq 1 ]; then
  echo "== F. inter-node traffic per call; 2 nodes x 2 ranks, block and cyclic layouts"
  traffic_run
  echo
  traffic_markdown
  exit 0
fi

echo "== machine: $ncpu CPUs"
echo "== A. OSU method; ranks on CPUs $a_ranks (one each), SPs unpinned"
run a-native ialltoallv --rank-cpus "$a_ranks" --native --
run a-offload ialltoallv --rank-cpus "$a_ranks" --
echo "== B. compute ${compute_us} us; ranks on CPUs $b_ranks, SPs reserved on CPU $last (polling)"
run b-native ialltoallv --rank-cpus "$b_ranks" --native -- --compute-us "$compute_us"
run b-offload ialltoallv --rank-cpus "$b_ranks" "${reserved_sps[@]}" -- --compute-us "$compute_us"
if [ $demo -eq 0 ]; then
  echo "== C. Iallgatherv, OSU method; ranks on CPUs $a_ranks, SPs unpinned"
  run c-native iallgatherv --rank-cpus "$a_ranks" --native --
  run c-offload iallgatherv --rank-cpus "$a_ranks" --
  echo "== D. Allgatherv with one late rank per node; 2 nodes x 2 ranks"
  for mode in native offload; do
    : > "$out/d-$mode.json"
    extra=(); [ $mode = native ] && extra=(--native)
    for delay in 0 1 10 50; do
      "$SP" launch --nodes 2 --ranks-per-node 2 "${extra[@]}" -- \
        "$BENCH" late --coll allgatherv --delay-ms "$delay" --sizes 64K,1M --iters 10 \
        --json "$out/d-part.json" 2> >(grep -v '^sp [0-9]* stats' >&2)
      cat "$out/d-part.json" >> "$out/d-$mode.json"
    done
  done
  echo "== E. simulated allgather, 32 nodes x 32 ranks (virtual time)"
  "$SP" simulate --nodes 32 --ranks-per-node 32 --seeds 1 > "$out/e.txt"
  cat "$out/e.txt"
  "$SP" simulate --coll bcast --nodes 32 --ranks-per-node 32 --seeds 1 > "$out/e-bcast.txt"
  cat "$out/e-bcast.txt"
  echo "== F. inter-node traffic per call; 2 nodes x 2 ranks, block and cyclic layouts"
  traffic_run
  "$BENCH" traffic-table "$out/f-block.json" "$out/f-cyclic.json"
  echo "== G. staged Ibcast and Iallgather; 2 nodes x {$staged_rpns} ranks, by design"
  staged_run ibcast
  staged_run iallgather
  echo "== H. a non-contiguous datatype (strided), compute ${compute_us} us, SPs reserved on CPU $last"
  packed_run
  echo "== I. Ialltoallv under MPICH and Open MPI, compute ${compute_us} us, ranks on CPUs $b_ranks, SPs reserved on CPU $last"
  mpich_run
fi
echo
echo "== A. OSU method (compute = t_pure), one core per rank, SPs unpinned"
"$BENCH" compare --native "$out/a-native.json" --offload "$out/a-offload.json"
echo
echo "== B. compute ${compute_us} us, SPs on a reserved core"
"$BENCH" compare --native "$out/b-native.json" --offload "$out/b-offload.json"

if [ $demo -eq 0 ]; then
  mkdir -p docs
  {
    echo "# Benchmarks"
    echo
    echo "Written by \`make bench\` (scripts/bench.sh) on $(date -u +%Y-%m-%d). Offloaded and native"
    echo "are measured in the same run on the same emulated layout (each section names it); compare"
    echo "ratios, not absolute times: this is a shared virtual machine."
    echo
    echo "- Machine: $ncpu CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')), $(free -g | awk '/Mem:/{print $2}') GiB, Open MPI $(mpirun --version | head -1 | awk '{print $NF}')."
    echo
    echo "## A. Ialltoallv, OSU method: ranks on CPUs $a_ranks (one core each), SPs unpinned"
    echo
    "$BENCH" compare --native "$out/a-native.json" --offload "$out/a-offload.json" --markdown
    echo
    echo "## B. Ialltoallv, compute ${compute_us} us: ranks on CPUs $b_ranks, SPs reserved on CPU $last (polling)"
    echo
    "$BENCH" compare --native "$out/b-native.json" --offload "$out/b-offload.json" --markdown
    echo
    echo "## C. Iallgatherv, OSU method: ranks on CPUs $a_ranks (one core each), SPs unpinned"
    echo
    "$BENCH" compare --native "$out/c-native.json" --offload "$out/c-offload.json" --markdown
    echo
    echo "## D. Allgatherv with late arrivals: 2 nodes x 2 ranks, the last rank of each node enters late"
    echo
    "$BENCH" compare --native "$out/d-native.json" --offload "$out/d-offload.json" --markdown
    echo
    echo "## E. Simulated Allgather, 32 nodes x 32 ranks (\`service-process simulate\`)"
    echo
    echo "Virtual time under the simulator's cost model (\`algorithms::sim::CostModel\`), not a"
    echo "measurement. \`inter_node_B\` is what crossed between nodes, \`min_inter_B\` the minimum"
    echo "(each rank's block enters each other node once); no_ready / passed / parked count the"
    echo "late-arrival paths."
    echo
    echo '```'
    cat "$out/e.txt"
    echo '```'
    echo
    echo "The staged Ibcast in the same simulator (\`simulate --coll bcast\`): 1 MiB from rank 0,"
    echo "256 KiB chunks, 4 staging slots per SP; \`completion_us\` includes the ranks' copy out"
    echo "of the segment for the hierarchical design."
    echo
    echo '```'
    cat "$out/e-bcast.txt"
    echo '```'
    echo
    echo "## F. inter-node traffic per call: Allgatherv, 2 nodes x 2 ranks, block and cyclic layouts"
    echo
    traffic_markdown
    echo
    echo "## G. Staged Ibcast and Iallgather: native and each design by ranks per node"
    echo
    staged_markdown ibcast
    echo
    staged_markdown iallgather
    echo
    echo "## H. A non-contiguous datatype: ranks on CPUs $b_ranks, SPs reserved on CPU $last (polling), compute ${compute_us} us"
    echo
    echo "\`coll-bench overlap --datatype strided\`: every 8 bytes of data are followed by an 8-byte"
    echo "hole, so natively MPI's datatype engine gathers and scatters them, and offloaded the shim"
    echo "packs the send side (\`MPI_Pack\`) in the post and unpacks the receive side in the wait."
    echo "bytes are data bytes (the buffers are twice as long)."
    echo
    packed_markdown
    echo
    echo "## I. Ialltoallv under MPICH beside Open MPI: ranks on CPUs $b_ranks, SPs reserved on CPU $last (polling), compute ${compute_us} us"
    echo
    mpich_intro
    echo
    mpich_markdown
    if [ -f docs/BENCHMARKS.notes.md ]; then
      echo
      cat docs/BENCHMARKS.notes.md
    fi
  } > docs/BENCHMARKS.md
  echo "wrote docs/BENCHMARKS.md"
fi
