//! What the fuzzer feeds arbitrary bytes to (`fuzz/`, `make fuzz`), and what `make test`
//! replays the kept corpus and crash inputs through (`tests/fuzz_corpus.rs`): every decoder of
//! untrusted input, the checks of a host's descriptor, and the engine's handling of peer
//! messages and posts, driven without sockets. Each must return, whatever the bytes: no
//! panic, no unbounded allocation or loop (and the hand-written post decoder must decode
//! what bincode decodes, and refuse what it refuses).

use crate::access;
use crate::drivers::{self, LocalPost, StagedConfig};
use crate::validate::{self, Poster};
use algorithms::{CollKey, CommId, Status};
use alias_mkey::{AliasKey, BackendData, Grant, Owner, Rights};
use bootstrap::auth::ClusterKey;
use bootstrap::wire::{self, CollKind, CollMsg, FrameDecoder, HostHello, HostToSp, SpToSp};
use bootstrap::{Cluster, Layout};

/// A cluster of 2 nodes x 2 SPs on loopback (nothing listens: only its shape matters).
fn cluster() -> Cluster {
    let sps = (0..4)
        .map(|i| bootstrap::cluster::SpEntry {
            id: i,
            node: i / 2,
            index: i % 2,
            peer_addr: "127.0.0.1:9".parse().unwrap(),
            host_socket: std::path::PathBuf::from(format!("/nonexistent/sp-{i}.sock")),
            host_addr: None,
        })
        .collect();
    Cluster::new(2, 2, Some(2), Layout::Block, sps).expect("a valid fixed cluster")
}

fn key() -> ClusterKey {
    ClusterKey::from_bytes([7; 32])
}

/// The byte stream of one host connection: frames, the first a hello, the rest host messages;
/// every post is checked as the SP would (by SP 0, for world rank 0 of a 4-rank job).
pub fn host_frames(data: &[u8]) {
    let cluster = cluster();
    let mut d = FrameDecoder::default();
    d.extend(data);
    let mut first = true;
    while let Ok(Some(f)) = d.next_frame() {
        if first {
            first = false;
            if let Ok(wire::Hello::Host(h)) = wire::decode_hello(&f) {
                let _ = access::check_hello(&h, &key(), Some(0), &access::Limits::default());
            }
            continue;
        }
        // The SP decodes a host's messages with `decode_host` (a post by hand): it must
        // agree with bincode on every input.
        let msg = wire::decode_host(&f);
        assert_eq!(
            msg.as_ref().ok(),
            wire::decode::<HostToSp>(&f).as_ref().ok(),
            "decode_host and bincode disagree"
        );
        if let Ok(HostToSp::Post(p)) = msg {
            let poster = Poster {
                sp: 0,
                world_rank: 0,
                world_size: 4,
            };
            let _ = validate::check_post(&p, &poster, &cluster, true, None);
            let _ = validate::check_post(
                &p,
                &poster,
                &cluster,
                false,
                Some((&[0, 0, 2, 2], &[0, 1, 2, 3])),
            );
        }
    }
}

/// The byte stream of one peer connection: frames of SP-to-SP messages.
pub fn peer_frames(data: &[u8]) {
    let mut d = FrameDecoder::default();
    d.extend(data);
    while let Ok(Some(f)) = d.next_frame() {
        if let Ok(SpToSp::Coll { msg, .. } | SpToSp::Data { msg, .. }) = wire::decode::<SpToSp>(&f)
        {
            let _ = msg.keys();
        }
    }
}

/// A job credential as text, and a host hello around it.
pub fn credential(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(c) = bootstrap::auth::JobCredential::decode(&text) {
        let _ = c.verify(&key());
    }
    let h = HostHello {
        credential: text.into_owned(),
        world_rank: data.first().copied().unwrap_or(0) as u32,
        world_size: data.get(1).copied().unwrap_or(1) as u32,
        node: 0,
        local_rank: 0,
        pid: 0,
    };
    let _ = access::check_hello(&h, &key(), Some(0), &access::Limits::default());
    let _ = access::check_hello(&h, &key(), None, &access::Limits::default());
}

/// Reads the fuzzer's bytes as a sequence of small numbers.
struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }
    fn small(&mut self) -> Option<u64> {
        let b = self.byte()?;
        Some(if b < 200 { b as u64 } else { (b as u64) << 12 })
    }
    /// A chunk prefixed by its length (two bytes, little endian; at most 4 KiB).
    fn chunk(&mut self) -> Option<&[u8]> {
        let n = u16::from_le_bytes([self.byte()?, self.byte()?]) as usize;
        let n = n.min(4096).min(self.0.len());
        let (c, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(c)
    }
}

fn fake_key(rank: u32) -> AliasKey {
    AliasKey {
        owner: Owner {
            job: 1,
            world_rank: rank,
            pid: 1,
            start: 1,
            uid: 0,
            gid: 0,
        },
        grant: Grant {
            region: rank as u64,
            generation: 0,
            addr: 0x10000,
            len: 1 << 20,
            rights: Rights::READ_WRITE,
            backend: BackendData::Cma,
        },
    }
}

/// A post of comm rank `rank` of a 4-rank communicator (SPs 0, 0, 2, 2: nodes 0, 0, 1, 1) to
/// an instance of `kind`, shaped by the kind's facts (`bootstrap::kinds`): its root drawn from
/// the cursor if it has one, then its block lengths (one per rank, or one for every block),
/// then, for a staged kind, whether this SP runs it hierarchically. The root's other side is
/// not emptied: posts as `validate::check_post` would pass them and as it would not, for the
/// drivers must not trust them either.
fn post(kind: CollKind, rank: u32, c: &mut Cursor) -> Option<LocalPost> {
    use bootstrap::kinds::Blocks;
    let f = kind.facts();
    let p = 4;
    let root = if f.rooted { (c.byte()? % 4) as u32 } else { 0 };
    let per_rank = |b: Blocks| b == Blocks::PerRank;
    let counts: Vec<u64> =
        if per_rank(f.send_blocks) || (per_rank(f.recv_blocks) && !f.recv_rank_ordered) {
            (0..p).map(|_| c.small()).collect::<Option<_>>()?
        } else {
            vec![c.small()?; p]
        };
    let hier = f.is_staged() && c.byte()? % 2 == 1;
    // Any operation on any type, defined or not.
    let reduce = if f.reduces {
        let b = c.byte()? as usize;
        Some(algorithms::allreduce::Reduce {
            op: algorithms::allreduce::Op::ALL[b % 10],
            elem: algorithms::allreduce::Elem::ALL[b / 10 % 10],
        })
    } else {
        None
    };
    let side = |b: Blocks| -> (Vec<u64>, Vec<u64>) {
        match b {
            Blocks::One => (vec![counts[rank as usize]], vec![0]),
            Blocks::PerRank if f.recv_rank_ordered => (
                counts.clone(),
                (0..p as u64).map(|i| i * counts[0]).collect(),
            ),
            Blocks::PerRank => (counts.clone(), (0..p as u64).map(|i| i * 4096).collect()),
        }
    };
    let ((send_counts, send_displs), (recv_counts, recv_displs)) =
        (side(f.send_blocks), side(f.recv_blocks));
    let d = wire::PostDesc {
        kind,
        comm: CommId { leader: 0, id: 1 },
        seq: 0,
        comm_rank: rank,
        members: vec![0, 0, 2, 2],
        world_ranks: vec![0, 1, 2, 3],
        nodes: if f.lists_nodes {
            vec![0, 0, 1, 1]
        } else {
            vec![]
        },
        slot: None,
        token: 0,
        send: fake_key(rank).grant,
        recv: fake_key(rank).grant,
        send_counts,
        send_displs,
        recv_counts,
        recv_displs,
        host_copies: false,
        staged: f.posts_staged_fields().then_some(wire::Staged {
            root,
            design: wire::StagedDesign::Flat,
            segment: None,
        }),
        send_packed: false,
        recv_packed: false,
        reduce,
        stamps: Default::default(),
    };
    Some(LocalPost {
        desc: d,
        send: fake_key(rank),
        recv: fake_key(rank),
        region: None,
        hier,
    })
}

/// The engine's side of one collective instance on SP 0: posts of its local comm ranks (0 and
/// 1), messages from peers (decoded from the bytes), copies and moves finishing with any
/// status, lost peers and ranks, aborts; every action is drained. Bounded by the input.
pub fn machine(data: &[u8]) {
    let mut c = Cursor(data);
    let Some(k) = c.byte() else { return };
    let kinds = &bootstrap::kinds::KINDS;
    let kind = kinds[k as usize % kinds.len()].kind;
    let key = CollKey {
        job: 1,
        comm: CommId { leader: 0, id: 1 },
        seq: 0,
    };
    let mut m = drivers::new(
        kind,
        key,
        0,
        &drivers::KindConfig {
            staged: StagedConfig {
                chunk_bytes: 4096,
                slots: 2,
            },
            mcast: drivers::McastParams {
                mtu: 64,
                subgroups: 2,
                ..drivers::McastParams::default()
            },
        },
    );
    let statuses = [
        Status::Ok,
        Status::AccessError,
        Status::PeerFailed,
        Status::RankFailed,
        Status::Aborted,
    ];
    let mut now = 0;
    let mut ids: Vec<u64> = Vec::new();
    for _ in 0..256 {
        let Some(op) = c.byte() else { break };
        now += 1_000;
        match op % 8 {
            0 | 1 => {
                if let Some(p) = post(kind, (op % 2) as u32, &mut c) {
                    let _ = m.handle_post(now, p);
                }
            }
            2 | 3 => {
                let from = [1u32, 2, 3][(op as usize / 8) % 3];
                let Some(bytes) = c.chunk() else { break };
                if let Ok(msg) = wire::decode::<CollMsg>(bytes) {
                    let _ = m.handle_msg(now, from, msg);
                }
            }
            4 => {
                let Some(s) = c.byte() else { break };
                let id = ids.pop().unwrap_or(s as u64);
                m.handle_copy_done(now, id, statuses[s as usize % statuses.len()]);
            }
            5 => {
                let Some(s) = c.byte() else { break };
                let id = ids.pop().unwrap_or(s as u64);
                m.handle_move_done(now, id, statuses[s as usize % statuses.len()]);
            }
            6 => {
                let Some(s) = c.byte() else { break };
                match s % 3 {
                    0 => m.handle_peer_lost(now, (s as u32 % 3) + 1),
                    1 => m.handle_rank_lost(now, s as u32 % 4),
                    _ => m.abort(now, statuses[s as usize % statuses.len()]),
                }
            }
            7 => {
                // What a family's resources report (the multicast's: a chunk landed, a
                // multicast done, a chunk that could not land), and the clock.
                let Some(s) = c.byte() else { break };
                use crate::mcast::plane::McastEvent;
                let ev = match s % 6 {
                    0 => McastEvent::Landed(vec![u64::from(s / 6)]),
                    1 => McastEvent::Landed((0..u64::from(s / 6)).rev().collect()),
                    2 => McastEvent::MulticastDone {
                        id: ids.pop().unwrap_or(s as u64),
                        status: statuses[s as usize % statuses.len()],
                    },
                    3 => McastEvent::Registered,
                    4 => McastEvent::Unregistered,
                    _ => McastEvent::SinkFailed,
                };
                m.handle_event(now, Box::new(ev));
                if let Some(d) = m.deadline() {
                    now = now.max(d);
                    m.tick(now);
                }
            }
            _ => {}
        }
        // Drain what the machine wants done; remember copy and move ids to finish later.
        for _ in 0..10_000 {
            match m.poll_action() {
                None => break,
                Some(crate::drivers::Act::Copy { id, .. })
                | Some(crate::drivers::Act::StageCopy { id, .. })
                | Some(crate::drivers::Act::Move { id, .. }) => ids.push(id),
                Some(crate::drivers::Act::Resource { req, .. }) => {
                    if let Ok(r) = req.downcast::<crate::mcast::plane::McastReq>() {
                        if let crate::mcast::plane::McastReq::Multicast(mc) = *r {
                            ids.push(mc.id);
                        }
                    }
                }
                Some(_) => {}
            }
        }
        let _ = (m.is_finished(), m.copies_in_flight());
    }
}

/// A `machine` input from peer messages seen in real traffic: a kind, posts of both local
/// ranks, then each message (the inverse of [`machine`]'s reading).
pub fn machine_input(kind: u8, msgs: &[Vec<u8>]) -> Vec<u8> {
    let mut v = vec![kind, 0, 8, 8, 8, 8, 1, 8, 8, 8, 8];
    for (i, m) in msgs.iter().enumerate() {
        v.push(2 + 8 * (i % 3) as u8);
        v.extend_from_slice(&(m.len() as u16).to_le_bytes());
        v.extend_from_slice(m);
        v.extend_from_slice(&[4, 0]);
    }
    v
}

/// The collective `mcast_datagram` registers: its id, tag, chunks and MTU.
const MCAST_COLL: (u64, u64, u32, usize) = (0x5a5a, 0x1234_5678_9abc_def0, 8, 64);

/// Datagrams off the multicast fabric, through a receive worker's intake with one collective
/// registered ([`MCAST_COLL`]): the input's first byte sets the injected drop and reorder rates,
/// then come datagrams, each a `u16` length and its bytes. Besides returning, the intake must
/// never hand the collective's sink a chunk it does not have, a chunk longer than the MTU, or
/// the same chunk twice (the sink panics if it does).
pub fn mcast_datagram(data: &[u8]) {
    use crate::mcast::worker::{Injection, Intake, Registration, Sink};
    struct Checked(std::sync::Mutex<Vec<bool>>);
    impl Sink for Checked {
        fn land(&self, psn: u32, payload: &[u8]) -> Result<(), String> {
            let mut seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
            assert!((psn as usize) < seen.len(), "chunk {psn} of {}", seen.len());
            assert!(
                payload.len() <= MCAST_COLL.3,
                "a chunk of {} bytes",
                payload.len()
            );
            assert!(!seen[psn as usize], "chunk {psn} landed twice");
            seen[psn as usize] = true;
            Ok(())
        }
    }
    let Some((&knobs, mut rest)) = data.split_first() else {
        return;
    };
    let (tx, _rx) = crossbeam_channel::unbounded();
    let mut intake = Intake::new(
        tx,
        Injection {
            drop_ppm: u32::from(knobs & 0x0f) * 50_000,
            reorder_ppm: u32::from(knobs >> 4) * 50_000,
            seed: u64::from(knobs),
        },
    );
    let (coll, tag, chunks, _) = MCAST_COLL;
    intake.register(Registration {
        coll,
        tag,
        chunks,
        sink: std::sync::Arc::new(Checked(std::sync::Mutex::new(vec![false; chunks as usize]))),
        skip: vec![],
    });
    while rest.len() >= 2 {
        let n = u16::from_le_bytes([rest[0], rest[1]]) as usize;
        let d = &rest[2..(2 + n).min(rest.len())];
        intake.on_datagram(d.to_vec());
        rest = &rest[(2 + n).min(rest.len())..];
    }
    intake.flush();
}

/// Seed inputs of [`mcast_datagram`]: every chunk of the registered collective in order, out
/// of order with a duplicate, and mixed with a foreign tag and garbage.
pub fn mcast_datagram_seeds() -> Vec<Vec<u8>> {
    use crate::mcast::datagram::{encode, Header};
    let (coll, tag, chunks, mtu) = MCAST_COLL;
    let dgram = |psn: u32, tag: u64, len: usize| {
        let mut out = Vec::new();
        let h = Header {
            subgroup: 0,
            coll,
            tag,
            psn,
            chunks,
        };
        encode(&h, &vec![psn as u8; len], &mut out);
        out
    };
    let input = |knobs: u8, ds: &[Vec<u8>]| {
        let mut v = vec![knobs];
        for d in ds {
            v.extend_from_slice(&(d.len() as u16).to_le_bytes());
            v.extend_from_slice(d);
        }
        v
    };
    let all: Vec<Vec<u8>> = (0..chunks)
        .map(|p| dgram(p, tag, if p + 1 == chunks { 5 } else { mtu }))
        .collect();
    let mut shuffled: Vec<Vec<u8>> = all.iter().rev().cloned().collect();
    shuffled.push(all[2].clone());
    let mixed = vec![
        dgram(1, tag ^ 1, mtu),
        all[0].clone(),
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        all[1].clone(),
    ];
    vec![input(0, &all), input(0x21, &shuffled), input(0x00, &mixed)]
}

/// A fuzz target: any bytes in, must return.
pub type Target = fn(&[u8]);

/// Every target, by name (for the corpus replay).
pub const TARGETS: [(&str, Target); 5] = [
    ("host_frames", host_frames),
    ("peer_frames", peer_frames),
    ("credential", credential),
    ("machine", machine),
    ("mcast_datagram", mcast_datagram),
];
