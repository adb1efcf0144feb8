#!/usr/bin/env bash
# Runs every test of the workspace and fails loudly if a suite ran nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test --release --workspace --no-fail-fast 2>&1 | tee "$log" || status=$?
passed=$(awk '/^test result: /{for(i=1;i<=NF;i++) if($(i+1) ~ /^passed/) s+=$i} END{print s+0}' "$log")
failed=$(awk '/^test result: /{for(i=1;i<=NF;i++) if($(i+1) ~ /^failed/) s+=$i} END{print s+0}' "$log")
echo
echo "summary: ${passed:-0} passed, ${failed:-0} failed"
if [ "$status" -ne 0 ]; then
  echo "make test: FAILED" >&2
  exit "$status"
fi
# The MPI integration tests must have run (not been skipped or filtered away).
if ! grep -qE '^test mpi_[a-z0-9_]+ \.\.\. ok' "$log"; then
  echo "make test: no MPI integration test ran; refusing to call this a pass" >&2
  exit 1
fi
if [ "${passed:-0}" -lt 1 ]; then
  echo "make test: no test ran" >&2
  exit 1
fi
