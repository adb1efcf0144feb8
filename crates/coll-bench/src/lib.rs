//! coll-bench (placeholder; being written).
