//! Offloaded `MPI_Allreduce` aggregated by the SPs themselves (issue 27, part 5: the SP
//! tree, for clusters without aggregating switches; `SPOFF_ALLREDUCE_DESIGN=sp-tree`).
//!
//! One [`Allreduce`] object exists per collective instance ([`CollKey`]) per SP. It knows
//! the SP's local ranks from the members list of the first local post.
//!
//! # Protocol
//!
//! *Tree.* The SPs serving members of the communicator, in the order of the first comm rank
//! each serves (so the SP of comm rank 0 is at position 0, the root), form a binomial tree
//! over their positions: the parent of position `i > 0` is `i` with its lowest set bit
//! cleared; the children of `i` are `i + 2^k` for every `2^k` below `i`'s lowest set bit
//! (every `2^k` for the root), in increasing `k`, that exist.
//!
//! *Up.* Each SP reads the send buffer of each of its local ranks into its own memory
//! ([`Action::Read`]; the driver lands the bytes and hands them back with
//! [`Allreduce::handle_copy_done`]). Once it has every local rank's contribution and the
//! partial result of every child, it reduces them in a fixed order (its local ranks by comm
//! rank, then its children in child order, each folded into the accumulator from the left)
//! and sends the result to its parent (`Up`). So the floating-point result depends only on
//! the communicator's placement, never on timing, and it is one value: the root's.
//!
//! *Down.* The root SP's accumulator is the result: it sends it to its children (`Down`),
//! each SP forwards it to its own children and writes it into each local rank's receive
//! buffer ([`Action::Write`], from the bytes [`Allreduce::result`] returns); a rank completes
//! when its write is done.
//!
//! *One block.* The message goes as one block of at most [`MAX_BYTES`] (the bound that keeps
//! an `Up`/`Down` within one frame of the SP-to-SP protocol); larger allreduces stay native
//! (the shim decides that from the count and the type, alike on every rank). Pipelining in
//! chunks is not done yet.
//!
//! *Consistency.* Posts of one instance must agree on members, length and reduction (MPI
//! requires it): a local post that differs is refused; an `Up` whose length or reduction
//! differs from this SP's aborts the instance (`CountMismatch`).
//!
//! *Failures.* A lost SP of the tree, or a lost local rank, before the result is known
//! aborts the instance (`PeerFailed`, `RankFailed`): this SP completes its ranks with the
//! status and tells every other SP of the tree (`Abort`), which does the same. A rank whose
//! copy is in flight completes once the copy is done (nothing of the instance touches its
//! memory afterwards). A failed read aborts (`AccessError`); a failed write fails that rank
//! only. Once the result is known nothing but the writes remain, and a lost peer changes
//! nothing. Every path ends in a completion of every local rank: never a hang.

mod reduce;
#[cfg(test)]
mod tests;

pub use reduce::{reduce_into, Elem, Op, Reduce, ReduceError};

use crate::{CollKey, Nanos, Rank, SpId, Status};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// The largest allreduce, in bytes, that is offloaded (one block in one SP-to-SP frame).
pub const MAX_BYTES: u64 = 1 << 20;
/// Messages from peers kept before this SP's first local post (at most one per peer SP, and
/// no more than this many).
const MAX_EARLY: usize = 65536;

/// Bytes carried by a message (serialized as one byte string).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Bytes(pub Vec<u8>);

impl Serialize for Bytes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Bytes;
            fn expecting(&self, f: &mut core::fmt::Formatter) -> core::fmt::Result {
                f.write_str("a byte string")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Bytes, E> {
                Ok(Bytes(v.to_vec()))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Bytes, E> {
                Ok(Bytes(v))
            }
        }
        d.deserialize_byte_buf(V)
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub me: SpId,
}

/// A local rank's post: its send buffer's key (what it contributes), its receive buffer's
/// key (where the result goes), both `len` bytes at offset 0.
#[derive(Clone, Debug)]
pub struct Post<K> {
    pub rank: Rank,
    pub members: Vec<SpId>,
    pub send: K,
    pub recv: K,
    pub len: u64,
    pub reduce: Reduce,
}

/// SP-to-SP messages of one instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// A child's subtree reduced (with the child's view of the length and reduction).
    Up {
        len: u64,
        reduce: Reduce,
        data: Bytes,
    },
    /// The result, from the parent.
    Down {
        data: Bytes,
    },
    Abort {
        status: Status,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CopyId(pub u64);

/// What the driver must do.
#[derive(Debug)]
pub enum Action<K> {
    Send {
        to: SpId,
        msg: Msg,
    },
    /// Read `len` bytes at offset 0 of `key` (rank `rank`'s send buffer) into SP memory; hand
    /// them to `handle_copy_done`.
    Read {
        id: CopyId,
        rank: Rank,
        key: K,
        len: u64,
    },
    /// Write the `len` bytes of [`Allreduce::result`] at offset 0 of `key` (rank `rank`'s
    /// receive buffer).
    Write {
        id: CopyId,
        rank: Rank,
        key: K,
        len: u64,
    },
    Complete {
        rank: Rank,
        status: Status,
    },
}

/// A post or a message this instance cannot take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error(pub String);

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The positions of the binomial tree: the parent of `i` (`None` for the root) and its
/// children in order, among `n` positions.
pub fn tree(i: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    let parent = (i > 0).then(|| i & (i - 1));
    let low = if i == 0 {
        usize::MAX
    } else {
        1 << i.trailing_zeros()
    };
    let mut children = Vec::new();
    let mut step = 1usize;
    while step < low && i + step < n {
        children.push(i + step);
        step <<= 1;
    }
    (parent, children)
}

/// The SPs of the tree in position order: each distinct member in the order of the first
/// comm rank it serves.
pub fn tree_sps(members: &[SpId]) -> Vec<SpId> {
    let mut seen = BTreeSet::new();
    members
        .iter()
        .copied()
        .filter(|s| seen.insert(*s))
        .collect()
}

/// What an instance knows once its first local post arrived.
#[derive(Debug)]
struct View {
    members: Vec<SpId>,
    len: u64,
    reduce: Reduce,
    sps: Vec<SpId>,
    parent: Option<SpId>,
    children: Vec<SpId>,
    /// The local ranks, in comm rank order.
    local: Vec<Rank>,
}

#[derive(Debug, Clone, Copy)]
enum CopyOf {
    Read(Rank),
    Write(Rank),
}

/// One allreduce instance on one SP.
#[derive(Debug)]
pub struct Allreduce<K> {
    key: CollKey,
    me: SpId,
    view: Option<View>,
    /// The posted local ranks' receive keys.
    posted: BTreeMap<Rank, K>,
    contrib: BTreeMap<Rank, Vec<u8>>,
    partials: BTreeMap<SpId, Vec<u8>>,
    early: Vec<(SpId, Msg)>,
    sent_up: bool,
    result: Option<Vec<u8>>,
    copies: BTreeMap<u64, CopyOf>,
    next_copy: u64,
    completed: BTreeSet<Rank>,
    lost_unposted: BTreeSet<Rank>,
    lost_sps: BTreeSet<SpId>,
    /// Ranks lost before the view (sorted out once it is known).
    lost_early: BTreeSet<Rank>,
    aborted: Option<Status>,
    actions: VecDeque<Action<K>>,
}

impl<K: Clone + core::fmt::Debug> Allreduce<K> {
    pub fn new(key: CollKey, cfg: Config) -> Allreduce<K> {
        Allreduce {
            key,
            me: cfg.me,
            view: None,
            posted: BTreeMap::new(),
            contrib: BTreeMap::new(),
            partials: BTreeMap::new(),
            early: Vec::new(),
            sent_up: false,
            result: None,
            copies: BTreeMap::new(),
            next_copy: 0,
            completed: BTreeSet::new(),
            lost_unposted: BTreeSet::new(),
            lost_sps: BTreeSet::new(),
            lost_early: BTreeSet::new(),
            aborted: None,
            actions: VecDeque::new(),
        }
    }

    pub fn key(&self) -> CollKey {
        self.key
    }

    /// The result's bytes, once known (what every [`Action::Write`] writes).
    pub fn result(&self) -> Option<&[u8]> {
        self.result.as_deref()
    }

    /// The status the instance was aborted with, if it was.
    pub fn abort_status(&self) -> Option<Status> {
        self.aborted
    }

    pub fn poll_action(&mut self) -> Option<Action<K>> {
        self.actions.pop_front()
    }

    pub fn copies_in_flight(&self) -> usize {
        self.copies.len()
    }

    pub fn is_finished(&self) -> bool {
        self.view
            .as_ref()
            .is_some_and(|v| self.completed.len() + self.lost_unposted.len() == v.local.len())
            && self.copies.is_empty()
            && self.actions.is_empty()
    }

    fn copy_id(&mut self, of: CopyOf) -> CopyId {
        let id = self.next_copy;
        self.next_copy += 1;
        self.copies.insert(id, of);
        CopyId(id)
    }

    fn complete(&mut self, rank: Rank, status: Status) {
        if self.completed.insert(rank) {
            self.actions.push_back(Action::Complete { rank, status });
        }
    }

    pub fn handle_post(&mut self, _now: Nanos, post: Post<K>) -> Result<(), Error> {
        let p = post.members.len();
        let r = post.rank as usize;
        if r >= p || post.members[r] != self.me {
            return Err(Error(format!(
                "rank {} of {p} is not served by SP {}",
                post.rank, self.me
            )));
        }
        let elem = post.reduce.elem.size() as u64;
        if !post.reduce.is_valid() || !post.len.is_multiple_of(elem) || post.len > MAX_BYTES {
            return Err(Error(format!(
                "an allreduce of {} bytes of {:?} by {:?} is not offloaded",
                post.len, post.reduce.elem, post.reduce.op
            )));
        }
        match &self.view {
            Some(v) => {
                if v.members != post.members || v.len != post.len || v.reduce != post.reduce {
                    return Err(Error(format!(
                        "rank {}'s post differs from the instance's (members, {} bytes, {:?})",
                        post.rank, v.len, v.reduce
                    )));
                }
            }
            None => {
                let sps = tree_sps(&post.members);
                let at = sps.iter().position(|&s| s == self.me).expect("served");
                let (parent, children) = tree(at, sps.len());
                let local = (0..p as Rank)
                    .filter(|&q| post.members[q as usize] == self.me)
                    .collect();
                self.view = Some(View {
                    members: post.members.clone(),
                    len: post.len,
                    reduce: post.reduce,
                    parent: parent.map(|i| sps[i]),
                    children: children.into_iter().map(|i| sps[i]).collect(),
                    sps,
                    local,
                });
                for r in std::mem::take(&mut self.lost_early) {
                    if post.members.get(r as usize) == Some(&self.me) && r != post.rank {
                        self.lost_unposted.insert(r);
                    }
                }
            }
        }
        if self.posted.contains_key(&post.rank)
            || self.lost_unposted.contains(&post.rank)
            || self.completed.contains(&post.rank)
        {
            return Err(Error(format!("rank {} posted twice", post.rank)));
        }
        self.posted.insert(post.rank, post.recv);
        if let Some(status) = self.aborted {
            self.complete(post.rank, status);
            return Ok(());
        }
        if post.len == 0 {
            self.contrib.insert(post.rank, Vec::new());
        } else {
            let id = self.copy_id(CopyOf::Read(post.rank));
            self.actions.push_back(Action::Read {
                id,
                rank: post.rank,
                key: post.send,
                len: post.len,
            });
        }
        // Messages and failures that came before the view.
        for (from, msg) in std::mem::take(&mut self.early) {
            self.take_msg(from, msg)?;
        }
        if self.lost_sps.iter().any(|s| self.in_tree(*s)) {
            self.abort_here(Status::PeerFailed, true);
        }
        self.progress();
        Ok(())
    }

    fn in_tree(&self, sp: SpId) -> bool {
        self.view.as_ref().is_some_and(|v| v.sps.contains(&sp))
    }

    pub fn handle_msg(&mut self, _now: Nanos, from: SpId, msg: Msg) -> Result<(), Error> {
        if self.view.is_none() {
            if let Msg::Abort { status } = msg {
                self.abort_here(status, false);
                return Ok(());
            }
            // A peer sends one `Up` or one `Down` to this SP per instance: one message per
            // peer (at most `MAX_BYTES` each) is all this SP keeps before it has a view.
            if self.early.len() >= MAX_EARLY || self.early.iter().any(|(f, _)| *f == from) {
                return Err(Error(format!(
                    "a second message from SP {from} before the first post"
                )));
            }
            self.early.push((from, msg));
            return Ok(());
        }
        self.take_msg(from, msg)?;
        self.progress();
        Ok(())
    }

    fn take_msg(&mut self, from: SpId, msg: Msg) -> Result<(), Error> {
        let v = self.view.as_ref().expect("a view");
        match msg {
            Msg::Abort { status } => {
                self.abort_here(status, false);
            }
            Msg::Up { len, reduce, data } => {
                if !v.children.contains(&from) || self.partials.contains_key(&from) {
                    return Err(Error(format!(
                        "an Up from SP {from}, not a child waited for"
                    )));
                }
                if self.aborted.is_some() {
                    return Ok(());
                }
                if len != v.len || reduce != v.reduce || data.0.len() as u64 != v.len {
                    self.abort_here(Status::CountMismatch, true);
                    return Ok(());
                }
                self.partials.insert(from, data.0);
            }
            Msg::Down { data } => {
                if v.parent != Some(from) || self.result.is_some() {
                    return Err(Error(format!("a Down from SP {from}, not the parent")));
                }
                if self.aborted.is_some() {
                    return Ok(());
                }
                if data.0.len() as u64 != v.len {
                    self.abort_here(Status::CountMismatch, true);
                    return Ok(());
                }
                self.set_result(data.0);
            }
        }
        Ok(())
    }

    /// Reduces and sends up once everything below this SP is in.
    fn progress(&mut self) {
        if self.aborted.is_some() || self.sent_up || self.result.is_some() {
            return;
        }
        let Some(v) = &self.view else { return };
        if self.contrib.len() != v.local.len() || self.partials.len() != v.children.len() {
            return;
        }
        let reduce = v.reduce;
        let mut parts = v
            .local
            .iter()
            .map(|r| &self.contrib[r])
            .chain(v.children.iter().map(|c| &self.partials[c]));
        let mut acc = parts.next().cloned().unwrap_or_default();
        for x in parts {
            reduce_into(reduce, &mut acc, x).expect("lengths checked on arrival");
        }
        match v.parent {
            Some(parent) => {
                self.sent_up = true;
                let msg = Msg::Up {
                    len: v.len,
                    reduce,
                    data: Bytes(acc),
                };
                self.actions.push_back(Action::Send { to: parent, msg });
                self.contrib.clear();
                self.partials.clear();
            }
            None => {
                self.contrib.clear();
                self.partials.clear();
                self.set_result(acc);
            }
        }
    }

    /// The result is known: down the tree, into every local rank.
    fn set_result(&mut self, data: Vec<u8>) {
        let v = self.view.as_ref().expect("a view");
        for &c in &v.children {
            self.actions.push_back(Action::Send {
                to: c,
                msg: Msg::Down {
                    data: Bytes(data.clone()),
                },
            });
        }
        let len = v.len;
        self.result = Some(data);
        let posted: Vec<(Rank, K)> = self
            .posted
            .iter()
            .filter(|(r, _)| !self.completed.contains(r))
            .map(|(r, k)| (*r, k.clone()))
            .collect();
        for (rank, key) in posted {
            if len == 0 {
                self.complete(rank, Status::Ok);
            } else {
                let id = self.copy_id(CopyOf::Write(rank));
                self.actions.push_back(Action::Write { id, rank, key, len });
            }
        }
    }

    /// A read or a write finished; a read hands its bytes (`data`, the `len` bytes read).
    pub fn handle_copy_done(&mut self, _now: Nanos, id: CopyId, status: Status, data: Vec<u8>) {
        let Some(of) = self.copies.remove(&id.0) else {
            return;
        };
        match of {
            CopyOf::Read(rank) => {
                if let Some(st) = self.aborted {
                    self.complete(rank, st);
                    return;
                }
                let len = self.view.as_ref().map_or(0, |v| v.len);
                if !status.is_ok() || data.len() as u64 != len {
                    self.abort_here(Status::AccessError, true);
                    return;
                }
                self.contrib.insert(rank, data);
                self.progress();
            }
            CopyOf::Write(rank) => {
                let st = if status.is_ok() {
                    Status::Ok
                } else {
                    Status::AccessError
                };
                self.complete(rank, st);
            }
        }
    }

    pub fn handle_peer_lost(&mut self, _now: Nanos, sp: SpId) {
        if self.view.is_none() {
            self.lost_sps.insert(sp);
        } else if self.in_tree(sp) && self.result.is_none() {
            self.abort_here(Status::PeerFailed, true);
        }
    }

    pub fn handle_rank_lost(&mut self, _now: Nanos, rank: Rank) {
        let local = self.view.as_ref().map(|v| v.local.contains(&rank));
        match local {
            Some(true) if !self.posted.contains_key(&rank) => {
                self.lost_unposted.insert(rank);
            }
            None => {
                self.lost_early.insert(rank);
            }
            _ => {}
        }
        if self.result.is_none() {
            self.abort_here(Status::RankFailed, true);
        }
    }

    pub fn abort(&mut self, _now: Nanos, status: Status) {
        self.abort_here(status, true);
    }

    /// Completes the posted ranks with `status` (those with a copy in flight when it is
    /// done) and, `tell`, tells every other SP of the tree.
    fn abort_here(&mut self, status: Status, tell: bool) {
        if self.aborted.is_some() {
            return;
        }
        self.aborted = Some(status);
        if tell {
            if let Some(v) = &self.view {
                for &sp in &v.sps {
                    if sp != self.me {
                        self.actions.push_back(Action::Send {
                            to: sp,
                            msg: Msg::Abort { status },
                        });
                    }
                }
            }
        }
        let busy: BTreeSet<Rank> = self
            .copies
            .values()
            .map(|c| match c {
                CopyOf::Read(r) | CopyOf::Write(r) => *r,
            })
            .collect();
        let idle: Vec<Rank> = self
            .posted
            .keys()
            .filter(|r| !busy.contains(r))
            .copied()
            .collect();
        for r in idle {
            self.complete(r, status);
        }
        self.contrib.clear();
        self.partials.clear();
    }
}
