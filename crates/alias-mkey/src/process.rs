//! Which process a key's owner is, pinned so that a recycled pid never stands for it, and
//! reached only as its client could reach it.
//!
//! A pid is reused once its process has exited and been reaped: a key naming only a pid could
//! end up reading or writing an unrelated process (another user's, under an SP that runs as
//! root). So an [`crate::Owner`] carries the process's start time as well (clock ticks after
//! boot, field 22 of `/proc/PID/stat`), and before any cross-memory access [`check`] makes
//! sure that the process is the one the key was made for and is still alive, through a pidfd:
//! a pidfd names one process for good, and while that process lives no other can have its pid.
//!
//! The memory itself is reached through `/proc/PID/mem`, opened once per pinned process **as
//! the owner's client** (its uid and gid, [`crate::ids::with_fs_ids`], never the SP's own
//! rights): the kernel refuses the open exactly when that user could not `ptrace` the process
//! (setuid, setgid or non-dumpable, another user's). The open descriptor is bound to the process
//! image it was opened on: once the process calls `exec`, reads and writes through it find no
//! memory (the kernel answers 0 bytes) and fail with [`AccessError::ImageChanged`], so no key
//! made before an `exec` reaches the program that `exec` started, even one a user cannot trace.
//!
//! The first check of `(pid, start)` opens a pidfd for the pid, then reads the start time; if
//! the process is still alive after that read, the start time read is that process's, and it
//! must equal the key's. Later checks only ask whether the pinned process is still alive (one
//! `poll` on the pidfd). An SP hands the pidfd it got for a host connection
//! (`SO_PEERPIDFD`) to [`pin`], which pins the very process that connected.

use crate::{AccessError, Owner};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

/// Pinned processes kept; beyond it, those found dead are dropped first.
const MAX_PINNED: usize = 1 << 16;
/// The table is swept of exited processes whenever it has doubled since the last sweep (and
/// has at least this many): each pin holds descriptors, which must not pile up in an SP that
/// serves job after job.
const SWEEP_FROM: usize = 64;

/// A pinned process: its pidfd (readable once it exits), its memory as opened by its client,
/// and an address mapped in that image (its stack's start) to ask whether the image lives.
#[derive(Debug)]
pub struct Pinned {
    pidfd: OwnedFd,
    mem: OwnedFd,
    probe_addr: u64,
}

impl Pinned {
    /// The `/proc/PID/mem` descriptor of the pinned image.
    pub fn mem(&self) -> &OwnedFd {
        &self.mem
    }

    /// Whether the image the memory was opened on is still the process's (no `exec` since):
    /// one byte read at its stack's start.
    pub fn image_alive(&self) -> bool {
        let mut b = 0u8;
        // SAFETY: reads at most one byte into `b`.
        let n = unsafe {
            libc::pread(
                self.mem.as_raw_fd(),
                (&mut b as *mut u8).cast(),
                1,
                self.probe_addr as libc::off_t,
            )
        };
        n == 1
    }
}

/// Who a pinned process is, and as whom it is reached: (pid, start time, uid, gid).
type PinKey = (u32, u64, u32, u32);

/// Pinned processes, and the size after the last sweep.
type Table = HashMap<PinKey, Arc<Pinned>>;

static PINNED: Mutex<Option<(Table, usize)>> = Mutex::new(None);

/// Field `n` (1-based, n > 2) of `/proc/PID/stat`, counted after the command name.
pub(crate) fn stat_field(stat: &str, n: usize) -> std::io::Result<u64> {
    // The command name (field 2) is in parentheses and may contain anything: count fields
    // after its closing parenthesis (field 3 is the first after it).
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| std::io::Error::other("malformed /proc stat"))?;
    after
        .split_whitespace()
        .nth(n - 3)
        .and_then(|f| f.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no field {n} in /proc stat")))
}

/// The start time of `pid` (clock ticks after boot), from `/proc/PID/stat`.
pub fn start_time(pid: u32) -> std::io::Result<u64> {
    stat_field(&std::fs::read_to_string(format!("/proc/{pid}/stat"))?, 22)
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

/// Opens the memory of `pid` (whose pidfd is `fd` and start time `start`) as `uid`/`gid`:
/// the kernel decides as it would for that user's `ptrace`. Also reads, with the same ids, the
/// stack's start (an address mapped while the image lives).
fn open_as(fd: OwnedFd, pid: u32, start: u64, uid: u32, gid: u32) -> std::io::Result<Pinned> {
    let (mem, stat) = crate::ids::with_fs_ids(uid, gid, || {
        let mem = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/mem"))?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        Ok((OwnedFd::from(mem), stat))
    })?;
    // What was opened is the pinned process's only if it still runs, with the same start.
    if !alive(&fd) || stat_field(&stat, 22)? != start {
        return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
    }
    // The stack's start reads 0 while the process is still being set up by exec (or when the
    // ids could not see it): no image to bind to yet.
    let probe_addr = stat_field(&stat, 28)?;
    if probe_addr == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::WouldBlock,
            format!("pid {pid} has no stack yet (it is executing a program)"),
        ));
    }
    Ok(Pinned {
        pidfd: fd,
        mem,
        probe_addr,
    })
}

fn with_table<R>(f: impl FnOnce(&mut Table, &mut usize) -> R) -> R {
    let mut t = PINNED.lock().unwrap_or_else(|e| e.into_inner());
    let (table, swept) = t.get_or_insert_with(|| (HashMap::new(), 0));
    f(table, swept)
}

fn insert(t: &mut Table, swept: &mut usize, key: PinKey, p: Arc<Pinned>) {
    if t.len() >= SWEEP_FROM.max(2 * *swept) || t.len() >= MAX_PINNED {
        t.retain(|_, p| alive(&p.pidfd));
        *swept = t.len();
    }
    if t.len() < MAX_PINNED {
        t.insert(key, p);
    }
}

/// Forgets a pinned process (its connection closed: no key of it will be used here again).
pub fn unpin(pid: u32, start: u64) {
    with_table(|t, _| t.retain(|k, _| (k.0, k.1) != (pid, start)));
}

/// Drops the pins of processes that have exited (an SP calls it when a job ends: the other
/// nodes' ranks it pinned for copies are gone too).
pub fn sweep() {
    with_table(|t, swept| {
        t.retain(|_, p| alive(&p.pidfd));
        *swept = t.len();
    });
}

/// How many processes are pinned (each holds descriptors).
pub fn pinned() -> usize {
    with_table(|t, _| t.len())
}

/// Whether the process a key names is pinned here and still running.
pub fn alive_pid(owner: &Owner) -> bool {
    let key = (owner.pid, owner.start, owner.uid, owner.gid);
    with_table(|t, _| t.get(&key).is_some_and(|p| alive(&p.pidfd)))
}

/// Starts `sleep SECS` and returns once exec has set it up (its stack is in `/proc/PID/stat`):
/// a child that [`check`] can pin at once. For tests.
#[doc(hidden)]
pub fn running_sleep(secs: &str) -> std::process::Child {
    let child = std::process::Command::new("sleep")
        .arg(secs)
        .spawn()
        .expect("sleep starts");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    // SAFETY: geteuid/getegid have no preconditions.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let stack = || {
        crate::ids::with_fs_ids(uid, gid, || {
            std::fs::read_to_string(format!("/proc/{}/stat", child.id()))
        })
        .ok()
        .and_then(|s| stat_field(&s, 28).ok())
        .unwrap_or(0)
    };
    while stack() == 0 {
        assert!(std::time::Instant::now() < deadline, "sleep never started");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    child
}

/// Whether the image of a pinned, running process is still the one its memory was opened on:
/// `None` if it is not pinned here or has exited, `Some(false)` once it has called `exec`.
pub fn image_alive(pid: u32, start: u64, uid: u32, gid: u32) -> Option<bool> {
    let p = with_table(|t, _| t.get(&(pid, start, uid, gid)).cloned())?;
    let image = p.image_alive();
    alive(&p.pidfd).then_some(image)
}

/// Starts a shell (as `uid`, if given) that execs `sleep 10` once a line is written to its
/// stdin, and returns once the shell runs. For tests of what an `exec` does to a pin.
#[doc(hidden)]
pub fn exec_on_cue(uid: Option<u32>) -> std::process::Child {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", "echo up; read x; exec sleep 10"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    if let Some(uid) = uid {
        cmd.uid(uid).gid(uid);
    }
    let mut child = cmd.spawn().expect("sh starts");
    // Running the shell (spawn returns while exec may still be setting it up).
    let mut up = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut up)
        .expect("the shell says it is up");
    child
}

/// What [`pin`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pin {
    /// The process's start time.
    pub start: u64,
    /// The process was pinned before, on an image it has since left by `exec`: every key and
    /// connection of that image must end.
    pub exec_since: bool,
}

/// Pins the process behind `fd` (a pidfd of `pid`), reached as `uid`/`gid` (its client). Fails
/// when that client could not `ptrace` it (the kernel's answer), or when it is gone.
pub fn pin(fd: OwnedFd, pid: u32, uid: u32, gid: u32) -> std::io::Result<Pin> {
    let start = start_time_of(&fd, pid)?;
    let key = (pid, start, uid, gid);
    let known = with_table(|t, _| t.get(&key).cloned());
    let exec_since = match known {
        Some(p) if alive(&p.pidfd) && p.image_alive() => {
            return Ok(Pin {
                start,
                exec_since: false,
            })
        }
        Some(_) => true,
        None => false,
    };
    let p = Arc::new(open_as(fd, pid, start, uid, gid)?);
    with_table(|t, swept| insert(t, swept, key, p));
    Ok(Pin { start, exec_since })
}

/// The pinned process a key names, opened as its client if it was not pinned here yet (a key
/// from a peer SP), after checking that `pid` with start time `start` is a live process: the
/// one the key was made for.
pub fn check(owner: &Owner) -> Result<Arc<Pinned>, AccessError> {
    let pid = owner.pid;
    let gone = || AccessError::ProcessGone { pid };
    let key = (pid, owner.start, owner.uid, owner.gid);
    let known = with_table(|t, _| t.get(&key).cloned());
    let p = match known {
        Some(p) => p,
        None => {
            let fd = pidfd_open(pid).map_err(|_| gone())?;
            if start_time_of(&fd, pid).map_err(|_| gone())? != owner.start {
                // The pid belongs to another process now.
                return Err(gone());
            }
            let p = open_as(fd, pid, owner.start, owner.uid, owner.gid).map_err(|e| {
                match e.raw_os_error() {
                    Some(libc::ESRCH) => gone(),
                    _ => AccessError::NotPermitted {
                        pid,
                        uid: owner.uid,
                        gid: owner.gid,
                        why: e.to_string(),
                    },
                }
            })?;
            let p = Arc::new(p);
            with_table(|t, swept| insert(t, swept, key, p.clone()));
            p
        }
    };
    if alive(&p.pidfd) {
        Ok(p)
    } else {
        with_table(|t, _| t.remove(&key));
        Err(gone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me_ids() -> (u32, u32) {
        // SAFETY: geteuid/getegid have no preconditions.
        unsafe { (libc::geteuid(), libc::getegid()) }
    }

    fn owner(pid: u32, start: u64) -> Owner {
        let (uid, gid) = me_ids();
        Owner {
            job: 1,
            world_rank: 0,
            pid,
            start,
            uid,
            gid,
        }
    }

    #[test]
    fn a_live_process_passes_and_a_wrong_start_or_an_exited_one_does_not() {
        let me = std::process::id();
        let start = start_time(me).unwrap();
        assert!(start > 0);
        assert!(check(&owner(me, start)).is_ok());
        assert_eq!(
            check(&owner(me, start + 1)).unwrap_err(),
            AccessError::ProcessGone { pid: me }
        );
        let mut child = running_sleep("10");
        let pid = child.id();
        let cstart = start_time(pid).unwrap();
        assert!(check(&owner(pid, cstart)).is_ok());
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(
            check(&owner(pid, cstart)).unwrap_err(),
            AccessError::ProcessGone { pid }
        );
        // Pinning through a pidfd gives the same start time.
        let fd = pidfd_open(me).unwrap();
        let (uid, gid) = me_ids();
        assert_eq!(pin(fd, me, uid, gid).unwrap().start, start);
    }

    #[test]
    fn an_exec_ends_the_pinned_image() {
        // A shell that execs `sleep` once told to: pinned before, its old image is gone after.
        let (uid, gid) = me_ids();
        let mut child = exec_on_cue(None);
        let pid = child.id();
        let p = pin(pidfd_open(pid).unwrap(), pid, uid, gid).unwrap();
        assert!(!p.exec_since);
        let pinned = check(&owner(pid, p.start)).unwrap();
        assert!(pinned.image_alive());
        use std::io::Write;
        writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while pinned.image_alive() {
            assert!(std::time::Instant::now() < deadline, "exec not seen");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // Same pid, same start time: pinning again opens the new image and says so.
        let again = pin(pidfd_open(pid).unwrap(), pid, uid, gid).unwrap();
        assert_eq!(
            again,
            Pin {
                start: p.start,
                exec_since: true
            }
        );
        assert!(check(&owner(pid, p.start)).unwrap().image_alive());
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn exited_processes_do_not_pile_up() {
        let (uid, gid) = me_ids();
        for _ in 0..3 * SWEEP_FROM {
            let mut c = running_sleep("10");
            let pid = c.id();
            if let Ok(fd) = pidfd_open(pid) {
                let _ = pin(fd, pid, uid, gid);
            }
            c.kill().unwrap();
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
        assert_eq!(stat_field("1 (a) b) S 7", 4).unwrap(), 7);
    }
}
