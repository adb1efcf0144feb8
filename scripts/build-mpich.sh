#!/usr/bin/env bash
# Builds the MPICH-ABI flavour of what runs inside MPI jobs (make build runs it): the host shim
# and the benchmark, from the same sources, against MPICH's mpi.h (MPI_FLAVOUR=mpich: mpi-ffi
# probes mpicc.mpich). Cargo builds them in a target directory of their own (target/mpich),
# since one build can link only one MPI, then they are copied next to the Open MPI ones:
#   target/release/libhost_shim_mpich.so   (service-process launch --mpi mpich preloads it)
#   target/release/coll-bench-mpich
set -euo pipefail
cd "$(dirname "$0")/.."
command -v mpicc.mpich >/dev/null || {
  echo "build-mpich: mpicc.mpich not found (install mpich libmpich-dev: make deps)" >&2
  exit 1
}
MPI_FLAVOUR=mpich CARGO_TARGET_DIR=target/mpich ${CARGO:-cargo} build --release \
  -p host-shim -p coll-bench
mkdir -p target/release
# Copied under a temporary name and renamed: a job running the old file keeps it.
for pair in "libhost_shim.so:libhost_shim_mpich.so" "coll-bench:coll-bench-mpich"; do
  src=target/mpich/release/${pair%%:*}
  dst=target/release/${pair##*:}
  cp "$src" "$dst.tmp.$$"
  mv -f "$dst.tmp.$$" "$dst"
done
