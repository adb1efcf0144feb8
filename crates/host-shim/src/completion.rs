//! What the active shim does with the requests it tracks: completing them from their mailbox
//! slot or from the SP's messages (refusals, completions of requests without a slot, copies
//! the SP hands to this host), freeing them, and failing them when the connection breaks.
//!
//! These are methods of [`Shim`] (the mutable state, `state.rs`), run under its lock, plus the
//! lock-free look at one request ([`poll`]) and its release.

use crate::boundary::say;
use crate::request::OffloadRequest;
use crate::state::{
    mailbox_stamps, mailbox_status, mailbox_token, topology, with_shim, Shim, TRACKED,
};
use bootstrap::mailbox;
use bootstrap::wire::{CopySrc, HostToSp, SpToHost};
use mpi_ffi::consts;
use std::os::raw::c_int;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

/// The MPI error code for a mailbox status.
pub fn mpi_code(status: u32) -> c_int {
    if status == mailbox::STATUS_OK {
        consts::SUCCESS()
    } else if status == mailbox::status_code(algorithms::Status::CountMismatch) {
        consts::ERR_TRUNCATE()
    } else {
        consts::ERR_OTHER()
    }
}

impl Shim {
    /// Records the mailbox result of `req` (whose token has been seen) and frees its slot.
    /// Idempotent.
    pub fn complete_from_mailbox(&mut self, req: &OffloadRequest) {
        let Some(slot) = req.slot else { return };
        if req.result().is_some() {
            return;
        }
        let noticed = bootstrap::stamps::now_ns();
        let status = mailbox_status(slot).load(Ordering::Acquire);
        if status == mailbox::STATUS_OK {
            let sp = bootstrap::stamps::SpStamps::from_words(mailbox_stamps(slot));
            self.last_notice_ns = crate::breakdown::record(req.sent_ns, &sp, noticed);
        }
        self.complete_with(req, status);
        self.slots.give(slot);
    }

    /// Records the result of `req` from the SP's status word (once).
    fn complete_with(&mut self, req: &OffloadRequest, status: u32) {
        if req.result().is_some() {
            return;
        }
        let code = mpi_code(status);
        if status != mailbox::STATUS_OK {
            let t = topology();
            say!(
                "rank {}: offloaded {} #{} on communicator {}:{} failed: {} (status {status})",
                t.world_rank,
                req.kind.facts().name,
                req.seq,
                req.comm.leader,
                req.comm.id,
                mailbox::status_name(status)
            );
        }
        req.finish_by_sp(code);
    }

    /// Looks at the mailbox for every tracked request that has not completed yet (after a
    /// round of UCX progress with the `ucx` backend).
    pub fn harvest(&mut self) {
        self.registrar.progress();
        let addrs: Vec<usize> = self.registry.all().collect();
        for a in addrs {
            // SAFETY: every address in the registry is a live OffloadRequest; objects are
            // removed from the registry (under this lock) before they are freed.
            let req = unsafe { &*(a as *const OffloadRequest) };
            let seen = req
                .slot
                .is_some_and(|slot| mailbox_token(slot).load(Ordering::Acquire) == req.token);
            if req.result().is_none() && seen {
                self.complete_from_mailbox(req);
            }
        }
        self.reap_detached();
    }

    /// Frees detached requests that have completed.
    pub fn reap_detached(&mut self) {
        let done = self.registry.take_finished_detached(|a| {
            // SAFETY: as in `harvest`.
            unsafe { &*(a as *const OffloadRequest) }.result().is_some()
        });
        for a in done {
            TRACKED.fetch_sub(1, Ordering::AcqRel);
            // SAFETY: `a` came from Box::into_raw in `post.rs` and has just left the registry,
            // so nothing else refers to it.
            drop(unsafe { Box::from_raw(a as *mut OffloadRequest) });
        }
    }

    /// Forgets a live handle and frees its object. The caller owns the handle.
    pub fn free_request(&mut self, addr: usize) {
        assert!(
            self.registry.remove(addr),
            "freeing unknown request {addr:#x}"
        );
        TRACKED.fetch_sub(1, Ordering::AcqRel);
        // SAFETY: as in `reap_detached`.
        drop(unsafe { Box::from_raw(addr as *mut OffloadRequest) });
    }

    /// Reads the SP connection: refusals of posts, or the connection's end. Every request the
    /// SP refused, or that can no longer complete, is finished with an error.
    pub fn service_connection(&mut self) {
        let was_broken = self.conn.broken.is_some();
        for msg in self.conn.poll_incoming() {
            match msg {
                SpToHost::Error {
                    comm,
                    seq,
                    code,
                    message,
                } => {
                    say!(
                        "rank {}: the service process refused a request ({code:?}): {message}",
                        topology().world_rank
                    );
                    let (Some(comm), Some(seq)) = (comm, seq) else {
                        // A refusal naming no post (a message the SP could not read): some
                        // request may never complete, and waiting for it would hang. The stream
                        // is not trusted any more: break it (every outstanding request fails).
                        self.conn.mark_broken(format!(
                            "the service process at {} refused a message it could not attribute",
                            self.conn.path.display()
                        ));
                        continue;
                    };
                    self.fail_matching(|r| r.comm == comm && r.seq == seq);
                }
                SpToHost::Registered { .. } | SpToHost::Heartbeat => {}
                SpToHost::Completed { token, status } => {
                    let req = self.registry.all().find(|&a| {
                        // SAFETY: as in `harvest`.
                        let r = unsafe { &*(a as *const OffloadRequest) };
                        r.slot.is_none() && r.token == token
                    });
                    match req {
                        // SAFETY: as in `harvest`.
                        Some(a) => {
                            self.complete_with(unsafe { &*(a as *const OffloadRequest) }, status)
                        }
                        None => self.conn.mark_broken(format!(
                            "the service process at {} completed token {token}, which no \
                             outstanding collective of this rank has",
                            self.conn.path.display()
                        )),
                    }
                }
                SpToHost::Copy {
                    token,
                    ticket,
                    src,
                    dst_offset,
                    len,
                } => {
                    let ok = match self.host_copy(token, src, dst_offset, len) {
                        Ok(()) => true,
                        Err(why) => {
                            say!(
                                "rank {}: intra-node copy for the service process failed: {why}",
                                topology().world_rank
                            );
                            false
                        }
                    };
                    // A failed send breaks the connection, which fails every request.
                    let _ = self.conn.send(&HostToSp::CopyDone { ticket, ok });
                }
            }
        }
        // An SP that says nothing while collectives are outstanding is stuck (it sends
        // heartbeats while it has posts of ours): waiting for it would hang.
        let waiting = self.registry.all().any(|a| {
            // SAFETY: as in `harvest`.
            unsafe { &*(a as *const OffloadRequest) }.result().is_none()
        });
        let silent = self.conn.silent_for();
        if waiting && self.conn.broken.is_none() && silent > sp_timeout() {
            self.conn.mark_broken(format!(
                "the service process at {} has sent nothing for {:.1} s (no heartbeat): it is \
                 stuck or gone",
                self.conn.path.display(),
                silent.as_secs_f64()
            ));
        }
        if !was_broken {
            if let Some(why) = self.conn.broken.clone() {
                say!(
                    "rank {}: {why}; outstanding offloaded collectives fail",
                    topology().world_rank
                );
                self.fail_matching(|_| true);
            }
        }
    }

    /// Copies `len` bytes from `src` (another process of this node, or this rank's mapping of
    /// its staged-collective segment) into the receive region of the outstanding request
    /// posted with `token`, at `dst_offset`: the SP's request for an intra-node copy in a
    /// blocking allgatherv, or a hierarchical staged collective. Only a request that accepts
    /// host copies, and only inside its own receive region, is written; a segment is read only
    /// inside its mapping.
    fn host_copy(
        &mut self,
        token: u64,
        src: CopySrc,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), String> {
        let region = self.registry.all().find_map(|a| {
            // SAFETY: as in `harvest`.
            let req = unsafe { &*(a as *const OffloadRequest) };
            (req.token == token && req.result().is_none())
                .then_some(req.host_copy_region)
                .flatten()
        });
        let Some((base, region_len)) = region else {
            return Err(format!(
                "no outstanding blocking collective has token {token}"
            ));
        };
        match dst_offset.checked_add(len) {
            Some(end) if end <= region_len => {}
            _ => {
                return Err(format!(
                    "[{dst_offset}, +{len}) lies outside the {region_len}-byte receive region"
                ))
            }
        }
        let dst = (base as u64 + dst_offset) as usize;
        match src {
            // SAFETY: [dst, dst+len) lies inside the receive region this request granted, which
            // the program may not touch until the request completes.
            CopySrc::Process { pid, addr } => unsafe {
                crate::cma::read_from(pid, addr, dst, len as usize)
            },
            CopySrc::Segment { offset } => {
                let seg = crate::segment::mapped()
                    .ok_or("a copy from the segment, which this rank has not mapped")?;
                let src = seg.range(offset, len)?;
                // SAFETY: `src` lies in the mapped segment and `dst` in the receive region (as
                // above); they do not overlap (the segment is the shim's own mapping).
                unsafe { std::ptr::copy_nonoverlapping(src, dst as *mut u8, len as usize) };
                Ok(())
            }
        }
    }

    /// The program freed the communicator `id`: its requests report errors through
    /// `MPI_COMM_WORLD` from now on (their handle is no longer valid).
    pub fn comm_freed(&mut self, id: algorithms::CommId) {
        for a in self.registry.all() {
            // SAFETY: as in `harvest`.
            let req = unsafe { &*(a as *const OffloadRequest) };
            if req.comm == id {
                req.comm_freed();
            }
        }
    }

    /// Finishes with `MPI_ERR_OTHER` every incomplete tracked request matching `pred`. Their
    /// slots are quarantined: a late write from the SP must not land in a reused slot.
    pub fn fail_matching(&mut self, pred: impl Fn(&OffloadRequest) -> bool) {
        let addrs: Vec<usize> = self.registry.all().collect();
        for a in addrs {
            // SAFETY: as in `harvest`.
            let req = unsafe { &*(a as *const OffloadRequest) };
            if req.result().is_none() && pred(req) {
                req.finish(consts::ERR_OTHER());
                if let Some(slot) = req.slot {
                    self.slots.quarantine(slot);
                }
            }
        }
    }
}

/// How long an SP may send nothing while collectives of this rank are outstanding before the
/// rank gives up on it: `SPOFF_SP_TIMEOUT_MS`, default 15 s (SPs send a heartbeat every
/// second while they have posts of this rank).
fn sp_timeout() -> std::time::Duration {
    static T: OnceLock<std::time::Duration> = OnceLock::new();
    *T.get_or_init(|| {
        let ms = std::env::var("SPOFF_SP_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|&ms| ms > 0)
            .unwrap_or(15_000);
        std::time::Duration::from_millis(ms)
    })
}

/// Non-blocking look at one request: its result if it has completed.
pub fn poll(req: &OffloadRequest) -> Option<c_int> {
    if let Some(code) = req.result() {
        return Some(code);
    }
    let Some(slot) = req.slot else {
        // Completed by a message, which the wait loops read.
        return None;
    };
    if mailbox_token(slot).load(Ordering::Acquire) == req.token {
        with_shim(|s| s.complete_from_mailbox(req));
        return req.result();
    }
    None
}

/// Releases a completed request the caller owns: forgets the handle and frees the object.
pub fn release(addr: usize) {
    with_shim(|s| s.free_request(addr));
}
