//! Tests of the wire protocol: frames, hellos, messages and their bounds.
use super::*;
use alias_mkey::{BackendData, Rights};

fn grant(len: u64) -> Grant {
    Grant {
        region: 1,
        generation: 0,
        addr: 4096,
        len,
        rights: Rights::READ,
        backend: BackendData::Cma,
    }
}

#[test]
fn hello_roundtrip_and_version_mismatch() {
    let h = Hello::Host(HostHello {
        credential: "spoffjob1:9:0:4:00".into(),
        world_rank: 1,
        world_size: 4,
        node: 0,
        local_rank: 1,
        pid: 7,
    });
    assert_eq!(decode_hello(&encode_hello(&h)).unwrap(), h);
    for h in [
        Hello::Sp(SpHello {
            sp: 3,
            cluster_fingerprint: 5,
            nonce: [1; 16],
        }),
        Hello::SpWelcome {
            sp: 2,
            nonce: [2; 16],
            proof: [3; 32],
        },
        Hello::SpProof { proof: [4; 32] },
        Hello::Admin(AdminHello {
            nonce: [5; 16],
            unix_secs: 6,
            proof: [7; 32],
        }),
        Hello::Welcome { sp: 1 },
    ] {
        assert_eq!(decode_hello(&encode_hello(&h)).unwrap(), h);
    }
    let old = encode_hello_with_version(&h, 99);
    let err = decode_hello(&old).unwrap_err();
    assert!(err
        .to_string()
        .contains(&format!("speaks {PROTOCOL_VERSION}")));
    assert!(err.to_string().contains("speaks 99"));
    let reject = encode_hello_with_version(
        &Hello::Reject {
            reason: "no".into(),
        },
        42,
    );
    assert_eq!(
        decode_hello(&reject).unwrap(),
        Hello::Reject {
            reason: "no".into()
        }
    );
    assert!(matches!(
        decode_hello(b"HTTP/1.1 200"),
        Err(HelloError::BadMagic(_))
    ));
}

/// A post of an alltoallv, varied by `i` (a hierarchical staged one for 3).
fn post(i: u32) -> HostToSp {
    HostToSp::Post(Box::new(PostDesc {
        kind: CollKind::Alltoallv,
        comm: CommId { leader: 0, id: i },
        seq: i as u64,
        comm_rank: 0,
        members: vec![0, 1],
        world_ranks: vec![0, 1],
        nodes: vec![],
        slot: Some(i),
        token: 77,
        send_packed: false,
        recv_packed: false,
        reduce: None,
        stamps: Default::default(),
        send: grant(10),
        recv: grant(20),
        send_counts: vec![1, 2],
        send_displs: vec![0, 1],
        recv_counts: vec![3, 4],
        recv_displs: vec![0, 3],
        host_copies: i.is_multiple_of(2),
        staged: (i == 3).then(|| Staged {
            root: 1,
            design: StagedDesign::Hier,
            segment: Some(grant(30)),
        }),
    }))
}

#[test]
fn frames_split_anywhere_reassemble() {
    let msgs: Vec<HostToSp> = (0..5).map(post).collect();
    let bytes: Vec<u8> = msgs.iter().flat_map(encode).collect();
    for step in [1, 3, 7, 64, bytes.len()] {
        let mut d = FrameDecoder::default();
        let mut got = vec![];
        for chunk in bytes.chunks(step) {
            d.extend(chunk);
            while let Some(p) = d.next_frame().unwrap() {
                got.push(decode::<HostToSp>(&p).unwrap());
            }
        }
        assert_eq!(got, msgs);
        assert_eq!(d.pending(), 0);
    }
}

#[test]
fn staged_data_round_trips() {
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 13) as u8).collect();
    let msg = SpToSp::Data {
        key: CollKey {
            job: 1,
            comm: CommId { leader: 0, id: 2 },
            seq: 3,
        },
        msg: CollMsg::Bcast(bcast::Msg::Chunk {
            index: 1,
            slot: bcast::SlotId(2),
            len: data.len() as u64,
        }),
        data: Bytes(data),
    };
    let f = encode(&msg);
    let mut d = FrameDecoder::default();
    d.extend(&f);
    let back: SpToSp = decode(&d.next_frame().unwrap().unwrap()).unwrap();
    assert_eq!(back, msg);
    // A truncated byte string is an error, not a short chunk.
    assert!(decode::<SpToSp>(&f[4..f.len() - 1]).is_err());
}

#[test]
fn oversized_frame_refused_before_payload() {
    let mut d = FrameDecoder::new(100);
    d.extend(&101u32.to_le_bytes());
    assert!(matches!(
        d.next_frame(),
        Err(FrameError::TooLarge { len: 101, max: 100 })
    ));
    let mut ch = Channel::new(std::io::Cursor::new(u32::MAX.to_le_bytes().to_vec()));
    assert!(matches!(ch.recv_raw(), Err(FrameError::TooLarge { .. })));
}

#[test]
fn a_hello_frame_is_small_and_read_no_further_than_needed() {
    let mut d = FrameDecoder::new(MAX_HELLO_FRAME_BYTES);
    assert_eq!(d.wanted(), 4);
    d.extend(&10u32.to_le_bytes()[..2]);
    assert_eq!(d.wanted(), 2);
    d.extend(&10u32.to_le_bytes()[2..]);
    assert_eq!(d.wanted(), 10);
    d.extend(&[1; 4]);
    assert_eq!(d.wanted(), 6);
    d.extend(&[1; 6]);
    assert_eq!(d.wanted(), 0);
    assert_eq!(d.next_frame().unwrap().unwrap(), vec![1; 10]);
    d.extend(&(MAX_HELLO_FRAME_BYTES + 1).to_le_bytes());
    assert!(matches!(d.next_frame(), Err(FrameError::TooLarge { .. })));
    // A larger frame after the hello, once allowed.
    let mut d = FrameDecoder::new(MAX_HELLO_FRAME_BYTES);
    d.extend(&(MAX_HELLO_FRAME_BYTES + 1).to_le_bytes());
    d.set_max(MAX_FRAME_BYTES);
    assert_eq!(d.wanted(), MAX_HELLO_FRAME_BYTES as usize + 1);
    let big = (MAX_HELLO_FRAME_BYTES + 1).to_le_bytes().to_vec();
    let mut ch = Channel::new(std::io::Cursor::new(big));
    assert!(matches!(ch.recv_hello(), Err(FrameError::TooLarge { .. })));
}

#[test]
fn garbage_payload_is_a_decode_error() {
    assert!(matches!(
        decode::<SpToSp>(&[0xff; 16]),
        Err(FrameError::Decode(_))
    ));
    // A vector length prefix far larger than the frame must not allocate it.
    let mut evil = vec![1u8]; // HostToSp::Post
    evil.extend_from_slice(&[0xfd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]);
    assert!(decode::<HostToSp>(&evil).is_err());
}

/// `encode_into` writes the frame `encode` always wrote (length prefix, then the payload that
/// `decode` reads back) into a reused buffer, and refuses a payload longer than a frame.
#[test]
fn encode_into_writes_the_same_frame_into_a_reused_buffer() {
    let mut out = Vec::with_capacity(8);
    let messages = [
        post(3),
        HostToSp::Goodbye,
        HostToSp::Register {
            cores: vec![0, 1],
            mailbox: grant(4096),
            mailbox_slots: 64,
            post_ring: None,
        },
        post(1),
    ];
    for msg in &messages {
        encode_into(msg, &mut out).unwrap();
        let payload = options().serialize(msg).unwrap();
        assert_eq!(out[..4], (payload.len() as u32).to_le_bytes());
        assert_eq!(out[4..], payload[..]);
        assert_eq!(decode::<HostToSp>(&out[4..]).unwrap(), *msg);
    }
    // `encode` sizes its buffer first: a frame with a chunk of data is allocated once, at
    // its length.
    for data in [encode(&post(2)), vec![5u8; 300_000]] {
        let framed = encode(&data);
        assert_eq!(framed.capacity(), framed.len());
        encode_into(&data, &mut out).unwrap();
        assert_eq!(framed, out);
    }
    // Reused: a second, shorter message leaves nothing of the first behind.
    encode_into(&HostToSp::Goodbye, &mut out).unwrap();
    assert_eq!(
        out,
        options()
            .serialize(&HostToSp::Goodbye)
            .map(|p| frame(&p))
            .unwrap()
    );
    let big = vec![7u8; MAX_FRAME_BYTES as usize + 1];
    match encode_into(&big, &mut out) {
        Err(FrameError::TooLarge { len, max }) => {
            assert_eq!(max, MAX_FRAME_BYTES);
            assert!(len > max, "{len}");
        }
        other => panic!("a payload past the frame bound: {other:?}"),
    }
    assert!(out.is_empty(), "a refused message leaves no partial frame");
}

/// The random-number stream of a test, from `SPOFF_TEST_SEED` or `default` (printed).
fn test_rng(default: u64) -> impl FnMut() -> u64 {
    let seed = std::env::var("SPOFF_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    println!("seed {seed} (SPOFF_TEST_SEED)");
    let mut x = seed | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// A random post (the `i`-th of a test: its kind), every optional field on or off, lists of
/// 0-40 entries, integers of every width, all three grant backends.
fn random_post(next: &mut impl FnMut() -> u64, i: usize) -> PostDesc {
    let n = (next() % 41) as usize;
    // Integers of every width: the varint's one, three, five and nine bytes.
    let mut wide = || next() >> (next() % 64);
    let mut list = || (0..n).map(|_| wide()).collect::<Vec<u64>>();
    let (sc, sd, rc, rd) = (list(), list(), list(), list());
    let mut g = || {
        let mut g = grant(next());
        g.addr = next();
        g.region = next() % 1000;
        g.generation = (next() >> (next() % 64)) as u32;
        g.len >>= next() % 64;
        g.rights = [
            Rights::NONE,
            Rights::READ,
            Rights::WRITE,
            Rights::READ_WRITE,
        ][(next() % 4) as usize];
        match next() % 3 {
            0 => {}
            1 => {
                g.backend = BackendData::Ucx {
                    worker_address: (0..next() % 300).map(|b| b as u8).collect(),
                    rkey: vec![7; (next() % 9) as usize],
                }
            }
            _ => {
                g.backend = BackendData::UcxExport {
                    memh: (0..next() % 260).map(|b| (b * 7) as u8).collect(),
                }
            }
        }
        g
    };
    let (send, recv, seg) = (g(), g(), g());
    PostDesc {
        kind: crate::kinds::KINDS[i % crate::kinds::KINDS.len()].kind,
        comm: CommId {
            leader: next() as u32,
            id: next() as u32,
        },
        seq: next(),
        comm_rank: (next() % 64) as u32,
        members: (0..n).map(|_| next() as u32).collect(),
        world_ranks: (0..n).map(|_| next() as u32 % 4096).collect(),
        nodes: if next().is_multiple_of(2) {
            Vec::new()
        } else {
            (0..n).map(|_| next() as u32 % 16).collect()
        },
        slot: (next().is_multiple_of(2)).then(|| next() as u32),
        token: next(),
        send,
        recv,
        send_counts: sc,
        send_displs: sd,
        recv_counts: rc,
        recv_displs: rd,
        host_copies: next().is_multiple_of(2),
        staged: (next().is_multiple_of(2)).then(|| Staged {
            root: next() as u32,
            design: if next().is_multiple_of(2) {
                StagedDesign::Flat
            } else {
                StagedDesign::Hier
            },
            segment: (next().is_multiple_of(2)).then_some(seg),
        }),
        send_packed: next().is_multiple_of(2),
        recv_packed: next().is_multiple_of(2),
        reduce: (next().is_multiple_of(2)).then(|| allreduce::Reduce {
            op: allreduce::Op::ALL[(next() % 10) as usize],
            elem: allreduce::Elem::ALL[(next() % 10) as usize],
        }),
        stamps: PostStamps {
            sent_ns: next(),
            last_notice_ns: next(),
        },
    }
}

/// A rank encodes its posts from a [`PostView`] by hand (`encode_post_into`); the SP decodes
/// `HostToSp::Post` as bincode wrote it. Random descriptors (`random_post`) encode to the
/// same bytes either way and decode back to themselves.
#[test]
fn a_post_view_encodes_as_the_post_message() {
    let mut next = test_rng(0x9e37_79b9_7f4a_7c15);
    for i in 0..300 {
        let d = random_post(&mut next, i);
        let owned = encode(&HostToSp::Post(Box::new(d.clone())));
        let mut viewed = Vec::new();
        encode_post_into(&d.view(), &mut viewed).unwrap();
        assert_eq!(viewed, owned, "post {i}: the view's encoding differs");
        let back: HostToSp = decode(&viewed[4..]).unwrap();
        assert_eq!(back, HostToSp::Post(Box::new(d.clone())), "post {i}");
        assert_eq!(d.view().to_desc(), d, "post {i}: to_desc");
    }
    // A post longer than a frame may be is refused, and leaves nothing in the buffer.
    let mut d = match post(1) {
        HostToSp::Post(d) => *d,
        _ => unreachable!(),
    };
    d.send_counts = vec![u64::MAX; MAX_FRAME_BYTES as usize / 9 + 1];
    let mut out = vec![1, 2, 3];
    assert!(matches!(
        encode_post_into(&d.view(), &mut out),
        Err(FrameError::TooLarge { .. })
    ));
    assert!(out.is_empty());
}

/// The SP decodes a host's payload with `decode_host` (a post by hand, `decode_post`): on
/// random posts and on every kind of damage to them (cut short, a byte changed or flipped,
/// a byte added or removed), and on an integer spelled longer than it need be, it gives what
/// bincode gives, the same message or an error alike.
#[test]
fn a_post_decodes_by_hand_as_bincode_decodes_it() {
    let mut next = test_rng(0x0bad_5eed);
    let (mut same, mut refused) = (0, 0);
    for i in 0..3000 {
        let d = random_post(&mut next, i);
        let mut p = encode(&HostToSp::Post(Box::new(d.clone())))[4..].to_vec();
        let at = |next: &mut dyn FnMut() -> u64, len: usize| next() as usize % len.max(1);
        match i % 6 {
            0 => {}
            1 => p.truncate(at(&mut next, p.len())),
            2 => {
                let k = at(&mut next, p.len());
                p[k] = next() as u8;
            }
            3 => {
                let k = at(&mut next, p.len() + 1);
                p.insert(k, next() as u8);
            }
            4 => {
                let k = at(&mut next, p.len());
                p.remove(k);
            }
            _ => {
                for _ in 0..1 + next() % 3 {
                    let k = at(&mut next, p.len());
                    p[k] ^= 1 << (next() % 8);
                }
            }
        }
        let (by_hand, by_bincode) = (decode_host(&p), decode::<HostToSp>(&p));
        match (&by_hand, &by_bincode) {
            (Ok(a), Ok(b)) => {
                assert_eq!(a, b, "payload {i}: {p:?}");
                if i % 6 == 0 {
                    assert_eq!(*a, HostToSp::Post(Box::new(d)), "payload {i}");
                }
                same += 1;
            }
            (Err(_), Err(_)) => refused += 1,
            _ => panic!("payload {i} {p:?}: by hand {by_hand:?}, bincode {by_bincode:?}"),
        }
    }
    println!("{same} decoded alike, {refused} refused by both");
    assert!(
        same >= 500 && refused >= 500,
        "{same} decoded, {refused} refused"
    );

    // The kind (the byte after the variant) spelled as a marker and two bytes: both take it.
    let d = match post(1) {
        HostToSp::Post(d) => *d,
        _ => unreachable!(),
    };
    let p = encode(&HostToSp::Post(Box::new(d.clone())))[4..].to_vec();
    let mut long = vec![p[0], 251, p[1], 0];
    long.extend_from_slice(&p[2..]);
    assert_eq!(decode_host(&long).unwrap(), HostToSp::Post(Box::new(d)));
    assert_eq!(
        decode::<HostToSp>(&long).unwrap(),
        decode_host(&long).unwrap()
    );

    // Every byte of a post with every optional part present, replaced by every value: each
    // enum's tag meets every index (so a variant bincode knows and the hand decoder does not
    // fails here), every integer marker, every option and boolean byte.
    let mut d = random_post(&mut next, 0);
    d.slot = Some(7);
    d.staged = Some(Staged {
        root: 1,
        design: StagedDesign::Hier,
        segment: Some(grant(30)),
    });
    d.reduce = Some(allreduce::Reduce {
        op: allreduce::Op::Bxor,
        elem: allreduce::Elem::F64,
    });
    // Two entries of each list: enough for every byte of an entry, short enough to try all.
    for list in [&mut d.members, &mut d.world_ranks, &mut d.nodes] {
        list.truncate(2);
    }
    for list in [
        &mut d.send_counts,
        &mut d.send_displs,
        &mut d.recv_counts,
        &mut d.recv_displs,
    ] {
        list.truncate(2);
    }
    let p = encode(&HostToSp::Post(Box::new(d)))[4..].to_vec();
    for k in 1..p.len() {
        for v in 0..=255u8 {
            let mut q = p.clone();
            q[k] = v;
            assert_eq!(
                decode_host(&q).ok(),
                decode::<HostToSp>(&q).ok(),
                "byte {k} set to {v}"
            );
        }
    }

    // Length: bincode applies no limit when it decodes from a slice (its `with_limit` is
    // replaced there), nor does `decode_host`: a payload is bounded before it is decoded, by
    // the frame reader (`MAX_FRAME_BYTES`) or the ring's entry. Both take a post of 4 MiB and
    // one of a byte more alike.
    let sized = |n: usize| {
        let mut d = match post(1) {
            HostToSp::Post(d) => *d,
            _ => unreachable!(),
        };
        d.send_counts = vec![0; n];
        // The payload without a frame (`encode` refuses one over the limit).
        encoding().serialize(&HostToSp::Post(Box::new(d))).unwrap()
    };
    let max = MAX_FRAME_BYTES as usize;
    // Each entry of 0 is one byte (the list's length takes five bytes either way).
    let n = max - 200 + (max - sized(max - 200).len());
    for (p, len) in [(sized(n), max), (sized(n + 1), max + 1)] {
        assert_eq!(p.len(), len);
        let by_hand = decode_host(&p).expect("decoded by hand");
        assert_eq!(
            Some(by_hand),
            decode::<HostToSp>(&p).ok(),
            "{} bytes",
            p.len()
        );
    }
}
