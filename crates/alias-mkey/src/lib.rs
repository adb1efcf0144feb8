//! alias-mkey (placeholder; being written).
