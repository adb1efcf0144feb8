//! The staged Iallgather, flat and hierarchical (`algorithms::staged_allgather`).

use super::{Act, CollDriver, Inbound, KindSpec, LocalPost};
use algorithms::{staged_allgather, CollKey, Nanos, Rank, SpId, Status};
use alias_mkey::AliasKey;
use bootstrap::wire::{CollKind, CollMsg};

pub static SPEC: KindSpec = KindSpec {
    kind: CollKind::StagedAllgather,
    new,
    abort_msg: |status| CollMsg::StagedAllgather(staged_allgather::Msg::Abort { status }),
    refuse,
    inbound,
    // A node's owner writes the node's region.
    region_writer: |d, me| staged_allgather::node_owner(&d.members, &d.nodes, me) == Some(me),
    // The whole message: P blocks (checked not to overflow).
    region_len: |d| d.recv_counts.iter().sum(),
    staged_len: super::all_staging_slots,
    check_desc: super::no_more_checks,
    // Measured: 145 bytes per member beyond the descriptor.
    state_bytes_per_member: 256,
    data_bytes: super::no_data_bytes,
};

struct Driver(staged_allgather::StagedAllgather<AliasKey>);

/// A `RegionDone` lends the receiver this node owner's region.
impl super::KindMsg for staged_allgather::Msg<AliasKey> {
    fn into_coll(self) -> CollMsg {
        CollMsg::StagedAllgather(self)
    }
    fn lends_region(&self) -> bool {
        matches!(self, staged_allgather::Msg::RegionDone { .. })
    }
}

super::copy_act!(staged_allgather::Copy<AliasKey> => StageCopy { rank, src, dst, len });

fn new(key: CollKey, me: SpId, cfg: &super::KindConfig) -> Box<dyn CollDriver> {
    Box::new(Driver(staged_allgather::StagedAllgather::new(
        key,
        cfg.staged.machine(me),
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
    super::delegate!(CollMsg::StagedAllgather, staged_allgather::CopyId);

    fn handle_post(&mut self, now: Nanos, mut p: LocalPost) -> Result<(), String> {
        let (design, shared_key, shared_at) = p.staged_parts();
        let d = p.desc;
        let post = staged_allgather::Post {
            rank: d.comm_rank,
            members: d.members,
            nodes: d.nodes,
            send_key: p.send,
            recv_key: p.recv,
            len: d.send_counts[0],
            design,
            shared_key,
            shared_at,
        };
        self.0.handle_post(now, post).map_err(|e| e.to_string())
    }
    fn segment_source(&self) -> Option<(SpId, u64, u64)> {
        self.0.segment_source()
    }
}
