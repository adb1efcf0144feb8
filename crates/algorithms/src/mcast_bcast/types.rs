//! The multicast bcast's public types: configuration, posts, messages,
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
    /// Multicast subgroups the chunks are spread over (0 is clamped to 1).
    pub subgroups: u16,
    /// `B_link` of the cutoff timer, in bytes per ns (0 is clamped to 1).
    pub link_bytes_per_ns: u64,
    /// `alpha` of the cutoff timer: RNR synchronisation and network noise.
    pub alpha_ns: Nanos,
}

/// What one local rank posted (its buffer already checked by the driver
/// against its grant: `key` holds at least `len` bytes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Post<K> {
    pub rank: Rank,
    pub root: Rank,
    /// SP serving each comm rank; its length is the comm size P.
    pub members: Vec<SpId>,
    /// The rank's buffer (message at offset 0): read at the root, written
    /// elsewhere.
    pub key: K,
    pub len: u64,
}

/// SP-to-SP messages of this collective (the driver adds the `CollKey`).
/// Those that carry a view (`root`, `len`, `mtu`) are checked against the
/// receiver's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg<K> {
    /// From the root's SP to every other SP, once its root rank posted.
    Open {
        root: Rank,
        len: u64,
        mtu: u64,
        subgroups: u16,
        ring: Vec<SpId>,
    },
    /// From a leaf SP to the root's SP: every local rank posted and the
    /// receive is registered (the RNR barrier).
    Ready { root: Rank, len: u64, mtu: u64 },
    /// From the root's SP to every other SP: every multicast is done.
    Sent { root: Rank, len: u64, mtu: u64 },
    /// To the left neighbour: the sender misses the chunks `[first, end)`
    /// of each range (sorted, disjoint, not empty).
    FetchReq {
        root: Rank,
        len: u64,
        mtu: u64,
        ranges: Vec<(u64, u64)>,
    },
    /// To the right neighbour, answering its `FetchReq`: every requested
    /// chunk is in the buffer `key` (at `psn * mtu`).
    FetchAck { key: K },
    /// To the left neighbour: the sender will never read its buffers again.
    Final { root: Rank, len: u64, mtu: u64 },
    /// The collective failed; stop and complete everyone with `status`.
    Abort { status: Status },
}

impl<K> Msg<K> {
    /// The memory keys the message carries (an SP checks where a peer's keys point).
    pub fn keys(&self) -> Vec<&K> {
        match self {
            Msg::FetchAck { key } => vec![key],
            Msg::Open { .. }
            | Msg::Ready { .. }
            | Msg::Sent { .. }
            | Msg::FetchReq { .. }
            | Msg::Final { .. }
            | Msg::Abort { .. } => Vec::new(),
        }
    }
}

/// Copy `len` bytes at `offset` of buffer `src` into the same place of
/// local rank `rank`'s buffer `dst`: a host-to-host copy at the root's SP
/// (`src` the root's buffer), or a fetch (`src` a buffer of the left
/// neighbour's rank, read remotely).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Copy<K> {
    pub id: CopyId,
    pub rank: Rank,
    pub src: K,
    pub dst: K,
    pub offset: u64,
    pub len: u64,
}

/// Multicast chunks `first_psn..first_psn + psns` of the root's buffer
/// `key` (bytes `offset..offset + len`, `mtu` bytes each, the last maybe
/// shorter; a 0-byte message is one 0-byte datagram) to subgroup
/// `subgroup`; report with `handle_copy_done(id)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Multicast<K> {
    pub id: CopyId,
    pub key: K,
    pub subgroup: u16,
    pub first_psn: u64,
    pub psns: u64,
    pub offset: u64,
    pub len: u64,
    pub mtu: u64,
    /// The message's chunks in all (every datagram carries it: a receiver registered for
    /// another count drops it).
    pub chunks: u64,
}

/// Have the receive workers accept this instance's `chunks` chunks
/// (`mtu` bytes each, `len` bytes in all, over `subgroups` subgroups) and
/// land chunk `psn` at `psn * mtu` of every buffer in `keys` (the SP's
/// local ranks) before reporting it with `handle_landed`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Register<K> {
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
        /// `root >= members.len()`.
        RootOutOfRange { root: Rank, size: usize },
        /// `members` differs from an earlier post of this instance.
        MembersDisagree,
    }
    display(f) {
        PostError::RootOutOfRange { root, size } => {
            write!(f, "root {root} out of range for comm size {size}")
        }
        PostError::MembersDisagree => write!(f, "members differ from an earlier post"),
    }
}

/// A protocol violation by a peer; the instance is unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MsgError {
    /// From an SP outside the ring.
    NotMember { sp: SpId },
    /// An `Open` whose ring does not start at its sender, or a `Sent` not
    /// from the root's SP of this SP's view (an `Open` from another SP
    /// claiming the root, or a `Ready` at an SP that is not the root's, is
    /// a disagreement and aborts instead).
    NotRoot { sp: SpId },
    /// A second `Open`, `Ready`, `Sent` or `Final` from the same SP.
    Duplicate { sp: SpId },
    /// A `FetchReq` not from the right neighbour, a second one, or with bad
    /// ranges.
    BadFetch { sp: SpId },
    /// A `FetchAck` not from the left neighbour, or with no request
    /// outstanding.
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
    /// Landed reports after the receive was unregistered, or out of range
    /// (ignored).
    pub landed_ignored: u64,
    /// Chunks multicast by this SP (as the root's SP).
    pub chunks_multicast: u64,
    /// Cutoff timers that found chunks missing.
    pub cutoffs_missing: u64,
    /// Cutoff timers put off because a chunk had landed less than `alpha`
    /// before them (each needs a new landing: at most one per chunk).
    pub cutoffs_extended: u64,
    /// `FetchReq`s sent / answered with `FetchAck`.
    pub fetch_requests: u64,
    pub fetches_served: u64,
    /// Chunks and bytes fetched (into each local rank: counted once per
    /// chunk).
    pub chunks_fetched: u64,
    pub bytes_fetched: u64,
    /// Host-to-host copies at the root's SP.
    pub local_copies: u64,
    /// `handle_copy_done` calls for unknown ids (ignored).
    pub unknown_done: u64,
    /// Messages ignored because their sender was declared lost.
    pub ignored_from_lost_sp: u64,
    /// `FetchAck`s that came after this SP no longer needed them.
    pub stale_acks: u64,
    /// Bitmap scans before the cutoff: a request from the right neighbour
    /// asked for chunks missing here after the multicast was over.
    pub scans_on_request: u64,
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
            cutoffs_missing,
            cutoffs_extended,
            fetch_requests,
            fetches_served,
            chunks_fetched,
            bytes_fetched,
            local_copies,
            unknown_done,
            ignored_from_lost_sp,
            stale_acks,
            scans_on_request,
        } = *other;
        self.chunks_landed += chunks_landed;
        self.landed_again += landed_again;
        self.landed_ignored += landed_ignored;
        self.chunks_multicast += chunks_multicast;
        self.cutoffs_missing += cutoffs_missing;
        self.cutoffs_extended += cutoffs_extended;
        self.fetch_requests += fetch_requests;
        self.fetches_served += fetches_served;
        self.chunks_fetched += chunks_fetched;
        self.bytes_fetched += bytes_fetched;
        self.local_copies += local_copies;
        self.unknown_done += unknown_done;
        self.ignored_from_lost_sp += ignored_from_lost_sp;
        self.stale_acks += stale_acks;
        self.scans_on_request += scans_on_request;
    }
}
