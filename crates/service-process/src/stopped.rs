//! The counters of an SP that stopped, kept in a file next to its host socket
//! (`<host_socket>.stopped.json`), where `service-process stats` finds them once the SP is gone.
//!
//! An SP writes it first thing on SIGTERM/SIGINT, together with its `STATS` line, before any
//! teardown: a launcher that SIGKILLs its processes shortly after SIGTERM (Open MPI's `mpirun`
//! about a second later; Slurm's srun SIGKILLs its tasks at once when it is itself sent
//! SIGTERM) must not take the counters with it. It also writes it, marked as a snapshot,
//! whenever a job ends there: an SP killed outright (SIGKILL alone, before it could act on a SIGTERM) leaves the counters as of its last
//! finished job. The file is written to a temporary name and renamed, so a reader sees the
//! whole record or the previous one. It survives the SP (the socket does not); under systemd
//! it stays in /run/spoff/ID (the unit keeps its `RuntimeDirectory`, `RuntimeDirectoryPreserve=yes`),
//! and the journal keeps the `STATS` line.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Where the SP whose host socket is `socket` keeps its counters when it stops.
pub fn path_for(socket: &Path) -> PathBuf {
    let mut p = socket.as_os_str().to_owned();
    p.push(".stopped.json");
    PathBuf::from(p)
}

/// Writes the record of SP `sp` with `stats`: `stopped` (it is stopping now) or a snapshot
/// (it serves on). Atomically: a temporary file renamed over the record; mode 0600.
pub fn write(
    socket: &Path,
    sp: u32,
    stats: &crate::stats::Stats,
    stopped: bool,
) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let when = if stopped {
        "stopped_at_unix"
    } else {
        "as_of_unix"
    };
    let record = serde_json::json!({
        "sp": sp,
        "pid": std::process::id(),
        when: bootstrap::auth::unix_secs(),
        "stats": stats,
    });
    let path = path_for(socket);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(record.to_string().as_bytes())?;
        f.write_all(b"\n")?;
        std::fs::rename(&tmp, &path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// [`write`]s a snapshot (the SP serves on); a failure is said once per process (a socket
/// directory the SP cannot write would otherwise be reported at every job's end).
pub fn snapshot(socket: &Path, sp: u32, stats: &crate::stats::Stats) {
    use std::sync::atomic::{AtomicBool, Ordering};
    static SAID: AtomicBool = AtomicBool::new(false);
    if let Err(e) = write(socket, sp, stats, false) {
        if !SAID.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                sp,
                "cannot keep the counters in {} (said once): {e}",
                path_for(socket).display()
            );
        }
    }
}

/// The record kept for the SP whose host socket is `socket`, if there is one: its counters
/// with `sp` added, and `stopped_at_unix` (it stopped then) or `as_of_unix` (a snapshot taken
/// when a job ended, all that is left of an SP killed outright).
pub fn read(socket: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(path_for(socket)).ok()?;
    let rec: serde_json::Value = serde_json::from_str(&text).ok()?;
    let mut stats = rec.get("stats")?.clone();
    let obj = stats.as_object_mut()?;
    obj.insert("sp".into(), rec.get("sp")?.clone());
    let mut dated = false;
    for when in ["stopped_at_unix", "as_of_unix"] {
        if let Some(t) = rec.get(when) {
            obj.insert(when.into(), t.clone());
            dated = true;
        }
    }
    dated.then_some(stats)
}

/// How `stats` labels a kept record (see [`read`]).
pub fn label(rec: &serde_json::Value) -> String {
    match (rec["stopped_at_unix"].as_u64(), rec["as_of_unix"].as_u64()) {
        (Some(t), _) => format!("stopped at {}", utc(t)),
        (None, Some(t)) => format!("gone without stopping; counters as of {}", utc(t)),
        (None, None) => "gone".into(),
    }
}

/// `secs` since the epoch as `YYYY-MM-DD HH:MM:SS UTC`.
pub fn utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_795_800_000), "2026-11-27 17:20:00 UTC");
    }

    #[test]
    fn a_record_round_trips_and_replaces_the_last() {
        let dir = std::env::temp_dir().join(format!("spoff-stopped-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("host.sock");
        assert!(read(&socket).is_none());
        let mut s = crate::stats::Stats {
            posts: 3,
            ..Default::default()
        };
        write(&socket, 7, &s, false).unwrap();
        let rec = read(&socket).unwrap();
        assert_eq!(rec["posts"], 3);
        assert!(label(&rec).starts_with("gone without stopping; counters as of 20"));
        s.posts = 5;
        write(&socket, 7, &s, true).unwrap();
        let rec = read(&socket).unwrap();
        assert_eq!(rec["posts"], 5);
        assert_eq!(rec["sp"], 7);
        assert!(rec["stopped_at_unix"].as_u64().unwrap() > 0);
        assert!(rec.get("as_of_unix").is_none());
        assert!(label(&rec).starts_with("stopped at 20"));
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "no temporary left"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
