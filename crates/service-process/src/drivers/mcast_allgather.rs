//! The multicast Iallgather (`algorithms::mcast_allgather`): each SP multicasts its local
//! ranks' blocks once, in the broadcast sequencer's chains; every SP's receive workers land
//! the others' blocks in its ranks' buffers; the fetch ring reads what they missed out of the
//! left neighbour's ranks' buffers. Requests to the multicast family's resources as the
//! multicast Ibcast's ([`super::mcast`]).

use super::{Act, CollDriver, Inbound, KindConfig, KindSpec, LocalPost};
use crate::mcast::plane::{Landing, McastReq, Send};
use algorithms::{mcast_allgather, CollKey, Nanos, Rank, SpId, Status};
use alias_mkey::AliasKey;
use bootstrap::wire::{CollKind, CollMsg};

pub static SPEC: KindSpec = KindSpec {
    kind: CollKind::McastAllgather,
    new,
    abort_msg: |status| CollMsg::McastAllgather(mcast_allgather::Msg::Abort { status }),
    refuse,
    inbound: |_| Inbound::default(),
    region_writer: super::no_region_writer,
    region_len: super::no_region_len,
    staged_len: super::all_staging_slots,
    check_desc: super::mcast_bcast::check_desc,
    // The ring, the chains and the members list: a few words per member.
    state_bytes_per_member: 64,
    data_bytes: super::no_data_bytes,
};

/// The machine, and whether it waits for the resources (see [`super::mcast`]).
struct Driver(mcast_allgather::McastAllgather<AliasKey>, bool);

impl super::KindMsg for mcast_allgather::Msg<AliasKey> {
    fn into_coll(self) -> CollMsg {
        CollMsg::McastAllgather(self)
    }
}

fn new(key: CollKey, me: SpId, cfg: &KindConfig) -> Box<dyn CollDriver> {
    let m = cfg.mcast;
    Box::new(Driver(
        mcast_allgather::McastAllgather::new(
            key,
            mcast_allgather::Config {
                me,
                mtu: m.mtu,
                subgroups: m.subgroups,
                // The sequencer's chains: its default (about the square root of the SPs).
                chains: 0,
                link_bytes_per_ns: m.link_bytes_per_ns,
                alpha_ns: m.alpha_ns,
            },
        ),
        false,
    ))
}

fn refuse(msg: &CollMsg, from: SpId, status: Status) -> Vec<(SpId, CollMsg)> {
    let CollMsg::McastAllgather(msg) = msg else {
        return vec![];
    };
    let abort = CollMsg::McastAllgather(mcast_allgather::Msg::Abort { status });
    match msg {
        // The coordinator waits for every `Ready`; an SP for `Start` after its `Ready`, for the
        // chain's `Go`, for a `FetchAck` after its `FetchReq`.
        mcast_allgather::Msg::Open { .. }
        | mcast_allgather::Msg::Ready { .. }
        | mcast_allgather::Msg::Start { .. }
        | mcast_allgather::Msg::Go { .. }
        | mcast_allgather::Msg::FetchReq { .. } => vec![(from, abort)],
        // Messages that expect no answer, listed one by one so that a new one is considered.
        mcast_allgather::Msg::FetchAck { .. }
        | mcast_allgather::Msg::Final { .. }
        | mcast_allgather::Msg::Abort { .. } => vec![],
    }
}

impl From<mcast_allgather::Action<AliasKey>> for Act {
    fn from(a: mcast_allgather::Action<AliasKey>) -> Act {
        match a {
            mcast_allgather::Action::Send { to, msg } => Act::send(to, msg),
            mcast_allgather::Action::Copy(c) => Act::Copy {
                id: c.id.0,
                dst_rank: c.rank,
                src_key: c.src,
                src_offset: c.src_offset,
                dst_key: c.dst,
                dst_offset: c.dst_offset,
                len: c.len,
            },
            mcast_allgather::Action::Register(r) => {
                super::mcast::resource(McastReq::Register(Landing {
                    blocks: r.blocks,
                    chunks: r.chunks,
                    mtu: r.mtu,
                    len: r.len,
                    subgroups: r.subgroups,
                    // Block `b` is comm rank `b`'s: this SP's ranks' blocks are its own
                    // multicasts.
                    own_blocks: r.keys.iter().map(|&(rank, _)| u64::from(rank)).collect(),
                    keys: r.keys.into_iter().map(|(_, k)| k).collect(),
                }))
            }
            mcast_allgather::Action::Unregister => super::mcast::resource(McastReq::Unregister),
            mcast_allgather::Action::Multicast(m) => {
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
            mcast_allgather::Action::Complete { rank, status } => Act::Complete {
                rank,
                status,
                from_segment: false,
            },
        }
    }
}

impl CollDriver for Driver {
    super::mcast::mcast_driver_body!(mcast_allgather, CollMsg::McastAllgather);

    fn handle_post(&mut self, now: Nanos, p: LocalPost) -> Result<(), String> {
        let d = p.desc;
        let post = mcast_allgather::Post {
            rank: d.comm_rank,
            len: d.send_counts[0],
            members: d.members,
            send_key: p.send,
            recv_key: p.recv,
        };
        self.0.handle_post(now, post).map_err(|e| e.to_string())
    }
}
