# The two commands of the README: `make demo` and `make test`. Both install the system packages
# they need (scripts/deps.sh) and build the whole workspace in release mode with two jobs.

CARGO ?= cargo
JOBS ?= 2
export CARGO_BUILD_JOBS := $(JOBS)
# Open MPI refuses to run as root without these; they are set for our jobs only.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

BIN := target/release
SP := $(BIN)/service-process
BENCH := $(BIN)/coll-bench

.PHONY: all deps build test test-mpich demo bench conformance chaos fuzz soak ucx-export-test deploy-test fmt clippy clean

all: build

deps:
	@bash scripts/deps.sh

# Both ABIs: the workspace against Open MPI, then the host shim and the benchmark against
# MPICH (target/release/libhost_shim_mpich.so, coll-bench-mpich; scripts/build-mpich.sh).
build: deps
	$(CARGO) build --release --workspace --bins --lib
	CARGO=$(CARGO) bash scripts/build-mpich.sh

# Every test: unit, simulator, SP engine, and the MPI integration tests (real SPs, real mpirun).
test: build
	bash scripts/test.sh

# Every shim test that runs MPI jobs (crates/host-shim/tests/mpirun_*.rs) under MPICH instead of
# Open MPI (programs built with mpicc.mpich, run by Hydra, the MPICH-ABI shim), then the
# conformance generator's large run under MPICH (make test runs mpirun_mpich.rs, a subset).
test-mpich: build
	bash scripts/test-mpich.sh

# An emulated two-node cluster running the offloaded Ialltoallv overlap benchmark against
# native Open MPI on the same layout, then the comparison.
demo: build
	bash scripts/bench.sh --demo

# The conformance generator's large run (12 configurations x CASES cases, default 1000);
# writes docs/CONFORMANCE.md (MPI=mpich: under MPICH, docs/CONFORMANCE.mpich.md).
conformance: build
	WRITE_DOCS=1 bash scripts/conformance.sh

# Chaos: random collectives while SPs and ranks are killed, stopped, paused and cut off
# (make test runs 4 rounds of it). CHAOS_ROUNDS=N for more.
CHAOS_ROUNDS ?= 60
chaos: build
	CHAOS_ROUNDS=$(CHAOS_ROUNDS) $(CARGO) test --release -p integration-tests --test chaos -- --nocapture

# Coverage-guided fuzzing (cargo-fuzz) of the decoders and the engine, FUZZ_SECS per target;
# crash inputs go to fuzz/regressions/, which make test replays.
fuzz: build
	bash scripts/fuzz.sh

# Soak: the same SPs serve 100 000 collectives in one job, then 200 jobs; their memory,
# descriptors, jobs and instances are sampled; writes docs/SOAK.md and docs/soak.svg.
soak: build
	SOAK_COLLECTIVES=100000 SOAK_JOBS=200 SOAK_WRITE_DOCS=1 $(CARGO) test --release -p integration-tests --test soak -- --nocapture

# The ucx-export backend (BlueField alias keys: UCX exported memory handles) built against
# UCX >= 1.15 from the PyPI wheel libucx-cu12 (scripts/ucx-wheel.sh; Debian's UCX is 1.13), in
# its own target directory: the export unit tests of ucx-sys and alias-mkey, an mpirun job whose
# ranks ask for ucx-export, are refused (no device here can export) and fall back to cma, and an
# SP handed an export grant it cannot import (the collective fails, the SP keeps serving).
UCX_EXPORT_TARGET := target/ucx-export
ucx-export-test: deps
	prefix=$$(bash scripts/ucx-wheel.sh) && \
	export UCX_DIR=$$prefix LD_LIBRARY_PATH=$$prefix/lib UCX_WARN_UNUSED_ENV_VARS=n \
	  CARGO_TARGET_DIR=$(UCX_EXPORT_TARGET) && \
	$(CARGO) test --release -p ucx-sys --test export && \
	$(CARGO) test --release -p alias-mkey --lib && \
	$(CARGO) build --release -p service-process -p host-shim --bins --lib && \
	$(CARGO) test --release -p host-shim --test mpirun_ucx ucx_export && \
	$(CARGO) test --release -p service-process --test engine_hostile ucx_export

# A real multi-node cluster made of network namespaces (needs root): per node a host and a DPU
# namespace, SPs in the DPU namespaces, the job started by Open MPI's mpirun across the host
# namespaces; correctness programs, the overlap benchmark, an SP and a rank killed; nothing
# left behind (docs/DEPLOY.md). DEPLOY_SHORT=1 for the short run make test does.
deploy-test: build
	bash scripts/deploy-test.sh

# The full benchmark; writes docs/BENCHMARKS.md.
bench: build
	bash scripts/bench.sh

fmt:
	$(CARGO) fmt --all

clippy:
	$(CARGO) clippy --release --workspace --all-targets

clean:
	$(CARGO) clean
