//! host-shim (placeholder; being written).
