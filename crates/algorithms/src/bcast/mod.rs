//! Staged, pipelined `Ibcast` progressed by service processes (after the
//! BluesMPI BlueField-2 designs: the root's DPU reads the root's buffer into
//! DPU memory, the DPUs pass it on among themselves, and each writes it back
//! to its hosts, either into every rank's buffer (*flat*) or once into a
//! node shared segment that the hosts copy from in `MPI_Wait`
//! (*hierarchical*)).
//!
//! One [`Bcast`] object exists per collective instance ([`CollKey`]) per SP.
//! The algorithm never holds bytes: data lives in host buffers (named by
//! keys `K`) and in the SP's *staging slots*, `Config::staging_slots` buffers
//! of `Config::chunk_bytes` each, owned by the SP for this instance and named
//! by [`SlotId`]s `0..staging_slots`. Both numbers come from the
//! configuration, never from a user count, so an instance's staging memory is
//! bounded whatever the message size.
//!
//! # Protocol
//!
//! *The tree.* The message (`len` bytes at offset 0 of every rank's buffer)
//! is cut into `n = max(1, ceil(len / chunk_bytes))` chunks; chunk `i` covers
//! bytes `i * chunk_bytes ..` (a 0-byte message is one 0-byte chunk, so the
//! SPs still agree on it). Every SP serving a member of the communicator
//! takes part, grouped by node: the root's node first, then the nodes with
//! members in ring order (ascending node number, wrapping). In the root's
//! group the root's SP comes first, then the node's other SPs in id order
//! (wrapping around after the root's SP); in the other groups the SPs are in
//! id order. The first SP of a group is its node's *leader*. The chunks flow
//! down a tree: a pipelined chain of the leaders, one SP per node, in group
//! order, and within each node from the leader to the node's other SPs. An
//! SP's *parent* is the previous group's leader (for a leader) or its own
//! leader; its *children* are the next group's leader and, for a leader, the
//! other SPs of its group. Each chunk therefore crosses each node boundary
//! exactly once, and the path from the root's SP to any SP has at most one
//! intra-node hop at its end, however many SPs a node runs. An SP's *view*
//! is `(root, len, chunk_bytes, tree)`; it forms it from its first local
//! post, or from the `Open` of its parent, whichever comes first.
//!
//! *Opening.* When an SP forms its view it sends `Open` (the view) to each
//! child and a first `Credit` to its parent. So an SP whose ranks have not
//! posted yet still learns the tree and takes part in forwarding: a late SP
//! never blocks the tree beyond its staging.
//!
//! *Credits.* A receiving SP grants free slots to its parent (`Credit {
//! slots }`), never more than the chunks it still expects. The parent moves
//! a chunk only into a slot that child granted: [`Action::Move`] asks the
//! driver to copy `len` bytes from a local slot to the child's slot and then
//! to deliver `Msg::Chunk { index, slot, len }` there ([`Move::chunk_msg`]);
//! the driver reports the end of the transfer on the sending side with
//! [`Bcast::handle_move_done`]. A granted slot stays reserved until the
//! chunk arrives in it, the parent gives it back (`Return`, after an abort
//! or a failed move) or the parent is lost, so no peer writes into staging
//! that was reused or released.
//!
//! *Per SP.* The root's SP reads chunks from the root's buffer into free slots
//! ([`Action::Copy`] from [`Loc::Host`] to [`Loc::Stage`]);
//! other SPs receive them. A chunk in a slot is forwarded to every
//! *receiving* child (to each strictly in index order) and written to the
//! SP's *targets*:
//! * flat: every local rank except the root ([`Loc::Stage`] to
//!   [`Loc::Host`] at offset `i * chunk_bytes` of the rank's `key`);
//! * hierarchical, at a node leader: only the node segment, through the
//!   `shared_key` of the SP's lowest local non-root rank (the *writer*; the
//!   root if it is the SP's only rank and the node has other SPs), once per
//!   chunk: its region at `shared_at` in the segment the whole node maps;
//! * hierarchical, at a node's other SP: every local non-root rank, as flat,
//!   for chunks its leader sends (only when the leader delivers flat).
//!
//! A leader's receiving children are the next leader and, when its own
//! design is flat, its node's other SPs. With its design hierarchical they
//! get no chunk: once the region holds all `n` chunks the leader sends each
//! of them `Sealed { at: shared_at }` (after its first `Credit`, which it
//! checked as any credit; the slots granted to the leader are void then).
//! A leader whose ranks have not posted yet does not know its design and
//! forwards to its node's other SPs nothing until one does; the region is
//! written through the writer's grant, so in the hierarchical design a
//! node's ranks wait for the post of their leader's writer rank.
//!
//! The slot is freed when every receiving child has the chunk and every target has
//! it. Targets are known from the members list of the
//! first local post (how many ranks this SP serves), so a chunk stays in
//! staging until ranks that have not posted yet got it: a rank that posts
//! late is served from staging, and staging slots, not local posts, bound
//! the pipeline (a late rank stalls its SP's intake once its slots are full,
//! and with it the tree upstream, but never deadlocks it: forwarding does
//! not wait for local posts).
//!
//! *Completion.* The root completes when every chunk was read out of its
//! buffer (only its own SP reads it; nothing else ever touches it), and, if
//! it is the writer, the region holds every chunk. Flat: a rank completes
//! when all `n` chunks were written into its buffer. Hier: a leader's
//! non-root ranks complete together when the region holds all `n` chunks,
//! the ranks of the node's other SPs when their SP gets `Sealed` (a rank
//! posting later completes at once), with `from_segment: true`: the host
//! then copies `len` bytes out of the region ([`Bcast::segment_source`])
//! into its buffer in `MPI_Wait`. The root's buffer is never written. The
//! driver keeps a leader's region until the ranks of its node's other SPs
//! copied out of it.
//!
//! *Completeness.* The SPs form a tree, so there is no cyclic wait: the
//! root's SP reads whenever a slot is free; an SP frees a slot once each
//! child granted one (which it does once its own slot is free, by induction
//! from the leaves, which only wait for their local writes) and its local
//! writes are done (which needs only its local ranks to post). So once every
//! rank posted, every chunk reaches every SP and every rank.
//!
//! *Consistency of posts.* Posts of one instance must agree on root and
//! length (MPI requires it). Each SP checks its local posts against its
//! view, and every `Open` and `Credit` it receives (both carry root, length
//! and chunk size) against its view: a disagreement aborts the instance with
//! `CountMismatch` (root or length) or `InvalidPost` (tree, chunk size,
//! design). Detection is complete: every SP with a view sends its view to
//! its children (`Open`) and its root, length and chunk size to its parent
//! (`Credit`) in the tree *of that view*; a parent checks that a credit
//! comes from one of its own children, then its own `Open` reaches that
//! child, who compares the trees. So if no check fails, the SPs holding any
//! given view form a set closed under parent and children of that view's
//! tree, i.e. the whole tree, so all views are equal. A rank completes `Ok`
//! only after its own chunks arrived, which were read under a view equal to
//! its post's (checked hop by hop), so an
//! `Ok` rank's post agrees with the root's and holds the root's data. Ranks
//! that already completed `Ok` when another SP detects a disagreement keep
//! that; all others complete with the error. (A rank whose post wrongly
//! names itself root is the root of its SP's view: its buffer is only read,
//! and it completes `Ok` once it was, as any root may; the SPs whose views
//! differ abort.) Detection needs no extra message and no global round: a
//! global agreement before any completion would make every rank wait for
//! the last one to post, which the late-arrival design exists to avoid.
//!
//! # Failure handling
//!
//! Local abort, rank loss (of a rank that has not completed), peer loss (of
//! an SP in the tree), a failed copy or move, and disagreeing posts abort
//! the instance: every SP that enters the abort broadcasts `Abort` once to
//! every SP of its tree (an SP that has no view yet tells the SPs that
//! granted it credits, who know the tree). An aborted SP stops reading,
//! forwarding, writing and granting; gives back every grant it holds
//! (`Return`); frees slots as their copies and moves finish; answers later
//! credits with `Return` and drops later chunks. A rank completes with the
//! error once no copy into (or, for the root, out of) its buffer is in
//! flight, so nothing writes into a rank's buffer after it completed and the
//! root's buffer is not read after the root completed: every buffer is
//! touched only by its own SP's copies, so no cross-SP handshake is needed.
//!
//! # Driver obligations
//!
//! Route `Action::Send` (tagged with the `CollKey`); execute every
//! `Action::Copy` (e.g. through a [`CopyLimiter`](crate::sched::CopyLimiter))
//! and report it with `handle_copy_done`; execute every `Action::Move` and
//! report it exactly once with `handle_move_done` (with an error status if
//! the bytes did not land, e.g. the peer is gone: then the `Chunk` message
//! must not be delivered); deliver the `Chunk` message of a successful move
//! only after its bytes are in the peer's slot; keep each instance's staging
//! (`staging_slots * chunk_bytes` bytes) until the instance `is_finished`;
//! on the receiving side, write an incoming chunk's bytes only where
//! [`Bcast::may_fill`] allows (the slot is granted to that sender).
//! Zero-length copies and moves never reach the driver (a zero-length move
//! is a plain `Send` of its `Chunk`). All SPs of a job must use the same
//! `chunk_bytes` (a mismatch aborts with `InvalidPost`).

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

mod messages;
mod pipeline;
mod state;
#[cfg(test)]
mod tests;
mod types;
mod view;

pub use state::Bcast;
use state::*;
pub use types::*;
pub use view::build_tree;
use view::*;

/// Deliberately broken variants, switched on per test thread by the
/// simulator's tests to show that its checkers catch them. Compiled out of
/// non-test builds.
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mutation {
    /// Free a slot once its moves started, not once they finished.
    FreeWhileMoving,
    /// Flat ranks complete one chunk early.
    CompleteOneChunkEarly,
    /// The root completes as soon as its last read started.
    RootCompletesBeforeReads,
    /// A rank that posts late gets no chunk that was already staged.
    SkipStagedForLateRank,
    /// Ranks complete `Ok` after an abort.
    OkAfterAbort,
}

mutation_switch!(Mutation);
