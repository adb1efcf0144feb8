//! algorithms (placeholder; being written).
