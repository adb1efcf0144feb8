//! Hierarchical, load-balanced `Allgatherv` progressed by service processes
//! (after NVIDIA's MIMOSA design). `Allgather` is the special case with
//! equal counts.
//!
//! One [`Allgatherv`] object exists per collective instance ([`CollKey`]) per
//! SP. Every SP serves ranks of exactly one node. The *segment* of comm rank
//! `s` is its send block; every rank needs every segment in its receive
//! buffer at its own displacement.
//!
//! # Protocol
//!
//! *Source side.* When rank `s` posts at SP `a` (node `n`), `a`
//! 1. sends `Announce` (address of `s`'s send buffer) to ONE SP on every
//!    other node that has members, nodes in ring order starting after `n`;
//!    the SP is chosen by `s`'s index among its node's ranks (plus the node
//!    number) modulo the node's SP count, which spreads sources evenly for
//!    block and cyclic layouts. The announcement carries the list of the
//!    target node's SPs, so it can be routed by SPs that have not seen a
//!    post yet;
//! 2. publishes the segment on its own node: `Segment` (holder `s`, its send
//!    buffer) to every SP of node `n`, itself included (internally).
//!
//! *Landing.* An SP holding an announcement (the target, or an SP it was
//! passed to) with a local rank that posted and has not completed picks the
//! one holding the fewest segments and copies the data there (the only
//! inter-node copy of segment `s` into this node). When the copy is done it
//! `Ack`s the announcing SP and publishes `Segment` (holder = that rank, its
//! receive buffer) to every SP of its node. Without a ready local rank:
//! * if it knows a ready sibling SP (see `RankReady`), it `Pass`es the
//!   announcement straight there;
//! * else it `Pass`es it to the next SP in the node's ring (the sorted list
//!   of the node's SPs); the pass carries how many SPs remain unvisited;
//! * the SP where the ring ends (every SP visited) *parks* it.
//!
//! `RankReady`: when an SP's first rank posts, it tells every other SP of
//! its node. An SP forwards everything it has parked to the first ready
//! sibling it hears of (and serves it itself if one of its own ranks posts
//! first), and from then on never parks. Completeness: an announcement is
//! always in exactly one place (in flight, landing, or parked at `x`); `x`
//! parks only while it knows no ready SP of its node; every SP that becomes
//! ready tells `x`; a ready SP stays ready until the collective completes
//! there (its ranks need this very segment), or aborts (then it acks).
//! So if any rank of the node ever posts, the announcement lands; if none
//! does, the collective aborts (rank loss) and the holder acks it.
//!
//! *Intra-node distribution.* Each SP copies every published segment of its
//! node into each of its ranks that needs it (all its ranks for a send
//! buffer segment, all but the holder for a landed one), as they post. When
//! all its ranks have it (or on abort, once its copies of it are done) it
//! sends `SegmentDone` to the holder's SP.
//!
//! *Completion.* A rank completes when its receive buffer has every segment
//! (or the instance aborted), no copy writes into it, every other node acked
//! its send buffer, and every SP of its node sent `SegmentDone` for every
//! segment it holds (send or receive buffer). Every announcement and every
//! `Segment` is answered exactly once (`Ack` / `SegmentDone`), also after an
//! abort (then without copying); answers to `Release` (below) are extra
//! `Ack`s.
//!
//! Failure handling follows [`crate::alltoallv`]: local abort, rank loss and
//! peer loss abort the instance and broadcast `Abort`; every SP that learns
//! of an abort re-broadcasts it once (the SP where it started may not know
//! the membership, and it is only contacted by some SPs); a lost SP's pending
//! `SegmentDone`s are dropped (its copies die with it, and `SegmentDone`s
//! are per SP, so no other SP's reads are covered by them).
//!
//! *Release after a peer loss.* When SP `d` of node `n` is lost, an unacked
//! announcement of a local source `s` to `n` may be at `d` (gone with it),
//! or at, or in a `Pass` to, a live SP of `n` (`d` may have passed it on
//! just before dying). The SP of `s` therefore sends `Release` to every live
//! SP of `n` and settles the ack (`s` stops waiting for `n`) only when every
//! one of them has acked since, or was lost too. An SP that gets `Release`
//! aborts, and answers with `Ack` at once unless a landing copy of `s` is
//! in flight there; then the `Ack` that the finished copy sends anyway is
//! the answer. Completeness: an `Ack` from a live SP `y` means either
//! (a) `y` finished the announcement (landing copy done or dropped): it is
//! in exactly one place, so it is gone for good, or (b) `y` answered
//! `Release`: `y` is aborted, has no landing copy of `s`, and an aborted SP
//! never starts one (`serve` runs only without an abort; every
//! announcement or pass reaching an aborted SP is acked without copying),
//! so a `Pass` still on its way to `y` is harmless. Only live SPs may read,
//! a lost SP is removed from every waiting set, and acks are created only
//! before the instance aborts (a post after the abort announces nothing),
//! so once the set is empty no SP will read `s`'s send buffer for `n`.
//! Late or duplicate acks (e.g. a parked announcement acked by the abort,
//! then the `Release` answer) are ignored.
//!
//! Count mismatches (a rank's `recv_counts[s]` differs from `s`'s send
//! length) abort the instance with `CountMismatch`; a failed copy aborts it
//! with the copy's status.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::ops::Bound::{Excluded, Unbounded};

use serde::{Deserialize, Serialize};

use crate::abort::{fail_pending, lose_rank, Outcome};
use crate::common::sp_nodes;
use crate::common::{common_api, take_finished, Core, VRecv};
pub use crate::direct::{Config, CopyId};
use crate::{CollKey, Nanos, Rank, SpId, Status};

mod messages;
mod segments;
mod state;
#[cfg(test)]
mod tests;
mod types;

pub use state::Allgatherv;
use state::*;
pub use types::*;
