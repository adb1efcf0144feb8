//! The Canary allreduce (issue 27): the SP-tree allreduce's driver (`super::allreduce`) with
//! the machine's `allreduce::Between::Network`: each SP reads and reduces its local ranks'
//! blocks chunk by chunk as the SP tree does, but combines its chunk with the other SPs'
//! through the Canary switches (the in-network family's resources,
//! `crate::canary_resources`) instead of along a tree of SPs, and writes the result that
//! comes back into its ranks. Only `Abort` travels between SPs.

use super::{Inbound, KindSpec};
use algorithms::{allreduce, SpId, Status};
use bootstrap::wire::{CollKind, CollMsg};

pub static SPEC: KindSpec = KindSpec {
    kind: CollKind::CanaryAllreduce,
    new: |key, me, cfg| super::allreduce::driver(key, me, cfg, allreduce::Between::Network),
    abort_msg: |status| CollMsg::CanaryAllreduce(allreduce::Msg::Abort { status }),
    refuse,
    inbound: |_| Inbound::default(),
    region_writer: super::no_region_writer,
    region_len: super::no_region_len,
    staged_len: super::all_staging_slots,
    check_desc: super::allreduce::check_desc,
    // As the SP tree's: the members list (the chunks in flight are the window's).
    state_bytes_per_member: 64,
    data_bytes: super::allreduce::canary_window_bytes,
};

/// No message of the kind expects an answer (the data go through the switches; a peer's
/// `Abort` is the only message).
fn refuse(_msg: &CollMsg, _from: SpId, _status: Status) -> Vec<(SpId, CollMsg)> {
    vec![]
}
