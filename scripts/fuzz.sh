#!/usr/bin/env bash
# Coverage-guided fuzzing of every decoder of untrusted input and of the engine's message
# handling (make fuzz): cargo-fuzz (libFuzzer) on the targets of fuzz/ (service_process::
# fuzz_targets), each for FUZZ_SECS seconds (default 120), starting from the seed corpus
# fuzz/corpus/TARGET (recorded from real traffic). New corpus entries are kept in a copy
# (fuzz/corpus stays the seed); a crash input is copied to fuzz/regressions/TARGET/, which
# `make test` replays. Prints executions, coverage and features per target.
#   scripts/fuzz.sh              fuzz every target
#   scripts/fuzz.sh TARGET...    fuzz these
#   scripts/fuzz.sh corpus       rebuild fuzz/corpus from a recorded real job
# Needs cargo-fuzz (installed with `cargo install cargo-fuzz` when missing). On the stable
# toolchain it builds without a sanitizer (RUSTC_BOOTSTRAP=1 for cargo-fuzz's flags); with a
# nightly toolchain installed, with AddressSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
secs=${FUZZ_SECS:-120}
targets=(host_frames peer_frames credential machine mcast_datagram)

if [ "${1:-}" = corpus ]; then
  rec=$(mktemp -d)
  trap 'rm -rf "$rec"' EXIT
  prog=$rec/conform
  mpicc -O1 -pthread -o "$prog" crates/host-shim/tests/progs/conform.c
  # The last configuration: the multicast Bcast with drops, so that its fetch ring talks.
  for cfg in "1 block flat lb 0" "2 cyclic hier hier 0" "2 block flat flat 0" "1 block mcast lb 5"; do
    read -r k layout b i drop <<< "$cfg"
    SPOFF_RECORD_FRAMES=$rec/frames SPOFF_BCAST_DESIGN=$b SPOFF_IALLGATHER_DESIGN=$i \
      target/release/service-process launch --nodes 2 --ranks-per-node 2 --sps-per-node "$k" \
      --layout "$layout" --sp-arg=--ucx=off --sp-arg=--mcast-drop-rate="$drop" -- \
      "$prog" --cases 40 --seed 5 --finalize-early > /dev/null
  done
  rm -rf fuzz/corpus
  SPOFF_RECORDED=$rec/frames cargo test --release -p service-process --test fuzz_corpus \
    -- --ignored build_corpus --nocapture
  exit 0
fi
[ $# -gt 0 ] && targets=("$@")

command -v cargo-fuzz > /dev/null || cargo install cargo-fuzz
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  fuzz=(cargo +nightly fuzz)
  san=(-s address)
else
  fuzz=(env RUSTC_BOOTSTRAP=1 cargo fuzz)
  san=(-s none)
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd fuzz
status=0
for t in "${targets[@]}"; do
  mkdir -p "$work/$t" "artifacts/$t"
  cp -r "corpus/$t/." "$work/$t/"
  set +e
  "${fuzz[@]}" run "${san[@]}" -O "$t" "$work/$t" -- -max_total_time="$secs" -max_len=8192 \
    -print_final_stats=1 > "$work/$t.log" 2>&1
  rc=$?
  set -e
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work/$t.log" | grep -o '[0-9]*$' | tail -1)
  last=$(grep -E '^#[0-9]+' "$work/$t.log" | tail -1)
  cov=$(echo "$last" | grep -o 'cov: [0-9]*' | grep -o '[0-9]*')
  ft=$(echo "$last" | grep -o 'ft: [0-9]*' | grep -o '[0-9]*')
  echo "fuzz: $t: ${secs}s, ${execs:-?} executions, coverage ${cov:-?} edges, ${ft:-?} features, exit $rc"
  if [ "$rc" -ne 0 ]; then
    status=1
    mkdir -p "regressions/$t"
    for a in artifacts/"$t"/*; do
      [ -e "$a" ] && cp "$a" "regressions/$t/" && echo "fuzz: $t: crash input kept in fuzz/regressions/$t/$(basename "$a")"
    done
    tail -40 "$work/$t.log"
  fi
done
exit $status
