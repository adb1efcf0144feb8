//! coll-bench: an overlap benchmark (OSU method) for nonblocking collectives.
//!
//! It is an ordinary MPI program: it calls the `MPI_*` entry points and knows nothing of the
//! offload, so the same binary runs natively and with `libhost_shim.so` preloaded. The library
//! part holds the pieces that do not need the command line: the MPI helper layer, the data
//! pattern used for validation, the calibrated compute kernel, size parsing and the pure parts
//! of the traffic benchmark (placement, ring schedule, counting, rendering) and the text tables
//! of the commands that need no MPI.

pub mod compute;
pub mod fft_math;
pub mod mpi;
pub mod pattern;
pub mod strided;
pub mod table;
pub mod traffic;

/// Parses a byte size: a plain number or one with a `K`/`M`/`G` suffix (1024-based,
/// case-insensitive, an optional trailing `B`/`iB` is accepted: `4K`, `4KiB`, `1m`).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let body = lower
        .strip_suffix("ib")
        .or_else(|| lower.strip_suffix('b'))
        .unwrap_or(&lower);
    let (digits, mult) = match body.chars().last() {
        Some('k') => (&body[..body.len() - 1], 1usize << 10),
        Some('m') => (&body[..body.len() - 1], 1 << 20),
        Some('g') => (&body[..body.len() - 1], 1 << 30),
        _ => (body, 1),
    };
    let n: usize = digits
        .trim()
        .parse()
        .map_err(|_| format!("invalid size '{t}' (examples: 512, 4K, 1M)"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("size '{t}' is too large"))
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("100"), Ok(100));
        assert_eq!(parse_size("0"), Ok(0));
        assert!(parse_size("K").is_err());
        assert!(parse_size("1.5K").is_err());
        assert!(parse_size("x").is_err());
    }
}
