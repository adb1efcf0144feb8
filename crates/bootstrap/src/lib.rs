//! bootstrap (placeholder; being written).
