//! The staged Iallgather, flat and hierarchical (`algorithms::staged_allgather`).

use super::{Act, CollDriver, Inbound, KindSpec, LocalPost, StagedConfig};
use algorithms::{bcast, staged_allgather, CollKey, Nanos, Rank, SpId, Status};
use alias_mkey::AliasKey;
use bootstrap::wire::{CollKind, CollMsg};

pub static SPEC: KindSpec = KindSpec {
    kind: CollKind::StagedAllgather,
    new,
    staging: true,
    host_copies: false,
    abort_msg: |status| CollMsg::StagedAllgather(staged_allgather::Msg::Abort { status }),
    refuse,
    inbound,
    // A node's owner writes the node's region.
    region_writer: |d, me| staged_allgather::node_owner(&d.members, &d.nodes, me) == Some(me),
    // The whole message: P blocks (checked not to overflow).
    region_len: |d| d.recv_counts.iter().sum(),
};

struct Driver(staged_allgather::StagedAllgather<AliasKey>);

fn new(key: CollKey, me: SpId, staged: StagedConfig) -> Box<dyn CollDriver> {
    Box::new(Driver(staged_allgather::StagedAllgather::new(
        key,
        staged_allgather::Config {
            me,
            chunk_bytes: staged.chunk_bytes,
            staging_slots: staged.slots,
        },
    )))
}

fn inbound(msg: &CollMsg) -> Inbound {
    Inbound {
        lends_region_at: match msg {
            CollMsg::StagedAllgather(staged_allgather::Msg::RegionDone { at }) => Some(*at),
            _ => None,
        },
        // Its writers wait for an answer even from an SP where the instance finished: that SP
        // has no write of theirs to wait for.
        answer_when_finished: true,
        ..Inbound::default()
    }
}

/// The staged allgather says itself what needs an answer.
fn refuse(msg: &CollMsg, from: SpId, status: Status) -> Vec<(SpId, CollMsg)> {
    let CollMsg::StagedAllgather(m) = msg else {
        return vec![];
    };
    staged_allgather::refusal(m, status)
        .map(|r| (from, CollMsg::StagedAllgather(r)))
        .into_iter()
        .collect()
}

impl CollDriver for Driver {
    fn kind(&self) -> CollKind {
        CollKind::StagedAllgather
    }
    fn handle_post(&mut self, now: Nanos, p: LocalPost) -> Result<(), String> {
        let d = p.desc;
        let (shared_key, shared_at) = match p.region {
            Some((k, at)) => (Some(k), at),
            None => (None, 0),
        };
        let post = staged_allgather::Post {
            rank: d.comm_rank,
            members: d.members,
            nodes: d.nodes,
            send_key: p.send,
            recv_key: p.recv,
            len: d.send_counts[0],
            design: if p.hier {
                bcast::Design::Hier
            } else {
                bcast::Design::Flat
            },
            shared_key,
            shared_at,
        };
        self.0.handle_post(now, post).map_err(|e| e.to_string())
    }
    fn handle_msg(&mut self, now: Nanos, from: SpId, msg: CollMsg) -> Result<(), String> {
        match msg {
            CollMsg::StagedAllgather(m) => {
                self.0.handle_msg(now, from, m).map_err(|e| e.to_string())
            }
            m => Err(format!(
                "a {:?} message for a staged allgather",
                super::kind_of(&m)
            )),
        }
    }
    fn handle_copy_done(&mut self, now: Nanos, id: u64, status: Status) {
        self.0.handle_copy_done(now, bcast::CopyId(id), status)
    }
    fn handle_peer_lost(&mut self, now: Nanos, sp: SpId) {
        self.0.handle_peer_lost(now, sp)
    }
    fn handle_rank_lost(&mut self, now: Nanos, rank: Rank) {
        self.0.handle_rank_lost(now, rank)
    }
    fn abort(&mut self, now: Nanos, status: Status) {
        self.0.abort(now, status)
    }
    fn poll_action(&mut self) -> Option<Act> {
        Some(match self.0.poll_action()? {
            staged_allgather::Action::Send { to, msg } => Act::Send {
                to,
                lends_region: matches!(msg, staged_allgather::Msg::RegionDone { .. }),
                grants_slots: vec![],
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
        })
    }
    fn is_finished(&self) -> bool {
        self.0.is_finished()
    }
    fn copies_in_flight(&self) -> usize {
        self.0.copies_in_flight()
    }
    fn segment_source(&self) -> Option<(SpId, u64, u64)> {
        self.0.segment_source()
    }
}
