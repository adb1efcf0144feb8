//! Staged `Iallgather` progressed by service processes (after the BluesMPI
//! BlueField-2 designs: each DPU gathers its node's send blocks into DPU
//! memory with RDMA reads, then RDMA-writes them into every rank's receive
//! buffer (*flat*) or once into each node's shared segment that the hosts
//! copy from in `MPI_Wait` (*hierarchical*)).
//!
//! Every comm rank sends `len` bytes; the block of comm rank `s` lands at
//! offset `s * len` of every receive buffer (`P * len` bytes, P the comm
//! size). One [`StagedAllgather`] object exists per collective instance
//! ([`CollKey`]) per SP. The algorithm never holds bytes: data live in host
//! grants (keys `K`) and in the SP's *staging slots*, `Config::staging_slots`
//! buffers of `Config::chunk_bytes` each, named by [`SlotId`]s. Both numbers
//! come from the configuration, never from a user count.
//!
//! # Protocol
//!
//! *View.* An SP forms its view `(len, members, nodes, design)` from its
//! first local post. The *member SPs* are the SPs serving comm ranks; the
//! *local ranks* of an SP are those it serves. A block is cut into
//! `n = ceil(len / chunk_bytes)` chunks (none for `len == 0`); chunk `i` of
//! block `s` covers bytes `i * chunk_bytes ..` of the block and lands at
//! `s * len + i * chunk_bytes`. The comm is summarised by [`comm_digest`]
//! of `members` and `nodes`.
//!
//! *Announcing where data go.* How an SP receives follows from its posts
//! ([`Design`]; the engine may fall back to flat on one SP when it has no
//! segment room, so designs may mix across SPs). A node's *owner* is its
//! lowest member SP; it holds the node's region in the hierarchical design:
//! * flat: when a local rank posts, its SP sends `Key { rank, key }` (the
//!   rank's receive buffer) to every other member SP;
//! * hierarchical, at an owner: with its first local post the SP sends
//!   `Region { rank, key }` once to every other member SP, `key` being the
//!   `shared_key` of that rank: its region of the node segment of `P * len`
//!   bytes (at `shared_at` in the segment), laid out like a receive buffer,
//!   which every rank of the node reads;
//! * hierarchical, at another SP of a node: it waits for its owner's
//!   announcement (every SP that is not its node's owner sends the owner
//!   `Waiting` with its first local post, whatever its design, so that an
//!   owner that aborts before it announces anything still owes it a
//!   `Stopped`, and an owner finishes only after every such message). A
//!   `Region` makes it *covered*: it sends `Covered` to
//!   every other member SP, and nobody writes into its ranks (they read
//!   the owner's region). A `Key` (the owner delivers flat) makes it flat:
//!   it sends the `Key`s of its ranks. So in the hierarchical design a
//!   node's ranks wait for their owner's first post.
//!
//! Both carry `len` and the comm digest, which every receiver checks
//! against its view. Keys that arrive before the receiver has a view wait
//! (checked when it forms one).
//!
//! *Gather.* Each SP reads its posted local ranks' send blocks chunk by
//! chunk into free slots ([`Action::Copy`] from [`Loc::Host`] (send key) to
//! [`Loc::Stage`]); reads stop while no slot is free.
//!
//! *Write.* A staged chunk is written into every *target unit*: every rank
//! of a flat SP and the region of every owner (a covered SP has none),
//! this SP's own included ([`Loc::Stage`] to [`Loc::Host`] at `s * len + i *
//! chunk_bytes`). The writer visits the nodes round-robin starting at its
//! own node, one unit of each node in turn (a node's units: SP by SP, its
//! SPs rotated by the writer's index on its own node; a hierarchical SP is
//! one unit), so that writers on different nodes target different nodes,
//! and one writer's concurrent writes go to different nodes, at any time.
//! A unit whose key is not known yet (the rank, or every rank of its SP,
//! has not posted) is skipped and remembered on the chunk; the write is
//! issued as soon as the key arrives (*late arrival*). The slot is freed
//! when every unit has the chunk: the slots of a chunk stalled by a late
//! rank stay full, and once all are full reads stop, until that rank
//! posts. A hierarchical SP's region takes every block as soon as its
//! first rank posted, whatever its other ranks do.
//!
//! *Written.* Only a writer knows when its copies finished. Once an SP has
//! written every chunk of every local block into a unit, it tells the
//! unit's SP: `Written { ranks }` (flat; one message per writer SP and
//! target rank, batched when several finish together) or `WrittenRegion`
//! (hierarchical: per writer SP and target SP). A writer never writes into
//! a unit after that.
//!
//! *Completion.* A local rank completes `Ok` when its own send block was
//! read completely (no read in flight: MPI lets it reuse the send buffer)
//! and, flat, every member SP (this one included) reported `Written` for
//! it, or, at an owner, every member SP reported `WrittenRegion` for this
//! SP, or, at a covered SP, its owner sent `RegionDone { at }` (which it
//! does, to each covered SP of its node, once every member SP reported
//! `WrittenRegion`): then it completes with `from_segment: true` and the
//! host copies `P * len` bytes out of the owner's region
//! ([`StagedAllgather::segment_source`]) into its receive buffer in
//! `MPI_Wait`. The driver keeps an owner's region until the ranks of the
//! covered SPs copied out of it.
//!
//! *Progress (no deadlock).* Nothing an SP does waits for another SP's
//! progress, only for posts: a read waits for a free slot, a slot for the
//! writes of its chunk, a write for its unit's key, and a key is sent when
//! its rank (flat) or its SP's first rank (hierarchical) posts. So once
//! every rank posted, every key reaches every member SP, every staged chunk
//! is written everywhere and freed, every block gets read, every `Written`
//! is sent and every rank completes. A late rank stalls each SP after it
//! filled its slots; its post unblocks them. Staging is bounded by
//! `staging_slots * chunk_bytes` per instance per SP, whatever `len` or P.
//!
//! *Consistency of posts.* Local posts are checked against the view:
//! another `len` aborts with `CountMismatch`; other `members`/`nodes` or
//! another design abort with `InvalidPost` (such a post is accepted, so its
//! rank completes with the error; structurally invalid posts are rejected
//! with a [`PostError`]). Every `Key`/`Region` is checked on arrival: `len`
//! (`CountMismatch`), digest, sender serving the rank in the receiver's
//! view, one design per SP (`InvalidPost`); `Covered` and `Waiting` are
//! checked alike (`len`, digest, sender a member SP that is not an owner,
//! and for `Waiting` of the receiver's node). A flat rank completes `Ok`
//! only with `Written` from every SP of its view, an owner's rank only with
//! `WrittenRegion` from every SP of its view, and an SP sends either only
//! after it checked the target's `Key` or `Region` against its own view and
//! after all its own local ranks posted in agreement with that view. A
//! covered rank completes `Ok` only with `RegionDone`, which its owner
//! sends only once its own ranks could complete `Ok` (every `WrittenRegion`
//! in), and only to an SP whose `Covered` it checked; the covered SP in
//! turn checked the owner's `Region`, and its own `WrittenRegion` to the
//! owner is among those. So an `Ok` rank proves that every member SP had
//! the same view and that every rank of the comm posted in agreement with
//! it: its buffer holds the right blocks at the right places. Once every SP involved has a post, a
//! disagreement is always detected by some SP: an SP with view V sends
//! keys to every SP of V, and an SP of V that holds another view aborts on
//! them (a rank that never posts leaves nobody `Ok` anyway).
//!
//! # Failure handling and the stop handshake
//!
//! Local abort, loss of a local rank that has not completed, loss of a
//! member SP, a failed copy and disagreeing posts abort the instance with
//! the matching [`Status`]. An aborted SP never starts a read or write
//! again and sends no keys. Writers are remote, so a rank cannot complete
//! with an error as soon as its SP aborts: some other SP may still be
//! writing into it. Hence *Stopped*: an aborted SP sends
//! `Stopped { status }` to every SP of its view and to every SP it heard
//! from, once none of its own writes into that SP's ranks or region is in
//! flight (if some are, it sends `Abort` at once, `Stopped` when they
//! finished). `Stopped` means: "aborted, no write of mine into your ranks
//! or region is in flight, and none will start". Receiving `Abort` or
//! `Stopped` aborts the receiver, which in turn informs everybody, so an
//! abort reaches every live SP of the view. An SP without a view (no local
//! post yet) has no keys, hence no writes: it answers at once. A rank that
//! posts at an aborted SP sends no key and completes after the handshake.
//! Nothing here relies on messages between two SPs arriving in order.
//!
//! An aborted SP completes a posted local rank (with the abort status) once
//! (1) no read of its send buffer and no write of this SP into its buffer
//! or into this SP's region is in flight, and (2) every other SP `w` of the
//! view has sent `Stopped`, or has sent `Written` for that rank (flat) /
//! `WrittenRegion` (hierarchical), or was lost. (2) is void for an SP that
//! sent no `Key` or `Region` (covered, or still waiting for its owner):
//! nobody has a key to write into its ranks.
//!
//! *Why nothing writes into a buffer after its rank completed.* Only a
//! copy issued by an SP writes, and an SP writes into a rank's buffer (a
//! region) only through the key that rank's SP sent it, which that SP sends
//! only to the SPs of its view. Take a rank `r` of SP `a` that completes
//! and any SP `w != a` of `a`'s view. If `w` sent `Written` for `r`: all its
//! writes into `r` finished before, and it issues each (chunk, unit) write
//! once, so it never writes into `r` again. If `w` sent `Stopped`: it was
//! aborted when it sent it, had no write into `a`'s ranks in flight, and an
//! aborted SP never starts one. If `w` was lost: its copies die with it
//! (a copy is executed by the SP that issues it). `a`'s own writes are
//! covered by (1) and, on the `Ok` path, by its own `Written`. SPs outside
//! `a`'s view never got `a`'s keys. Reads of a send buffer are done only by
//! the rank's own SP, which waits for them. The same argument covers the
//! region of a hierarchical SP: all its ranks complete under the same
//! condition.
//!
//! *Why every posted rank completes (bounded time).* Without a fault, by
//! the progress argument. With one, every live SP of the view aborts (an
//! abort is announced to every SP of the aborting SP's view and to every SP
//! it heard from, and every SP that aborts does the same), drains the
//! copies it has in flight (bounded), then sends `Stopped` to every SP that
//! can be waiting for it; lost SPs count as stopped. A finished SP that
//! completed `Ok` sent `Written` for every unit, so nobody waits for its
//! `Stopped`; a finished aborted SP sent `Stopped` to all SPs of its view.
//! Only an SP that is *not* in the finished SP's view (different comms
//! posted under one key) may later send it a `Key` or `Abort` that needs an
//! answer: see [`refusal`].
//!
//! # Driver obligations
//!
//! Route `Action::Send` (tagged with the `CollKey`; `Key`/`Region` carry
//! keys `K` that must be usable by the receiving SP); execute every
//! `Action::Copy` and report it exactly once with `handle_copy_done` (a
//! dropped copy with an error status); keep each instance's staging
//! (`staging_slots * chunk_bytes` bytes) and a hierarchical SP's region
//! until the instance `is_finished` and its hosts copied out; check every
//! post against the rank's grants before `handle_post` (`send_key` holds
//! `len` bytes, `recv_key` and, hierarchical, `shared_key` `P * len`).
//! A message that reaches an SP where the instance is finished or gone is
//! answered with [`refusal`]. This is needed only when ranks posted
//! different comms under one key: with agreeing posts, whatever reaches a
//! finished instance (a late `Abort` or `Stopped`) may be dropped, and the
//! simulator runs that way. Chunk sizes may differ between SPs.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::abort::{fail_pending, lose_rank, Outcome};
use crate::common::sp_nodes;
use crate::common::{common_api, take_finished, Core};
use crate::staged::{mutation_switch, Slots};
pub use crate::staged::{Config, CopyId, Design, Loc, SlotId};
type Slot = crate::staged::Slot<Held>;
use crate::{CollKey, Nanos, Rank, SpId, Status};

mod completion;
mod messages;
mod pipeline;
mod state;
#[cfg(test)]
mod tests;
mod types;
mod view;

pub use state::StagedAllgather;
use state::*;
pub use types::*;
use view::*;
pub use view::{comm_digest, node_owner};

/// Deliberately broken variants, switched on per test thread by the
/// simulator's tests to show that its checkers catch them. Compiled out of
/// non-test builds.
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mutation {
    /// Free a slot once all its writes were issued, not finished.
    FreeWhileWriting,
    /// Flat ranks complete with `Written` from half of the SPs.
    CompleteEarly,
    /// Aborted ranks complete without waiting for remote writers' `Stopped`
    /// (only for their SP's own copies).
    SkipStopHandshake,
    /// Aborted ranks complete without waiting for reads of their send
    /// buffer.
    IgnoreReadsOnAbort,
    /// Ranks complete `Ok` after an abort.
    OkAfterAbort,
}

mutation_switch!(Mutation);
