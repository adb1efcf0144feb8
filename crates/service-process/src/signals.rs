//! SIGINT/SIGTERM as an event of the loop: the handler only writes a byte to a pipe (which is
//! async-signal-safe); the loop reads the pipe like any other source.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI32, AtomicPtr, Ordering};

static WRITE_FD: AtomicI32 = AtomicI32::new(-1);
/// A path the handler removes itself ([`unlink_on_signal`]); null: none.
static UNLINK: AtomicPtr<libc::c_char> = AtomicPtr::new(std::ptr::null_mut());

/// Has the handler remove `path` (an SP's host socket) at the signal itself, before the loop
/// even sees it: unlink(2) is async-signal-safe, and a launcher that SIGKILLs right after its
/// signal (`srun` on a second Ctrl-C sends SIGINT and SIGKILL at once) must not leave the
/// socket behind. Call it once the path is bound.
pub fn unlink_on_signal(path: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt;
    if let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) {
        // Leaked on purpose: the handler may read it until the process ends. Set once per
        // process (an earlier one is leaked too, never freed under the handler).
        UNLINK.store(c.into_raw(), Ordering::Release);
    }
}

extern "C" fn on_signal(_: libc::c_int) {
    let path = UNLINK.load(Ordering::Acquire);
    if !path.is_null() {
        // SAFETY: unlink(2) is async-signal-safe; `path` is a leaked, NUL-terminated CString.
        unsafe { libc::unlink(path) };
    }
    let fd = WRITE_FD.load(Ordering::Relaxed);
    if fd >= 0 {
        let b = 1u8;
        // SAFETY: write(2) is async-signal-safe; the buffer is a valid byte.
        unsafe { libc::write(fd, (&b as *const u8).cast(), 1) };
    }
}

pub struct SignalPipe {
    read_fd: RawFd,
}

impl SignalPipe {
    /// Installs handlers for SIGINT and SIGTERM. One per process.
    pub fn install() -> io::Result<SignalPipe> {
        let mut fds = [0; 2];
        // SAFETY: `fds` is valid for two ints.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        WRITE_FD.store(fds[1], Ordering::Relaxed);
        for sig in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: a zeroed sigaction with a plain handler is valid; the handler only calls
            // async-signal-safe functions.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as *const () as usize;
                sa.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut sa.sa_mask);
                if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
        }
        Ok(SignalPipe { read_fd: fds[0] })
    }

    pub fn source(&self) -> mio::unix::SourceFd<'_> {
        mio::unix::SourceFd(&self.read_fd)
    }

    /// Empties the pipe; true if a signal arrived.
    pub fn drain(&mut self) -> bool {
        let mut got = false;
        let mut buf = [0u8; 64];
        loop {
            // SAFETY: `buf` is valid for writes of its length.
            let n = unsafe { libc::read(self.read_fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                return got;
            }
            got = true;
        }
    }
}
