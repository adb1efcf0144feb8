//! What `/proc` says of a process, for tests that watch SPs' memory (shared with the SP crate's
//! tests, which include this file by path).

/// Resident set size of `pid` in KiB (`VmRSS` in `/proc/<pid>/status`); `None` when the
/// process is gone or the line is missing.
pub fn rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}
