//! Offloaded request objects and their completion. (The work on the shim's state that completes
//! them, [`crate::completion`], sits above this module.)
//!
//! A request is created when a collective is posted and lives on the heap; the registry names
//! it with the `MPI_Request` handle given to the program (its address under Open MPI, a number
//! MPICH never uses under MPICH: see `registry.rs`). Its result is written once,
//! under the shim lock, by whichever thread first sees the completion (the owner polling in a
//! Wait/Test call, or another thread harvesting slots); the owner reads it without the lock.
//! Polling the mailbox (`completion::poll`) needs no lock either: the token word is read with an
//! acquire load, and only when it equals the posted token is the lock taken to record the status
//! and free the slot.
//!
//! A request without a mailbox slot (posted while every slot was taken: waiting for one inside
//! a nonblocking call could deadlock, since the slot may only free up once another rank posts
//! a later collective) is completed by the SP with a message on the connection
//! (`SpToHost::Completed`), which every wait loop reads while such requests are outstanding.
//!
//! A request owns the staging of its packed sides (`pack.rs`): a received side is unpacked
//! into the program's buffer by [`OffloadRequest::finish`], before the result is published, so
//! whoever sees the request complete sees the data in place.
//!
//! A request also remembers the communicator handle it was created on: a failed request is
//! reported through that communicator's error handler (see `boundary::raise`). If the program
//! frees the communicator while the request is outstanding (allowed by MPI), the handle is
//! replaced by `MPI_COMM_WORLD` (from the attribute destructor, `comm.rs`), so the handler call
//! never touches a freed communicator.

use crate::boundary::say;
use crate::pack::Unpack;
use crate::state;
use algorithms::CommId;
use bootstrap::wire::CollKind;
use mpi_ffi as ffi;
use mpi_ffi::{abi, consts};
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::Mutex;

/// The staging a request owns while it runs.
#[derive(Debug, Default)]
pub struct Staging {
    /// A packed send side (or the copy of an `MPI_IN_PLACE` send side).
    pub send: Option<Vec<u8>>,
    /// A packed receive side, unpacked at completion.
    pub recv: Option<Unpack>,
    /// The arena chunk the call's sides went through (`arena.rs`): its received blocks are
    /// copied out at completion, before any unpacking.
    pub arena: Option<crate::arena::InArena>,
}

#[derive(Debug)]
pub struct OffloadRequest {
    pub kind: CollKind,
    /// The mailbox slot its completion is written to; `None`: completed by a message.
    pub slot: Option<u32>,
    pub token: u64,
    pub comm: CommId,
    pub seq: u64,
    /// For a post with `host_copies`: the start and length of the receive region granted to
    /// the SP, which the SP's `Copy` requests write into (at offsets it checked).
    pub host_copy_region: Option<(usize, u64)>,
    /// The handle the program holds (bits of an `MPI_Request`, [`mpi_ffi::abi::handle_bits`]),
    /// set when the request is registered, before it is shared.
    pub handle: usize,
    /// When its post was sent (CLOCK_MONOTONIC ns, `bootstrap::stamps`; 0 before).
    pub sent_ns: u64,
    /// The `MPI_Comm` handle of the call (as an integer: `MPI_Comm` is a pointer in Open MPI,
    /// an int in MPICH), whose error handler reports the request's failure.
    errhandler_comm: AtomicUsize,
    staging: Mutex<Staging>,
    done: AtomicBool,
    code: AtomicI32,
}

impl OffloadRequest {
    pub fn new(
        kind: CollKind,
        slot: Option<u32>,
        token: u64,
        comm: CommId,
        seq: u64,
        handle: ffi::MPI_Comm,
        staging: Staging,
    ) -> Self {
        if slot.is_none() {
            BY_MESSAGE.fetch_add(1, Ordering::AcqRel);
        }
        OffloadRequest {
            kind,
            slot,
            token,
            comm,
            seq,
            host_copy_region: None,
            handle: 0,
            sent_ns: 0,
            errhandler_comm: AtomicUsize::new(abi::handle_bits(handle)),
            staging: Mutex::new(staging),
            done: AtomicBool::new(false),
            code: AtomicI32::new(0),
        }
    }

    /// The MPI code once the request has completed.
    pub fn result(&self) -> Option<c_int> {
        self.done
            .load(Ordering::Acquire)
            .then(|| self.code.load(Ordering::Relaxed))
    }

    /// The communicator whose error handler reports this request's failure.
    pub fn errhandler_comm(&self) -> ffi::MPI_Comm {
        abi::handle_from_bits(self.errhandler_comm.load(Ordering::Acquire))
    }

    /// The program freed the communicator of this request: report through `MPI_COMM_WORLD`.
    pub fn comm_freed(&self) {
        self.errhandler_comm
            .store(abi::handle_bits(consts::COMM_WORLD()), Ordering::Release);
    }

    /// Records the result (under the shim lock), once. On success a packed receive side is
    /// unpacked into the program's buffer first; its failure fails the request. The staging
    /// is freed, except after a failure: the SP may not have stopped using it yet (a broken
    /// connection fails requests whose copies are still running), so it is leaked rather
    /// than handed back to the allocator (but see [`OffloadRequest::finish_by_sp`]).
    pub fn finish(&self, code: c_int) {
        self.finish_as(code, false)
    }

    /// As [`OffloadRequest::finish`] with the result the SP itself wrote (its completion, in
    /// the mailbox or a message): the SP completes a post, even a failed one, only once
    /// nothing of its instance touches the rank's sides any more, so a failed request gives
    /// its arena chunk back (the rest of its staging is still kept, as for any failure).
    pub fn finish_by_sp(&self, code: c_int) {
        self.finish_as(code, true)
    }

    fn finish_as(&self, code: c_int, by_sp: bool) {
        if self.done.load(Ordering::Acquire) {
            return;
        }
        let staging = std::mem::take(&mut *self.staging.lock().unwrap_or_else(|e| e.into_inner()));
        let mut code = code;
        if code == consts::SUCCESS() {
            if let Some(arena) = &staging.arena {
                // SAFETY: the collective completed: the SP is done with the chunk, and the
                // receive region (the program's, or the staging unpacked below) is ours to
                // write until `done` is published below.
                unsafe { arena.deliver() };
            }
            if let Some(unpack) = staging.recv {
                // SAFETY: the collective completed: the receive buffer is ours to write until
                // `done` is published below.
                if let Err(why) = unsafe { unpack.run() } {
                    say!(
                        "rank {}: offloaded {} #{}: {why}",
                        my_rank(),
                        self.kind.facts().name,
                        self.seq
                    );
                    code = consts::ERR_OTHER();
                }
            }
            drop(staging.send);
            drop(staging.arena);
        } else {
            let mut staging = staging;
            if by_sp {
                drop(staging.arena.take());
            }
            std::mem::forget(staging);
        }
        self.code.store(code, Ordering::Relaxed);
        if !self.done.swap(true, Ordering::AcqRel) {
            if self.host_copy_region.is_some() {
                HOST_COPY_REQUESTS.fetch_sub(1, Ordering::AcqRel);
            }
            if self.slot.is_none() {
                BY_MESSAGE.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Marks a request the SP will hand copies to (call once, before it is shared).
    pub fn accept_host_copies(&mut self, region: (usize, u64)) {
        self.host_copy_region = Some(region);
        HOST_COPY_REQUESTS.fetch_add(1, Ordering::AcqRel);
    }
}

/// Outstanding requests that accept host copies: while there are any, every Test-style call
/// reads the SP connection (the copies are handed over there).
static HOST_COPY_REQUESTS: AtomicUsize = AtomicUsize::new(0);

/// Outstanding requests completed by a message rather than a mailbox slot.
static BY_MESSAGE: AtomicUsize = AtomicUsize::new(0);

/// Whether something outstanding needs the SP connection read at every look: copies handed to
/// this host, or completions that come as messages.
pub fn connection_needed() -> bool {
    HOST_COPY_REQUESTS.load(Ordering::Acquire) > 0 || BY_MESSAGE.load(Ordering::Acquire) > 0
}

/// The object behind one of our handles.
///
/// # Safety
/// `addr` was classified as ours (it is in the registry) and the caller owns the handle, so the
/// object stays alive until the caller frees it.
pub unsafe fn by_addr<'a>(addr: usize) -> &'a OffloadRequest {
    // SAFETY: forwarded precondition.
    unsafe { &*(addr as *const OffloadRequest) }
}

/// Fills `status` (unless it is `MPI_STATUS_IGNORE` or null) as for a completed collective.
///
/// # Safety
/// `status` is null, `MPI_STATUS_IGNORE` or valid for writes.
pub unsafe fn fill_status(status: *mut ffi::MPI_Status, code: c_int) {
    if status.is_null() || status == consts::STATUS_IGNORE() {
        return;
    }
    // SAFETY: a valid status object, not MPI_STATUS_IGNORE (checked above).
    unsafe { abi::status_set_empty(status, code) }
}

/// The handle the program holds for the live request at `addr`.
///
/// # Safety
/// `addr` is a registered request the caller owns (as for [`by_addr`]).
pub unsafe fn handle_of(addr: usize) -> ffi::MPI_Request {
    // SAFETY: forwarded precondition.
    abi::handle_from_bits(unsafe { by_addr(addr) }.handle)
}

/// The world rank, for messages.
pub fn my_rank() -> u32 {
    state::topology().world_rank
}
