//! ucx-sys (placeholder; being written).
