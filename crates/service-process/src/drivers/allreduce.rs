//! The SP-tree Allreduce (`algorithms::allreduce`): each SP reads its local ranks' send
//! buffers into its own memory chunk by chunk, reduces them with its children's partial
//! results, sends its subtree's result up, and writes the root's result, which comes down the
//! tree, into its ranks' receive buffers.
//!
//! SP memory: the reads (a chunk of a rank's send buffer each) land in buffers of this
//! driver's own (`staging::Stage`, the staged family's buffer type: an `AliasKey` of this SP
//! process, so the datapath copies between it and a rank's grant exactly as between two
//! ranks, `Act::Copy`); the machine takes the bytes when the copy is done and reduces them.
//! Each chunk's result is written from one such buffer, filled once from the machine's result
//! and shared by the SP's ranks' writes of that chunk, dropped after the last. Buffers are one
//! chunk each (`serve --stage-chunk-bytes`, at most `allreduce::MAX_CHUNK_BYTES`), at most
//! `allreduce::WINDOW` chunks in progress per instance, and dropped with the instance at the
//! latest (which is not dropped while a copy is in flight: `copies_in_flight`). Partial
//! results travel between SPs as the bytes of the kind's own messages
//! (`allreduce::Msg::Up`, `Down`), a chunk per frame.
//!
//! The same driver runs the Canary allreduce (`super::canary_allreduce`, the machine with
//! `allreduce::Between::Network`): there each chunk the SP reduced goes to the in-network
//! family's resources (`crate::canary_resources`) as a request, and its result comes back as
//! their event; only `Abort` travels between SPs, as `CollMsg::CanaryAllreduce`.

use super::{Act, CollDriver, Inbound, KindConfig, KindSpec, LocalPost};
use crate::canary_resources::{Contribute, Ended};
use crate::staging::Stage;
use algorithms::{allreduce, CollKey, Nanos, Rank, SpId, Status};
use alias_mkey::AliasKey;
use bootstrap::wire::{CollKind, CollMsg, PostDesc};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

pub static SPEC: KindSpec = KindSpec {
    kind: CollKind::Allreduce,
    new,
    abort_msg: |status| CollMsg::Allreduce(allreduce::Msg::Abort { status }),
    refuse,
    inbound: |_| Inbound::default(),
    region_writer: super::no_region_writer,
    region_len: super::no_region_len,
    staged_len: super::all_staging_slots,
    check_desc,
    // The members list and the tree: a few words per member (the data buffers, a window of
    // chunks per instance, are not counted here).
    state_bytes_per_member: 64,
    data_bytes: window_bytes,
};

/// Region ids of the driver's buffers: apart from the staging's (which count up from 1).
static NEXT_REGION: AtomicU64 = AtomicU64::new(1 << 62);

struct Driver {
    m: allreduce::Allreduce<AliasKey>,
    between: allreduce::Between,
    /// The buffers reads land in, by copy id.
    reads: HashMap<u64, Stage>,
    /// Each chunk's result, once a write needs it, and its writes in flight.
    out: HashMap<u32, (Stage, usize)>,
    /// The chunk of each write in flight, by copy id.
    writes: HashMap<u64, u32>,
}

/// The pipeline's chunk is the staged collectives' (`serve --stage-chunk-bytes`, the same on
/// every SP of a cluster), at most `allreduce::MAX_CHUNK_BYTES`.
fn new(key: CollKey, me: SpId, cfg: &KindConfig) -> Box<dyn CollDriver> {
    driver(key, me, cfg, allreduce::Between::Tree)
}

/// The driver of either design (`between`).
pub(super) fn driver(
    key: CollKey,
    me: SpId,
    cfg: &KindConfig,
    between: allreduce::Between,
) -> Box<dyn CollDriver> {
    Box::new(Driver {
        m: allreduce::Allreduce::new(
            key,
            allreduce::Config {
                me,
                chunk_bytes: cfg.staged.chunk_bytes,
                between,
            },
        ),
        between,
        reads: HashMap::new(),
        out: HashMap::new(),
        writes: HashMap::new(),
    })
}

/// One block each way, of equal length, whole elements of a reduction MPI defines, at most
/// `allreduce::MAX_BYTES`.
/// The chunks of `d` in progress at once on an SP (at most `allreduce::WINDOW`) and the bytes
/// of each, for chunks of `chunk_bytes` (the driver's, at most `allreduce::MAX_CHUNK_BYTES`).
/// Before the descriptor is checked: a missing or oversized length counts as the largest.
fn window_chunks(d: &PostDesc, chunk_bytes: u64) -> (u64, u64) {
    let len = d
        .send_counts
        .first()
        .copied()
        .unwrap_or(allreduce::MAX_BYTES)
        .min(allreduce::MAX_BYTES);
    let chunk = chunk_bytes.clamp(1, allreduce::MAX_CHUNK_BYTES);
    (
        len.div_ceil(chunk).min(u64::from(allreduce::WINDOW)),
        len.min(chunk),
    )
}

/// The SP tree's data buffers of one post, from above: per chunk in progress, the read of
/// this rank's contribution, the partial result of each child in the SPs' binomial tree (at
/// most ceil(log2 S) for S SPs among the members) and the chunk's result buffer.
pub(super) fn window_bytes(d: &PostDesc, chunk_bytes: u64) -> u64 {
    let (chunks, bytes) = window_chunks(d, chunk_bytes);
    let mut sps = d.members.clone();
    sps.sort_unstable();
    sps.dedup();
    let children = u64::from(sps.len().max(1).next_power_of_two().trailing_zeros());
    chunks * bytes * (2 + children)
}

/// The Canary allreduce's, from above: per chunk in progress, the read of this rank's
/// contribution, the reduced chunk handed to the plane, the host machine's copy of it and
/// its result, and the result buffer the ranks' writes share.
pub(super) fn canary_window_bytes(d: &PostDesc, chunk_bytes: u64) -> u64 {
    let (chunks, bytes) = window_chunks(d, chunk_bytes);
    chunks * bytes * 5
}

pub(super) fn check_desc(d: &PostDesc) -> Result<(), String> {
    let Some(r) = d.reduce else {
        return Err("an allreduce post without its operation and type".into());
    };
    let (s, rv) = (d.send_counts[0], d.recv_counts[0]);
    if s != rv {
        return Err(format!(
            "an allreduce sends {s} bytes and receives {rv}: they must be equal"
        ));
    }
    if !r.is_valid() || !s.is_multiple_of(r.elem.size() as u64) {
        return Err(format!(
            "{s} bytes are not whole elements of a {:?} by {:?}",
            r.elem, r.op
        ));
    }
    if s > allreduce::MAX_BYTES {
        return Err(format!(
            "an allreduce of {s} bytes is larger than {}",
            allreduce::MAX_BYTES
        ));
    }
    if d.staged.is_some() {
        return Err("an allreduce post names no root or design".into());
    }
    Ok(())
}

fn refuse(msg: &CollMsg, from: SpId, status: Status) -> Vec<(SpId, CollMsg)> {
    let CollMsg::Allreduce(msg) = msg else {
        return vec![];
    };
    match msg {
        // A child waits for the result after its `Up`.
        allreduce::Msg::Up { .. } => {
            vec![(from, CollMsg::Allreduce(allreduce::Msg::Abort { status }))]
        }
        // Messages that expect no answer, listed one by one so that a new one is considered.
        allreduce::Msg::Down { .. } | allreduce::Msg::Abort { .. } => vec![],
    }
}

/// A buffer of this SP of `len` bytes for job `job`.
fn buffer(job: u64, len: u64) -> Stage {
    Stage::new(
        job,
        NEXT_REGION.fetch_add(1, Ordering::Relaxed),
        len as usize,
    )
}

impl Driver {
    /// A message of this instance on the wire, as its design's kind.
    fn wire(&self, msg: allreduce::Msg) -> CollMsg {
        match self.between {
            allreduce::Between::Tree => CollMsg::Allreduce(msg),
            allreduce::Between::Network => CollMsg::CanaryAllreduce(msg),
        }
    }
}

impl CollDriver for Driver {
    fn kind(&self) -> CollKind {
        match self.between {
            allreduce::Between::Tree => SPEC.kind,
            allreduce::Between::Network => super::canary_allreduce::SPEC.kind,
        }
    }

    fn handle_post(&mut self, now: Nanos, p: LocalPost) -> Result<(), String> {
        let d = p.desc;
        let reduce = d.reduce.ok_or("an allreduce post without its operation")?;
        let post = allreduce::Post {
            rank: d.comm_rank,
            members: d.members,
            send: p.send,
            recv: p.recv,
            len: d.send_counts[0],
            reduce,
        };
        self.m.handle_post(now, post).map_err(|e| e.to_string())
    }

    fn handle_msg(&mut self, now: Nanos, from: SpId, msg: CollMsg) -> Result<(), String> {
        match msg {
            CollMsg::Allreduce(m) if self.between == allreduce::Between::Tree => {
                self.m.handle_msg(now, from, m).map_err(|e| e.to_string())
            }
            CollMsg::CanaryAllreduce(m) if self.between == allreduce::Between::Network => {
                self.m.handle_msg(now, from, m).map_err(|e| e.to_string())
            }
            m => Err(format!(
                "a {:?} message for an instance of {}",
                m.kind(),
                self.kind().facts().name
            )),
        }
    }

    fn handle_copy_done(&mut self, now: Nanos, id: u64, status: Status) {
        let data = match self.reads.remove(&id) {
            Some(stage) => stage.bytes(stage.key().grant.len as usize).to_vec(),
            None => Vec::new(),
        };
        // A chunk's result buffer goes with its last write.
        if let Some(chunk) = self.writes.remove(&id) {
            if let Some((_, n)) = self.out.get_mut(&chunk) {
                *n -= 1;
                if *n == 0 {
                    self.out.remove(&chunk);
                }
            }
        }
        self.m
            .handle_copy_done(now, allreduce::CopyId(id), status, data)
    }

    fn handle_event(&mut self, now: Nanos, event: super::resources::Payload) {
        let Ok(e) = event.downcast::<Ended>() else {
            return;
        };
        let result = e.result.map_err(|why| {
            tracing::warn!(key = ?self.m.key(), chunk = e.chunk, "{why}");
            Status::NetworkFailed
        });
        if let Err(err) = self.m.handle_outside(now, e.chunk, result) {
            tracing::warn!(key = ?self.m.key(), "{err}");
        }
    }

    fn handle_peer_lost(&mut self, now: Nanos, sp: SpId) {
        self.m.handle_peer_lost(now, sp)
    }

    fn handle_rank_lost(&mut self, now: Nanos, rank: Rank) {
        self.m.handle_rank_lost(now, rank)
    }

    fn abort(&mut self, now: Nanos, status: Status) {
        self.m.abort(now, status)
    }

    fn is_finished(&self) -> bool {
        self.m.is_finished()
    }

    fn copies_in_flight(&self) -> usize {
        self.m.copies_in_flight()
    }

    fn poll_action(&mut self) -> Option<Act> {
        let job = self.m.key().job;
        Some(match self.m.poll_action()? {
            allreduce::Action::Send { to, msg } => Act::Send {
                to,
                lends_region: false,
                grants_slots: vec![],
                msg: self.wire(msg),
            },
            allreduce::Action::Contribute { chunk, data } => {
                let sps = self.m.sps().expect("a contribution after the first post");
                Act::Resource {
                    family: bootstrap::kinds::Family::InNetwork,
                    req: Box::new(Contribute {
                        chunk,
                        sps: sps.to_vec(),
                        me: self.m.position().expect("served here"),
                        reduce: self
                            .m
                            .reduce()
                            .expect("a contribution after the first post"),
                        data,
                    }),
                }
            }
            allreduce::Action::Read {
                id,
                rank,
                key,
                offset,
                len,
            } => {
                let stage = buffer(job, len);
                let dst_key = stage.key().clone();
                self.reads.insert(id.0, stage);
                Act::Copy {
                    id: id.0,
                    dst_rank: rank,
                    src_key: key,
                    src_offset: offset,
                    dst_key,
                    dst_offset: 0,
                    len,
                }
            }
            allreduce::Action::Write {
                id,
                rank,
                key,
                chunk,
                offset,
                len,
            } => {
                if !self.out.contains_key(&chunk) {
                    let result = self.m.result(chunk).expect("a write after its result");
                    let mut stage = buffer(job, result.len() as u64);
                    stage.fill(result);
                    self.out.insert(chunk, (stage, 0));
                }
                let (stage, n) = self.out.get_mut(&chunk).expect("filled");
                *n += 1;
                self.writes.insert(id.0, chunk);
                Act::Copy {
                    id: id.0,
                    dst_rank: rank,
                    src_key: stage.key().clone(),
                    src_offset: 0,
                    dst_key: key,
                    dst_offset: offset,
                    len,
                }
            }
            allreduce::Action::Complete { rank, status } => Act::Complete {
                rank,
                status,
                from_segment: false,
            },
        })
    }
}
