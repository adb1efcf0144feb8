#!/usr/bin/env bash
# make test-mpich: the unit tests of mpi-ffi and the shim built for MPICH's ABI (target/mpich),
# every test file of the shim that runs MPI jobs (crates/host-shim/tests/mpirun_*.rs), under MPICH (SPOFF_TEST_MPI=mpich: programs built with mpicc.mpich and
# compared with MPICH's PMPI_*, Hydra's mpiexec.mpich, libhost_shim_mpich.so), then the
# conformance generator under MPICH (CASES per configuration, default 1000; scripts/conformance.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[ -e target/release/libhost_shim_mpich.so ] || {
  echo "test-mpich: target/release/libhost_shim_mpich.so is missing; run 'make build' first" >&2
  exit 1
}
MPI_FLAVOUR=mpich CARGO_TARGET_DIR=target/mpich ${CARGO:-cargo} test --release -p mpi-ffi \
  -p host-shim --lib
tests=()
for f in crates/host-shim/tests/mpirun_*.rs; do
  tests+=(--test "$(basename "$f" .rs)")
done
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
SPOFF_TEST_MPI=mpich ${CARGO:-cargo} test --release -p host-shim "${tests[@]}" --no-fail-fast 2>&1 \
  | tee "$log" || status=$?
passed=$(awk '/^test result: /{for(i=1;i<=NF;i++) if($(i+1) ~ /^passed/) s+=$i} END{print s+0}' "$log")
failed=$(awk '/^test result: /{for(i=1;i<=NF;i++) if($(i+1) ~ /^failed/) s+=$i} END{print s+0}' "$log")
echo "test-mpich: shim tests under MPICH: $passed passed, $failed failed"
if [ "$status" -ne 0 ] || [ "$passed" -lt 1 ]; then
  echo "test-mpich: FAILED" >&2
  exit 1
fi
MPI=mpich CASES=${CASES:-1000} bash scripts/conformance.sh
