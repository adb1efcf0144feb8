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
#   scripts/bench.sh --canary-only    only section S (the Canary allreduce across a network-
#                                     namespace tree, with and without background traffic on a
#                                     shaped link, beside the SP tree and native; needs root, ip
#                                     and tc), printed as Markdown; writes no file
#   scripts/bench.sh --fft-only       only section P (coll-bench fft, the 3D-FFT transpose loop,
#                                     offloaded against native, two machine splits), printed as
#                                     Markdown; writes no file
#   scripts/bench.sh --tail-only      only section Q (the Allgatherv tail after the last arrival
#                                     at 16 and 32 nodes, simulated with a cost model calibrated
#                                     by a small real run here, against a host ring; the small
#                                     real late-arrival run as a check), printed as Markdown;
#                                     writes no file
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
canary_only=0
fft_only=0
tail_only=0
case "${1:-}" in
  --demo) demo=1 ;;
  --traffic-only) traffic_only=1 ;;
  --staged-only) staged_only=1 ;;
  --packed-only) packed_only=1 ;;
  --mpich-only) mpich_only=1 ;;
  --mcast-only) mcast_only=1 ;;
  --allreduce-only) allreduce_only=1 ;;
  --canary-only) canary_only=1 ;;
  --fft-only) fft_only=1 ;;
  --tail-only) tail_only=1 ;;
  "") ;;
  *) echo "bench: unknown option $1 (expected --demo, --traffic-only, --staged-only, --packed-only, --mpich-only, --mcast-only, --allreduce-only, --canary-only, --fft-only or --tail-only)" >&2; exit 2 ;;
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
    echo "-- iallreduce, 2 nodes x 1 rank, $kind: canary (a loopback tree of 2 leaves, 2 spines)"
    "$SP" launch --nodes 2 --ranks-per-node 1 --rank-cpus "$b_ranks" "${reserved_sps[@]}" \
      --canary-tree 2+2 -- \
      "$BENCH" overlap --coll iallreduce --design canary --sizes "$allreduce_sizes" \
      "${iters[@]}" "${extra[@]}" --json "$out/r-$kind-canary.json" \
      2> >(grep -v '^sp [0-9]* stats\|^canary-tree: switch' >&2)
  done
}
allreduce_markdown() {
  echo "Ranks on CPUs $b_ranks, SPs reserved on CPU $last and polling every 100 us; MPI_INT64_T"
  echo "sums of SIZE bytes, every result checked against the sum computed on each rank."
  echo
  local d
  for d in sp-tree canary; do
    echo "### $d, the OSU method (compute = the slowest rank's pure time)"
    echo
    "$BENCH" compare --native "$out/r-osu-native.json" --offload "$out/r-osu-$d.json" --markdown
    echo
    echo "### $d, a fixed compute of ${compute_us} us (host_us: the host's time in MPI per call)"
    echo
    "$BENCH" compare --native "$out/r-fixed-native.json" --offload "$out/r-fixed-$d.json" --markdown
    echo
  done
}

if [ $allreduce_only -eq 1 ]; then
  echo "== R. the SPs' Iallreduce; 2 nodes x 1 rank, SPs reserved on CPU $last"
  allreduce_run
  echo
  allreduce_markdown
  exit 0
fi

# S. The Canary allreduce across a namespace tree (issue 27): 2 nodes x 1 rank, 2 SPs on 2
# leaves (a namespace per switch and per SP link, veths, no route out), leaf 0's link to spine 0
# shaped by tc to 200 Mbit/s; Canary and one static tree (rooted at spine 0), each without and
# with 150 Mbit/s of background UDP on that link, beside the SP tree and native (which do not cross the namespaces: their traffic is on the
# machine's loopback). The OSU method; t_pure is the allreduce alone.
canary_sizes=${CANARY_SIZES:-4K,64K,1M,4M}
canary_run() {
  local bg
  echo "-- iallreduce, 2 nodes x 1 rank: native"
  "$SP" launch --nodes 2 --ranks-per-node 1 --native --rank-cpus "$b_ranks" -- \
    "$BENCH" overlap --coll iallreduce --sizes "$canary_sizes" "${iters[@]}" \
    --json "$out/s-native.json" 2> >(grep -v '^sp [0-9]* stats' >&2)
  echo "-- iallreduce, 2 nodes x 1 rank: sp-tree"
  "$SP" launch --nodes 2 --ranks-per-node 1 --rank-cpus "$b_ranks" "${reserved_sps[@]}" -- \
    "$BENCH" overlap --coll iallreduce --design sp-tree --sizes "$canary_sizes" "${iters[@]}" \
    --json "$out/s-sp-tree.json" 2> >(grep -v '^sp [0-9]* stats' >&2)
  local how
  for how in canary static1; do
    for bg in 0 150; do
      echo "-- iallreduce, 2 nodes x 1 rank: $how, namespace tree, background ${bg} Mbit/s"
      local extra=()
      [ "$bg" -gt 0 ] && extra=(--canary-background-mbit "$bg")
      [ "$how" = static1 ] && extra+=(--canary-params '{"static_trees":1}')
      "$SP" launch --nodes 2 --ranks-per-node 1 --rank-cpus "$b_ranks" "${reserved_sps[@]}" \
        --canary-tree 2+2 --canary-netns --canary-shape 200mbit "${extra[@]}" -- \
        "$BENCH" overlap --coll iallreduce --design canary --sizes "$canary_sizes" \
        "${iters[@]}" --json "$out/s-$how-bg$bg.json" \
        2> >(grep -v '^sp [0-9]* stats\|^canary-tree: switch' >&2)
    done
  done
}
canary_markdown() {
  echo "Ranks on CPUs $b_ranks, SPs and switches on CPU $last; MPI_INT64_T sums, every result"
  echo "checked. The column groups after sp-tree, in order: Canary without background traffic,"
  echo "Canary with 150 Mbit/s on the shaped link, one static tree (rooted at spine 0, whose link"
  echo "from leaf 0 is the shaped one) without, and with, the background traffic."
  echo
  "$BENCH" compare --native "$out/s-native.json" --offload "$out/s-sp-tree.json" \
    --offload "$out/s-canary-bg0.json" --offload "$out/s-canary-bg150.json" \
    --offload "$out/s-static1-bg0.json" --offload "$out/s-static1-bg150.json" --markdown
}

if [ $canary_only -eq 1 ]; then
  echo "== S. the Canary allreduce across a namespace tree"
  canary_run
  echo
  canary_markdown
  exit 0
fi

# P. An application proxy (issue 28): coll-bench fft, the transpose loop of a slab-decomposed
# 3D FFT of several fields, 2 nodes x 1 rank, native and offloaded under two machine splits:
# a: one core per rank, the SPs unpinned (they take CPU from the ranks); b: the ranks on the
# first cores, the SPs reserved on the last CPU and polling (they stand for DPU cores).
fft_ns=${FFT_NS:-63,64,96}
fft_opts=(--fields "${FFT_FIELDS:-4}" --iters "${FFT_ITERS:-8}" --warmup 2 --seed "${FFT_SEED:-1}")
fft_reps=${FFT_REPS:-3}
fft_run() {
  local rep split mode extra
  for rep in $(seq 1 "$fft_reps"); do
    for split in a b; do
      for mode in native offload; do
        extra=()
        if [ $split = a ]; then extra=(--rank-cpus "$a_ranks"); else extra=(--rank-cpus "$b_ranks"); fi
        if [ $mode = native ]; then extra+=(--native); elif [ $split = b ]; then extra+=("${reserved_sps[@]}"); fi
        echo "-- fft, repetition $rep, split $split, $mode (load average before: $(cut -d' ' -f1-3 /proc/loadavg))"
        "$SP" launch "${base[@]}" "${extra[@]}" -- \
          "$BENCH" fft --n "$fft_ns" "${fft_opts[@]}" --json "$out/p-$split-$mode-$rep.json" \
          2> >(grep -v '^sp [0-9]* stats' >&2)
      done
    done
  done
  echo "-- load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
}
fft_markdown() {
  echo "\`coll-bench fft --n $fft_ns ${fft_opts[*]}\`, 2 nodes x 1 rank, $fft_reps repetitions, native"
  echo "and offloaded interleaved. Split a: ranks on CPUs $a_ranks (one each), SPs unpinned; split b:"
  echo "ranks on CPUs $b_ranks, SPs reserved on CPU $last and polling every 100 us. Per repetition:"
  echo "times per iteration (all fields), maximum over ranks; ratio = offload pipelined_us / native"
  echo "pipelined_us (below 1: the offloaded loop is faster); overlap = 100 - 100 * (pipelined -"
  echo "compute) / comm, clamped. Columns: the median over repetitions of the means, and (min)"
  echo "the same on each phase's fastest iteration, the fastest over repetitions. validated:"
  echo "bitwise against a native point-to-point transpose and spot points against a direct DFT,"
  echo "every run."
  echo
  python3 - "$out" "$fft_reps" <<'PY'
import json, sys
from statistics import median
out, reps = sys.argv[1], int(sys.argv[2])
def runs(split, mode):
    return [{r["n"]: r for r in map(json.loads, open(f"{out}/p-{split}-{mode}-{i}.json"))}
            for i in range(1, reps + 1)]
print("| split | N | sent B/rank/field | native comm us | native pipelined us | native overlap % "
      "| offload comm us | offload pipelined us | offload overlap % | ratio (median) | ratios (each repetition) "
      "| ratio (min) | overlap % native / offload (min) | validated |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for split in "ab":
    nat, off = runs(split, "native"), runs(split, "offload")
    for n in sorted(nat[0]):
        a = [r[n] for r in nat]; b = [r[n] for r in off]
        m = lambda rows, k: median(r[k] for r in rows)
        lo = lambda rows, k: min(r[k] for r in rows)
        ratios = [y["pipelined_us"] / x["pipelined_us"] for x, y in zip(a, b)]
        ok = all(r["validated"] for r in a + b)
        print(f"| {split} | {n} | {a[0]['max_sent_bytes']} | {m(a, 'comm_us'):.0f} | {m(a, 'pipelined_us'):.0f} "
              f"| {m(a, 'overlap_pct'):.1f} | {m(b, 'comm_us'):.0f} | {m(b, 'pipelined_us'):.0f} "
              f"| {m(b, 'overlap_pct'):.1f} | {median(ratios):.2f} | {' '.join(f'{x:.2f}' for x in ratios)} "
              f"| {lo(b, 'pipelined_min_us') / lo(a, 'pipelined_min_us'):.2f} "
              f"| {max(r['overlap_min_pct'] for r in a):.1f} / {max(r['overlap_min_pct'] for r in b):.1f} | {ok} |")
PY
}

# Q. The Allgatherv tail after the last arrival at 16 and 32 nodes (issue 28), simulated
# (`service-process simulate --coll tail`) with a cost model calibrated by a small real run
# here: `coll-bench overlap --coll ialltoallv --sizes 8,1M`, offloaded at 1 node x 1 rank and
# at 2 nodes x 1 rank and native at 2 nodes x 1 rank, ranks one per core, SPs unpinned, twice.
#   per post      = offloaded 1 x 1 pure_us at 8 B (the whole fixed cost of a call);
#   per copy byte = (1 x 1 pure_us at 1 MiB - at 8 B) / (1 MiB - 8 B);
#   per message   = (2 x 1 pure_us at 8 B - 1 x 1 at 8 B) / 2 (a notification and an ack);
#   native        = 2 x 1 native pure_us at 8 B per message, (1 MiB - 8 B) per byte.
# Then the simulation, the offloaded hierarchical Allgatherv against a host ring priced with
# the same cost model, and against a host ring priced as native MPI measured; and the small
# real run of section D (2 nodes x 2 ranks, the last rank of each node 10 ms late) as a check.
tail_nodes=${TAIL_NODES:-16 32}
tail_rpn=${TAIL_RPN:-8}
tail_reps=${TAIL_REPS:-2}
tail_calibrate() {
  local i
  for i in $(seq 1 "$tail_reps"); do
    "$SP" launch --nodes 1 --ranks-per-node 1 --rank-cpus "${a_ranks%%,*}" -- \
      "$BENCH" overlap --coll ialltoallv --sizes 8,1M --iters 100 --warmup 5 \
      --json "$out/q-o1-$i.json" > /dev/null 2> >(grep -v '^sp [0-9]* stats' >&2)
    "$SP" launch --nodes 2 --ranks-per-node 1 --rank-cpus "$a_ranks" -- \
      "$BENCH" overlap --coll ialltoallv --sizes 8,1M --iters 100 --warmup 5 \
      --json "$out/q-o2-$i.json" > /dev/null 2> >(grep -v '^sp [0-9]* stats' >&2)
    "$SP" launch --nodes 2 --ranks-per-node 1 --native --rank-cpus "$a_ranks" -- \
      "$BENCH" overlap --coll ialltoallv --sizes 8,1M --iters 100 --warmup 5 \
      --json "$out/q-n2-$i.json" > /dev/null 2> >(grep -v '^sp [0-9]* stats' >&2)
  done
  # Prints: per post ns, per copy ns/B, per message ns, native message ns, native ns/B.
  python3 - "$out" "$tail_reps" <<'PY'
import json, sys
out, reps = sys.argv[1], int(sys.argv[2])
def mean(name, size):
    v = []
    for i in range(1, reps + 1):
        v += [r["pure_us"] for r in map(json.loads, open(f"{out}/q-{name}-{i}.json")) if r["bytes"] == size]
    return sum(v) / len(v)
MB = 1 << 20
o1s, o1l, o2s = mean("o1", 8), mean("o1", MB), mean("o2", 8)
n2s, n2l = mean("n2", 8), mean("n2", MB)
print(round(o1s * 1e3), (o1l - o1s) * 1e3 / (MB - 8), round((o2s - o1s) / 2 * 1e3),
      round(n2s * 1e3), (n2l - n2s) * 1e3 / (MB - 8))
PY
}
# cost-model arguments for a calibration: post ns, ns per byte, message ns, native message ns,
# native ns per byte. Buffers are 64 B (the simulator keeps real ones); byte_weight prices a
# byte as 1024 x (ns per byte) bytes at 1 byte/ns: a 64 KiB block.
tail_cost() {
  python3 - "$@" <<'PY'
import sys
post, nspb, msg, nmsg, nnspb = map(float, sys.argv[1:6])
w = lambda x: max(1, round(1024 * x))
print(f"post_ns={post:.0f},inter_node_latency_ns={msg:.0f},intra_node_latency_ns={msg:.0f},"
      f"copy_fixed_inter_ns=400,copy_fixed_intra_ns=400,inter_node_bytes_per_ns=1,"
      f"intra_node_bytes_per_ns=1,byte_weight={w(nspb)}")
print(f"msg_proc_ns=0,inter_node_latency_ns={nmsg:.0f},intra_node_latency_ns={nmsg:.0f},"
      f"byte_weight={w(nnspb)}")
PY
}
tail_sim() { # label, cost, native ring cost
  local label=$1 cost=$2 ncost=$3 nodes inflight ring
  for nodes in $tail_nodes; do
    for inflight in 1 4; do
      for ring in same native; do
        local rc=(); [ $ring = native ] && rc=(--ring-cost "$ncost")
        "$SP" simulate --coll tail --nodes "$nodes" --ranks-per-node "$tail_rpn" --sps-per-node 4 \
          --layout block --late-ranks "$nodes" --late-delay-us 30000 --seeds 3 \
          --inflight "$inflight" --cost "$cost" "${rc[@]}" --json |
          python3 -c 'import json,sys; [print(json.dumps(dict(json.loads(l), label=sys.argv[1], ring=sys.argv[2]))) for l in sys.stdin]' "$label" "$ring" \
          >> "$out/q-sim.json"
      done
    done
  done
}
tail_run() {
  local cal live rec
  : > "$out/q-sim.json"
  echo "-- calibration runs (load average before: $(cut -d' ' -f1-3 /proc/loadavg))"
  cal=$(tail_calibrate)
  echo "-- measured: per post ns, per copy ns/B, per message ns, native message ns, native ns/B: $cal (load average after: $(cut -d' ' -f1-3 /proc/loadavg))"
  echo "$cal" > "$out/q-cal.txt"
  # shellcheck disable=SC2086
  mapfile -t live < <(tail_cost $cal)
  # Recorded in docs/BENCHMARKS.md on a quieter machine: issue 28's table (1 x 1, --poll-us=0:
  # 8 B 39 us, 1 MiB 339 us) and section A (2 x 1 offloaded 1 KiB 134.61 us; native 1 KiB
  # 1.24 us, 1 MiB 131.91 us).
  mapfile -t rec < <(tail_cost 39000 "$(python3 -c 'print((339-39)*1e3/((1<<20)-8))')" \
    "$(python3 -c 'print((134.61-39)/2*1e3)')" 1240 "$(python3 -c 'print((131.91-1.24)*1e3/((1<<20)-1024))')")
  echo "live cost: ${live[0]}; native ring: ${live[1]}" > "$out/q-costs.txt"
  echo "recorded cost: ${rec[0]}; native ring: ${rec[1]}" >> "$out/q-costs.txt"
  tail_sim live "${live[0]}" "${live[1]}"
  tail_sim recorded "${rec[0]}" "${rec[1]}"
  echo "-- the small real run (section D's setup), delay 10 ms"
  for mode in native offload; do
    local extra=(); [ $mode = native ] && extra=(--native)
    "$SP" launch --nodes 2 --ranks-per-node 2 "${extra[@]}" -- \
      "$BENCH" late --coll allgatherv --delay-ms 10 --sizes 64K,1M --iters 10 \
      --json "$out/q-late-$mode.json" 2> >(grep -v '^sp [0-9]* stats' >&2)
  done
}
tail_markdown() {
  echo "Calibration (per post ns, per copy ns/byte, per message ns, native message ns, native"
  echo "ns/byte) measured by this run: $(cat "$out/q-cal.txt"). The simulator's cost fields:"
  echo
  sed 's/^/    /' "$out/q-costs.txt"
  echo
  echo "Simulated: \`service-process simulate --coll tail --nodes N --ranks-per-node $tail_rpn"
  echo "--sps-per-node 4 --layout block --late-ranks N --late-delay-us 30000 --seeds 3 --inflight K"
  echo "--cost ... [--ring-cost ...]\`: 64 KiB per rank (64-byte buffers priced by byte_weight), N"
  echo "ranks picked at random 30 ms late. ring: \`same\` = the host ring under the same cost model;"
  echo "\`native\` = the ring's message and byte costs those of native MPI measured here. Tails in"
  echo "microseconds after the last arrival, means over 3 seeds; ratio = offload / ring."
  echo
  python3 - "$out/q-sim.json" <<'PY'
import json, sys
print("| calibration | nodes x ranks | copies in flight per SP | ring priced | offload tail us | ring tail us | ratio |")
print("|---|---|---|---|---|---|---|")
for r in map(json.loads, open(sys.argv[1])):
    print(f"| {r['label']} | {r['nodes']} x {r['ranks_per_node']} | {r['max_inflight_reads']} | {r['ring']} "
          f"| {r['mean_offload_tail_us']:.0f} | {r['mean_ring_tail_us']:.0f} | {r['tail_ratio']:.2f} |")
PY
  echo
  echo "The small real run (2 nodes x 2 ranks, the last rank of each node 10 ms late, \`coll-bench late\`):"
  echo
  "$BENCH" compare --native "$out/q-late-native.json" --offload "$out/q-late-offload.json" --markdown
}

if [ $tail_only -eq 1 ]; then
  echo "== Q. the Allgatherv tail after the last arrival, calibrated; $tail_nodes nodes x $tail_rpn ranks"
  tail_run
  echo
  tail_markdown
  exit 0
fi

if [ $fft_only -eq 1 ]; then
  echo "== P. coll-bench fft (3D-FFT transpose loop); 2 nodes x 1 rank, splits a and b"
  fft_run
  echo
  fft_markdown
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
