//! The ring Alltoallv (`algorithms::alltoallv`).

use super::{Act, CollDriver, Inbound, KindSpec, LocalPost};
use algorithms::{alltoallv, CollKey, Nanos, Rank, SpId, Status};
use alias_mkey::AliasKey;
use bootstrap::wire::{CollKind, CollMsg};

pub static SPEC: KindSpec = KindSpec {
    kind: CollKind::Alltoallv,
    new,
    abort_msg: |status| CollMsg::Alltoallv(alltoallv::Msg::Abort { status }),
    refuse,
    inbound,
    region_writer: super::no_region_writer,
    region_len: super::no_region_len,
    check_desc: super::no_more_checks,
    // Measured: 408 bytes per member beyond the descriptor (its rank state, and an announcement
    // per member queued until that member posts).
    state_bytes_per_member: 512,
};

super::direct_driver!(alltoallv::Alltoallv, CollMsg::Alltoallv);

fn refuse(msg: &CollMsg, from: SpId, status: Status) -> Vec<(SpId, CollMsg)> {
    let CollMsg::Alltoallv(msg) = msg else {
        return vec![];
    };
    match msg {
        alltoallv::Msg::Announce { src, dst, .. } => vec![
            (
                from,
                CollMsg::Alltoallv(alltoallv::Msg::Ack {
                    src: *src,
                    dst: *dst,
                    status,
                }),
            ),
            (from, CollMsg::Alltoallv(alltoallv::Msg::Abort { status })),
        ],
        // Messages that expect no answer. Listed one by one so that a new message kind has to
        // be considered here.
        alltoallv::Msg::Ack { .. } | alltoallv::Msg::Abort { .. } => vec![],
    }
}

impl CollDriver for Driver {
    super::delegate!(CollMsg::Alltoallv, alltoallv::CopyId);

    fn handle_post(&mut self, now: Nanos, p: LocalPost) -> Result<(), String> {
        let post = p.direct(|d| alltoallv::Own {
            send_counts: std::mem::take(&mut d.send_counts),
            send_displs: std::mem::take(&mut d.send_displs),
        });
        self.0.handle_post(now, post).map_err(|e| e.to_string())
    }
}
