//! Reliable `Ibcast` over unreliable multicast, progressed by service
//! processes: the algorithm part of the paper's constant-time broadcast
//! (`multicast-bcast-allgather-dpa.txt`, §III; issue 26). The datagrams
//! themselves are the driver's: its send worker multicasts what
//! [`Action::Multicast`] names, its receive workers land chunks in the
//! ranks' buffers and report each with [`McastBcast::handle_landed`].
//!
//! One [`McastBcast`] object exists per collective instance ([`CollKey`])
//! per SP. It knows the SP's local ranks from the members list of the first
//! local post.
//!
//! # Protocol
//!
//! *Ring and chunks.* The SPs serving members of the communicator form a
//! ring: the root's SP first, then the others in id order, wrapping (the
//! root's SP at position 0). The *left* neighbour of the SP at position
//! `i > 0` is the one at `i - 1` (towards the root), its *right* neighbour
//! the one at `i + 1` (the root's SP for the last). The message is cut into
//! `n = max(1, ceil(len / mtu))` chunks numbered by PSN (a 0-byte message is
//! one 0-byte chunk, so that every receiver still sees it), spread over
//! `subgroups` multicast subgroups as contiguous runs (§IV-C "Multicast
//! subgroups"; [`subgroup_runs`] is the same map as the SP's
//! `mcast::subgroup_of`).
//!
//! *RNR barrier* (§III-C, receiver-not-ready drops). A leaf SP (not the
//! root's) waits until every local rank posted; it then asks its driver to
//! register the receive ([`Action::Register`]: the receive workers accept
//! the instance's chunks and land them in every local rank's buffer) and
//! sends `Ready` (its view: root, length, MTU) to the root's SP. The root's
//! SP, once its root rank posted, sends `Open` (its view and the ring) to
//! every other SP, copies the message into its own other local ranks
//! (host-to-host copies, as they post), and, once every other SP is
//! `Ready`, emits one [`Action::Multicast`] per non-empty subgroup run (the
//! fast path, §III-A: the send worker reads the root's buffer by its key)
//! and `Final` to its left neighbour (it never reads anyone's buffer). When
//! every multicast is reported done it tells every SP `Sent` (not needed
//! for correctness: it re-arms the leaves' cutoff timers, see below).
//!
//! *Bitmap and cutoff timer* (§III-B "Receive-side staging", §III-C
//! "Bitmap", "Cutoff timer"). A leaf keeps one bit per chunk, set when the
//! chunk is in every local rank's buffer (landed by a receive worker, or
//! fetched). When it sends `Ready` it arms the cutoff timer at `now +
//! len / link_bytes_per_ns + alpha_ns` ([`Config`]); `Sent` re-arms it at
//! `now + alpha_ns` (all datagrams are on the wire: only the network's noise
//! is left to wait for). At the deadline, or at `Sent` + `alpha_ns`, the
//! bitmap is scanned (earlier if every bit is set: nothing to scan), unless
//! a chunk new here landed less than `alpha_ns` before: then the scan waits
//! until `alpha_ns` after the last such landing. This is ours, not the
//! paper's: a receiver slower than `B_link` assumes (an SP that shares its
//! core) would otherwise fetch what is still arriving. It stays bounded:
//! each postponement needs a new chunk, at most one per chunk.
//!
//! *Fetch ring* (§III-C "Fetch layer"). A leaf missing chunks sends
//! `FetchReq { ranges }` (the missing runs) to its left neighbour. The
//! neighbour answers `FetchAck { key }` (the key of one of its local ranks'
//! buffers: the root's at the root's SP) once it has every requested chunk
//! itself: a leaf lacking some fetches them from its own left neighbour
//! first (at its own cutoff, or at once if it already had `Sent`), so
//! requests recurse towards the root's SP, which has everything. The leaf
//! then copies the missing ranges from that key into each local rank's
//! buffer (RDMA reads of the neighbour's host buffer) and sets the bits as
//! the copies finish. Only the SP at position 1 ever reads the root's
//! buffer: no incast on the root.
//!
//! *Final handshake* (§III-C "Final handshake"). A leaf that has every
//! chunk, with no fetch copy in flight, unregisters the receive
//! ([`Action::Unregister`]: nothing lands any more) and sends `Final` to
//! its left neighbour: it will never read the neighbour's buffers again. Its
//! ranks complete when it has every chunk and `Final` came from its right
//! neighbour (who may read them until then). The root completes when its
//! multicasts are done, `Final` came from its right neighbour and every
//! other rank of its SP posted and got its copy (the root's buffer is their
//! only source); the root's SP's other ranks when their copy is done.
//!
//! *Completeness.* No cyclic wait: a leaf's `Ready` needs only its own
//! posts; the multicast needs only every `Ready` and the root's post. A
//! leaf gets every chunk: by the multicast, or by fetching from its left
//! neighbour, who answers once it has every chunk, which by induction on
//! the ring position (the root's SP has all) happens. Each `Final` needs
//! only its sender to have every chunk; so once every rank posted, every
//! SP has every chunk, every `Final` goes out and every rank completes.
//! The cutoff timer only decides *when* a leaf fetches, never whether.
//!
//! *Consistency of posts.* Posts of one instance must agree on root and
//! length (MPI requires it), the SPs on the chunk size. Each SP checks its
//! local posts against its view; the root's SP checks every `Ready` against
//! its view, every leaf checks `Open` (root, length, MTU, subgroups, ring),
//! and `FetchReq`s, `Sent` and `Final` carry the view too: a disagreement
//! aborts with `CountMismatch` (root or length) or `InvalidPost` (MTU,
//! subgroups, ring). The root's SP multicasts only after a `Ready` agreeing
//! with its view from every other SP, and the true root's SP (the root
//! rank posts there) sends `Open` to every SP: an SP whose view names
//! another root either sends its `Ready` to an SP that is not root in its
//! own view (which aborts), or receives that `Open` and aborts. So no
//! chunk is multicast or fetched unless every SP's view agrees with the
//! root's SP's, which agrees with the root's own post (SPs whose members
//! lists differ build different rings, which `Open` reveals). A rank
//! completes `Ok` only with the bytes of the rank its post names as root,
//! which named itself root with the same length: through the multicast and
//! the fetch ring (every view agreed), or at an SP whose view makes it the
//! root's, through local copies, which need no other SP. (So a rank naming
//! a rank of its own SP that wrongly names itself root gets that rank's
//! bytes, `Ok`, as in the staged bcast; the SPs whose views differ abort.)
//!
//! # Failure handling
//!
//! Local abort, loss of a rank that has not completed, loss of a ring SP,
//! a failed copy, a failed multicast, a disagreement: the instance aborts.
//! Every SP learns of it: the SP where it began tells every SP of the ring
//! `Abort` (once it knows the ring: from its first post, or from the
//! root's `Open`); every aborted SP with a view tells its two neighbours;
//! and an aborted SP answers every message it accepts with its `Abort`
//! (each notice once per SP), also those that wait for it to have a view.
//! So an abort that began at an SP whose ranks never posted (no view)
//! still reaches every SP with a posted rank: if the root posted, its
//! SP's `Open` gives that SP the ring; if not, the root's SP aborted too
//! (the root is lost) and answers the `Ready` that every SP whose ranks
//! all posted sends it, while an SP with a lost rank aborts by itself. An
//! aborted SP stops the timer and the fetches, unregisters the receive,
//! answers no more `FetchReq`s, and sends `Final` to its left neighbour once
//! no fetch copy of its own is in flight (if it sent a request; the
//! neighbour then knows it will not be read). A rank completes with the
//! error once no copy or multicast touches its buffer, the receive is
//! unregistered, and, if this SP acknowledged a fetch to its right
//! neighbour, that neighbour's `Final` came (or the neighbour was lost). So
//! no buffer is written or read by this protocol after its rank completed.
//!
//! # Driver obligations
//!
//! Route `Action::Send` (tagged with the `CollKey`); execute
//! `Action::Register` before the actions that follow it (the `Ready`) and
//! `Action::Unregister` synchronously (no chunk of the instance lands after
//! it, before the `Complete`s that follow); report each landed chunk once
//! with `handle_landed` (landing it in every key of the registration);
//! execute every `Action::Copy` and `Action::Multicast` and report each with
//! `handle_copy_done` (their ids share one space); call `handle_timeout`
//! at `poll_timeout` (re-read it after every input). Zero-length copies
//! never reach the driver; a zero-length message is one zero-byte datagram.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::abort::{fail_pending, lose_rank, Outcome};
use crate::common::{common_api, take_finished, Core};
use crate::staged::mutation_switch;
pub use crate::staged::CopyId;
use crate::{CollKey, Nanos, Rank, SpId, Status};

mod messages;
mod state;
#[cfg(test)]
mod tests;
mod types;

pub(crate) use state::in_runs;
pub use state::McastBcast;
use state::*;
pub use types::*;

/// Deliberately broken variants, switched on per test thread by the
/// simulator's tests to show that its checkers catch them. Compiled out of
/// non-test builds.
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mutation {
    /// A fetch asks for every missing range but the last, and sets the
    /// bits of all.
    SkipLastRange,
    /// The fetch ring is wired the wrong way: a leaf fetches from its right
    /// neighbour (who serves it) and still sends `Final` to its left.
    FetchFromRight,
    /// Leaf ranks complete once every chunk is in, without waiting for
    /// their right neighbour's `Final`.
    CompleteBeforeFinal,
}

mutation_switch!(Mutation);

/// The PSN runs `[first, end)` of subgroups `0..subgroups` for `n` chunks
/// (contiguous runs; empty runs included): chunk `psn` travels in subgroup
/// `psn * subgroups / n`.
pub fn subgroup_runs(n: u64, subgroups: u16) -> Vec<(u64, u64)> {
    let s = u64::from(subgroups.max(1));
    (0..s)
        .map(|g| ((g * n).div_ceil(s), ((g + 1) * n).div_ceil(s)))
        .collect()
}

/// The ring of SPs for a broadcast from `root` over `members`: the root's
/// SP first, then the other SPs serving members in id order, wrapping.
pub fn build_ring(members: &[SpId], root: Rank) -> Vec<SpId> {
    let sps: BTreeSet<SpId> = members.iter().copied().collect();
    let root_sp = members[root as usize];
    sps.range(root_sp..)
        .chain(sps.range(..root_sp))
        .copied()
        .collect()
}
