//! One collective instance as the engine sees it, whichever collective it is.
//!
//! The state machines of `algorithms` differ in their posts, messages and copies; the engine
//! only needs to feed them and execute three kinds of action. [`Machine`] wraps each machine
//! and turns its actions into [`Act`], with messages already wrapped for the wire
//! ([`CollMsg`]) and copy ids as plain numbers.

use algorithms::{
    allgatherv, alltoallv, bcast, staged_allgather, CollKey, Nanos, Rank, SpId, Status,
};
use alias_mkey::AliasKey;
use bootstrap::wire::{CollKind, CollMsg};

pub enum Machine {
    // Boxed: the machines are a few hundred bytes each and of different sizes.
    Alltoallv(Box<alltoallv::Alltoallv<AliasKey>>),
    Allgatherv(Box<allgatherv::Allgatherv<AliasKey>>),
    Bcast(Box<bcast::Bcast<AliasKey>>),
    StagedAllgather(Box<staged_allgather::StagedAllgather<AliasKey>>),
}

/// Staging of the staged collectives (the same on every SP of a cluster).
#[derive(Clone, Copy, Debug)]
pub struct StagedConfig {
    pub chunk_bytes: u64,
    pub slots: u32,
}

/// What the engine must do next.
pub enum Act {
    Send {
        to: SpId,
        msg: CollMsg,
    },
    Copy {
        id: u64,
        /// The comm rank written (always served by this SP).
        dst_rank: Rank,
        src_key: AliasKey,
        src_offset: u64,
        dst_key: AliasKey,
        dst_offset: u64,
        len: u64,
    },
    /// A copy of a staged collective: one end may be a staging slot of the instance.
    StageCopy {
        id: u64,
        /// The local rank whose grant is one end.
        rank: Rank,
        src: bcast::Loc<AliasKey>,
        dst: bcast::Loc<AliasKey>,
        len: u64,
    },
    /// Move `len` bytes from staging slot `src_slot` to SP `to`, delivering `msg` (which names
    /// the slot there) with them; report with `handle_move_done`.
    Move {
        id: u64,
        to: SpId,
        src_slot: u32,
        dst_slot: u32,
        len: u64,
        msg: CollMsg,
    },
    Complete {
        rank: Rank,
        status: Status,
        /// Hierarchical staged design: the data are in the segment; the host copies them
        /// before the rank may complete.
        from_segment: bool,
    },
}

/// The post of one local rank, already checked against its grants.
pub enum Post {
    Alltoallv(alltoallv::Post<AliasKey>),
    Allgatherv(allgatherv::Post<AliasKey>),
    Bcast(bcast::Post<AliasKey>),
    StagedAllgather(staged_allgather::Post<AliasKey>),
}

/// Counters of the hierarchical collectives, summed over finished instances.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct LateArrivals {
    /// Announcements that found no ready local rank at the SP they reached.
    pub no_ready_rank: u64,
    /// Of those, served by another SP of the node (the pass path).
    pub served_after_pass: u64,
    /// Announcements parked on the node's pending list.
    pub parked: u64,
    /// Total time announcements waited there (ns).
    pub parked_wait_ns: u64,
}

impl Machine {
    pub fn new(kind: CollKind, key: CollKey, me: SpId, staged: StagedConfig) -> Machine {
        match kind {
            CollKind::Alltoallv => Machine::Alltoallv(Box::new(alltoallv::Alltoallv::new(
                key,
                alltoallv::Config { me },
            ))),
            CollKind::Allgatherv => Machine::Allgatherv(Box::new(allgatherv::Allgatherv::new(
                key,
                allgatherv::Config { me },
            ))),
            CollKind::Bcast => Machine::Bcast(Box::new(bcast::Bcast::new(
                key,
                bcast::Config {
                    me,
                    chunk_bytes: staged.chunk_bytes,
                    staging_slots: staged.slots,
                },
            ))),
            CollKind::StagedAllgather => {
                Machine::StagedAllgather(Box::new(staged_allgather::StagedAllgather::new(
                    key,
                    staged_allgather::Config {
                        me,
                        chunk_bytes: staged.chunk_bytes,
                        staging_slots: staged.slots,
                    },
                )))
            }
        }
    }

    pub fn kind(&self) -> CollKind {
        match self {
            Machine::Alltoallv(_) => CollKind::Alltoallv,
            Machine::Allgatherv(_) => CollKind::Allgatherv,
            Machine::Bcast(_) => CollKind::Bcast,
            Machine::StagedAllgather(_) => CollKind::StagedAllgather,
        }
    }

    /// The collective a peer message belongs to.
    pub fn kind_of(msg: &CollMsg) -> CollKind {
        match msg {
            CollMsg::Alltoallv(_) => CollKind::Alltoallv,
            CollMsg::Allgatherv(_) => CollKind::Allgatherv,
            CollMsg::Bcast(_) => CollKind::Bcast,
            CollMsg::StagedAllgather(_) => CollKind::StagedAllgather,
        }
    }

    /// A staged collective's incoming chunk may land in staging slot `slot` (granted to
    /// `from`, not holding anything): checked before the bytes are written there.
    pub fn may_fill(&self, from: SpId, slot: u32) -> bool {
        match self {
            Machine::Bcast(m) => m.may_fill(from, bcast::SlotId(slot)),
            _ => false,
        }
    }

    pub fn handle_move_done(&mut self, now: Nanos, id: u64, status: Status) {
        if let Machine::Bcast(m) = self {
            m.handle_move_done(now, bcast::MoveId(id), status);
        }
    }

    pub fn handle_post(&mut self, now: Nanos, post: Post) -> Result<(), String> {
        match (self, post) {
            (Machine::Alltoallv(m), Post::Alltoallv(p)) => {
                m.handle_post(now, p).map_err(|e| e.to_string())
            }
            (Machine::Allgatherv(m), Post::Allgatherv(p)) => {
                m.handle_post(now, p).map_err(|e| e.to_string())
            }
            (Machine::Bcast(m), Post::Bcast(p)) => m.handle_post(now, p).map_err(|e| e.to_string()),
            (Machine::StagedAllgather(m), Post::StagedAllgather(p)) => {
                m.handle_post(now, p).map_err(|e| e.to_string())
            }
            (m, _) => Err(format!(
                "this collective instance is a {:?}; ranks posted different collectives",
                m.kind()
            )),
        }
    }

    pub fn handle_msg(&mut self, now: Nanos, from: SpId, msg: CollMsg) -> Result<(), String> {
        match (self, msg) {
            (Machine::Alltoallv(m), CollMsg::Alltoallv(msg)) => {
                m.handle_msg(now, from, msg).map_err(|e| e.to_string())
            }
            (Machine::Allgatherv(m), CollMsg::Allgatherv(msg)) => {
                m.handle_msg(now, from, msg).map_err(|e| e.to_string())
            }
            (Machine::Bcast(m), CollMsg::Bcast(msg)) => {
                m.handle_msg(now, from, msg).map_err(|e| e.to_string())
            }
            (Machine::StagedAllgather(m), CollMsg::StagedAllgather(msg)) => {
                m.handle_msg(now, from, msg).map_err(|e| e.to_string())
            }
            (m, msg) => Err(format!(
                "a {:?} message for a {:?} instance",
                Machine::kind_of(&msg),
                m.kind()
            )),
        }
    }

    pub fn handle_copy_done(&mut self, now: Nanos, id: u64, status: Status) {
        match self {
            Machine::Alltoallv(m) => m.handle_copy_done(now, alltoallv::CopyId(id), status),
            Machine::Allgatherv(m) => m.handle_copy_done(now, allgatherv::CopyId(id), status),
            Machine::Bcast(m) => m.handle_copy_done(now, bcast::CopyId(id), status),
            Machine::StagedAllgather(m) => m.handle_copy_done(now, bcast::CopyId(id), status),
        }
    }

    pub fn handle_peer_lost(&mut self, now: Nanos, sp: SpId) {
        match self {
            Machine::Alltoallv(m) => m.handle_peer_lost(now, sp),
            Machine::Allgatherv(m) => m.handle_peer_lost(now, sp),
            Machine::Bcast(m) => m.handle_peer_lost(now, sp),
            Machine::StagedAllgather(m) => m.handle_peer_lost(now, sp),
        }
    }

    pub fn abort(&mut self, now: Nanos, status: Status) {
        match self {
            Machine::Alltoallv(m) => m.abort(now, status),
            Machine::Allgatherv(m) => m.abort(now, status),
            Machine::Bcast(m) => m.abort(now, status),
            Machine::StagedAllgather(m) => m.abort(now, status),
        }
    }

    pub fn handle_rank_lost(&mut self, now: Nanos, rank: Rank) {
        match self {
            Machine::Alltoallv(m) => m.handle_rank_lost(now, rank),
            Machine::Allgatherv(m) => m.handle_rank_lost(now, rank),
            Machine::Bcast(m) => m.handle_rank_lost(now, rank),
            Machine::StagedAllgather(m) => m.handle_rank_lost(now, rank),
        }
    }

    pub fn is_finished(&self) -> bool {
        match self {
            Machine::Alltoallv(m) => m.is_finished(),
            Machine::Allgatherv(m) => m.is_finished(),
            Machine::Bcast(m) => m.is_finished(),
            Machine::StagedAllgather(m) => m.is_finished(),
        }
    }

    pub fn copies_in_flight(&self) -> usize {
        match self {
            Machine::Alltoallv(m) => m.copies_in_flight(),
            Machine::Allgatherv(m) => m.copies_in_flight(),
            Machine::Bcast(m) => m.copies_in_flight(),
            Machine::StagedAllgather(m) => m.copies_in_flight(),
        }
    }

    /// A hierarchical staged collective: the SP whose segment region this SP's ranks copy out
    /// of, where it starts and its length (see `bcast::Bcast::segment_source` and
    /// `staged_allgather::StagedAllgather::segment_source`).
    pub fn segment_source(&self) -> Option<(SpId, u64, u64)> {
        match self {
            Machine::Bcast(m) => m.segment_source(),
            Machine::StagedAllgather(m) => m.segment_source(),
            _ => None,
        }
    }

    /// Late-arrival counters (zero for collectives without a hierarchical landing).
    pub fn late_arrivals(&self) -> LateArrivals {
        match self {
            Machine::Alltoallv(_) | Machine::Bcast(_) | Machine::StagedAllgather(_) => {
                LateArrivals::default()
            }
            Machine::Allgatherv(m) => {
                let s = m.stats();
                LateArrivals {
                    no_ready_rank: s.no_ready_rank,
                    served_after_pass: s.served_after_pass,
                    parked: s.parked,
                    parked_wait_ns: s.parked_wait_ns,
                }
            }
        }
    }

    pub fn poll_action(&mut self) -> Option<Act> {
        match self {
            Machine::Alltoallv(m) => Some(match m.poll_action()? {
                alltoallv::Action::Send { to, msg } => Act::Send {
                    to,
                    msg: CollMsg::Alltoallv(msg),
                },
                alltoallv::Action::Copy(c) => Act::Copy {
                    id: c.id.0,
                    dst_rank: c.dst_rank,
                    src_key: c.src_key,
                    src_offset: c.src_offset,
                    dst_key: c.dst_key,
                    dst_offset: c.dst_offset,
                    len: c.len,
                },
                alltoallv::Action::Complete { rank, status } => Act::Complete {
                    rank,
                    status,
                    from_segment: false,
                },
            }),
            Machine::Allgatherv(m) => Some(match m.poll_action()? {
                allgatherv::Action::Send { to, msg } => Act::Send {
                    to,
                    msg: CollMsg::Allgatherv(msg),
                },
                allgatherv::Action::Copy(c) => Act::Copy {
                    id: c.id.0,
                    dst_rank: c.dst_rank,
                    src_key: c.src_key,
                    src_offset: c.src_offset,
                    dst_key: c.dst_key,
                    dst_offset: c.dst_offset,
                    len: c.len,
                },
                allgatherv::Action::Complete { rank, status } => Act::Complete {
                    rank,
                    status,
                    from_segment: false,
                },
            }),
            Machine::Bcast(m) => Some(match m.poll_action()? {
                bcast::Action::Send { to, msg } => Act::Send {
                    to,
                    msg: CollMsg::Bcast(msg),
                },
                bcast::Action::Copy(c) => Act::StageCopy {
                    id: c.id.0,
                    rank: c.rank,
                    src: c.src,
                    dst: c.dst,
                    len: c.len,
                },
                bcast::Action::Move(mv) => Act::Move {
                    id: mv.id.0,
                    to: mv.to,
                    src_slot: mv.src_slot.0,
                    dst_slot: mv.dst_slot.0,
                    len: mv.len,
                    msg: CollMsg::Bcast(mv.chunk_msg()),
                },
                bcast::Action::Complete {
                    rank,
                    status,
                    from_segment,
                } => Act::Complete {
                    rank,
                    status,
                    from_segment,
                },
            }),
            Machine::StagedAllgather(m) => Some(match m.poll_action()? {
                staged_allgather::Action::Send { to, msg } => Act::Send {
                    to,
                    msg: CollMsg::StagedAllgather(msg),
                },
                staged_allgather::Action::Copy(c) => Act::StageCopy {
                    id: c.id.0,
                    rank: c.rank,
                    src: c.src,
                    dst: c.dst,
                    len: c.len,
                },
                staged_allgather::Action::Complete {
                    rank,
                    status,
                    from_segment,
                } => Act::Complete {
                    rank,
                    status,
                    from_segment,
                },
            }),
        }
    }
}

/// The replies that let peers finish when a message reaches an SP where its job is gone (no
/// rank of the job will ever post here): every message that expects exactly one answer gets it,
/// with `status`, followed by an abort. Returns (destination SP, message) pairs; `from` is the
/// SP the message came from.
pub fn refuse(msg: &CollMsg, from: SpId, status: Status) -> Vec<(SpId, CollMsg)> {
    let a2a_abort = CollMsg::Alltoallv(alltoallv::Msg::Abort { status });
    let agv_abort = CollMsg::Allgatherv(allgatherv::Msg::Abort { status });
    match msg {
        CollMsg::Alltoallv(alltoallv::Msg::Announce { src, dst, .. }) => vec![
            (
                from,
                CollMsg::Alltoallv(alltoallv::Msg::Ack {
                    src: *src,
                    dst: *dst,
                    status,
                }),
            ),
            (from, a2a_abort),
        ],
        CollMsg::Allgatherv(
            allgatherv::Msg::Announce {
                src, node, origin, ..
            }
            | allgatherv::Msg::Pass {
                src, node, origin, ..
            },
        ) => vec![
            (
                *origin,
                CollMsg::Allgatherv(allgatherv::Msg::Ack {
                    src: *src,
                    node: *node,
                    status,
                }),
            ),
            (*origin, agv_abort.clone()),
            (from, agv_abort),
        ],
        // The source's SP waits for this SP's answer to a release before it lets its rank go.
        CollMsg::Allgatherv(allgatherv::Msg::Release { src, node, .. }) => vec![(
            from,
            CollMsg::Allgatherv(allgatherv::Msg::Ack {
                src: *src,
                node: *node,
                status,
            }),
        )],
        CollMsg::Allgatherv(allgatherv::Msg::Segment { src, holder_sp, .. }) => vec![
            (
                *holder_sp,
                CollMsg::Allgatherv(allgatherv::Msg::SegmentDone { src: *src, status }),
            ),
            (*holder_sp, agv_abort),
        ],
        // The sender waits for credits after `Open`, for its slots after `Credit`.
        CollMsg::Bcast(bcast::Msg::Open { .. } | bcast::Msg::Chunk { .. }) => {
            vec![(from, CollMsg::Bcast(bcast::Msg::Abort { status }))]
        }
        CollMsg::Bcast(bcast::Msg::Credit { slots, .. }) => vec![
            (
                from,
                CollMsg::Bcast(bcast::Msg::Return {
                    slots: slots.clone(),
                }),
            ),
            (from, CollMsg::Bcast(bcast::Msg::Abort { status })),
        ],
        // The staged allgather says itself what needs an answer.
        CollMsg::StagedAllgather(m) => staged_allgather::refusal(m, status)
            .map(|r| (from, CollMsg::StagedAllgather(r)))
            .into_iter()
            .collect(),
        // Messages that expect no answer. Listed one by one so that a new message kind has to
        // be considered here.
        CollMsg::Alltoallv(alltoallv::Msg::Ack { .. } | alltoallv::Msg::Abort { .. })
        | CollMsg::Allgatherv(
            allgatherv::Msg::Ack { .. }
            | allgatherv::Msg::RankReady
            | allgatherv::Msg::SegmentDone { .. }
            | allgatherv::Msg::Abort { .. },
        )
        // A `Sealed` is answered outside the collective (`SpToSp::RegionReleased`).
        | CollMsg::Bcast(
            bcast::Msg::Return { .. } | bcast::Msg::Abort { .. } | bcast::Msg::Sealed { .. },
        ) => vec![],
    }
}
