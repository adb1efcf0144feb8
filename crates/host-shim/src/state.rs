//! The shim's shared state: the state machine, what never changes once active, the mailbox, and
//! the mutable state behind the lock. This module depends on nothing above it: the start-up and
//! shutdown that drive the state machine are in `lifecycle.rs`, and what the active shim does
//! with its tracked requests (completing them from the mailbox or from the SP's messages) is in
//! `completion.rs`.
//!
//! The shim's life is an explicit state machine in [`STATE`]:
//!
//! - `Uninit`: loaded, nothing done. Every call is native.
//! - `Connecting`: entered by the intercepted `MPI_Init`/`MPI_Init_thread` once `PMPI_Init*`
//!   has returned. The rank reads its configuration, learns with the others where every rank
//!   runs (node and local rank, from MPI: `lifecycle.rs`), connects and registers with its SP, and
//!   all ranks agree (collectively, on `MPI_COMM_WORLD`) whether offload is on for the job.
//!   Calls made meanwhile are native.
//! - `Active`: every rank of the job is registered with its SP; the collectives in `coll.rs`
//!   offload.
//! - `Disabled`: offload is off (not configured, an SP unreachable somewhere, after
//!   `MPI_Finalize`, or in a child after `fork`). Every call is native.
//!
//! The transitions happen once, on the thread that called `MPI_Init*` / `MPI_Finalize`. The
//! data the active shim needs are split by how they are used: what never changes after
//! activation ([`Topology`], the mailbox address) is set once and read without locking; what
//! changes (the connection, the slot pool, the request registry, the token counter, the grant
//! cache) sits in [`SHIM`] behind a mutex that is only ever held for short, non-blocking work.

use crate::conn::Conn;
use crate::grants::Grants;
use crate::registry::Registry;
use crate::slots::SlotPool;
use algorithms::SpId;
use bootstrap::mailbox::{SLOT_BYTES, STAMPS_OFFSET, STATUS_OFFSET, TOKEN_OFFSET};
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum State {
    Uninit = 0,
    Connecting = 1,
    Active = 2,
    Disabled = 3,
}

static STATE: AtomicU8 = AtomicU8::new(State::Uninit as u8);

pub fn state() -> State {
    match STATE.load(Ordering::Acquire) {
        0 => State::Uninit,
        1 => State::Connecting,
        2 => State::Active,
        _ => State::Disabled,
    }
}

/// Moves the state from `from` to `to`; `false` (and no change) when it is not `from`.
pub fn transition(from: State, to: State) -> bool {
    STATE
        .compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
}

/// Sets the state, whatever it was.
pub fn set_state(to: State) {
    STATE.store(to as u8, Ordering::Release);
}

#[inline]
pub fn is_active() -> bool {
    STATE.load(Ordering::Acquire) == State::Active as u8
}

/// What never changes once the shim is active.
#[derive(Debug)]
pub struct Topology {
    pub world_rank: u32,
    pub world_size: u32,
    /// The SP serving each world rank: the placement every rank computed alike at `MPI_Init`
    /// from every rank's node (gathered once; see `bootstrap::placement`).
    pub sp_of_world: Vec<SpId>,
    /// The node of each SP of the cluster description, indexed by SP id.
    pub node_of_sp: Vec<u32>,
    /// The name of the job's segment on this rank's node (hierarchical staged designs), as
    /// its SP named it.
    pub segment: String,
    /// The SP cannot attach to this rank (it is reached over TCP from another machine), so no
    /// segment can be shared with it: the staged collectives take their flat designs.
    pub remote: bool,
}

static TOPOLOGY: OnceLock<Topology> = OnceLock::new();

/// Only called on paths that run when active.
pub fn topology() -> &'static Topology {
    TOPOLOGY
        .get()
        .expect("topology is set before the shim becomes active")
}

/// Sets the topology (once, at start-up, before the shim becomes active).
pub fn set_topology(topology: Topology) {
    let _ = TOPOLOGY.set(topology);
}

/// Base address of the mailbox (never unmapped once set).
static MAILBOX: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
static MAILBOX_SLOTS: AtomicU32 = AtomicU32::new(0);

/// Number of request objects the shim tracks (live + detached): lets the Wait/Test family skip
/// the lock entirely while it is zero.
pub static TRACKED: AtomicUsize = AtomicUsize::new(0);

/// The completion token word of `slot`.
pub fn mailbox_token(slot: u32) -> &'static AtomicU64 {
    let base = MAILBOX.load(Ordering::Acquire);
    assert!(!base.is_null() && slot < MAILBOX_SLOTS.load(Ordering::Relaxed));
    // SAFETY: the mailbox is a live, never-unmapped, page-aligned mapping of
    // MAILBOX_SLOTS * SLOT_BYTES bytes; the slot is in range (checked above) and the word is
    // 8-aligned (SLOT_BYTES and TOKEN_OFFSET are multiples of 8). Other writers (the SP, via
    // process_vm_writev) are outside Rust's memory model; we only use atomic accesses.
    unsafe { &*(base.add((slot as u64 * SLOT_BYTES + TOKEN_OFFSET) as usize) as *const AtomicU64) }
}

/// The status word of `slot`.
pub fn mailbox_status(slot: u32) -> &'static std::sync::atomic::AtomicU32 {
    let base = MAILBOX.load(Ordering::Acquire);
    assert!(!base.is_null() && slot < MAILBOX_SLOTS.load(Ordering::Relaxed));
    // SAFETY: as in `mailbox_token`; STATUS_OFFSET is 4-aligned and inside the slot.
    unsafe {
        &*(base.add((slot as u64 * SLOT_BYTES + STATUS_OFFSET) as usize)
            as *const std::sync::atomic::AtomicU32)
    }
}

/// The SP's stamps of the call completed in `slot` (`bootstrap::stamps::SpStamps`), read once
/// its token was seen.
pub fn mailbox_stamps(slot: u32) -> [u64; 5] {
    let base = MAILBOX.load(Ordering::Acquire);
    assert!(!base.is_null() && slot < MAILBOX_SLOTS.load(Ordering::Relaxed));
    let at = (slot as u64 * SLOT_BYTES + STAMPS_OFFSET) as usize;
    // SAFETY: as in `mailbox_token`; the five words lie inside the slot, 8-aligned.
    std::array::from_fn(|i| unsafe {
        (*(base.add(at + 8 * i) as *const AtomicU64)).load(Ordering::Relaxed)
    })
}

/// Publishes the mailbox mapped at `base` with `slots` slots (once, at start-up).
pub fn set_mailbox(base: *mut u8, slots: u32) {
    MAILBOX_SLOTS.store(slots, Ordering::Release);
    MAILBOX.store(base, Ordering::Release);
}

/// The number of mailbox slots (0 before the mailbox is set).
pub fn mailbox_slot_count() -> u32 {
    MAILBOX_SLOTS.load(Ordering::Acquire)
}

/// The mutable state of the active shim. Its methods that complete, free and fail the tracked
/// requests are in `completion.rs`.
pub struct Shim {
    pub conn: Conn,
    pub slots: SlotPool,
    /// Grants on the program's buffers (`cma` or `ucx`; the mailbox is always `cma`).
    pub registrar: Grants,
    pub registry: Registry,
    /// Next completion token (tokens start at 1: 0 means "nothing written").
    pub next_token: u64,
    /// The `notice` stage of the last call completed through the mailbox (`breakdown`), for
    /// the next post to tell the SP (0: none since).
    pub last_notice_ns: u64,
}

static SHIM: Mutex<Option<Shim>> = Mutex::new(None);

fn lock() -> MutexGuard<'static, Option<Shim>> {
    // A panic while locked (caught at the boundary) must not disable the whole shim.
    SHIM.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` on the shim state under the lock; `None` when there is no active state.
pub fn with_shim<R>(f: impl FnOnce(&mut Shim) -> R) -> Option<R> {
    lock().as_mut().map(f)
}

/// Installs the state of the now active shim.
pub fn install(shim: Shim) {
    *lock() = Some(shim);
}

/// Takes the state away (at shutdown): from now on [`with_shim`] finds none.
pub fn take() -> Option<Shim> {
    lock().take()
}
