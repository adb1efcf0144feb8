//! Reliable `Iallgather` over unreliable multicast, progressed by service
//! processes: the paper's Allgather as a composition of multicast
//! broadcasts (`multicast-bcast-allgather-dpa.txt`, §IV "Allgather as a
//! composition of Broadcasts", §IV-A "Broadcast sequencer" and Appendix A;
//! the reliability of §III-C; issue 26). It reuses the pieces of
//! [`crate::mcast_bcast`]: the subgroup runs, the RNR barrier, the cutoff
//! timer, the fetch ring and the final handshake, here over every block at
//! once. The datagrams are the driver's, as for the bcast: its send worker
//! multicasts what [`Action::Multicast`] names, its receive workers land
//! chunks in the ranks' receive buffers and report each with
//! [`McastAllgather::handle_landed`].
//!
//! One [`McastAllgather`] object exists per collective instance
//! ([`CollKey`]) per SP. It knows the SP's local ranks from the members
//! list of the first local post.
//!
//! # Protocol
//!
//! *Blocks, chunks, datagram identity.* `MPI_Allgather` with equal blocks:
//! each of the P ranks posts a send buffer of `len` bytes and a receive
//! buffer of `P * len` bytes, which ends up holding every rank's block in
//! rank order (block `b` at `b * len`). A block is cut into `n = max(1,
//! ceil(len / mtu))` chunks (a 0-byte block is one 0-byte chunk). A
//! datagram is named by its *global PSN* `g = b * n + i` (chunk `i` of
//! block `b`, `P * n` in all); it lands at `b * len + i * mtu` of every
//! receive buffer. Within each block the chunks are spread over the
//! subgroups as in the bcast ([`subgroup_runs`]`(n, subgroups)`: chunk `i`
//! of any block travels in subgroup `i * subgroups / n`).
//!
//! *Participants.* The participants of the paper's schedule are the SPs
//! serving members (K of them), not the ranks: an SP serves several ranks
//! and is, in the schedule, the root of all their blocks at once; each
//! rank's block is multicast exactly once, out of its own send buffer. The
//! SPs form a ring in id order ([`build_ring`]); the *left* neighbour of
//! the SP at position `i` is the one at `i - 1` (the last for position 0),
//! its *right* neighbour the one at `i + 1`. The SP at position 0 is the
//! *coordinator* of the RNR barrier.
//!
//! *Broadcast sequencer* (§IV-A, Appendix A). The ring is split into `M`
//! *broadcast chains* ([`chain_bounds`]): `M` contiguous runs of ring
//! positions of lengths `ceil(K / M)` or `floor(K / M)` (the paper asks for
//! `K mod M = 0`, equal chains of `R = K / M`; we allow the remainder and
//! spread it). At step `j` the `j`th SP of every chain multicasts (the
//! paper's `G^j = {P_j, P_{R+j}, ..}`): the chain heads start once the
//! barrier is complete, and an SP whose multicasts are all done sends `Go`
//! (the activation signal) to the next SP of its chain. `M` is
//! [`Config::chains`] (every SP must use the same; 0 picks
//! [`default_chains`], about `sqrt(K)`: `R ~ M` balances the chain's `R`
//! sequential activation latencies against `M` roots incasting every
//! receiver at once; `M` is clamped to `1..=K`).
//!
//! *RNR barrier* (§III-C, receiver-not-ready drops). An SP waits until
//! every local rank posted; it then registers the receive
//! ([`Action::Register`]: the receive workers accept the instance's chunks
//! and land them in every local rank's receive buffer), starts the local
//! copies (each local rank's block, out of its send buffer, into every
//! local rank's receive buffer: host-to-host copies; its own blocks never
//! go over the fabric to itself), and sends `Ready` (its view: block
//! length, MTU, subgroups, chains and a digest of the members list) to the
//! coordinator. The coordinator, once every SP (itself included) is ready,
//! sends `Start` to every SP: every receiver has registered before any
//! datagram is multicast. (The coordinator also sends every SP `Open`, its
//! view, as soon as it has one: an SP that aborted before any of its ranks
//! posted knows no ring, and answers that `Open` with its `Abort`.)
//!
//! *Multicast.* An SP that has `Start` and is a chain head, or has `Go`
//! from its chain predecessor, emits one [`Action::Multicast`] per local
//! rank and non-empty subgroup run (the send worker reads the rank's send
//! buffer by its key) to every other SP.
//!
//! *Bitmap and cutoff timer* (§III-B, §III-C "Bitmap", "Cutoff timer"). An
//! SP keeps one bit per global PSN, set when the chunk is in every local
//! rank's receive buffer (landed, fetched, or, for its own blocks, once
//! every local copy of the block finished). At `Start` it arms the cutoff
//! timer at `now + P * len / link_bytes_per_ns + alpha_ns` (the paper's
//! `N / B_link + alpha`, `N` the receive buffer's size: the whole schedule
//! fits in it); at the deadline the bitmap is scanned once (not at all if
//! every bit is set), put off, as in the Bcast, while chunks new here keep
//! landing (until `alpha_ns` after the last one).
//!
//! *Fetch ring* (§III-C "Fetch layer"). An SP missing chunks (of other
//! SPs' blocks) sends `FetchReq { ranges }` to its left neighbour, once.
//! The neighbour answers with `FetchAck { key, ranges }` as soon as it
//! holds some of the requested chunks, and again as more come in (`ranges`:
//! the requested runs now in its receive buffer `key`, never acknowledged
//! twice). Partial answers are what the Allgather needs: in the bcast the
//! root's SP holds everything, here every SP holds only its own blocks, and
//! answering only whole requests can wait in a circle (each SP missing some
//! chunk its right neighbour asked it for, all around the ring; the
//! `WholeAcks` mutation tests show it). The requester reads the
//! acknowledged runs it still lacks from that key into its first local
//! rank's receive buffer (an RDMA read of the neighbour's host buffer, once
//! per run), copies them from there into its other local ranks' receive
//! buffers (host-to-host), and sets the bits as the copies finish. A
//! neighbour lacking chunks gets them from its own left neighbour (at its
//! own cutoff), so requests recurse towards each block's owner, which holds
//! it from its local copies. No SP but the right neighbour ever reads an
//! SP's receive buffers: no incast on any root.
//!
//! *Final handshake* (§III-C "Final handshake"). An SP that has every
//! chunk, with no fetch copy in flight, unregisters the receive
//! ([`Action::Unregister`]) and sends `Final` to its left neighbour: it
//! will never read the neighbour's buffers again. Its ranks complete when
//! it has every chunk, every multicast of its blocks, every local copy and
//! every fetched run's copies are done (a run may still be fanning out
//! after the same chunks landed), and `Final` came from its right
//! neighbour (who may read them until then).
//!
//! *Completeness.* No cyclic wait: `Ready` needs only local posts, `Start`
//! every `Ready`, a chain's `Go`s only `Start` and the multicasts before
//! them; so once every rank posted, every block is multicast. Every SP
//! gets every chunk: by the multicast or by the fetch ring, where chunk `g`
//! of block `b` reaches the SPs to the right of `b`'s owner one after the
//! other (the owner has it once its local copies finished; an SP holding
//! it acknowledges it to its right neighbour, who asked for it if it
//! lacked it at its cutoff). Each `Final` needs only its sender to have
//! every chunk; so every `Final` goes out and every rank completes. The
//! cutoff timer only decides *when* an SP fetches, never whether.
//!
//! *Consistency of posts.* Posts of one instance must agree on the block
//! length (MPI requires it) and the members list, the SPs on MTU,
//! subgroups and chains. Each SP checks its local posts against its view
//! (another length aborts with `CountMismatch`, another members list is
//! rejected); the coordinator checks every `Ready`, every SP `Start`, `Go`,
//! `FetchReq` and `Final` against its view: a disagreement aborts with
//! `CountMismatch` (length) or `InvalidPost` (MTU, subgroups, chains,
//! members digest, or a `Ready` at an SP that is not the coordinator in its
//! own view). `Start` goes out only after a `Ready` agreeing with the
//! coordinator's view from every SP, and nothing is multicast or fetched
//! before `Start`: so a rank completes `Ok` only if every SP's view agreed
//! (an SP with only one SP has no one to disagree with but its own posts).
//! The members digest is a 64-bit hash ([`members_digest`]): members lists
//! that differ but hash alike go unnoticed (the driver builds them from
//! the same communicator).
//!
//! # Failure handling
//!
//! Local abort, loss of a rank that has not completed, loss of a ring SP,
//! a failed copy or multicast, a disagreement: the instance aborts. The SP
//! where it began tells every SP of the ring `Abort` (every SP with a
//! posted rank knows the ring); every aborted SP tells its two neighbours
//! and answers every message it accepts with its `Abort` (each notice once
//! per SP), so an SP none of whose ranks posted yet still learns of it
//! when it does (its `Ready` or a message it queued gets the answer). An
//! aborted SP starts no multicast, copy or fetch, stops the timer,
//! unregisters the receive, answers no more `FetchReq`s, and sends `Final`
//! to its left neighbour once no fetch copy of its own is in flight (if it
//! sent a request). A rank completes with the error once no copy or
//! multicast touches its buffers, the receive is unregistered, and, if
//! this SP acknowledged a fetch to its right neighbour, that neighbour's
//! `Final` came (or the neighbour was lost). So no buffer is written or
//! read by this protocol after its rank completed.
//!
//! # Driver obligations
//!
//! As for [`crate::mcast_bcast`]: route `Action::Send` (tagged with the
//! `CollKey`); execute `Action::Register` before the actions that follow it
//! (the `Ready`) and `Action::Unregister` synchronously (no chunk of the
//! instance lands after it); land datagram `g` (global PSN) at `(g / n) *
//! len + (g % n) * mtu` of every receive key of the registration and
//! report it once with `handle_landed(g)`; execute every `Action::Copy`
//! and `Action::Multicast` and report each with `handle_copy_done` (their
//! ids share one space); call `handle_timeout` at `poll_timeout` (re-read
//! it after every input). Zero-length copies never reach the driver; a
//! zero-length block is one zero-byte datagram.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::abort::{fail_pending, lose_rank, Outcome};
use crate::common::{common_api, take_finished, Core};
pub use crate::mcast_bcast::subgroup_runs;
use crate::staged::mutation_switch;
pub use crate::staged::CopyId;
use crate::{CollKey, Nanos, Rank, SpId, Status};

mod messages;
mod state;
#[cfg(test)]
mod tests;
mod types;

pub use state::McastAllgather;
use state::*;
pub use types::*;

/// Deliberately broken variants, switched on per test thread by the
/// simulator's tests to show that its checkers catch them. Compiled out of
/// non-test builds.
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mutation {
    /// A fetch copies each acknowledged run but its last chunk, and sets
    /// the bits of all.
    SkipLastChunk,
    /// The fetch ring is wired the wrong way: an SP fetches from its right
    /// neighbour (who serves it) and still sends `Final` to its left.
    FetchFromRight,
    /// Ranks complete once every chunk is in, without waiting for the
    /// right neighbour's `Final`.
    CompleteBeforeFinal,
    /// A fetch request is answered only once every requested chunk is in
    /// (the bcast's rule), not in part.
    WholeAcks,
}

mutation_switch!(Mutation);

/// The ring of SPs serving `members`, in id order (position 0: the
/// coordinator of the RNR barrier).
pub fn build_ring(members: &[SpId]) -> Vec<SpId> {
    let sps: BTreeSet<SpId> = members.iter().copied().collect();
    sps.into_iter().collect()
}

/// The default number of broadcast chains for `k` SPs: `round(sqrt(k))`,
/// at least 1.
pub fn default_chains(k: usize) -> usize {
    let mut m = 1usize;
    // (m + 1/2)^2 < k  <=>  4m^2 + 4m + 1 < 4k
    while 4 * m * m + 4 * m + 1 < 4 * k {
        m += 1;
    }
    m.min(k.max(1))
}

/// The ring positions `[first, end)` of each of the `m` broadcast chains
/// over `k` SPs (`m` clamped to `1..=k`; contiguous, lengths differing by
/// at most one).
pub fn chain_bounds(k: usize, m: usize) -> Vec<(usize, usize)> {
    let m = m.clamp(1, k.max(1));
    (0..m).map(|c| (c * k / m, (c + 1) * k / m)).collect()
}

/// A 64-bit digest (FNV-1a) of a members list, carried in the view.
pub fn members_digest(members: &[SpId]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &m in members {
        for b in m.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h ^ members.len() as u64
}
