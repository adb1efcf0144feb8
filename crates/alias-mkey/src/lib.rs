//! Memory grants and alias keys. A host rank registers a buffer and hands its service process
//! (SP) a [`Grant`]: the region, the rights on it and what a backend needs to reach it. The SP
//! adds the owner it learned from the kernel (never from the message) and gets an
//! [`AliasKey`], which it may pass to peer SPs so that they too can read or write that region.
//! Every access goes through [`AliasKey::check`]: a range outside the grant, a missing right, a
//! stale generation or an arithmetic overflow is an [`AccessError`] and nothing is touched.
//! This crate never decides *what* to copy; it only moves bytes where a grant allows.
//!
//! # Backends
//!
//! | backend | host side | SP side ([`mover`]) | what it needs of the host | status |
//! |---|---|---|---|---|
//! | `cma` (default) | [`host::Registrar`]: no resource, [`BackendData::Cma`] | [`mover::CmaMover`]: reads and writes of `/proc/PID/mem`, opened as the owner's client ([`ids`], [`process`]), staged through a bounded buffer | nothing (the kernel must let the client's user attach: same user and Yama `ptrace_scope` 0 or `PR_SET_PTRACER`; a setuid, setgid or non-dumpable process is refused) | used by the SP |
//! | `ucx` (feature `ucx`, on by default; chosen at run time) | [`host::UcxRegistrar`]: `ucp_mem_map` of the user buffer + packed rkey, [`BackendData::Ucx`] | [`mover::UcxMover`]: `ucp_get_nbx` into a bounded staging buffer, `ucp_put_nbx` out of it, `ucp_ep_flush_nbx`; every wait bounded | **UCX 1.13 here: the host must progress its worker** ([`host::UcxRegistrar::progress`]) while SPs access its memory: tcp and shared-memory RMA on `ucp_mem_map`ped user memory is emulated over active messages. Not needed on InfiniBand RC/DC | implemented and tested with real processes; served by the SP with UCX on (`serve --ucx`) |
//! | `ucx-export` (feature `ucx`; needs ucx-sys built against UCX >= 1.15: `UCX_DIR=$(scripts/ucx-wheel.sh)`) | [`host::UcxRegistrar::exporting`]: `ucp_mem_map` + `ucp_memh_pack(..., UCP_MEMH_PACK_FLAG_EXPORT)`, [`BackendData::UcxExport`] | [`mover::ExportMover`]: checks the exported buffer's framing and that it covers the grant, `ucp_mem_map` with `UCP_MEM_MAP_PARAM_FIELD_EXPORTED_MEMH_BUFFER` (the alias mkey, context feature `UCP_FEATURE_EXPORTED_MEMH`), then `ucp_put_nbx`/`ucp_get_nbx` with the alias as the *local* memory handle on a loopback endpoint, to and from a registered staging buffer | nothing: the device serves the accesses | the BlueField cross-GVMI path. No device here can export: the host's registration fails with [`AccessError::CannotExport`] ("this device cannot export memory (needs BlueField cross-GVMI)"); built against UCX < 1.15 it fails with [`AccessError::ExportNotBuilt`] |
//!
//! An SP serves every kind of grant with [`mover::DynMover`] (built from a
//! [`mover::MoverConfig`]), which dispatches per key and stages mixed copies.
//!
//! What the `ucx` backend works with on this machine (Debian UCX 1.13.1, one host; see
//! [`mover::UcxMover`] for details): `UCX_TLS=tcp` (and the default, and `cma,tcp`) with either
//! error-handling mode; `sm`, `posix`, `sysv` only with error handling `None`. In every case the
//! host must progress, a host that stops progressing makes the SP's accesses time out, and a
//! dead host is reported as an error within the mover's timeout.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod copy;
pub mod host;
pub mod ids;
pub mod mover;
pub mod process;

/// UCX configuration of every context this crate makes (hosts' registrars, SPs' movers): the
/// caller's `overrides`, plus `KEEPALIVE_INTERVAL=inf` unless the caller or the environment
/// (`UCX_KEEPALIVE_INTERVAL`) sets it. UCX's keepalive (on by default for the endpoints with
/// peer error handling these are) sends check messages between a host's worker and the SP's
/// on every round; one that reaches the SP after the host exited, or when the SP has just
/// closed the host's endpoint at the end of its job, is answered by connecting back to the
/// host, which fails with a UCX `ERROR` line on the SP for every such host ("connect(...)
/// failed: Connection refused", "Endpoint timeout"). Nothing here needs it: every UCX wait
/// is bounded by its own timeout, a peer that dies with a request pending fails it, and an
/// SP closes the endpoints of a job when the job ends.
#[cfg(feature = "ucx")]
pub(crate) fn ucx_config<'a>(overrides: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut v = overrides.to_vec();
    if !v
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("KEEPALIVE_INTERVAL"))
        && std::env::var_os("UCX_KEEPALIVE_INTERVAL").is_none()
    {
        v.push(("KEEPALIVE_INTERVAL", "inf"));
    }
    v
}

use serde::{Deserialize, Serialize};

/// Access rights on a granted region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Rights(u8);

impl Rights {
    pub const NONE: Rights = Rights(0);
    pub const READ: Rights = Rights(1);
    pub const WRITE: Rights = Rights(2);
    pub const READ_WRITE: Rights = Rights(3);

    pub fn contains(self, other: Rights) -> bool {
        self.0 & other.0 == other.0
    }

    pub fn bits(self) -> u8 {
        self.0
    }

    /// The rights of these bits, any of them, as a decoded message carries them (what the
    /// other bits mean is for the checks to refuse: `contains` reads only the ones asked for).
    pub fn from_bits(bits: u8) -> Rights {
        Rights(bits)
    }
}

impl std::fmt::Display for Rights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = if self.contains(Rights::READ) {
            "r"
        } else {
            "-"
        };
        let w = if self.contains(Rights::WRITE) {
            "w"
        } else {
            "-"
        };
        write!(f, "{r}{w}")
    }
}

/// What a backend needs, besides the address, to reach a granted region.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BackendData {
    /// Cross-memory attach: the owner's pid (learned by the SP from the socket) is enough.
    Cma,
    /// UCX: the owner's worker address and the packed remote key of its `ucp_mem_map`.
    Ucx {
        worker_address: Vec<u8>,
        rkey: Vec<u8>,
    },
    /// UCX exported memory handle (BlueField cross-GVMI): the bytes of
    /// `ucp_memh_pack(..., UCP_MEMH_PACK_FLAG_EXPORT)` of the owner's `ucp_mem_map`, which the SP
    /// imports as an alias of the owner's memory ([`mover::ExportMover`]).
    UcxExport { memh: Vec<u8> },
}

/// A region a host process grants to its SP. Produced by [`host::Registrar`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// Host-local registration id; with `generation` it names one registration.
    pub region: u64,
    /// Bumped each time the host re-registers the same region id (memory freed or remapped).
    pub generation: u32,
    pub addr: u64,
    pub len: u64,
    pub rights: Rights,
    pub backend: BackendData,
}

/// Who owns a granted region, and as whom it is reached. The SP fills `pid`, `uid` and `gid`
/// from what the kernel says of the connected host (never from the host's message).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Owner {
    pub job: u64,
    pub world_rank: u32,
    pub pid: u32,
    /// The process's start time (clock ticks after boot): with `pid`, names the process for
    /// good (a pid alone is recycled). Every cross-memory access checks it ([`process`]).
    pub start: u64,
    /// The client's uid and gid: the process's memory is opened with these ids, never with
    /// the SP's own, so the kernel refuses what that user could not `ptrace` ([`ids`]).
    pub uid: u32,
    pub gid: u32,
}

/// A grant bound to its owner: what SPs pass among themselves to access a host region.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AliasKey {
    pub owner: Owner,
    pub grant: Grant,
}

/// Why an access was refused or failed. Nothing was touched when `check` refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    #[error("range [{offset}, {offset}+{len}) lies outside the granted {grant_len} bytes")]
    OutOfRange {
        offset: u64,
        len: u64,
        grant_len: u64,
    },
    #[error("offset {offset} + length {len} overflows")]
    Overflow { offset: u64, len: u64 },
    #[error("the grant gives rights {have}, the access needs {need}")]
    NoRight { have: Rights, need: Rights },
    #[error("grant generation {got} is stale: the region is at generation {have}")]
    StaleGeneration { have: u32, got: u32 },
    #[error("the grant's address range overflows the address space")]
    BadGrant,
    #[error("{op} on pid {pid} failed: {errno}")]
    Os {
        op: &'static str,
        pid: u32,
        errno: i32,
    },
    #[error("process {pid} is gone (exited, or its pid now names another process)")]
    ProcessGone { pid: u32 },
    /// The process has called `exec` since its memory was granted: the grant named memory of
    /// a program that no longer runs.
    #[error("process {pid} has executed another program since it granted this memory")]
    ImageChanged { pid: u32 },
    /// The kernel refused to open the process's memory for its client (what that user could
    /// not do with `ptrace`: another user's, setuid, setgid or non-dumpable process).
    #[error("the memory of process {pid} may not be reached as uid {uid} gid {gid}: {why}")]
    NotPermitted {
        pid: u32,
        uid: u32,
        gid: u32,
        why: String,
    },
    #[error("backend {0} is not available in this build")]
    Unsupported(&'static str),
    /// A UCX call failed (or refused its input) for the region of process `pid`; `status` is
    /// UCX's text for the status code.
    #[error("{op} for pid {pid} failed: {status}")]
    Ucx {
        op: &'static str,
        pid: u32,
        status: String,
    },
    /// A UCX operation on the region of process `pid` did not complete within the mover's
    /// timeout (the owner died, hangs, or does not progress its worker). Part of the data may
    /// have been moved.
    #[error("{op} for pid {pid} did not complete within {after_ms} ms")]
    Timeout {
        op: &'static str,
        pid: u32,
        after_ms: u64,
    },
    /// The `ucx-export` backend cannot run here: UCX found no memory domain able to export
    /// (only the mlx5 device of a BlueField can, for its DPU's cross-GVMI aliases).
    #[error(
        "this device cannot export memory (needs BlueField cross-GVMI): {op} returned {status}"
    )]
    CannotExport { op: &'static str, status: String },
    /// The `ucx-export` backend was asked for, but ucx-sys was built against a UCX without
    /// exported memory handles (`probe` says which UCX).
    #[error(
        "ucx-export: built without UCX >= 1.15 export support ({probe}); rebuild with \
         UCX_DIR=$(scripts/ucx-wheel.sh) or a UCX >= 1.15 install"
    )]
    ExportNotBuilt { probe: &'static str },
}

impl AliasKey {
    /// Checks an access of `len` bytes at `offset` needing `need`, and returns the absolute
    /// address in the owner's address space. Zero-length accesses inside (or at the end of) the
    /// grant are allowed.
    pub fn check(&self, offset: u64, len: u64, need: Rights) -> Result<u64, AccessError> {
        let g = &self.grant;
        if !g.rights.contains(need) {
            return Err(AccessError::NoRight {
                have: g.rights,
                need,
            });
        }
        let end = offset
            .checked_add(len)
            .ok_or(AccessError::Overflow { offset, len })?;
        if end > g.len {
            return Err(AccessError::OutOfRange {
                offset,
                len,
                grant_len: g.len,
            });
        }
        g.addr.checked_add(g.len).ok_or(AccessError::BadGrant)?;
        Ok(g.addr + offset)
    }

    /// Refuses a key older than the generation the SP last saw for the same region.
    pub fn check_generation(&self, current: u32) -> Result<(), AccessError> {
        if self.grant.generation < current {
            return Err(AccessError::StaleGeneration {
                have: current,
                got: self.grant.generation,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(len: u64, rights: Rights) -> AliasKey {
        AliasKey {
            owner: Owner {
                job: 1,
                world_rank: 0,
                pid: 1,
                start: 1,
                uid: 0,
                gid: 0,
            },
            grant: Grant {
                region: 7,
                generation: 3,
                addr: 0x1000,
                len,
                rights,
                backend: BackendData::Cma,
            },
        }
    }

    #[test]
    fn inside_is_allowed_and_translated() {
        assert_eq!(
            key(100, Rights::READ).check(10, 90, Rights::READ),
            Ok(0x1000 + 10)
        );
        assert_eq!(
            key(100, Rights::READ).check(100, 0, Rights::READ),
            Ok(0x1000 + 100)
        );
    }

    #[test]
    fn outside_overflow_and_rights_are_refused() {
        let k = key(100, Rights::READ);
        assert!(matches!(
            k.check(10, 91, Rights::READ),
            Err(AccessError::OutOfRange { .. })
        ));
        assert!(matches!(
            k.check(101, 0, Rights::READ),
            Err(AccessError::OutOfRange { .. })
        ));
        assert!(matches!(
            k.check(u64::MAX, 2, Rights::READ),
            Err(AccessError::Overflow { .. })
        ));
        assert!(matches!(
            k.check(0, 1, Rights::WRITE),
            Err(AccessError::NoRight { .. })
        ));
        let mut wrap = key(16, Rights::READ);
        wrap.grant.addr = u64::MAX - 4;
        assert_eq!(wrap.check(0, 1, Rights::READ), Err(AccessError::BadGrant));
    }

    #[test]
    fn stale_generation_is_refused() {
        let k = key(1, Rights::READ);
        assert!(k.check_generation(3).is_ok());
        assert!(k.check_generation(2).is_ok());
        assert_eq!(
            k.check_generation(4),
            Err(AccessError::StaleGeneration { have: 4, got: 3 })
        );
    }
}
