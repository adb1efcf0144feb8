//! The randomized alltoallv of the engine tests: counts and buffer layouts drawn from a seed,
//! posts of any subset of its ranks, and the check against a directly computed alltoallv.
#![allow(clippy::needless_range_loop)]

use super::{assert_completed, desc, read_back, shuffled_layout, Host, Rng};
use algorithms::CommId;
use alias_mkey::Rights;
use bootstrap::mailbox::STATUS_OK;
use bootstrap::wire;

/// One randomized alltoallv over `comm` (world ranks, in comm-rank order).
pub struct Op {
    pub comm: CommId,
    pub seq: u64,
    pub members_world: Vec<u32>,
    pub counts: Vec<Vec<u64>>, // counts[s][d], comm ranks
    pub send: Vec<Vec<u8>>,
    pub send_displs: Vec<Vec<u64>>,
    pub recv: Vec<Vec<u8>>,
    pub recv_displs: Vec<Vec<u64>>,
}

pub const SENTINEL: u8 = 0xA5;

/// A buffer of blocks of `sizes`: shuffled, gapped, and sometimes 16 bytes of slack at the end.
fn layout(rng: &mut Rng, sizes: &[u64]) -> (Vec<u64>, u64) {
    let (displs, end) = shuffled_layout(rng, sizes);
    (displs, end + rng.below(2) * 16)
}

/// The first alltoallv (seq 0) of world ranks `0..world` on communicator (leader 0, id 1),
/// blocks of up to `max` bytes, its counts drawn from seed `seed`.
pub fn first_op(seed: u64, world: u32, max: u64) -> Op {
    let comm = CommId { leader: 0, id: 1 };
    make_op(&mut Rng(seed), comm, 0, (0..world).collect(), max)
}

pub fn make_op(rng: &mut Rng, comm: CommId, seq: u64, members_world: Vec<u32>, max: u64) -> Op {
    let p = members_world.len();
    let all_zero = rng.below(10) == 0;
    let counts: Vec<Vec<u64>> = (0..p)
        .map(|_| {
            (0..p)
                .map(|_| {
                    if all_zero || rng.below(4) == 0 {
                        0
                    } else {
                        rng.below(max + 1)
                    }
                })
                .collect()
        })
        .collect();
    let mut op = Op {
        comm,
        seq,
        members_world,
        counts: counts.clone(),
        send: vec![],
        send_displs: vec![],
        recv: vec![],
        recv_displs: vec![],
    };
    for s in 0..p {
        let (d, len) = layout(rng, &counts[s]);
        op.send.push((0..len).map(|_| rng.next() as u8).collect());
        op.send_displs.push(d);
        let col: Vec<u64> = (0..p).map(|src| counts[src][s]).collect();
        let (d, len) = layout(rng, &col);
        op.recv.push(vec![SENTINEL; len as usize]);
        op.recv_displs.push(d);
    }
    op
}

impl Op {
    pub fn post(
        &self,
        hosts: &mut [Host],
        world_to_host: &dyn Fn(u32) -> usize,
        slot: u32,
    ) -> Vec<(usize, u32, u64)> {
        let members: Vec<u32> = self
            .members_world
            .iter()
            .map(|&w| hosts[world_to_host(w)].sp)
            .collect();
        let all: Vec<usize> = (0..self.members_world.len()).collect();
        self.post_ranks(hosts, world_to_host, &members, slot, &all)
    }

    /// Posts for the comm ranks in `ranks` only, naming `members` as the SP of each comm rank
    /// (so ranks that never post, or whose host is gone, can still be named). Returns
    /// (host index, slot, token) per post.
    pub fn post_ranks(
        &self,
        hosts: &mut [Host],
        world_to_host: &dyn Fn(u32) -> usize,
        members: &[u32],
        slot: u32,
        ranks: &[usize],
    ) -> Vec<(usize, u32, u64)> {
        let mut posted = vec![];
        for &r in ranks {
            let h = world_to_host(self.members_world[r]);
            let d = self.desc_for(&mut hosts[h], members, r, slot);
            let (slot, token) = hosts[h].post(d);
            posted.push((h, slot, token));
        }
        posted
    }

    /// The descriptor of comm rank `r`, its buffers granted by `host`.
    pub fn desc_for(
        &self,
        host: &mut Host,
        members: &[u32],
        r: usize,
        slot: u32,
    ) -> wire::PostDesc {
        let p = self.members_world.len();
        let send = host.grant(&self.send[r], Rights::READ);
        let recv = host.grant(&self.recv[r], Rights::WRITE);
        let d = desc(
            self.comm,
            self.seq,
            r as u32,
            members.to_vec(),
            slot,
            send,
            recv,
            (
                self.counts[r].clone(),
                self.send_displs[r].clone(),
                (0..p).map(|s| self.counts[s][r]).collect(),
                self.recv_displs[r].clone(),
            ),
        );
        wire::PostDesc {
            world_ranks: self.members_world.clone(),
            ..d
        }
    }

    pub fn check(&self) {
        let p = self.members_world.len();
        for r in 0..p {
            let mut want = vec![SENTINEL; self.recv[r].len()];
            for s in 0..p {
                let c = self.counts[s][r] as usize;
                let so = self.send_displs[s][r] as usize;
                let ro = self.recv_displs[r][s] as usize;
                want[ro..ro + c].copy_from_slice(&self.send[s][so..so + c]);
            }
            let got = read_back(&self.recv[r]);
            if let Some(i) = (0..want.len()).find(|&i| want[i] != got[i]) {
                panic!(
                    "comm {:?} seq {} rank {r}: byte {i} is {:#x}, native alltoallv puts {:#x}",
                    self.comm, self.seq, got[i], want[i]
                );
            }
        }
    }
}

/// Posts a valid 2-rank alltoallv on (hosts[a], hosts[b]) and checks it completes OK: the SP
/// still serves after whatever came before.
pub fn still_serves(hosts: &mut [Host], a: usize, b: usize, seq: u64) {
    let mut rng = Rng(seq);
    let comm = CommId {
        leader: a.min(b) as u32,
        id: 77,
    };
    let op = make_op(&mut rng, comm, seq, vec![a as u32, b as u32], 64);
    let posted = op.post(hosts, &|w| w as usize, 5);
    assert_completed(hosts, &posted, STATUS_OK, "the SP still serves");
    op.check();
}
