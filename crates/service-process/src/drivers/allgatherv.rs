//! The hierarchical, load-balanced Allgatherv (`algorithms::allgatherv`).

use super::{Act, CollDriver, Inbound, KindSpec, LateArrivals, LocalPost};
use algorithms::{allgatherv, CollKey, Nanos, Rank, SpId, Status};
use alias_mkey::AliasKey;
use bootstrap::wire::{CollKind, CollMsg};

pub static SPEC: KindSpec = KindSpec {
    kind: CollKind::Allgatherv,
    new,
    abort_msg: |status| CollMsg::Allgatherv(allgatherv::Msg::Abort { status }),
    refuse,
    inbound,
    region_writer: super::no_region_writer,
    region_len: super::no_region_len,
    staged_len: super::all_staging_slots,
    check_desc: super::no_more_checks,
    // Measured: 6 bytes per member beyond the descriptor.
    state_bytes_per_member: 64,
    data_bytes: super::no_data_bytes,
};

super::direct_driver!(allgatherv::Allgatherv, CollMsg::Allgatherv);

fn refuse(msg: &CollMsg, from: SpId, status: Status) -> Vec<(SpId, CollMsg)> {
    let CollMsg::Allgatherv(msg) = msg else {
        return vec![];
    };
    let abort = CollMsg::Allgatherv(allgatherv::Msg::Abort { status });
    let ack = |src, node| CollMsg::Allgatherv(allgatherv::Msg::Ack { src, node, status });
    match msg {
        allgatherv::Msg::Announce(ann) | allgatherv::Msg::Pass { ann, .. } => vec![
            (ann.origin, ack(ann.src, ann.node)),
            (ann.origin, abort.clone()),
            (from, abort),
        ],
        // The source's SP waits for this SP's answer to a release before it lets its rank go.
        allgatherv::Msg::Release { src, node, .. } => vec![(from, ack(*src, *node))],
        allgatherv::Msg::Segment(seg) => vec![
            (
                seg.holder_sp,
                CollMsg::Allgatherv(allgatherv::Msg::SegmentDone {
                    src: seg.src,
                    status,
                }),
            ),
            (seg.holder_sp, abort),
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
    super::delegate!(CollMsg::Allgatherv, allgatherv::CopyId);

    fn handle_post(&mut self, now: Nanos, p: LocalPost) -> Result<(), String> {
        // `check_post` made sure the send block is the one entry at offset 0.
        let post = p.direct(|d| allgatherv::Own {
            nodes: std::mem::take(&mut d.nodes),
            send_len: d.send_counts[0],
        });
        self.0.handle_post(now, post).map_err(|e| e.to_string())
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
