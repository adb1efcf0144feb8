//! Moving bytes between granted regions.
//!
//! A [`Mover`] performs what an SP's datapath does with alias keys: read a source region,
//! write a destination region, or copy between two regions of two other processes (the RDMA read
//! from one host into another). Every call checks both keys first; a refused access touches
//! nothing. A copy that fails half way (the owner died, the memory was unmapped) may have written
//! part of the destination; it returns the error and the caller fails the collective.
//!
//! [`CmaMover`] is the commodity backend: a read of the source process's memory into a
//! bounded staging buffer, then a write into the destination process, one chunk at a time,
//! through each process's `/proc/PID/mem` opened **as its client** ([`crate::process`],
//! [`crate::ids`]): the kernel lets the SP reach exactly what the client's user could reach
//! with `ptrace`, and nothing of an image the process left by `exec`. The kernel must allow
//! that user to attach to the hosts (same user with Yama
//! `ptrace_scope` 0, or the host calls `prctl(PR_SET_PTRACER, ...)`, or root).
//!
//! [`UcxMover`] (cargo feature `ucx`) does the same through UCX get/put on regions a host
//! granted with [`crate::host::UcxRegistrar`]; see [its module](ucx) for the transports that
//! work here and what the host must do (progress).
//!
//! [`ExportMover`] (cargo feature `ucx`, UCX >= 1.15 at build time) is the BlueField alias-key
//! path: it imports the exported memory handle of a `ucx-export` grant and reaches the host's
//! memory through it (see [its module](export)).
//!
//! [`DynMover`] serves every kind of grant: it dispatches each access to the mover of the
//! key's backend, and stages copies between grants of two backends through its own bounded
//! buffer. Build it from a [`MoverConfig`]; `cma` alone is the default.

use crate::{AccessError, AliasKey, BackendData, Owner, Rights};
use std::os::fd::AsRawFd;

#[cfg(feature = "ucx")]
pub mod ucx;
#[cfg(feature = "ucx")]
pub use ucx::{ErrorHandling, UcxMover, UcxMoverConfig, UcxMoverStats};
#[cfg(feature = "ucx")]
pub mod export;
#[cfg(feature = "ucx")]
pub use export::{ExportMover, ExportMoverConfig, ExportMoverStats};

/// Length from which a kernel copy ([`crate::copy::slow_offset`]) between an SP's own memory
/// and a process's goes through the bounce buffer instead (the same one system call, and a
/// copy in this process of a few ns at this size). Measured here (`copy_offsets`): the slow
/// case costs a `process_vm_readv` 0.24 us more at 256 B, 0.46 us at 1 KiB, 1.4 us at 4 KiB.
const SLOW_KERNEL_COPY_FROM: u64 = 256;

/// Default staging chunk per copy in flight.
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 20;

pub trait Mover {
    /// Copies `len` bytes from `src` at `src_offset` to `dst` at `dst_offset`.
    fn copy(
        &mut self,
        src: &AliasKey,
        src_offset: u64,
        dst: &AliasKey,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), AccessError>;
    /// Writes `data` into `dst` at `offset`.
    fn write(&mut self, dst: &AliasKey, offset: u64, data: &[u8]) -> Result<(), AccessError>;
    /// Reads `out.len()` bytes of `src` at `offset`.
    fn read(&mut self, src: &AliasKey, offset: u64, out: &mut [u8]) -> Result<(), AccessError>;
}

/// Cross-memory-attach mover with one staging buffer of `chunk_bytes`.
pub struct CmaMover {
    /// Page-aligned, with room to place each chunk where neither of its two copies is a slow
    /// one ([`crate::copy::bounce_at`]).
    staging: crate::copy::BounceBuf,
    /// This process's pid, read once (`getpid` is a system call, and a copy asks it).
    me: u32,
}

impl CmaMover {
    pub fn new(chunk_bytes: usize) -> Self {
        CmaMover {
            staging: crate::copy::BounceBuf::new(chunk_bytes.max(4096)),
            me: std::process::id(),
        }
    }
}

impl Default for CmaMover {
    fn default() -> Self {
        Self::new(DEFAULT_CHUNK_BYTES)
    }
}

impl CmaMover {
    /// Writes `first` at `first_offset` of `dst`, then `then` at `then_offset`, in that order:
    /// `then` lands only once `first` is whole (a completion's status, then its token). Where
    /// `process_vm_writev` may stand for the client ([`crate::ids::acts_as`]), one process check
    /// and one call with two remote pieces, which the kernel copies in order; otherwise (or if
    /// that call moved less than both) two writes.
    pub fn write_then(
        &mut self,
        dst: &AliasKey,
        first_offset: u64,
        first: &[u8],
        then_offset: u64,
        then: &[u8],
    ) -> Result<(), AccessError> {
        require_cma(dst)?;
        let a = dst.check(first_offset, first.len() as u64, Rights::WRITE)?;
        let b = dst.check(then_offset, then.len() as u64, Rights::WRITE)?;
        let owner = &dst.owner;
        if crate::ids::acts_as(owner.uid, owner.gid) {
            crate::process::check(owner)?;
            crate::ids::ptrace_effective(owner.uid == 0).map_err(|e| AccessError::Os {
                op: "capset",
                pid: owner.pid,
                errno: e.raw_os_error().unwrap_or(0),
            })?;
            let iov = |p: *const u8, len: usize| libc::iovec {
                iov_base: p as *mut libc::c_void,
                iov_len: len,
            };
            let local = [
                iov(first.as_ptr(), first.len()),
                iov(then.as_ptr(), then.len()),
            ];
            let remote = [
                iov(a as *const u8, first.len()),
                iov(b as *const u8, then.len()),
            ];
            // SAFETY: the local pieces are the two slices, which the kernel only reads; the
            // remote addresses are only interpreted by the kernel in the other process.
            let n = unsafe {
                libc::process_vm_writev(
                    owner.pid as libc::pid_t,
                    local.as_ptr(),
                    2,
                    remote.as_ptr(),
                    2,
                    0,
                )
            };
            if n >= 0 && n as usize == first.len() + then.len() {
                return Ok(());
            }
        }
        vm_write(owner, a, first)?;
        vm_write(owner, b, then)
    }
}

fn require_cma(key: &AliasKey) -> Result<(), AccessError> {
    match key.grant.backend {
        BackendData::Cma => Ok(()),
        BackendData::Ucx { .. } => Err(AccessError::Unsupported("ucx (in the cma mover)")),
        BackendData::UcxExport { .. } => {
            Err(AccessError::Unsupported("ucx-export (in the cma mover)"))
        }
    }
}

/// Which way a cross-memory-attach transfer goes.
#[derive(Clone, Copy)]
enum Direction {
    /// From the other process into the local buffer.
    Read,
    /// From the local buffer into the other process.
    Write,
}

/// Moves `len` bytes between `local` in this process and `addr` in the owner's process,
/// looping over partial transfers: through the owner's `/proc/PID/mem` as its client opened
/// it ([`crate::process`]), never with the SP's own rights, never into another image; or, where
/// this thread has exactly the client's rights ([`crate::ids::acts_as`]: a root client, or an
/// SP running as the client's uid and gid), with `process_vm_readv`/`writev`, which the kernel
/// judges at each call by those rights and which copy once where `/proc/PID/mem` bounces every
/// page through the kernel (about half the bandwidth at 1 MiB and above).
///
/// # Safety
/// `local` must be valid for `len` bytes: for writes into it when `dir` is `Read`, for reads
/// when `dir` is `Write`.
unsafe fn vm_transfer(
    dir: Direction,
    owner: &Owner,
    addr: u64,
    local: *mut u8,
    len: usize,
) -> Result<(), AccessError> {
    // The process the key was made for, still alive, opened as its client.
    let pinned = crate::process::check(owner)?;
    // SAFETY: forwarded.
    unsafe { vm_transfer_pinned(dir, owner, &pinned, addr, local, len) }
}

/// [`vm_transfer`] with `owner`'s process just checked ([`crate::process::check`]) by the caller.
///
/// # Safety
/// As for [`vm_transfer`].
unsafe fn vm_transfer_pinned(
    dir: Direction,
    owner: &Owner,
    pinned: &crate::process::Pinned,
    addr: u64,
    local: *mut u8,
    len: usize,
) -> Result<(), AccessError> {
    let pid = owner.pid as libc::pid_t;
    let direct = crate::ids::acts_as(owner.uid, owner.gid);
    let fd = pinned.mem().as_raw_fd();
    let op = match (direct, dir) {
        (true, Direction::Read) => "process_vm_readv",
        (true, Direction::Write) => "process_vm_writev",
        (false, Direction::Read) => "read of /proc/PID/mem",
        (false, Direction::Write) => "write of /proc/PID/mem",
    };
    if direct {
        crate::ids::ptrace_effective(owner.uid == 0).map_err(|e| AccessError::Os {
            op: "capset",
            pid: owner.pid,
            errno: e.raw_os_error().unwrap_or(0),
        })?;
    }
    let mut done = 0usize;
    while done < len {
        // SAFETY: `done < len`, inside the caller's buffer.
        let here = unsafe { local.add(done) };
        let (left, at) = (len - done, addr + done as u64);
        let local_iov = libc::iovec {
            iov_base: here.cast(),
            iov_len: left,
        };
        let remote_iov = libc::iovec {
            iov_base: at as *mut libc::c_void,
            iov_len: left,
        };
        // SAFETY: the local range lies in the caller's buffer, valid as the contract says; the
        // remote address is only interpreted by the kernel in the other process.
        let n = unsafe {
            match (direct, dir) {
                (true, Direction::Read) => {
                    libc::process_vm_readv(pid, &local_iov, 1, &remote_iov, 1, 0)
                }
                (true, Direction::Write) => {
                    libc::process_vm_writev(pid, &local_iov, 1, &remote_iov, 1, 0)
                }
                (false, Direction::Read) => libc::pread(fd, here.cast(), left, at as libc::off_t),
                (false, Direction::Write) => libc::pwrite(fd, here.cast(), left, at as libc::off_t),
            }
        };
        if n < 0 {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            return Err(AccessError::Os {
                op,
                pid: owner.pid,
                errno,
            });
        }
        if n == 0 {
            // `/proc/PID/mem` moves nothing once the image it was opened on is gone (an
            // unmapped address is EIO instead); `process_vm_*` never answers 0 for a length.
            return Err(if direct {
                AccessError::Os {
                    op,
                    pid: owner.pid,
                    errno: libc::EFAULT,
                }
            } else if crate::process::alive_pid(owner) {
                AccessError::ImageChanged { pid: owner.pid }
            } else {
                AccessError::ProcessGone { pid: owner.pid }
            });
        }
        done += n as usize;
    }
    Ok(())
}

/// Reads `out.len()` bytes at `addr` of `owner`'s process.
fn vm_read(owner: &Owner, addr: u64, out: &mut [u8]) -> Result<(), AccessError> {
    // SAFETY: `out` is valid for writes of its length.
    unsafe { vm_transfer(Direction::Read, owner, addr, out.as_mut_ptr(), out.len()) }
}

/// Writes `data` at `addr` of `owner`'s process.
fn vm_write(owner: &Owner, addr: u64, data: &[u8]) -> Result<(), AccessError> {
    // SAFETY: `data` is valid for reads of its length; the kernel only reads it.
    unsafe {
        vm_transfer(
            Direction::Write,
            owner,
            addr,
            data.as_ptr() as *mut u8,
            data.len(),
        )
    }
}

impl Mover for CmaMover {
    fn copy(
        &mut self,
        src: &AliasKey,
        src_offset: u64,
        dst: &AliasKey,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), AccessError> {
        require_cma(src)?;
        require_cma(dst)?;
        let src_addr = src.check(src_offset, len, Rights::READ)?;
        let dst_addr = dst.check(dst_offset, len, Rights::WRITE)?;
        // One end in this process (an SP's own staging memory): one transfer, no bounce,
        // unless the two addresses make the kernel's copy a slow one ([`crate::copy`]): then
        // through the bounce buffer at an offset where it is not, and a copy in this process
        // that does not care. The owner pid of a key comes from the kernel (the host
        // connection's peer credentials) or from this process itself, so a key naming this
        // pid describes this process's memory.
        let me = self.me;
        let slow = len > SLOW_KERNEL_COPY_FROM
            && crate::copy::slow_offset(src_addr as usize, dst_addr as usize);
        if dst.owner.pid == me && !slow {
            // SAFETY: [dst_addr, +len) is this process's memory that the key grants for writing.
            return unsafe {
                vm_transfer(
                    Direction::Read,
                    &src.owner,
                    src_addr,
                    dst_addr as *mut u8,
                    len as usize,
                )
            };
        }
        if src.owner.pid == me && !slow {
            // SAFETY: [src_addr, +len) is this process's memory that the key grants for
            // reading; the kernel only reads it.
            return unsafe {
                vm_transfer(
                    Direction::Write,
                    &dst.owner,
                    dst_addr,
                    src_addr as *mut u8,
                    len as usize,
                )
            };
        }
        let mut moved = 0u64;
        while moved < len {
            let n = (len - moved).min(self.staging.len() as u64) as usize;
            let (s, d) = ((src_addr + moved) as usize, (dst_addr + moved) as usize);
            let chunk = self.staging.at(crate::copy::bounce_at(s, d), n);
            // In this process: a plain copy into or out of the bounce buffer.
            let (src_here, dst_here) = (src.owner.pid == me, dst.owner.pid == me);
            // Each end's process checked before each chunk; one check when both ends are the
            // same process (a rank copying between its own buffers): a poll fewer per chunk.
            let mut ps = None;
            if src_here {
                // SAFETY: [s, +n) is this process's memory that the key grants for reading,
                // and the bounce buffer is this mover's own.
                unsafe { crate::copy::copy_bytes(s as *const u8, chunk.as_mut_ptr(), n) };
            } else {
                let pinned = ps.insert(crate::process::check(&src.owner)?);
                // SAFETY: `chunk` is valid for writes of its length.
                unsafe {
                    vm_transfer_pinned(
                        Direction::Read,
                        &src.owner,
                        pinned,
                        s as u64,
                        chunk.as_mut_ptr(),
                        n,
                    )?
                };
            }
            if dst_here {
                // SAFETY: [d, +n) is this process's memory that the key grants for writing.
                unsafe { crate::copy::copy_bytes(chunk.as_ptr(), d as *mut u8, n) };
            } else {
                let pd = match ps {
                    Some(ps) if dst.owner == src.owner => ps,
                    _ => crate::process::check(&dst.owner)?,
                };
                // SAFETY: `chunk` is valid for reads of its length.
                unsafe {
                    vm_transfer_pinned(
                        Direction::Write,
                        &dst.owner,
                        &pd,
                        d as u64,
                        chunk.as_mut_ptr(),
                        n,
                    )?
                };
            }
            moved += n as u64;
        }
        Ok(())
    }

    fn write(&mut self, dst: &AliasKey, offset: u64, data: &[u8]) -> Result<(), AccessError> {
        require_cma(dst)?;
        let addr = dst.check(offset, data.len() as u64, Rights::WRITE)?;
        vm_write(&dst.owner, addr, data)
    }

    fn read(&mut self, src: &AliasKey, offset: u64, out: &mut [u8]) -> Result<(), AccessError> {
        require_cma(src)?;
        let addr = src.check(offset, out.len() as u64, Rights::READ)?;
        vm_read(&src.owner, addr, out)
    }
}

/// How an SP builds its [`DynMover`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoverConfig {
    /// Staging buffer size of each mover (and of mixed-backend copies).
    pub chunk_bytes: usize,
    /// Also serve `ucx` grants (needs the `ucx` feature; the UCX context is configured from
    /// the environment, `UCX_TLS` included). Off by default: `cma` only.
    pub ucx: bool,
    /// Also serve `ucx-export` grants (needs the `ucx` feature and UCX >= 1.15 at build time;
    /// the [`ExportMover`] is created on the first such grant, and if it cannot be, every such
    /// access fails with the reason). Off by default.
    pub ucx_export: bool,
}

impl Default for MoverConfig {
    fn default() -> Self {
        MoverConfig {
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            ucx: false,
            ucx_export: false,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Cma,
    Ucx,
    UcxExport,
}

fn kind(key: &AliasKey) -> Kind {
    match key.grant.backend {
        BackendData::Cma => Kind::Cma,
        BackendData::Ucx { .. } => Kind::Ucx,
        BackendData::UcxExport { .. } => Kind::UcxExport,
    }
}

/// The [`DynMover`]'s `ucx-export` mover, made on first use.
#[cfg(feature = "ucx")]
enum ExportSlot {
    Off,
    Unmade,
    Made(Box<ExportMover>),
    Failed(AccessError),
}

const EXPORT_OFF: AccessError = AccessError::Unsupported(if cfg!(feature = "ucx") {
    "ucx-export (not enabled in this mover's config)"
} else {
    "ucx-export (alias-mkey built without the `ucx` feature)"
});

/// A mover for every kind of grant: `cma` keys go to a [`CmaMover`], `ucx` keys to a
/// [`UcxMover`] (if enabled), and a copy between a `cma` and a `ucx` key is staged through a
/// buffer of `chunk_bytes`. With `ucx` enabled it is `!Send`: create it on its datapath thread.
pub struct DynMover {
    cma: CmaMover,
    #[cfg(feature = "ucx")]
    ucx: Option<UcxMover>,
    #[cfg(feature = "ucx")]
    export: ExportSlot,
    chunk_bytes: usize,
    /// For mixed copies only; allocated on first use.
    staging: Vec<u8>,
}

const UCX_OFF: AccessError = AccessError::Unsupported(if cfg!(feature = "ucx") {
    "ucx (not enabled in this mover's config)"
} else {
    "ucx (alias-mkey built without the `ucx` feature)"
});

impl DynMover {
    /// Builds the movers `cfg` asks for. Fails only if `ucx` is requested and UCX cannot be
    /// initialised (or is not built in).
    pub fn new(cfg: &MoverConfig) -> Result<Self, AccessError> {
        let chunk_bytes = cfg.chunk_bytes.max(4096);
        #[cfg(feature = "ucx")]
        {
            let ucx = if cfg.ucx {
                Some(UcxMover::new(UcxMoverConfig {
                    chunk_bytes,
                    ..Default::default()
                })?)
            } else {
                None
            };
            Ok(DynMover {
                cma: CmaMover::new(chunk_bytes),
                ucx,
                export: if cfg.ucx_export {
                    ExportSlot::Unmade
                } else {
                    ExportSlot::Off
                },
                chunk_bytes,
                staging: Vec::new(),
            })
        }
        #[cfg(not(feature = "ucx"))]
        {
            if cfg.ucx {
                return Err(UCX_OFF);
            }
            if cfg.ucx_export {
                return Err(EXPORT_OFF);
            }
            Ok(DynMover {
                cma: CmaMover::new(chunk_bytes),
                chunk_bytes,
                staging: Vec::new(),
            })
        }
    }

    /// A dispatcher over movers built by the caller (e.g. a [`UcxMover`] with its own timeout
    /// or transports).
    #[cfg(feature = "ucx")]
    pub fn with_movers(cma: CmaMover, ucx: Option<UcxMover>, chunk_bytes: usize) -> Self {
        DynMover {
            cma,
            ucx,
            export: ExportSlot::Off,
            chunk_bytes: chunk_bytes.max(4096),
            staging: Vec::new(),
        }
    }

    /// The `ucx-export` mover, made now if enabled and not yet made.
    #[cfg(feature = "ucx")]
    fn export_mover(&mut self) -> Result<&mut ExportMover, AccessError> {
        if matches!(self.export, ExportSlot::Unmade) {
            self.export = match ExportMover::new(ExportMoverConfig {
                chunk_bytes: self.chunk_bytes,
                ..Default::default()
            }) {
                Ok(m) => ExportSlot::Made(Box::new(m)),
                Err(e) => ExportSlot::Failed(e),
            };
        }
        match &mut self.export {
            ExportSlot::Made(m) => Ok(m),
            ExportSlot::Failed(e) => Err(e.clone()),
            ExportSlot::Off | ExportSlot::Unmade => Err(EXPORT_OFF),
        }
    }

    /// Closes the UCX endpoints whose owner `pred` selects ([`UcxMover::close_endpoints`]);
    /// how many.
    pub fn close_endpoints(&mut self, pred: impl Fn(&Owner) -> bool) -> u64 {
        #[cfg(feature = "ucx")]
        if let Some(u) = &mut self.ucx {
            return u.close_endpoints(pred);
        }
        let _ = pred;
        0
    }

    /// The `ucx` mover, if enabled (for stats and [`UcxMover::note_generation`]).
    #[cfg(feature = "ucx")]
    pub fn ucx(&mut self) -> Option<&mut UcxMover> {
        self.ucx.as_mut()
    }

    /// Every check of `key` that moves nothing, with the mover of its backend.
    fn precheck(
        &mut self,
        key: &AliasKey,
        offset: u64,
        len: u64,
        need: Rights,
    ) -> Result<(), AccessError> {
        match kind(key) {
            Kind::Cma => key.check(offset, len, need).map(drop),
            #[cfg(feature = "ucx")]
            Kind::Ucx => match &self.ucx {
                Some(u) => u.precheck(key, offset, len, need).map(drop),
                None => Err(UCX_OFF),
            },
            #[cfg(not(feature = "ucx"))]
            Kind::Ucx => Err(UCX_OFF),
            #[cfg(feature = "ucx")]
            Kind::UcxExport => self
                .export_mover()?
                .precheck(key, offset, len, need)
                .map(drop),
            #[cfg(not(feature = "ucx"))]
            Kind::UcxExport => Err(EXPORT_OFF),
        }
    }

    fn mover(&mut self, k: Kind) -> Result<&mut dyn Mover, AccessError> {
        match k {
            Kind::Cma => Ok(&mut self.cma),
            #[cfg(feature = "ucx")]
            Kind::Ucx => match &mut self.ucx {
                Some(u) => Ok(u),
                None => Err(UCX_OFF),
            },
            #[cfg(not(feature = "ucx"))]
            Kind::Ucx => Err(UCX_OFF),
            #[cfg(feature = "ucx")]
            Kind::UcxExport => Ok(self.export_mover()?),
            #[cfg(not(feature = "ucx"))]
            Kind::UcxExport => Err(EXPORT_OFF),
        }
    }
}

impl Mover for DynMover {
    fn copy(
        &mut self,
        src: &AliasKey,
        src_offset: u64,
        dst: &AliasKey,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), AccessError> {
        let (ks, kd) = (kind(src), kind(dst));
        if ks == kd {
            return self.mover(ks)?.copy(src, src_offset, dst, dst_offset, len);
        }
        // Mixed backends: check both sides before moving anything, then stage.
        self.precheck(src, src_offset, len, Rights::READ)?;
        self.precheck(dst, dst_offset, len, Rights::WRITE)?;
        let mut staging = std::mem::take(&mut self.staging);
        staging.resize(self.chunk_bytes, 0);
        let mut moved = 0u64;
        let result = loop {
            if moved >= len {
                break Ok(());
            }
            let n = (len - moved).min(staging.len() as u64) as usize;
            let chunk = &mut staging[..n];
            if let Err(e) = self
                .mover(ks)
                .and_then(|m| m.read(src, src_offset + moved, chunk))
            {
                break Err(e);
            }
            if let Err(e) = self
                .mover(kd)
                .and_then(|m| m.write(dst, dst_offset + moved, chunk))
            {
                break Err(e);
            }
            moved += n as u64;
        };
        self.staging = staging;
        result
    }

    fn write(&mut self, dst: &AliasKey, offset: u64, data: &[u8]) -> Result<(), AccessError> {
        self.mover(kind(dst))?.write(dst, offset, data)
    }

    fn read(&mut self, src: &AliasKey, offset: u64, out: &mut [u8]) -> Result<(), AccessError> {
        self.mover(kind(src))?.read(src, offset, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Grant, Owner};

    fn key_for(buf: &[u8], rights: Rights) -> AliasKey {
        AliasKey {
            owner: Owner {
                job: 1,
                world_rank: 0,
                pid: std::process::id(),
                start: crate::process::start_time(std::process::id()).unwrap(),
                // SAFETY: geteuid/getegid have no preconditions.
                uid: unsafe { libc::geteuid() },
                gid: unsafe { libc::getegid() },
            },
            grant: Grant {
                region: 1,
                generation: 0,
                addr: buf.as_ptr() as u64,
                len: buf.len() as u64,
                rights,
                backend: BackendData::Cma,
            },
        }
    }

    #[test]
    fn copy_with_one_end_in_this_process_moves_the_bytes() {
        // Both keys name this process, so the copy takes the one-transfer path (the bounce
        // through the staging buffer runs between two other processes: the SP engine tests).
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let dst = vec![0u8; 20_000];
        let (ks, kd) = (key_for(&src, Rights::READ), key_for(&dst, Rights::WRITE));
        let mut m = CmaMover::new(4096);
        m.copy(&ks, 100, &kd, 50, 15_000).unwrap();
        // SAFETY-free check: the kernel wrote `dst` behind the compiler's back, so read it
        // through a volatile copy.
        let seen: Vec<u8> = dst
            .iter()
            .map(|b| unsafe { std::ptr::read_volatile(b) })
            .collect();
        assert_eq!(&seen[50..15_050], &src[100..15_100]);
        assert!(seen[..50].iter().all(|&b| b == 0));
        assert!(seen[15_050..].iter().all(|&b| b == 0));
    }

    #[test]
    fn copies_at_every_offset_land_exactly_through_the_kernel_and_the_bounce() {
        // A forked child holds a patterned buffer (at the same address as here); copies go
        // from it into this process, from here into it, and within it (both ends another
        // process: the bounce), at random offsets, so that many fall in the slow case of
        // `crate::copy` and take the bounce at a shifted offset. Seed printed.
        let mut next = crate::copy::random_numbers();
        const N: usize = 40_000;
        let theirs: Vec<u8> = (0..N).map(|i| (i * 31 % 253) as u8).collect();
        let mut fds = [0; 2];
        // SAFETY: `fds` holds two ints for pipe(2).
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child only blocks in read(2) on the pipe and then _exits, both
        // async-signal-safe, so forking this multi-threaded test process is sound.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let mut b = [0u8; 1];
            unsafe {
                libc::read(fds[0], b.as_mut_ptr().cast(), 1);
                libc::_exit(0);
            }
        }
        assert!(pid > 0);
        // Killed and reaped however the test ends (a panic included: the child holds the
        // harness's output pipe open).
        struct Reap(libc::pid_t, [libc::c_int; 2]);
        impl Drop for Reap {
            fn drop(&mut self) {
                // SAFETY: kill and waitpid of our own child, then close of our pipe's ends.
                unsafe {
                    libc::kill(self.0, libc::SIGKILL);
                    libc::waitpid(self.0, std::ptr::null_mut(), 0);
                    libc::close(self.1[0]);
                    libc::close(self.1[1]);
                }
            }
        }
        let _reap = Reap(pid, fds);
        let mut child_key = key_for(&theirs, Rights::READ_WRITE);
        child_key.owner.pid = pid as u32;
        child_key.owner.start = crate::process::start_time(pid as u32).unwrap();
        let mut m = CmaMover::new(8192);
        let mut model = theirs.clone();
        for round in 0..120 {
            let len = [0, 1, 100, 1025, 4096, 5000, 8192, 8193, 20_000][next() as usize % 9];
            let (so, d_o) = (next() as usize % (N - len), next() as usize % (N - len));
            let mine: Vec<u8> = (0..N).map(|_| next() as u8).collect();
            let mut seen = vec![0u8; N];
            match round % 3 {
                0 => {
                    // Theirs into mine.
                    let kd = key_for(&seen, Rights::WRITE);
                    m.copy(&child_key, so as u64, &kd, d_o as u64, len as u64)
                        .unwrap();
                    let got: Vec<u8> = seen
                        .iter()
                        .map(|b| unsafe { std::ptr::read_volatile(b) })
                        .collect();
                    assert_eq!(
                        &got[d_o..d_o + len],
                        &model[so..so + len],
                        "in {len} {so}->{d_o}"
                    );
                    assert!(got[..d_o].iter().chain(&got[d_o + len..]).all(|&b| b == 0));
                    continue;
                }
                1 => {
                    // Mine into theirs.
                    let ks = key_for(&mine, Rights::READ);
                    m.copy(&ks, so as u64, &child_key, d_o as u64, len as u64)
                        .unwrap();
                    model[d_o..d_o + len].copy_from_slice(&mine[so..so + len]);
                }
                _ => {
                    // Within theirs (ranges apart: the copy is between two regions).
                    if so.abs_diff(d_o) < len {
                        continue;
                    }
                    m.copy(&child_key, so as u64, &child_key, d_o as u64, len as u64)
                        .unwrap();
                    model.copy_within(so..so + len, d_o);
                }
            }
            m.read(&child_key, 0, &mut seen).unwrap();
            assert_eq!(seen, model, "round {round}: {len} bytes {so}->{d_o}");
        }
    }

    #[test]
    fn write_then_lands_both_pieces_and_refuses_out_of_range_whole() {
        let dst = vec![0u8; 64];
        let kd = key_for(&dst, Rights::WRITE);
        let mut m = CmaMover::default();
        let head: Vec<u8> = (1..=48).collect();
        m.write_then(&kd, 8, &head, 0, &[0xaa; 8]).unwrap();
        let seen: Vec<u8> = dst
            .iter()
            .map(|b| unsafe { std::ptr::read_volatile(b) })
            .collect();
        assert_eq!(&seen[..8], &[0xaa; 8]);
        assert_eq!(&seen[8..56], &head[..]);
        assert!(seen[56..].iter().all(|&b| b == 0));
        // The second piece out of range: nothing is written, not even the first.
        let before = seen.clone();
        assert!(matches!(
            m.write_then(&kd, 0, &[7; 8], 60, &[7; 8]),
            Err(AccessError::OutOfRange { .. })
        ));
        let after: Vec<u8> = dst
            .iter()
            .map(|b| unsafe { std::ptr::read_volatile(b) })
            .collect();
        assert_eq!(after, before);
    }

    #[test]
    fn refused_access_touches_nothing() {
        let src = vec![9u8; 64];
        let dst = vec![0u8; 64];
        let mut m = CmaMover::default();
        let ks = key_for(&src, Rights::READ);
        let kd = key_for(&dst, Rights::WRITE);
        assert!(matches!(
            m.copy(&ks, 0, &kd, 1, 64),
            Err(AccessError::OutOfRange { .. })
        ));
        assert!(matches!(
            m.copy(&kd, 0, &ks, 0, 8),
            Err(AccessError::NoRight { .. })
        ));
        assert!(matches!(
            m.write(&ks, 0, &[1]),
            Err(AccessError::NoRight { .. })
        ));
        let seen: Vec<u8> = dst
            .iter()
            .map(|b| unsafe { std::ptr::read_volatile(b) })
            .collect();
        assert!(seen.iter().all(|&b| b == 0));
    }

    /// The path a root SP takes for another user's process: `/proc/PID/mem` opened as that
    /// user. A process of uid 65534 (a shell that execs `sleep` when told to) is read and
    /// written as 65534; the same key as root's or as another uid is refused; after its
    /// `exec` the key reaches nothing.
    #[test]
    fn another_users_process_is_reached_as_that_user_and_not_after_exec() {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(unsafe { libc::geteuid() }, 0, "this test needs root");
        use std::io::Write;
        let mut child = crate::process::exec_on_cue(Some(65534));
        let pid = child.id();
        // An address mapped in the shell: its stack's start, read as root from its stat.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let stack = crate::process::stat_field(&stat, 28).unwrap();
        let start = crate::process::start_time(pid).unwrap();
        let key = |uid: u32, gid: u32| AliasKey {
            owner: Owner {
                job: 1,
                world_rank: 0,
                pid,
                start,
                uid,
                gid,
            },
            grant: Grant {
                region: 1,
                generation: 0,
                addr: stack - 8,
                len: 8,
                rights: Rights::READ_WRITE,
                backend: BackendData::Cma,
            },
        };
        let mut m = CmaMover::default();
        let mut out = [0u8; 8];
        m.read(&key(65534, 65534), 0, &mut out).unwrap();
        m.write(&key(65534, 65534), 0, &out).unwrap();
        // Another user's key for it: the kernel refuses the open.
        let err = m.read(&key(65533, 65533), 0, &mut out).unwrap_err();
        assert!(matches!(err, AccessError::NotPermitted { .. }), "{err:?}");
        writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let err = loop {
            match m.read(&key(65534, 65534), 0, &mut out) {
                Err(e) => break e,
                Ok(()) => {
                    assert!(std::time::Instant::now() < deadline, "exec not seen");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            }
        };
        assert_eq!(err, AccessError::ImageChanged { pid });
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn a_dead_or_recycled_process_is_refused_before_any_access() {
        let mut child = crate::process::running_sleep("10");
        let pid = child.id();
        let buf = vec![0u8; 8];
        let mut k = key_for(&buf, Rights::READ);
        k.owner.pid = pid;
        k.owner.start = crate::process::start_time(pid).unwrap();
        // Another start time: the key was made for another process that had this pid.
        let mut recycled = k.clone();
        recycled.owner.start += 1;
        let mut out = [0u8; 8];
        let err = CmaMover::default()
            .read(&recycled, 0, &mut out)
            .unwrap_err();
        assert_eq!(err, AccessError::ProcessGone { pid });
        child.kill().unwrap();
        child.wait().unwrap();
        let err = CmaMover::default().read(&k, 0, &mut out).unwrap_err();
        assert_eq!(err, AccessError::ProcessGone { pid });
    }

    #[cfg(feature = "ucx")]
    #[test]
    fn dyn_mover_serves_ucx_export_keys_only_when_enabled_and_says_why_it_cannot() {
        let buf = vec![0u8; 64];
        let mut k = key_for(&buf, Rights::WRITE);
        k.grant.backend = BackendData::UcxExport {
            memh: vec![0xff; 300],
        };
        let mut off = DynMover::new(&MoverConfig::default()).unwrap();
        assert_eq!(off.write(&k, 0, &[1; 8]), Err(EXPORT_OFF));
        let mut on = DynMover::new(&MoverConfig {
            ucx_export: true,
            ..Default::default()
        })
        .unwrap();
        let err = on.write(&k, 0, &[1; 8]).unwrap_err();
        println!("{err}");
        match (ucx_sys::EXPORT_API, &err) {
            (false, AccessError::ExportNotBuilt { .. }) => {}
            (true, AccessError::Ucx { status, .. }) if status.contains("malformed") => {}
            (api, e) => panic!("export API {api}: unexpected {e}"),
        }
        // A copy from a cma grant into it is refused before anything moves, with the same
        // reason.
        let src = vec![7u8; 64];
        let ks = key_for(&src, Rights::READ);
        assert_eq!(on.copy(&ks, 0, &k, 0, 8), Err(err));
        let seen: Vec<u8> = buf
            .iter()
            .map(|b| unsafe { std::ptr::read_volatile(b) })
            .collect();
        assert!(seen.iter().all(|&b| b == 0));
    }
}
