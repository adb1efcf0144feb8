//! Acting as the client: the ids under which an SP opens a host process's memory, and the
//! capabilities it gives up so that the kernel, not the SP, decides what a client may reach.
//!
//! An SP may run as root (a site daemon serving every user of a node). Its own rights must
//! never stand in for a client's: a root SP that reads `/proc/PID/mem` with its own ids reads
//! any process, including a setuid-root program that a user's rank turned into by `exec`. So
//! every open of a host process's memory happens with the **client's** filesystem ids on the
//! calling thread ([`with_fs_ids`]; `setfsuid`/`setfsgid` are per thread and, unlike the real
//! ids, give no one the right to signal the SP) and without `CAP_SYS_PTRACE` in the thread's
//! effective set ([`drop_effective`]). The kernel then applies to the open exactly the rule it
//! applies to that user's `ptrace` (`PTRACE_MODE_ATTACH_FSCREDS`): same uid and gid as the
//! target's real, effective and saved ids, the target dumpable (not setuid, setgid or made
//! non-dumpable), no capability the target holds that the user lacks (the capability
//! module's check: a program given file capabilities is refused too).
//!
//! A client that is root (uid 0) could trace any process itself: for it, and only for it, the
//! thread raises `CAP_SYS_PTRACE` (if the SP keeps it permitted) for the open. Without it even
//! root could not open another root process's memory (that process's capabilities are not a
//! subset of the SP's).

use std::io;

/// `CAP_SYS_PTRACE`: with it the kernel lets a thread attach to any process.
pub const CAP_SYS_PTRACE: u32 = 19;

const CAP_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// The calling thread's capability sets (two words each: capabilities 0-31 and 32-63).
fn capget() -> io::Result<[CapData; 2]> {
    let mut hdr = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget(2) with a version-3 header and room for its two data words.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut hdr, data.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(data)
}

fn capset(data: &[CapData; 2]) -> io::Result<()> {
    let mut hdr = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    // SAFETY: capset(2) with a version-3 header and its two data words; pid 0 is this thread.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut hdr, data.as_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn bit(cap: u32) -> (usize, u32) {
    ((cap / 32) as usize, 1 << (cap % 32))
}

/// Whether the calling thread has `cap` in its effective set.
pub fn has_effective(cap: u32) -> io::Result<bool> {
    let (w, b) = bit(cap);
    Ok(capget()?[w].effective & b != 0)
}

/// Removes `caps` from the calling thread's effective set (it can raise them again only if
/// they stay permitted). A thread that cannot drop them (no capset) gets the error.
pub fn drop_effective(caps: &[u32]) -> io::Result<()> {
    if caps.contains(&CAP_SYS_PTRACE) {
        PTRACE_ON.set(None);
    }
    let mut d = capget()?;
    let mut changed = false;
    for &c in caps {
        let (w, b) = bit(c);
        changed |= d[w].effective & b != 0;
        d[w].effective &= !b;
    }
    if changed {
        capset(&d)?;
    }
    Ok(())
}

/// Gives up `caps` for good: from the bounding set (so no exec regains them), and from this
/// thread's effective, permitted and inheritable sets. Threads started afterwards inherit the
/// result; call it before starting any. Capabilities the process does not have are skipped.
pub fn drop_for_good(caps: &[u32]) -> io::Result<()> {
    for &c in caps {
        // SAFETY: prctl(PR_CAPBSET_DROP, cap): fails with EPERM without CAP_SETPCAP and with
        // EINVAL for a capability this kernel does not know; either leaves nothing to drop.
        unsafe { libc::prctl(libc::PR_CAPBSET_DROP, c as libc::c_ulong, 0, 0, 0) };
    }
    let mut d = capget()?;
    for &c in caps {
        let (w, b) = bit(c);
        d[w].effective &= !b;
        d[w].permitted &= !b;
        d[w].inheritable &= !b;
    }
    capset(&d)
}

fn setfsuid(uid: u32) -> u32 {
    // SAFETY: setfsuid(2) changes only this thread's filesystem uid (or nothing, if not
    // permitted) and returns the previous one.
    unsafe { libc::syscall(libc::SYS_setfsuid, uid) as u32 }
}

fn setfsgid(gid: u32) -> u32 {
    // SAFETY: as setfsuid, for the filesystem gid.
    unsafe { libc::syscall(libc::SYS_setfsgid, gid) as u32 }
}

/// Adds `cap` to the calling thread's effective set, if it is permitted.
fn raise_effective(cap: u32) -> io::Result<()> {
    let mut d = capget()?;
    let (w, b) = bit(cap);
    if d[w].permitted & b != 0 && d[w].effective & b == 0 {
        d[w].effective |= b;
        capset(&d)?;
    }
    Ok(())
}

thread_local! {
    /// Whether `CAP_SYS_PTRACE` was last made effective (`Some(true)`) or not on this thread
    /// by [`ptrace_effective`]; `None`: not known.
    static PTRACE_ON: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Makes `CAP_SYS_PTRACE` effective on the calling thread (if permitted) or not, skipping the
/// system calls when this thread already is in that state. Every access to a host's memory
/// sets the state it needs first, so no access inherits another's.
pub fn ptrace_effective(on: bool) -> io::Result<()> {
    if PTRACE_ON.get() == Some(on) {
        return Ok(());
    }
    if on {
        raise_effective(CAP_SYS_PTRACE)?;
    } else {
        drop_effective(&[CAP_SYS_PTRACE])?;
    }
    PTRACE_ON.set(Some(on));
    Ok(())
}

/// Whether the calling thread, as it is, has exactly the client's rights over the client's
/// processes, so that `process_vm_readv`/`writev` (which the kernel judges by the thread's
/// real ids and its capabilities, at each call) may stand for the client: the client is root
/// (with `CAP_SYS_PTRACE` raised, as root could trace anything), or the process runs as the
/// client's own uid and gid (an SP a user started for its own jobs; it holds no
/// `CAP_SYS_PTRACE`). Otherwise (a root SP serving another user) the memory is reached only
/// through the descriptor opened as the client.
pub fn acts_as(uid: u32, gid: u32) -> bool {
    // The process's real ids never change (only threads' filesystem ids do): read them once,
    // not at every copy.
    static REAL: std::sync::OnceLock<(u32, u32)> = std::sync::OnceLock::new();
    // SAFETY: getuid/getgid have no preconditions.
    uid == 0 || *REAL.get_or_init(|| unsafe { (libc::getuid(), libc::getgid()) }) == (uid, gid)
}

/// Runs `f` with the calling thread's filesystem ids set to `uid` and `gid` and without
/// `CAP_SYS_PTRACE` (with it, if permitted, for a root client: `uid` 0), then gives the
/// thread its ids back and leaves `CAP_SYS_PTRACE` out of its effective set. If the thread
/// cannot take those ids (an SP not running as root, asked to act for another user or
/// group), `f` does not run and the error says so (`EPERM`).
pub fn with_fs_ids<R>(uid: u32, gid: u32, f: impl FnOnce() -> io::Result<R>) -> io::Result<R> {
    ptrace_effective(uid == 0)?;
    let result = with_fs_ids_as_is(uid, gid, f);
    ptrace_effective(false)?;
    result
}

fn with_fs_ids_as_is<R>(uid: u32, gid: u32, f: impl FnOnce() -> io::Result<R>) -> io::Result<R> {
    let prev_gid = setfsgid(gid);
    let prev_uid = setfsuid(uid);
    // With an invalid id (-1) each call changes nothing and answers the current one.
    let (now_uid, now_gid) = (setfsuid(u32::MAX), setfsgid(u32::MAX));
    let result = if now_uid == uid && now_gid == gid {
        f()
    } else {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "this SP (filesystem uid {prev_uid} gid {prev_gid}) cannot act as uid {uid} \
                 gid {gid}: run it as that user or as root"
            ),
        ))
    };
    setfsuid(prev_uid);
    setfsgid(prev_gid);
    result
}

/// This thread's filesystem ids (for tests and logs).
pub fn fs_ids() -> (u32, u32) {
    (setfsuid(u32::MAX), setfsgid(u32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ids_come_back_and_ptrace_is_not_effective_inside() {
        let before = fs_ids();
        // SAFETY: geteuid/getegid have no preconditions.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let inside = std::thread::spawn(move || {
            with_fs_ids(uid, gid, || Ok((fs_ids(), has_effective(CAP_SYS_PTRACE)?))).unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(inside.0, (uid, gid));
        if uid != 0 {
            assert!(!inside.1, "CAP_SYS_PTRACE stayed effective");
        }
        assert_eq!(fs_ids(), before);
        if uid == 0 {
            // Root may act as anyone; another thread's ids are untouched meanwhile.
            let other = std::thread::spawn(|| {
                with_fs_ids(65534, 65534, || {
                    let me = fs_ids();
                    let main_thread = std::fs::read_to_string("/proc/self/status").unwrap();
                    Ok((me, main_thread))
                })
                .unwrap()
            })
            .join()
            .unwrap();
            assert_eq!(other.0, (65534, 65534));
            let ptrace_inside = std::thread::spawn(|| {
                with_fs_ids(65534, 65534, || has_effective(CAP_SYS_PTRACE)).unwrap()
            });
            assert!(
                !ptrace_inside.join().unwrap(),
                "CAP_SYS_PTRACE stayed effective"
            );
            let fs_line = other.1.lines().find(|l| l.starts_with("Uid:")).unwrap();
            assert!(
                fs_line.ends_with("\t0"),
                "the process's fsuid changed: {fs_line}"
            );
        } else {
            let err = with_fs_ids(uid ^ 1, gid, || Ok(())).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
            assert_eq!(fs_ids(), before);
        }
    }
}
