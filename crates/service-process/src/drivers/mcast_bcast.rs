//! The multicast Ibcast (`algorithms::mcast_bcast`): the root's SP multicasts the message in
//! MTU chunks over the fabric ([`crate::mcast`]), the receive workers land them in the
//! ranks' buffers, the fetch ring reads what they missed out of the left neighbour's ranks'
//! buffers. Its registrations and multicasts are requests to the multicast family's
//! resources ([`crate::mcast::plane::Plane`]); its copies (the root's SP's local ranks, the
//! fetches) go through the datapath like every kind's.

use super::{Act, CollDriver, Inbound, KindConfig, KindSpec, LocalPost};
use crate::mcast::plane::{Landing, McastReq, Send};
use algorithms::{mcast_bcast, CollKey, Nanos, Rank, SpId, Status};
use alias_mkey::AliasKey;
use bootstrap::wire::{CollKind, CollMsg, PostDesc, StagedDesign};

pub static SPEC: KindSpec = KindSpec {
    kind: CollKind::McastBcast,
    new,
    abort_msg: |status| CollMsg::McastBcast(mcast_bcast::Msg::Abort { status }),
    refuse,
    inbound: |_| Inbound::default(),
    region_writer: super::no_region_writer,
    region_len: super::no_region_len,
    staged_len: super::all_staging_slots,
    check_desc,
    // The ring and the members list: a few words per member.
    state_bytes_per_member: 64,
    data_bytes: super::no_data_bytes,
};

/// The machine, and whether it waits for its resources to take a registration or an
/// unregistration (the machine's next actions, a `Ready` after a `Register`, the completions
/// after an `Unregister`, are held back until they did: the machine's driver obligation, kept
/// without the SP's loop ever waiting for a receive worker).
struct Driver(mcast_bcast::McastBcast<AliasKey>, bool);

impl super::KindMsg for mcast_bcast::Msg<AliasKey> {
    fn into_coll(self) -> CollMsg {
        CollMsg::McastBcast(self)
    }
}

fn new(key: CollKey, me: SpId, cfg: &KindConfig) -> Box<dyn CollDriver> {
    let m = cfg.mcast;
    Box::new(Driver(
        mcast_bcast::McastBcast::new(
            key,
            mcast_bcast::Config {
                me,
                mtu: m.mtu,
                subgroups: m.subgroups,
                link_bytes_per_ns: m.link_bytes_per_ns,
                alpha_ns: m.alpha_ns,
            },
        ),
        false,
    ))
}

/// The post names its root in the staged fields; it has no design of its own and no segment.
pub(super) fn check_desc(d: &PostDesc) -> Result<(), String> {
    match &d.staged {
        Some(st) if st.design == StagedDesign::Flat && st.segment.is_none() => Ok(()),
        Some(_) => Err("a multicast post names no design (flat) and no segment".into()),
        None => Err("a multicast post without its staged fields".into()),
    }
}

fn refuse(msg: &CollMsg, from: SpId, status: Status) -> Vec<(SpId, CollMsg)> {
    let CollMsg::McastBcast(msg) = msg else {
        return vec![];
    };
    let abort = CollMsg::McastBcast(mcast_bcast::Msg::Abort { status });
    match msg {
        // The root's SP waits for every `Ready` after its `Open`; a leaf for the multicast
        // (or an abort) after its `Ready`, for a `FetchAck` after its `FetchReq`.
        mcast_bcast::Msg::Open { .. }
        | mcast_bcast::Msg::Ready { .. }
        | mcast_bcast::Msg::FetchReq { .. } => vec![(from, abort)],
        // Messages that expect no answer, listed one by one so that a new one is considered.
        mcast_bcast::Msg::Sent { .. }
        | mcast_bcast::Msg::FetchAck { .. }
        | mcast_bcast::Msg::Final { .. }
        | mcast_bcast::Msg::Abort { .. } => vec![],
    }
}

impl From<mcast_bcast::Action<AliasKey>> for Act {
    fn from(a: mcast_bcast::Action<AliasKey>) -> Act {
        match a {
            mcast_bcast::Action::Send { to, msg } => Act::send(to, msg),
            mcast_bcast::Action::Copy(c) => Act::Copy {
                id: c.id.0,
                dst_rank: c.rank,
                src_key: c.src,
                src_offset: c.offset,
                dst_key: c.dst,
                dst_offset: c.offset,
                len: c.len,
            },
            mcast_bcast::Action::Register(r) => {
                super::mcast::resource(McastReq::Register(Landing {
                    blocks: 1,
                    chunks: r.chunks,
                    mtu: r.mtu,
                    len: r.len,
                    subgroups: r.subgroups,
                    keys: r.keys.into_iter().map(|(_, k)| k).collect(),
                    // The root's SP multicasts and never registers.
                    own_blocks: vec![],
                }))
            }
            mcast_bcast::Action::Unregister => super::mcast::resource(McastReq::Unregister),
            mcast_bcast::Action::Multicast(m) => {
                super::mcast::resource(McastReq::Multicast(Send {
                    id: m.id.0,
                    key: m.key,
                    subgroup: m.subgroup,
                    first_psn: m.first_psn,
                    psns: m.psns,
                    offset: m.offset,
                    len: m.len,
                    mtu: m.mtu,
                    chunks: m.chunks,
                }))
            }
            mcast_bcast::Action::Complete { rank, status } => Act::Complete {
                rank,
                status,
                from_segment: false,
            },
        }
    }
}

impl CollDriver for Driver {
    super::mcast::mcast_driver_body!(mcast_bcast, CollMsg::McastBcast);

    fn handle_post(&mut self, now: Nanos, p: LocalPost) -> Result<(), String> {
        let d = p.desc;
        let st = d
            .staged
            .as_ref()
            .ok_or("a mcast bcast post without its root")?;
        let is_root = st.root == d.comm_rank;
        let post = mcast_bcast::Post {
            rank: d.comm_rank,
            root: st.root,
            key: if is_root { p.send } else { p.recv },
            len: if is_root {
                d.send_counts[0]
            } else {
                d.recv_counts[0]
            },
            members: d.members,
        };
        self.0.handle_post(now, post).map_err(|e| e.to_string())
    }
}
