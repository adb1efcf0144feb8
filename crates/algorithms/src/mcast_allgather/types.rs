//! The multicast allgather's public types: configuration, posts, messages,
//! actions, errors and counters.

use super::*;

/// Static configuration of one instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Config {
    /// The SP running this instance.
    pub me: SpId,
    /// Bytes per chunk (datagram payload; 0 is clamped to 1). Every SP of a
    /// job must use the same value.
    pub mtu: u64,
    /// Multicast subgroups the chunks of each block are spread over (0 is
    /// clamped to 1).
    pub subgroups: u16,
    /// Broadcast chains `M` (concurrent roots per step); 0: the default
    /// for the number of SPs ([`default_chains`]). Clamped to the number of
    /// SPs. Every SP of a job must use the same value.
    pub chains: u32,
    /// `B_link` of the cutoff timer, in bytes per ns (0 is clamped to 1).
    pub link_bytes_per_ns: u64,
    /// `alpha` of the cutoff timer: RNR synchronisation and network noise.
    pub alpha_ns: Nanos,
}

/// What one local rank posted (its buffers already checked by the driver
/// against its grants: `send_key` holds at least `len` bytes, `recv_key`
/// at least `members.len() * len`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Post<K> {
    pub rank: Rank,
    /// SP serving each comm rank; its length is the comm size P.
    pub members: Vec<SpId>,
    /// The rank's block (read only).
    pub send_key: K,
    /// The rank's receive buffer: block `b` at `b * len`.
    pub recv_key: K,
    /// Block length (the same on every rank).
    pub len: u64,
}

/// An SP's view of the instance, carried by the messages that need it and
/// checked by their receivers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    pub len: u64,
    pub mtu: u64,
    pub subgroups: u16,
    /// The number of chains in force (after the default and the clamp).
    pub chains: u32,
    /// [`members_digest`] of the members list.
    pub members: u64,
}

impl Shape {
    /// The abort status if `other` disagrees with this view.
    pub fn disagreement(&self, other: &Shape) -> Option<Status> {
        if self.len != other.len {
            Some(Status::CountMismatch)
        } else if self != other {
            Some(Status::InvalidPost)
        } else {
            None
        }
    }
}

/// SP-to-SP messages of this collective (the driver adds the `CollKey`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg<K> {
    /// From the coordinator to every other SP, once it has a view (so that
    /// an SP that aborted before any of its ranks posted hears from it and
    /// answers with its `Abort`).
    Open { shape: Shape },
    /// To the coordinator: every local rank posted and the receive is
    /// registered (the RNR barrier).
    Ready { shape: Shape },
    /// From the coordinator to every other SP: every SP is ready.
    Start { shape: Shape },
    /// To the next SP of the sender's chain: the sender's multicasts are
    /// done (the activation signal).
    Go { shape: Shape },
    /// To the left neighbour: the sender misses the global PSNs
    /// `[first, end)` of each range (sorted, disjoint, not empty).
    FetchReq {
        shape: Shape,
        ranges: Vec<(u64, u64)>,
    },
    /// To the right neighbour, answering its `FetchReq` in part: the
    /// chunks of `ranges` (requested, never acknowledged before) are in the
    /// receive buffer `key`.
    FetchAck { key: K, ranges: Vec<(u64, u64)> },
    /// To the left neighbour: the sender will never read its buffers again.
    Final { shape: Shape },
    /// The collective failed; stop and complete everyone with `status`.
    Abort { status: Status },
}

impl<K> Msg<K> {
    /// The memory keys the message carries (an SP checks where a peer's keys point).
    pub fn keys(&self) -> Vec<&K> {
        match self {
            Msg::FetchAck { key, .. } => vec![key],
            Msg::Open { .. }
            | Msg::Ready { .. }
            | Msg::Start { .. }
            | Msg::Go { .. }
            | Msg::FetchReq { .. }
            | Msg::Final { .. }
            | Msg::Abort { .. } => Vec::new(),
        }
    }
}

/// Copy `len` bytes at `src_offset` of buffer `src` to `dst_offset` of
/// local rank `rank`'s receive buffer `dst`: a local copy (`src` a local
/// rank's send buffer) or a fetch (`src` the left neighbour's receive
/// buffer, read remotely; both offsets equal).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Copy<K> {
    pub id: CopyId,
    pub rank: Rank,
    pub src: K,
    pub src_offset: u64,
    pub dst: K,
    pub dst_offset: u64,
    pub len: u64,
}

/// Multicast the global PSNs `first_psn..first_psn + psns` (chunks of
/// block `block`) read from bytes `offset..offset + len` of the send
/// buffer `key` (`mtu` bytes each, the last maybe shorter; a 0-byte block
/// is one 0-byte datagram) to subgroup `subgroup`; report with
/// `handle_copy_done(id)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Multicast<K> {
    pub id: CopyId,
    pub key: K,
    pub block: Rank,
    pub subgroup: u16,
    pub first_psn: u64,
    pub psns: u64,
    pub offset: u64,
    pub len: u64,
    pub mtu: u64,
    /// Global PSNs of the instance in all (`blocks * chunks` of its `Register`): every
    /// datagram carries it.
    pub chunks: u64,
}

/// Have the receive workers accept this instance's datagrams (global PSNs
/// `0..blocks * chunks`, `chunks` per block of `len` bytes, `mtu` bytes
/// each, over `subgroups` subgroups) and land PSN `g` at `(g / chunks) *
/// len + (g % chunks) * mtu` of every receive buffer in `keys` (the SP's
/// local ranks) before reporting it with `handle_landed`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Register<K> {
    pub blocks: u64,
    pub chunks: u64,
    pub mtu: u64,
    pub len: u64,
    pub subgroups: u16,
    pub keys: Vec<(Rank, K)>,
}

/// Output of the state machine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action<K> {
    /// Send `msg` to SP `to` (never this SP itself).
    Send { to: SpId, msg: Msg<K> },
    /// Register the receive (before the actions that follow).
    Register(Register<K>),
    /// Stop landing chunks of this instance (synchronously).
    Unregister,
    /// Start this multicast; report it with `handle_copy_done`.
    Multicast(Multicast<K>),
    /// Start this copy; report it with `handle_copy_done`.
    Copy(Copy<K>),
    /// Local `rank` is done; emitted exactly once per posted rank.
    Complete { rank: Rank, status: Status },
}

crate::common::post_error! {
    own {
        /// `members` differs from an earlier post of this instance.
        MembersDisagree,
    }
    display(f) {
        PostError::MembersDisagree => write!(f, "members differ from an earlier post"),
    }
}

/// A protocol violation by a peer; the instance is unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MsgError {
    /// From an SP outside the ring.
    NotMember { sp: SpId },
    /// An `Open` or `Start` from an SP that is not the coordinator (a
    /// `Ready` at an SP that is not the coordinator is a disagreement and
    /// aborts).
    NotCoordinator { sp: SpId },
    /// A `Go` not from the chain predecessor.
    UnexpectedGo { sp: SpId },
    /// A second `Open`, `Ready`, `Start`, `Go` or `Final` from the same SP.
    Duplicate { sp: SpId },
    /// A `FetchReq` not from the right neighbour, a second one, or with bad
    /// ranges.
    BadFetch { sp: SpId },
    /// A `FetchAck` not from the left neighbour, with no request
    /// outstanding, or for chunks not requested.
    UnexpectedAck { sp: SpId },
    /// A `Final` not from the right neighbour.
    UnexpectedFinal { sp: SpId },
    /// More messages from one SP before this SP had a view than the
    /// protocol ever sends.
    TooEarly { sp: SpId },
}

crate::common::debug_error!(MsgError);

/// Counters for drivers, tests and the simulator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Chunks reported landed (first time).
    pub chunks_landed: u64,
    /// Landed reports for chunks already in (fetched, or a duplicate).
    pub landed_again: u64,
    /// Landed reports after the receive was unregistered, out of range or
    /// of this SP's own blocks (ignored).
    pub landed_ignored: u64,
    /// Chunks (datagrams) and payload bytes multicast by this SP.
    pub chunks_multicast: u64,
    pub bytes_multicast: u64,
    /// Cutoff timers that found chunks missing.
    pub cutoffs_missing: u64,
    /// Cutoff timers put off because a chunk had landed less than `alpha`
    /// before them (each needs a new landing: at most one per chunk).
    pub cutoffs_extended: u64,
    /// `FetchReq`s sent; `FetchAck`s sent and received.
    pub fetch_requests: u64,
    pub fetch_acks_sent: u64,
    pub fetch_acks_received: u64,
    /// Chunks and bytes fetched (into each local rank: counted once per
    /// chunk).
    pub chunks_fetched: u64,
    pub bytes_fetched: u64,
    /// Host-to-host copies of local blocks.
    pub local_copies: u64,
    /// `handle_copy_done` calls for unknown ids (ignored).
    pub unknown_done: u64,
    /// Messages ignored because their sender was declared lost.
    pub ignored_from_lost_sp: u64,
    /// `FetchAck`s that came after this SP no longer needed them.
    pub stale_acks: u64,
}

impl Stats {
    /// Adds `other`'s counters into these, as when totalling the counters
    /// of many instances.
    pub fn absorb(&mut self, other: &Stats) {
        let Stats {
            chunks_landed,
            landed_again,
            landed_ignored,
            chunks_multicast,
            bytes_multicast,
            cutoffs_missing,
            cutoffs_extended,
            fetch_requests,
            fetch_acks_sent,
            fetch_acks_received,
            chunks_fetched,
            bytes_fetched,
            local_copies,
            unknown_done,
            ignored_from_lost_sp,
            stale_acks,
        } = *other;
        self.chunks_landed += chunks_landed;
        self.landed_again += landed_again;
        self.landed_ignored += landed_ignored;
        self.chunks_multicast += chunks_multicast;
        self.bytes_multicast += bytes_multicast;
        self.cutoffs_missing += cutoffs_missing;
        self.cutoffs_extended += cutoffs_extended;
        self.fetch_requests += fetch_requests;
        self.fetch_acks_sent += fetch_acks_sent;
        self.fetch_acks_received += fetch_acks_received;
        self.chunks_fetched += chunks_fetched;
        self.bytes_fetched += bytes_fetched;
        self.local_copies += local_copies;
        self.unknown_done += unknown_done;
        self.ignored_from_lost_sp += ignored_from_lost_sp;
        self.stale_acks += stale_acks;
    }
}
