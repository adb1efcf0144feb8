//! service-process (placeholder; being written).
