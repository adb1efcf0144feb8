//! mpi-ffi (placeholder; being written).
