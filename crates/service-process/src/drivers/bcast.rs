//! The staged Ibcast, flat and hierarchical (`algorithms::bcast`): chunks through staging
//! slots granted by credits, over UCX puts into the child's slots when both ends have UCX.

use super::{Act, CollDriver, Inbound, KindSpec, LocalPost};
use algorithms::{bcast, CollKey, Nanos, Rank, SpId, Status};
use alias_mkey::AliasKey;
use bootstrap::wire::{CollKind, CollMsg, PostDesc};

pub static SPEC: KindSpec = KindSpec {
    kind: CollKind::Bcast,
    new,
    abort_msg: |status| CollMsg::Bcast(bcast::Msg::Abort { status }),
    refuse,
    inbound,
    region_writer,
    region_len: |d| message_len(d).unwrap_or(0),
    staged_len: message_len,
    check_desc: super::no_more_checks,
    // Measured: 17 bytes per member beyond the descriptor.
    state_bytes_per_member: 64,
    data_bytes: super::no_data_bytes,
};

struct Driver(bcast::Bcast<AliasKey>);

/// A `Sealed` lends the receiver this node leader's region; a `Credit` grants slots.
impl super::KindMsg for bcast::Msg {
    fn into_coll(self) -> CollMsg {
        CollMsg::Bcast(self)
    }
    fn lends_region(&self) -> bool {
        matches!(self, bcast::Msg::Sealed { .. })
    }
    fn grants_slots(&self) -> Vec<u32> {
        match self {
            bcast::Msg::Credit { slots, .. } => slots.iter().map(|s| s.0).collect(),
            _ => vec![],
        }
    }
}

super::copy_act!(bcast::Copy<AliasKey> => StageCopy { rank, src, dst, len });

/// A move carries its chunk's bytes into the child's slot, then its `Chunk` message.
impl From<bcast::Move> for Act {
    fn from(mv: bcast::Move) -> Act {
        Act::Move {
            id: mv.id.0,
            to: mv.to,
            src_slot: mv.src_slot.0,
            dst_slot: mv.dst_slot.0,
            len: mv.len,
            msg: CollMsg::Bcast(mv.chunk_msg()),
        }
    }
}

/// The message is the one block: the root's send side, the others' receive side (`None` for
/// a post without blocks, which its checks refuse).
fn message_len(d: &PostDesc) -> Option<u64> {
    d.send_counts.first().max(d.recv_counts.first()).copied()
}

fn new(key: CollKey, me: SpId, cfg: &super::KindConfig) -> Box<dyn CollDriver> {
    Box::new(Driver(bcast::Bcast::new(key, cfg.staged.machine(me))))
}

/// A node's leader in the bcast's tree writes the node's region.
fn region_writer(d: &PostDesc, me: SpId) -> bool {
    let Some(st) = &d.staged else { return true };
    bcast::build_tree(&d.members, &d.nodes, st.root).is_ok_and(|t| t.iter().any(|g| g[0] == me))
}

fn inbound(msg: &CollMsg) -> Inbound {
    match msg {
        CollMsg::Bcast(bcast::Msg::Sealed { at }) => Inbound {
            lends_region_at: Some(*at),
            ..Inbound::default()
        },
        CollMsg::Bcast(bcast::Msg::Chunk { slot, len, .. }) => Inbound {
            fills_slot: Some((slot.0, *len)),
            ..Inbound::default()
        },
        CollMsg::Bcast(bcast::Msg::Open { len, .. } | bcast::Msg::Credit { len, .. }) => Inbound {
            message_len: Some(*len),
            ..Inbound::default()
        },
        _ => Inbound::default(),
    }
}

fn refuse(msg: &CollMsg, from: SpId, status: Status) -> Vec<(SpId, CollMsg)> {
    let CollMsg::Bcast(msg) = msg else {
        return vec![];
    };
    let abort = CollMsg::Bcast(bcast::Msg::Abort { status });
    match msg {
        // The sender waits for credits after `Open`, for its slots after `Credit`.
        bcast::Msg::Open { .. } | bcast::Msg::Chunk { .. } => vec![(from, abort)],
        bcast::Msg::Credit { slots, .. } => vec![
            (
                from,
                CollMsg::Bcast(bcast::Msg::Return {
                    slots: slots.clone(),
                }),
            ),
            (from, abort),
        ],
        // Messages that expect no answer. Listed one by one so that a new message kind has to
        // be considered here. A `Sealed` is answered outside the collective
        // (`SpToSp::RegionReleased`).
        bcast::Msg::Return { .. } | bcast::Msg::Abort { .. } | bcast::Msg::Sealed { .. } => {
            vec![]
        }
    }
}

impl CollDriver for Driver {
    super::delegate!(CollMsg::Bcast, bcast::CopyId);

    fn handle_post(&mut self, now: Nanos, mut p: LocalPost) -> Result<(), String> {
        let (design, shared_key, shared_at) = p.staged_parts();
        let d = p.desc;
        let st = d.staged.as_ref().ok_or("a bcast post without its root")?;
        let is_root = st.root == d.comm_rank;
        let post = bcast::Post {
            rank: d.comm_rank,
            root: st.root,
            key: if is_root { p.send } else { p.recv },
            len: if is_root {
                d.send_counts[0]
            } else {
                d.recv_counts[0]
            },
            members: d.members,
            nodes: d.nodes,
            design,
            shared_key,
            shared_at,
        };
        self.0.handle_post(now, post).map_err(|e| e.to_string())
    }
    fn handle_move_done(&mut self, now: Nanos, id: u64, status: Status) {
        self.0.handle_move_done(now, bcast::MoveId(id), status)
    }
    fn may_fill(&self, from: SpId, slot: u32) -> bool {
        self.0.may_fill(from, bcast::SlotId(slot))
    }
    fn segment_source(&self) -> Option<(SpId, u64, u64)> {
        self.0.segment_source()
    }
}
