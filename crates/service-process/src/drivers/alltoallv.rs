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
    staged_len: super::all_staging_slots,
    check_desc: super::no_more_checks,
    // Measured: 408 bytes per member beyond the descriptor (its rank state, and an announcement
    // per member queued until that member posts).
    state_bytes_per_member: 512,
    data_bytes: super::no_data_bytes,
};

// An announcing rank completes only once its block is acked (its buffer may be read until
// then). An instance that aborted here before a peer's announcement came (its ranks posted
// after the abort: they announce nothing and complete at once) has finished and is gone when
// that announcement comes: its sender still needs the ack.
super::direct_driver!(
    alltoallv::Alltoallv,
    CollMsg::Alltoallv,
    answer_when_finished: alltoallv::Msg::Announce { .. }
);

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

#[cfg(test)]
mod tests {
    use super::*;
    use alias_mkey::{BackendData, Grant, Owner, Rights};
    use bootstrap::wire::PostDesc;
    use std::collections::{BTreeMap, BTreeSet, VecDeque};

    /// The SPs of the test: SP 0 was lost (it restarted, or died), SPs 1..=3 each serve one rank
    /// of a 4-rank communicator (comm rank r at SP r).
    const MEMBERS: [SpId; 4] = [0, 1, 2, 3];

    fn key(rank: Rank) -> AliasKey {
        AliasKey {
            owner: Owner {
                job: 1,
                world_rank: rank,
                pid: 100 + rank,
                start: 1,
                uid: 0,
                gid: 0,
            },
            grant: Grant {
                region: 1,
                generation: 0,
                addr: 0x1000,
                len: 32,
                rights: Rights::READ_WRITE,
                backend: BackendData::Cma,
            },
        }
    }

    fn post(rank: Rank) -> LocalPost {
        let p = MEMBERS.len();
        let counts = vec![8u64; p];
        let displs: Vec<u64> = (0..p as u64).map(|i| 8 * i).collect();
        LocalPost {
            desc: PostDesc {
                kind: CollKind::Alltoallv,
                comm: algorithms::CommId { leader: 0, id: 1 },
                seq: 2,
                comm_rank: rank,
                world_ranks: (0..p as u32).collect(),
                members: MEMBERS.to_vec(),
                nodes: vec![],
                slot: None,
                token: 0,
                send: key(rank).grant,
                recv: key(rank).grant,
                send_counts: counts.clone(),
                send_displs: displs.clone(),
                recv_counts: counts,
                recv_displs: displs,
                host_copies: false,
                send_packed: false,
                recv_packed: false,
                reduce: None,
                staged: None,
                stamps: Default::default(),
            },
            send: key(rank),
            recv: key(rank),
            region: None,
            hier: false,
        }
    }

    /// The SPs 1..=3 as the engine runs them: an instance is made by the first event that
    /// names it, and dropped once finished; a message for a finished collective is answered
    /// only if its kind says so (`Inbound::answer_when_finished`, refused with `Aborted`).
    #[derive(Default)]
    struct Net {
        live: BTreeMap<SpId, Driver>,
        finished: BTreeSet<SpId>,
        /// In flight, per (from, to) link, in order.
        links: BTreeMap<(SpId, SpId), VecDeque<CollMsg>>,
        completed: BTreeMap<SpId, Status>,
    }

    impl Net {
        fn ck() -> CollKey {
            CollKey {
                job: 1,
                comm: algorithms::CommId { leader: 0, id: 1 },
                seq: 2,
            }
        }

        fn instance(&mut self, sp: SpId) -> &mut Driver {
            self.live.entry(sp).or_insert_with(|| {
                Driver(alltoallv::Alltoallv::new(
                    Self::ck(),
                    alltoallv::Config { me: sp },
                ))
            })
        }

        /// Runs every action of SP `sp`'s instance; drops it once finished.
        fn drive(&mut self, sp: SpId) {
            while let Some(act) = self.live.get_mut(&sp).and_then(|d| d.poll_action()) {
                match act {
                    // SP 0 is gone: nothing reaches it.
                    Act::Send { to, msg, .. } if to != 0 => {
                        self.links.entry((sp, to)).or_default().push_back(msg)
                    }
                    Act::Send { .. } => {}
                    Act::Copy { id, .. } => {
                        self.live
                            .get_mut(&sp)
                            .unwrap()
                            .handle_copy_done(0, id, Status::Ok)
                    }
                    Act::Complete { rank, status, .. } => {
                        assert_eq!(rank, sp, "SP {sp} serves comm rank {sp} only");
                        assert!(self.completed.insert(sp, status).is_none(), "twice");
                    }
                    _ => panic!("an alltoallv only sends, copies and completes"),
                }
            }
            if self.live.get(&sp).is_some_and(|d| d.is_finished()) {
                self.live.remove(&sp);
                self.finished.insert(sp);
            }
        }

        /// The rank of SP `sp` posts; the job lost SP 0 (the engine tells every new post).
        fn post(&mut self, sp: SpId) {
            assert!(!self.finished.contains(&sp));
            let d = self.instance(sp);
            d.handle_post(0, post(sp)).unwrap();
            d.handle_peer_lost(0, 0);
            self.drive(sp);
        }

        /// Delivers the first message in flight from `from` to `to`; false if none.
        fn deliver(&mut self, from: SpId, to: SpId) -> bool {
            let Some(msg) = self.links.get_mut(&(from, to)).and_then(|q| q.pop_front()) else {
                return false;
            };
            if self.finished.contains(&to) {
                if (SPEC.inbound)(&msg).answer_when_finished {
                    for (dst, reply) in refuse(&msg, from, Status::Aborted) {
                        self.links.entry((to, dst)).or_default().push_back(reply);
                    }
                }
                return true;
            }
            self.instance(to).handle_msg(0, from, msg).unwrap();
            self.drive(to);
            true
        }

        fn deliver_all(&mut self) {
            loop {
                let links: Vec<(SpId, SpId)> = self.links.keys().copied().collect();
                let mut any = false;
                for (from, to) in links {
                    any |= self.deliver(from, to);
                }
                if !any {
                    return;
                }
            }
        }
    }

    /// The interleaving of a job that lost an SP and posts again (the restarted SP's job seen
    /// in `tests/rejoin.rs`): SP 2's abort reaches SP 3 before SP 1's announcement does, so SP
    /// 3's rank posts into an aborted instance, completes at once and the instance is gone
    /// when SP 1's announcement comes. SP 1's rank waits for that block's ack: it must get one,
    /// and every rank completes with an error.
    #[test]
    fn an_announcement_reaching_an_sp_where_the_aborted_instance_finished_is_answered() {
        let mut net = Net::default();
        net.post(2);
        net.post(1);
        // SP 2's announcement and abort reach SP 3 first; SP 3's rank posts.
        while net.deliver(2, 3) {}
        net.post(3);
        assert!(
            net.finished.contains(&3),
            "SP 3's instance finished at its post"
        );
        assert!(
            !net.links[&(1, 3)].is_empty(),
            "SP 1's announcement is still in flight"
        );
        net.deliver_all();
        for sp in 1..=3 {
            let got = net.completed.get(&sp);
            assert!(
                got.is_some_and(|s| !s.is_ok()),
                "the rank of SP {sp} completed with {got:?}"
            );
        }
        assert!(net.live.is_empty(), "unfinished: {:?}", net.live.keys());
    }
}
