//! Which process a key's owner is, pinned so that a recycled pid never stands for it.
//!
//! A pid is reused once its process has exited and been reaped: a key naming only a pid could
//! end up reading or writing an unrelated process (another user's, under an SP that runs as
//! root). So an [`crate::Owner`] carries the process's start time as well (clock ticks after
//! boot, field 22 of `/proc/PID/stat`), and before any cross-memory access [`check`] makes
//! sure that the process is the one the key was made for and is still alive, through a pidfd:
//! a pidfd names one process for good, and while that process lives no other can have its pid.
//!
//! The first check of `(pid, start)` opens a pidfd for the pid, then reads the start time; if
//! the process is still alive after that read, the start time read is that process's, and it
//! must equal the key's. Later checks only ask whether the pinned process is still alive (one
//! `poll` on the pidfd). An SP hands the pidfd it got for a host connection
//! (`SO_PEERPIDFD`) to [`pin`], which pins the very process that connected.

use crate::AccessError;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

/// Pinned processes kept; beyond it, those found dead are dropped first.
const MAX_PINNED: usize = 1 << 16;
/// The table is swept of exited processes whenever it has doubled since the last sweep (and
/// has at least this many): each pin holds a descriptor, which must not pile up in an SP that
/// serves job after job.
const SWEEP_FROM: usize = 64;

/// Pinned processes by (pid, start time), and the size after the last sweep.
type Table = HashMap<(u32, u64), Arc<OwnedFd>>;

static PINNED: Mutex<Option<(Table, usize)>> = Mutex::new(None);

/// The start time of `pid` (clock ticks after boot), from `/proc/PID/stat`.
pub fn start_time(pid: u32) -> std::io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) is in parentheses and may contain anything: count fields
    // after its closing parenthesis. Field 22 is the 20th after it.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| std::io::Error::other("malformed /proc stat"))?;
    after
        .split_whitespace()
        .nth(19)
        .and_then(|f| f.parse().ok())
        .ok_or_else(|| std::io::Error::other("no start time in /proc stat"))
}

/// A pidfd for `pid`.
pub fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) with a pid and no flags; returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Whether the process of a pidfd is still running (its pidfd is not readable yet).
pub fn alive(fd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 0
}

/// The start time of the process behind `fd` (whose pid is `pid`), read while it is known to
/// be alive on both sides of the read.
pub fn start_time_of(fd: &OwnedFd, pid: u32) -> std::io::Result<u64> {
    let gone = || std::io::Error::from_raw_os_error(libc::ESRCH);
    if !alive(fd) {
        return Err(gone());
    }
    let start = start_time(pid)?;
    if !alive(fd) {
        return Err(gone());
    }
    Ok(start)
}

fn with_table<R>(f: impl FnOnce(&mut Table, &mut usize) -> R) -> R {
    let mut t = PINNED.lock().unwrap_or_else(|e| e.into_inner());
    let (table, swept) = t.get_or_insert_with(|| (HashMap::new(), 0));
    f(table, swept)
}

fn insert(t: &mut Table, swept: &mut usize, key: (u32, u64), fd: Arc<OwnedFd>) {
    if t.len() >= SWEEP_FROM.max(2 * *swept) || t.len() >= MAX_PINNED {
        t.retain(|_, fd| alive(fd));
        *swept = t.len();
    }
    if t.len() < MAX_PINNED {
        t.insert(key, fd);
    }
}

/// Forgets a pinned process (its connection closed: no key of it will be used here again).
pub fn unpin(pid: u32, start: u64) {
    with_table(|t, _| t.remove(&(pid, start)));
}

/// Drops the pins of processes that have exited (an SP calls it when a job ends: the other
/// nodes' ranks it pinned for copies are gone too).
pub fn sweep() {
    with_table(|t, swept| {
        t.retain(|_, fd| alive(fd));
        *swept = t.len();
    });
}

/// How many processes are pinned (each holds a descriptor).
pub fn pinned() -> usize {
    with_table(|t, _| t.len())
}

/// Pins the process behind `fd` (a pidfd of `pid`): returns its start time.
pub fn pin(fd: OwnedFd, pid: u32) -> std::io::Result<u64> {
    let start = start_time_of(&fd, pid)?;
    with_table(|t, swept| insert(t, swept, (pid, start), Arc::new(fd)));
    Ok(start)
}

/// Checks that `pid` with start time `start` is a live process: the one a key was made for.
pub fn check(pid: u32, start: u64) -> Result<(), AccessError> {
    let gone = || AccessError::ProcessGone { pid };
    let known = with_table(|t, _| t.get(&(pid, start)).cloned());
    let fd = match known {
        Some(fd) => fd,
        None => {
            let fd = pidfd_open(pid).map_err(|_| gone())?;
            if start_time_of(&fd, pid).map_err(|_| gone())? != start {
                // The pid belongs to another process now.
                return Err(gone());
            }
            let fd = Arc::new(fd);
            with_table(|t, swept| insert(t, swept, (pid, start), fd.clone()));
            fd
        }
    };
    if alive(&fd) {
        Ok(())
    } else {
        with_table(|t, _| t.remove(&(pid, start)));
        Err(gone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_process_passes_and_a_wrong_start_or_an_exited_one_does_not() {
        let me = std::process::id();
        let start = start_time(me).unwrap();
        assert!(start > 0);
        assert_eq!(check(me, start), Ok(()));
        assert_eq!(
            check(me, start + 1),
            Err(AccessError::ProcessGone { pid: me })
        );
        let mut child = std::process::Command::new("sleep")
            .arg("10")
            .spawn()
            .unwrap();
        let pid = child.id();
        let cstart = start_time(pid).unwrap();
        assert_eq!(check(pid, cstart), Ok(()));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(check(pid, cstart), Err(AccessError::ProcessGone { pid }));
        // Pinning through a pidfd gives the same start time.
        let fd = pidfd_open(me).unwrap();
        assert_eq!(pin(fd, me).unwrap(), start);
    }

    #[test]
    fn exited_processes_do_not_pile_up() {
        for _ in 0..3 * SWEEP_FROM {
            let mut c = std::process::Command::new("true").spawn().unwrap();
            let pid = c.id();
            if let Ok(fd) = pidfd_open(pid) {
                let _ = pin(fd, pid);
            }
            c.wait().unwrap();
        }
        // Each insertion sweeps once the table has doubled: never more than twice the
        // processes alive at the last sweep (here, none of these), plus the sweep threshold.
        assert!(pinned() <= 2 * SWEEP_FROM + 8, "{} pinned", pinned());
    }

    #[test]
    fn start_time_survives_odd_command_names() {
        // Field 22 is counted after the last ')' whatever the name holds.
        assert!(start_time(std::process::id()).is_ok());
        assert!(start_time(u32::MAX).is_err());
    }
}
