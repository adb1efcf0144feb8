//! The hierarchical, load-balanced Allgatherv (`algorithms::allgatherv`).

use super::{Act, CollDriver, Inbound, KindSpec, LateArrivals, LocalPost, StagedConfig};
use algorithms::{allgatherv, CollKey, Nanos, Rank, SpId, Status};
use alias_mkey::AliasKey;
use bootstrap::wire::{CollKind, CollMsg};

pub static SPEC: KindSpec = KindSpec {
    kind: CollKind::Allgatherv,
    new,
    staging: false,
    host_copies: true,
    abort_msg: |status| CollMsg::Allgatherv(allgatherv::Msg::Abort { status }),
    refuse,
    inbound,
    region_writer: super::no_region_writer,
    region_len: super::no_region_len,
};

struct Driver(allgatherv::Allgatherv<AliasKey>);

fn new(key: CollKey, me: SpId, _: StagedConfig) -> Box<dyn CollDriver> {
    Box::new(Driver(allgatherv::Allgatherv::new(
        key,
        allgatherv::Config { me },
    )))
}

fn inbound(msg: &CollMsg) -> Inbound {
    Inbound {
        announce: matches!(msg, CollMsg::Allgatherv(allgatherv::Msg::Announce { .. })),
        ..Inbound::default()
    }
}

fn refuse(msg: &CollMsg, from: SpId, status: Status) -> Vec<(SpId, CollMsg)> {
    let CollMsg::Allgatherv(msg) = msg else {
        return vec![];
    };
    let abort = CollMsg::Allgatherv(allgatherv::Msg::Abort { status });
    let ack = |src, node| CollMsg::Allgatherv(allgatherv::Msg::Ack { src, node, status });
    match msg {
        allgatherv::Msg::Announce {
            src, node, origin, ..
        }
        | allgatherv::Msg::Pass {
            src, node, origin, ..
        } => vec![
            (*origin, ack(*src, *node)),
            (*origin, abort.clone()),
            (from, abort),
        ],
        // The source's SP waits for this SP's answer to a release before it lets its rank go.
        allgatherv::Msg::Release { src, node, .. } => vec![(from, ack(*src, *node))],
        allgatherv::Msg::Segment { src, holder_sp, .. } => vec![
            (
                *holder_sp,
                CollMsg::Allgatherv(allgatherv::Msg::SegmentDone { src: *src, status }),
            ),
            (*holder_sp, abort),
        ],
        // Messages that expect no answer. Listed one by one so that a new message kind has to
        // be considered here.
        allgatherv::Msg::Ack { .. }
        | allgatherv::Msg::RankReady
        | allgatherv::Msg::SegmentDone { .. }
        | allgatherv::Msg::Abort { .. } => vec![],
    }
}

impl CollDriver for Driver {
    fn kind(&self) -> CollKind {
        CollKind::Allgatherv
    }
    fn handle_post(&mut self, now: Nanos, p: LocalPost) -> Result<(), String> {
        let d = p.desc;
        // `check_post` made sure the send block is the one entry at offset 0.
        let post = allgatherv::Post {
            rank: d.comm_rank,
            members: d.members,
            nodes: d.nodes,
            send_key: p.send,
            send_len: d.send_counts[0],
            recv_key: p.recv,
            recv_counts: d.recv_counts,
            recv_displs: d.recv_displs,
        };
        self.0.handle_post(now, post).map_err(|e| e.to_string())
    }
    fn handle_msg(&mut self, now: Nanos, from: SpId, msg: CollMsg) -> Result<(), String> {
        match msg {
            CollMsg::Allgatherv(m) => self.0.handle_msg(now, from, m).map_err(|e| e.to_string()),
            m => Err(format!(
                "a {:?} message for an allgatherv",
                super::kind_of(&m)
            )),
        }
    }
    fn handle_copy_done(&mut self, now: Nanos, id: u64, status: Status) {
        self.0.handle_copy_done(now, allgatherv::CopyId(id), status)
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
            allgatherv::Action::Send { to, msg } => Act::Send {
                to,
                msg: CollMsg::Allgatherv(msg),
                lends_region: false,
                grants_slots: vec![],
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
        })
    }
    fn is_finished(&self) -> bool {
        self.0.is_finished()
    }
    fn copies_in_flight(&self) -> usize {
        self.0.copies_in_flight()
    }
    fn late_arrivals(&self) -> LateArrivals {
        let s = self.0.stats();
        LateArrivals {
            no_ready_rank: s.no_ready_rank,
            served_after_pass: s.served_after_pass,
            parked: s.parked,
            parked_wait_ns: s.parked_wait_ns,
        }
    }
}
