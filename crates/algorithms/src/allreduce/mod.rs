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
//! *Chunks.* The message is cut into chunks of [`Config::chunk_bytes`] (the last one shorter;
//! one empty chunk for an empty message), each reduced and broadcast on its own, in a
//! pipeline: an SP has at most [`WINDOW`] chunks in progress, from the lowest chunk not yet
//! written into all its ranks on; it reads a later chunk only once the lowest is written. A
//! child is then at most [`WINDOW`] chunks ahead of its parent (it needs the parent's result
//! of a chunk to move its window past it), so a parent holds at most `2 * WINDOW` chunks and an
//! `Up` beyond that is a protocol error. An SP's memory is bounded by its window, not by the
//! message (up to [`MAX_BYTES`]); each message carries one chunk, within one SP-to-SP frame.
//!
//! *Up.* Each SP reads the chunk of the send buffer of each of its local ranks into its own
//! memory ([`Action::Read`]; the driver lands the bytes and hands them back with
//! [`Allreduce::handle_copy_done`]). Once it has a chunk of every local rank and of every
//! child, it reduces them in a fixed order (its local ranks by comm rank, then its children
//! in child order, each folded into the accumulator from the left) and sends the chunk to its
//! parent (`Up`). So the floating-point result depends only on the communicator's placement,
//! never on timing or chunking, and it is one value: the root's.
//!
//! *Down.* The root SP's accumulator is the chunk's result: it sends it to its children
//! (`Down`), each SP forwards it to its own children and writes it into each local rank's
//! receive buffer ([`Action::Write`], from the bytes [`Allreduce::result`] returns); a rank
//! completes when every chunk is written into it.
//!
//! *Outside the SPs* ([`Between::Network`], the Canary design): no tree; each SP reduces its
//! local ranks' chunk in the same fixed order and hands it out ([`Action::Contribute`]); the
//! chunk's result comes back ([`Allreduce::handle_outside`]) and is written as above. The
//! floating-point result then also depends on the order the switches combined the SPs' parts
//! in, but it is still one value, broadcast by the block's leader. A failed chunk aborts the
//! instance on every SP (`Abort`, the only message between SPs).
//!
//! *Consistency.* Posts of one instance must agree on members, length and reduction (MPI
//! requires it): a local post that differs is refused; an `Up` whose length or reduction
//! differs from this SP's aborts the instance (`CountMismatch`).
//!
//! *Failures.* A lost SP of the tree, or a lost local rank, before every chunk's result is
//! known here aborts the instance (`PeerFailed`, `RankFailed`): this SP completes its ranks with the
//! status and tells every other SP of the tree (`Abort`), which does the same. A rank whose
//! copy is in flight completes once the copy is done (nothing of the instance touches its
//! memory afterwards; reads and writes not handed to the driver yet are dropped). A failed
//! read aborts (`AccessError`); a failed write fails that rank only. Once every result is
//! known nothing but the writes remain, and a lost peer changes nothing. Every path ends in a
//! completion of every local rank: never a hang.

mod reduce;
#[cfg(test)]
mod tests;

pub use reduce::{reduce_into, Elem, Op, Reduce, ReduceError};

use crate::{CollKey, Nanos, Rank, SpId, Status};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// The largest allreduce, in bytes, that is offloaded. The message moves in chunks of
/// [`Config::chunk_bytes`], at most [`WINDOW`] of them in progress per SP at a time: the SP
/// memory an instance holds does not grow with this bound.
pub const MAX_BYTES: u64 = 1 << 30;
/// Chunks an SP has in progress at once (read, reduced, sent, waiting for their result or
/// being written): the pipeline's depth, and what bounds an instance's SP memory to about
/// `WINDOW * (local ranks + children + 1) * chunk_bytes`.
pub const WINDOW: u32 = 4;
/// Messages from one peer kept before this SP's first local post: a child sends at most
/// [`WINDOW`] `Up`s before it hears from its parent.
const MAX_EARLY_PER_PEER: usize = WINDOW as usize;
/// Messages from peers kept before this SP's first local post, in all.
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

/// Where the SPs' partial results are combined.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Between {
    /// Along the SPs' binomial tree (`Up`, `Down`): the SP-tree design.
    #[default]
    Tree,
    /// Outside the SPs (the Canary switches): each SP hands its local ranks' reduced chunk
    /// out ([`Action::Contribute`]) and gets the chunk's result back
    /// ([`Allreduce::handle_outside`]); no `Up` or `Down` travels, only `Abort`.
    Network,
}

#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub me: SpId,
    pub between: Between,
    /// The pipeline's chunk, the same on every SP of a cluster (rounded down to a multiple
    /// of 8, so that a chunk is whole elements of every type; from 8 to
    /// [`MAX_CHUNK_BYTES`]).
    pub chunk_bytes: u64,
}

/// The largest chunk: an `Up` or a `Down` carries one, within one SP-to-SP frame.
pub const MAX_CHUNK_BYTES: u64 = 1 << 20;

impl Config {
    fn chunk(self) -> u64 {
        (self.chunk_bytes.min(MAX_CHUNK_BYTES) / 8 * 8).max(8)
    }
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
    /// Chunk `chunk` of a child's subtree, reduced (with the child's view of the length and
    /// reduction).
    Up {
        len: u64,
        reduce: Reduce,
        chunk: u32,
        data: Bytes,
    },
    /// Chunk `chunk` of the result, from the parent.
    Down {
        chunk: u32,
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
    /// Read `len` bytes at `offset` of `key` (rank `rank`'s send buffer) into SP memory; hand
    /// them to `handle_copy_done`.
    Read {
        id: CopyId,
        rank: Rank,
        key: K,
        offset: u64,
        len: u64,
    },
    /// Write the bytes of [`Allreduce::result`]`(chunk)` (`len` of them) at `offset` of `key`
    /// (rank `rank`'s receive buffer).
    Write {
        id: CopyId,
        rank: Rank,
        key: K,
        chunk: u32,
        offset: u64,
        len: u64,
    },
    Complete {
        rank: Rank,
        status: Status,
    },
    /// [`Between::Network`]: chunk `chunk` of this SP's local ranks, reduced, to combine with
    /// every other SP's outside (the SPs of [`Allreduce::sps`], this one at
    /// [`Allreduce::position`]); its result comes back to [`Allreduce::handle_outside`].
    Contribute {
        chunk: u32,
        data: Vec<u8>,
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
    /// Chunks of the message (one, of 0 bytes, for an empty one).
    chunks: u32,
}

#[derive(Debug, Clone, Copy)]
enum CopyOf {
    Read(Rank, u32),
    Write(Rank, u32),
}

/// One chunk in progress.
#[derive(Debug, Default)]
struct Chunk {
    contrib: BTreeMap<Rank, Vec<u8>>,
    partials: BTreeMap<SpId, Vec<u8>>,
    sent_up: bool,
    result: Option<Vec<u8>>,
    /// Writes of the result not done yet.
    writes: usize,
}

/// One allreduce instance on one SP.
#[derive(Debug)]
pub struct Allreduce<K> {
    key: CollKey,
    me: SpId,
    between: Between,
    chunk_bytes: u64,
    view: Option<View>,
    /// The posted local ranks' send and receive keys.
    posted: BTreeMap<Rank, (K, K)>,
    /// Per posted rank: the next chunk whose read is to be issued.
    next_read: BTreeMap<Rank, u32>,
    /// Per posted rank: chunks written into it.
    written: BTreeMap<Rank, u32>,
    /// The chunks in progress (from `low` on).
    chunks: BTreeMap<u32, Chunk>,
    /// Every chunk below it is written into every local rank (and forgotten).
    low: u32,
    /// Chunks above `low` already written everywhere.
    done_above: BTreeSet<u32>,
    early: Vec<(SpId, Msg)>,
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
            between: cfg.between,
            chunk_bytes: cfg.chunk(),
            view: None,
            posted: BTreeMap::new(),
            next_read: BTreeMap::new(),
            written: BTreeMap::new(),
            chunks: BTreeMap::new(),
            low: 0,
            done_above: BTreeSet::new(),
            early: Vec::new(),
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

    /// The result's bytes of chunk `chunk`, once known and until written everywhere (what
    /// every [`Action::Write`] of the chunk writes).
    pub fn result(&self, chunk: u32) -> Option<&[u8]> {
        self.chunks.get(&chunk).and_then(|c| c.result.as_deref())
    }

    /// The SPs of the instance in position order, once a local post came.
    pub fn sps(&self) -> Option<&[SpId]> {
        self.view.as_ref().map(|v| v.sps.as_slice())
    }

    /// This SP's position in [`Allreduce::sps`], once a local post came.
    pub fn position(&self) -> Option<usize> {
        self.view
            .as_ref()
            .and_then(|v| v.sps.iter().position(|&s| s == self.me))
    }

    /// The instance's reduction, once a local post came.
    pub fn reduce(&self) -> Option<Reduce> {
        self.view.as_ref().map(|v| v.reduce)
    }

    /// Chunks of the message (one for an empty one), once a local post came.
    pub fn chunks(&self) -> Option<u32> {
        self.view.as_ref().map(|v| v.chunks)
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

    /// Chunks this SP holds in progress (at most [`WINDOW`], plus children's chunks that came
    /// ahead, at most [`WINDOW`] more).
    pub fn chunks_in_progress(&self) -> usize {
        self.chunks.len()
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

    /// Offset and length of chunk `c`.
    fn span(&self, c: u32) -> (u64, u64) {
        let len = self.view.as_ref().map_or(0, |v| v.len);
        let at = u64::from(c) * self.chunk_bytes;
        (at, self.chunk_bytes.min(len.saturating_sub(at)))
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
                let (parent, children) = match self.between {
                    Between::Tree => tree(at, sps.len()),
                    Between::Network => (None, Vec::new()),
                };
                let local = (0..p as Rank)
                    .filter(|&q| post.members[q as usize] == self.me)
                    .collect();
                let chunks = post.len.div_ceil(self.chunk_bytes).max(1) as u32;
                self.view = Some(View {
                    members: post.members.clone(),
                    len: post.len,
                    reduce: post.reduce,
                    parent: parent.map(|i| sps[i]),
                    children: children.into_iter().map(|i| sps[i]).collect(),
                    sps,
                    local,
                    chunks,
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
        self.posted.insert(post.rank, (post.send, post.recv));
        self.next_read.insert(post.rank, 0);
        self.written.insert(post.rank, 0);
        if let Some(status) = self.aborted {
            self.complete(post.rank, status);
            return Ok(());
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
            // A child sends at most `WINDOW` chunks up before it hears from this SP, which
            // needs a view to answer: that is all this SP keeps from a peer before it has one.
            let from_peer = self.early.iter().filter(|(f, _)| *f == from).count();
            if self.early.len() >= MAX_EARLY || from_peer >= MAX_EARLY_PER_PEER {
                return Err(Error(format!(
                    "more than {MAX_EARLY_PER_PEER} messages from SP {from} before the first post"
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
        let (chunks, vlen, vreduce) = (v.chunks, v.len, v.reduce);
        let is_child = v.children.contains(&from);
        let is_parent = v.parent == Some(from);
        match msg {
            Msg::Abort { status } => {
                self.abort_here(status, false);
            }
            Msg::Up {
                len,
                reduce,
                chunk,
                data,
            } => {
                // A child is at most `WINDOW` chunks ahead of this SP's written ones.
                let ahead = chunk >= self.low + 2 * WINDOW;
                let dup = chunk < self.low
                    || self.done_above.contains(&chunk)
                    || self.chunks.get(&chunk).is_some_and(|c| {
                        c.partials.contains_key(&from) || c.sent_up || c.result.is_some()
                    });
                if !is_child || dup || ahead {
                    return Err(Error(format!(
                        "an Up of chunk {chunk} from SP {from}, not a child's chunk waited for"
                    )));
                }
                if self.aborted.is_some() {
                    return Ok(());
                }
                let (_, clen) = self.span(chunk);
                if len != vlen
                    || reduce != vreduce
                    || chunk >= chunks
                    || data.0.len() as u64 != clen
                {
                    self.abort_here(Status::CountMismatch, true);
                    return Ok(());
                }
                self.chunks
                    .entry(chunk)
                    .or_default()
                    .partials
                    .insert(from, data.0);
            }
            Msg::Down { chunk, data } => {
                let known = chunk < self.low
                    || self.done_above.contains(&chunk)
                    || self.chunks.get(&chunk).is_some_and(|c| c.result.is_some());
                if !is_parent || known || chunk >= chunks {
                    return Err(Error(format!(
                        "a Down of chunk {chunk} from SP {from}, not the parent's chunk waited for"
                    )));
                }
                if self.aborted.is_some() {
                    return Ok(());
                }
                let (_, clen) = self.span(chunk);
                if data.0.len() as u64 != clen {
                    self.abort_here(Status::CountMismatch, true);
                    return Ok(());
                }
                self.set_result(chunk, data.0);
            }
        }
        Ok(())
    }

    /// Issues the reads the window allows, and reduces and sends up every chunk whose parts
    /// are all in.
    fn progress(&mut self) {
        if self.aborted.is_some() {
            return;
        }
        let Some(v) = &self.view else { return };
        let end = (self.low + WINDOW).min(v.chunks);
        // Reads of the posted ranks, chunk by chunk within the window.
        let mut reads = Vec::new();
        for (&rank, (send, _)) in &self.posted {
            let next = self.next_read[&rank];
            for c in next..end {
                reads.push((rank, send.clone(), c));
            }
        }
        for (rank, key, c) in reads {
            self.next_read.insert(rank, c + 1);
            let (offset, len) = self.span(c);
            if len == 0 {
                self.chunks
                    .entry(c)
                    .or_default()
                    .contrib
                    .insert(rank, Vec::new());
            } else {
                self.chunks.entry(c).or_default();
                let id = self.copy_id(CopyOf::Read(rank, c));
                self.actions.push_back(Action::Read {
                    id,
                    rank,
                    key,
                    offset,
                    len,
                });
            }
        }
        // Chunks whose every part is in, in order.
        let v = self.view.as_ref().expect("a view");
        let (nlocal, children, parent, reduce, vlen) =
            (v.local.len(), v.children.clone(), v.parent, v.reduce, v.len);
        let local = v.local.clone();
        let ready: Vec<u32> = self
            .chunks
            .iter()
            .filter(|(_, c)| {
                !c.sent_up
                    && c.result.is_none()
                    && c.contrib.len() == nlocal
                    && c.partials.len() == children.len()
            })
            .map(|(&i, _)| i)
            .collect();
        for i in ready {
            let c = self.chunks.get_mut(&i).expect("ready");
            let contrib = std::mem::take(&mut c.contrib);
            let partials = std::mem::take(&mut c.partials);
            let mut parts = local
                .iter()
                .map(|r| &contrib[r])
                .chain(children.iter().map(|s| &partials[s]));
            let mut acc = parts.next().cloned().unwrap_or_default();
            for x in parts {
                reduce_into(reduce, &mut acc, x).expect("lengths checked on arrival");
            }
            match parent {
                _ if self.between == Between::Network => {
                    c.sent_up = true;
                    self.actions.push_back(Action::Contribute {
                        chunk: i,
                        data: acc,
                    });
                }
                Some(parent) => {
                    c.sent_up = true;
                    self.actions.push_back(Action::Send {
                        to: parent,
                        msg: Msg::Up {
                            len: vlen,
                            reduce,
                            chunk: i,
                            data: Bytes(acc),
                        },
                    });
                }
                None => self.set_result(i, acc),
            }
        }
    }

    /// [`Between::Network`]: the result of chunk `chunk` this SP contributed, or why it
    /// failed (the instance is then aborted everywhere with `Err`'s status).
    pub fn handle_outside(
        &mut self,
        _now: Nanos,
        chunk: u32,
        result: Result<Vec<u8>, Status>,
    ) -> Result<(), Error> {
        if self.aborted.is_some() {
            return Ok(());
        }
        let waited = self.between == Between::Network
            && self
                .chunks
                .get(&chunk)
                .is_some_and(|c| c.sent_up && c.result.is_none());
        if !waited {
            return Err(Error(format!(
                "a result of chunk {chunk} from outside, not one waited for"
            )));
        }
        match result {
            Ok(data) if data.len() as u64 == self.span(chunk).1 => {
                self.set_result(chunk, data);
                self.progress();
            }
            Ok(_) => self.abort_here(Status::CountMismatch, true),
            Err(status) => self.abort_here(status, true),
        }
        Ok(())
    }

    /// Chunk `i`'s result is known: down the tree, into every local rank.
    fn set_result(&mut self, i: u32, data: Vec<u8>) {
        let v = self.view.as_ref().expect("a view");
        for &c in &v.children {
            self.actions.push_back(Action::Send {
                to: c,
                msg: Msg::Down {
                    chunk: i,
                    data: Bytes(data.clone()),
                },
            });
        }
        let (offset, len) = self.span(i);
        let targets: Vec<(Rank, K)> = self
            .posted
            .iter()
            .filter(|(r, _)| !self.completed.contains(r))
            .map(|(r, (_, recv))| (*r, recv.clone()))
            .collect();
        {
            let c = self.chunks.entry(i).or_default();
            c.contrib.clear();
            c.partials.clear();
            c.result = Some(data);
        }
        let mut writes = 0;
        for (rank, key) in targets {
            if len == 0 {
                self.wrote(rank);
            } else {
                writes += 1;
                let id = self.copy_id(CopyOf::Write(rank, i));
                self.actions.push_back(Action::Write {
                    id,
                    rank,
                    key,
                    chunk: i,
                    offset,
                    len,
                });
            }
        }
        self.chunks.get_mut(&i).expect("set").writes = writes;
        if writes == 0 {
            self.chunk_done(i);
        }
    }

    /// A chunk was written into `rank`: it completes with the last.
    fn wrote(&mut self, rank: Rank) {
        let chunks = self.view.as_ref().map_or(1, |v| v.chunks);
        let w = self.written.entry(rank).or_default();
        *w += 1;
        if *w == chunks {
            self.complete(rank, Status::Ok);
        }
    }

    /// Chunk `i` is written everywhere here: the window moves on.
    fn chunk_done(&mut self, i: u32) {
        self.chunks.remove(&i);
        self.done_above.insert(i);
        while self.done_above.remove(&self.low) {
            self.low += 1;
        }
        self.progress();
    }

    /// A read or a write finished; a read hands its bytes (`data`, the bytes read).
    pub fn handle_copy_done(&mut self, _now: Nanos, id: CopyId, status: Status, data: Vec<u8>) {
        let Some(of) = self.copies.remove(&id.0) else {
            return;
        };
        match of {
            CopyOf::Read(rank, c) => {
                if let Some(st) = self.aborted {
                    self.complete_if_idle(rank, st);
                    return;
                }
                let (_, len) = self.span(c);
                if !status.is_ok() || data.len() as u64 != len {
                    self.abort_here(Status::AccessError, true);
                    return;
                }
                self.chunks.entry(c).or_default().contrib.insert(rank, data);
                self.progress();
            }
            CopyOf::Write(rank, c) => {
                if !status.is_ok() {
                    // That rank fails; the others still get the result.
                    self.complete(rank, Status::AccessError);
                } else if let Some(st) = self.aborted {
                    self.complete_if_idle(rank, st);
                } else {
                    self.wrote(rank);
                }
                if let Some(ch) = self.chunks.get_mut(&c) {
                    ch.writes -= 1;
                    if ch.writes == 0 && self.aborted.is_none() {
                        self.chunk_done(c);
                    }
                }
            }
        }
    }

    /// After an abort: `rank` completes with `status` once no copy of it is in flight.
    fn complete_if_idle(&mut self, rank: Rank, status: Status) {
        let busy = self.copies.values().any(|c| match c {
            CopyOf::Read(r, _) | CopyOf::Write(r, _) => *r == rank,
        });
        if !busy {
            self.complete(rank, status);
        }
    }

    /// Every chunk's result is known here: nothing but local writes remain (a lost peer or
    /// rank changes nothing any more).
    fn all_results(&self) -> bool {
        let Some(v) = &self.view else { return false };
        (self.low..v.chunks).all(|j| {
            self.done_above.contains(&j) || self.chunks.get(&j).is_some_and(|c| c.result.is_some())
        })
    }

    pub fn handle_peer_lost(&mut self, _now: Nanos, sp: SpId) {
        if self.view.is_none() {
            self.lost_sps.insert(sp);
        } else if self.in_tree(sp) && !self.all_results() {
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
        if !self.all_results() {
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
        // Reads and writes not handed to the driver yet never start.
        let queued = std::mem::take(&mut self.actions);
        for a in queued {
            match a {
                Action::Read { id, .. } | Action::Write { id, .. } => {
                    self.copies.remove(&id.0);
                }
                other => self.actions.push_back(other),
            }
        }
        let posted: Vec<Rank> = self.posted.keys().copied().collect();
        for r in posted {
            self.complete_if_idle(r, status);
        }
        self.chunks.clear();
    }
}
