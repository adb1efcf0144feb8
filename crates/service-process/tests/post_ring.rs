//! The post ring (`bootstrap::post_ring`) against a real SP: posts written in shared memory
//! complete as socket posts do and keep their order with the host's socket frames; a ring the
//! SP cannot trust is refused at registration with its reason (the host's posts then go on the
//! socket); a ring corrupted later closes the connection with a clear error.

mod common;

use bootstrap::mailbox::STATUS_OK;
use bootstrap::post_ring::{RingShape, ARENA_CHUNK_BYTES, ARENA_SIDE_BYTES, HEADER_BYTES};
use bootstrap::wire::{ErrorCode, HostToSp, PostDesc, SpToHost};
use bootstrap::Layout;
use common::alltoallv::make_op;
use common::*;
use nix::fcntl::SealFlag;
use std::os::fd::OwnedFd;

/// Polling SPs read rings; napping between looks keeps the test's CPU use low.
const POLLING: &[&str] = &["--poll-us", "20"];

fn sealed() -> SealFlag {
    SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL
}

fn placement(set: &SpSet, rank: u32, world: u32) -> bootstrap::Placement {
    set.cluster.placement(rank, world).unwrap()
}

fn ring_off(answer: &SpToHost) -> Option<String> {
    match answer {
        SpToHost::Registered { post_ring_off, .. } => post_ring_off.clone(),
        other => panic!("register answered with {other:?}"),
    }
}

/// Randomized alltoallvs between two ranks, several outstanding at once on a small ring, each
/// post going through the ring or the socket at random and to the socket when the ring is
/// full (as the shim does): every one completes with the bytes a direct alltoallv gives, and
/// the SP counts the ring's.
#[test]
fn posts_in_the_ring_complete_like_posts_on_the_socket() {
    let seed = test_seed();
    let mut rng = Rng(seed);
    let mut set = SpSet::start_with(1, 1, 2, Layout::Block, POLLING);
    let job = new_job();
    let shape = RingShape {
        slots: 2 + rng.below(4) as u32,
        entry_bytes: 1024,
        ..RingShape::default()
    };
    let mut hosts = vec![];
    let mut rings = vec![];
    for r in 0..2 {
        let (fd, producer, _) = make_ring(shape, shape.bytes(), sealed());
        let (h, answer) = Host::connect_offering(
            &set,
            job,
            r,
            2,
            placement(&set, r, 2),
            Some((shape, Some(&fd))),
        );
        assert_eq!(ring_off(&answer), None, "rank {r}: the SP reads the ring");
        hosts.push(h);
        rings.push((producer, 0u64, fd));
    }
    let comm = algorithms::CommId { leader: 0, id: 1 };
    let (mut by_ring, mut full, mut posts) = (0, 0, 0);
    let mut seq = 0u64;
    for round in 0..8 {
        // Up to twice the ring's entries outstanding per rank.
        let n = 1 + rng.below(2 * shape.slots as u64);
        let ops: Vec<_> = (0..n)
            .map(|_| {
                seq += 1;
                make_op(&mut rng, comm, seq - 1, vec![0, 1], 2000)
            })
            .collect();
        let members: Vec<u32> = vec![hosts[0].sp, hosts[1].sp];
        let mut posted = vec![];
        for (k, op) in ops.iter().enumerate() {
            for r in 0..2 {
                let d = op.desc_for(&mut hosts[r], &members, r, k as u32);
                posts += 1;
                let (p, frames, _) = &mut rings[r];
                let tried =
                    (rng.below(4) > 0).then(|| hosts[r].try_post_in_ring(p, *frames, d.clone()));
                let (slot, token) = match tried {
                    Some(Some(st)) => {
                        by_ring += 1;
                        st
                    }
                    other => {
                        full += other.is_some() as u64;
                        *frames += 1;
                        hosts[r].post(d)
                    }
                };
                posted.push((r, slot, token));
            }
        }
        assert_completed(&hosts, &posted, STATUS_OK, &format!("round {round}"));
        for op in &ops {
            op.check();
        }
    }
    eprintln!("{posts} posts: {by_ring} through the rings, {full} found a ring full");
    let stats = set.stats_after_goodbyes(hosts);
    assert_eq!(sum(&stats, "ring_posts"), by_ring, "{stats:?}");
    assert_eq!(sum(&stats, "posts"), posts);
}

/// The mailbox inside the ring, as the shim puts it: with a polling SP that maps the ring,
/// every completion is written there with plain stores (`ring_completions`); with an SP that
/// sleeps and maps nothing, the same memory still gets them through the grant. Both ways the
/// randomized alltoallvs are right.
#[test]
fn completions_reach_a_mailbox_inside_the_ring_either_way() {
    let seed = test_seed();
    for (polling, serve_args) in [(true, POLLING), (false, &[][..])] {
        let mut rng = Rng(seed ^ polling as u64);
        let mut set = SpSet::start_with(1, 1, 2, Layout::Block, serve_args);
        let job = new_job();
        let shape = RingShape {
            mailbox_slots: SLOTS,
            ..RingShape::default()
        };
        let mut hosts = vec![];
        let mut rings = vec![];
        for r in 0..2 {
            let (fd, producer, _) = make_ring(shape, shape.bytes(), sealed());
            let (h, answer) = Host::connect_offering(
                &set,
                job,
                r,
                2,
                placement(&set, r, 2),
                Some((shape, Some(&fd))),
            );
            assert_eq!(ring_off(&answer).is_none(), polling, "rank {r}: {answer:?}");
            hosts.push(h);
            rings.push((producer, fd));
        }
        let comm = algorithms::CommId { leader: 0, id: 1 };
        for seq in 0..16u64 {
            let op = make_op(&mut rng, comm, seq, vec![0, 1], 3000);
            let members: Vec<u32> = vec![hosts[0].sp, hosts[1].sp];
            let mut posted = vec![];
            for r in 0..2 {
                let slot = rng.below(SLOTS as u64) as u32;
                let d = op.desc_for(&mut hosts[r], &members, r, slot);
                let (slot, token) = if polling {
                    hosts[r].post_in_ring(&mut rings[r].0, 0, d)
                } else {
                    hosts[r].post(d)
                };
                posted.push((r, slot, token));
            }
            assert_completed(
                &hosts,
                &posted,
                STATUS_OK,
                &format!("polling {polling}, seq {seq}"),
            );
            op.check();
        }
        let stats = set.stats_after_goodbyes(hosts);
        let want = if polling { 32 } else { 0 };
        assert_eq!(sum(&stats, "ring_completions"), want, "{stats:?}");
        assert_eq!(sum(&stats, "completions"), 32, "{stats:?}");
    }
}

/// Small alltoallvs whose sides the ranks put in their arenas (`bootstrap::post_ring`): with one
/// SP serving both ranks, the SP reaches every side through its own mapping of the arenas and
/// moves every block with a plain copy (`arena_sides`, `copies_own`); with each rank at an SP
/// of its own, the same grants are reached as any memory of the rank (cma), and no key into an
/// arena leaves its SP; an SP whose `--inline-copy-bytes` is below an arena side says at
/// registration that it takes no side from the arenas, and makes no arena key. Either way the bytes are those of a direct alltoallv, and the bytes of
/// the arena around the blocks stay as they were.
#[test]
fn small_sides_in_the_arena_move_by_plain_copies_at_an_sp_that_serves_every_rank() {
    let seed = test_seed();
    // (SPs, serve arguments beyond polling, whether the SP takes sides from the arenas).
    let small_inline: &[&str] = &["--inline-copy-bytes", "1024"];
    for (case, (sps, extra, takes)) in [
        (1u32, &[][..], true),
        (2, &[][..], false),
        (1, small_inline, false),
    ]
    .into_iter()
    .enumerate()
    {
        let mut rng = Rng(seed ^ case as u64);
        let args: Vec<&str> = POLLING.iter().chain(extra).copied().collect();
        let mut set = SpSet::start_with(1, sps, 2, Layout::Block, &args);
        let job = new_job();
        let mut hosts = vec![];
        let mut rings = vec![];
        for r in 0..2 {
            let shape = RingShape {
                arena_chunks: 2,
                ..RingShape::default()
            };
            let (fd, producer, base) = make_ring(shape, shape.bytes(), sealed());
            let shape = RingShape {
                rank_base: base as u64,
                ..shape
            };
            let (h, answer) = Host::connect_offering(
                &set,
                job,
                r,
                2,
                placement(&set, r, 2),
                Some((shape, Some(&fd))),
            );
            assert_eq!(ring_off(&answer), None, "rank {r}: the SP reads the ring");
            // The SP says whether it takes sides from the arena (the shim opens it only then);
            // at two SPs it does, for the communicators it serves alone (none here).
            let SpToHost::Registered { arena_off, .. } = &answer else {
                unreachable!()
            };
            if extra.is_empty() {
                assert_eq!(arena_off, &None, "case {case}, rank {r}");
            } else {
                let why = arena_off.as_deref().unwrap_or_default();
                assert!(
                    why.contains("--inline-copy-bytes 1024"),
                    "case {case}: {why}"
                );
            }
            // SAFETY: the arena lies inside the mapping, which the test never unmaps.
            let arena = unsafe { base.add(shape.arena_offset()) };
            hosts.push(h);
            rings.push((producer, fd, arena));
        }
        assert_eq!(hosts[0].sp == hosts[1].sp, sps == 1);
        let comm = algorithms::CommId { leader: 0, id: 1 };
        let (mut sides, mut posts) = (0u64, 0u64);
        for seq in 0..12u64 {
            let mut op = make_op(&mut rng, comm, seq, vec![0, 1], 900);
            let members: Vec<u32> = vec![hosts[0].sp, hosts[1].sp];
            // Each rank's sides in a chunk of its arena (the second, now and then), the rest
            // of the chunk filled with a pattern that must survive.
            let mut at = vec![];
            let mut posted = vec![];
            for r in 0..2 {
                let chunk = rng.below(2) * ARENA_CHUNK_BYTES;
                // SAFETY: the chunk lies inside the arena (2 chunks).
                let (send, recv) = unsafe {
                    let c = rings[r].2.add(chunk as usize);
                    (c, c.add(ARENA_SIDE_BYTES as usize))
                };
                let (sl, rl) = (op.send[r].len(), op.recv[r].len());
                assert!(sl as u64 <= ARENA_SIDE_BYTES && rl as u64 <= ARENA_SIDE_BYTES);
                // SAFETY: both halves hold ARENA_SIDE_BYTES; nothing else writes them now.
                let (send_s, recv_s) = unsafe {
                    for i in 0..ARENA_CHUNK_BYTES as usize {
                        send.add(i).write((i as u8) ^ 0x3c);
                    }
                    std::ptr::copy_nonoverlapping(op.send[r].as_ptr(), send, sl);
                    std::ptr::copy_nonoverlapping(op.recv[r].as_ptr(), recv, rl);
                    (
                        std::slice::from_raw_parts(send as *const u8, sl),
                        std::slice::from_raw_parts(recv as *const u8, rl),
                    )
                };
                let mut d = op.desc_for(&mut hosts[r], &members, r, r as u32);
                d.send = hosts[r].grant(send_s, alias_mkey::Rights::READ);
                d.recv = hosts[r].grant(recv_s, alias_mkey::Rights::WRITE);
                sides += (sl > 0) as u64 + (rl > 0) as u64;
                posts += 1;
                let (p, _, _) = &mut rings[r];
                posted.push((r, hosts[r].post_in_ring(p, 0, d)));
                at.push((recv, rl, send));
            }
            let posted: Vec<_> = posted.into_iter().map(|(r, (s, t))| (r, s, t)).collect();
            assert_completed(&hosts, &posted, STATUS_OK, &format!("{sps} SPs, seq {seq}"));
            for (r, &(recv, rl, send)) in at.iter().enumerate() {
                // SAFETY: as above; the SP is done with the chunk (the post completed).
                let chunk = unsafe { std::slice::from_raw_parts(send, ARENA_CHUNK_BYTES as usize) };
                let half = ARENA_SIDE_BYTES as usize;
                let sl = op.send[r].len();
                assert_eq!(
                    &chunk[..sl],
                    &op.send[r][..],
                    "rank {r}: its send side as written"
                );
                for (i, &b) in chunk.iter().enumerate() {
                    if (sl..half).contains(&i) || i >= half + rl {
                        assert_eq!(b, (i as u8) ^ 0x3c, "{sps} SPs, rank {r}: chunk byte {i}");
                    }
                }
                // SAFETY: as above.
                unsafe { std::ptr::copy_nonoverlapping(recv, op.recv[r].as_mut_ptr(), rl) };
            }
            op.check();
        }
        let stats = set.stats_after_goodbyes(hosts);
        assert_eq!(sum(&stats, "posts"), posts, "{stats:?}");
        if takes {
            assert_eq!(sum(&stats, "arena_sides"), sides, "{stats:?}");
            assert_eq!(
                sum(&stats, "copies_own"),
                sum(&stats, "copies_started"),
                "{stats:?}"
            );
        } else {
            assert_eq!(sum(&stats, "arena_sides"), 0, "{stats:?}");
            assert_eq!(sum(&stats, "copies_own"), 0, "{stats:?}");
        }
        eprintln!("case {case}, {sps} SP(s): {sides} sides in arenas, {posts} posts");
    }
}

/// A post the SP refuses (its mailbox slot outside the registered ones), with `seq`.
fn bad_post(h: &mut Host, seq: u64) -> PostDesc {
    let buf: &'static [u8] = Box::leak(vec![0u8; 8].into_boxed_slice());
    let g = h.grant(buf, alias_mkey::Rights::READ_WRITE);
    desc(
        algorithms::CommId { leader: 0, id: 9 },
        seq,
        0,
        vec![0],
        SLOTS + 7,
        g.clone(),
        g,
        (vec![0], vec![0], vec![0], vec![0]),
    )
}

/// Ring entries and socket frames interleaved: the SP's refusals (one per post, on the
/// socket) come back in the order the host wrote the posts, whichever path each took.
#[test]
fn ring_entries_keep_their_place_among_socket_frames() {
    let seed = test_seed();
    let mut rng = Rng(seed);
    let set = SpSet::start_with(1, 1, 1, Layout::Block, POLLING);
    let shape = RingShape::default();
    let (fd, mut producer, _) = make_ring(shape, shape.bytes(), sealed());
    let (mut h, answer) = Host::connect_offering(
        &set,
        new_job(),
        0,
        1,
        placement(&set, 0, 1),
        Some((shape, Some(&fd))),
    );
    assert_eq!(ring_off(&answer), None);
    let mut frames = 0u64;
    let mut seq = 0u64;
    let mut ring_used = 0;
    for round in 0..30 {
        // A burst written faster than the SP looks: entries and frames in a random order.
        let n = 2 + rng.below(6);
        let mut want = vec![];
        for _ in 0..n {
            seq += 1;
            if rng.below(2) == 0 {
                let frame =
                    bootstrap::wire::encode(&HostToSp::Post(Box::new(bad_post(&mut h, seq))));
                assert!(producer.push(frames, &frame[4..]));
                ring_used += 1;
            } else {
                let d = bad_post(&mut h, seq);
                h.ch.send(&HostToSp::Post(Box::new(d))).unwrap();
                frames += 1;
            }
            want.push(seq);
        }
        let mut got = vec![];
        while got.len() < want.len() {
            match h.ch.recv::<SpToHost>().unwrap() {
                SpToHost::Error {
                    seq: Some(s),
                    code: ErrorCode::BadDescriptor,
                    ..
                } => got.push(s),
                SpToHost::Heartbeat => {}
                other => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!(
            got, want,
            "round {round}: refusals out of the order of the posts"
        );
    }
    assert!(ring_used > 10, "the ring carried {ring_used} posts");
}

/// Offers the SP cannot take: the registration succeeds and says why the ring is not read.
#[test]
fn a_ring_the_sp_cannot_trust_is_refused_with_its_reason() {
    let set = SpSet::start_with(1, 1, 1, Layout::Block, POLLING);
    let shape = RingShape::default();
    let (pipe_r, _pipe_w) = nix::unistd::pipe().unwrap();
    let unsealed = make_ring(shape, shape.bytes(), SealFlag::empty()).0;
    let short = make_ring(shape, shape.bytes() - 4096, sealed()).0;
    let good = make_ring(shape, shape.bytes(), sealed()).0;
    // The rank's own descriptor, opened read-only: the SP must not gain the write access
    // the rank does not pass.
    let read_only: OwnedFd = std::fs::File::open(format!(
        "/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(&good)
    ))
    .unwrap()
    .into();
    let bad_shape = RingShape { slots: 0, ..shape };
    let cases: Vec<(&str, RingShape, Option<&OwnedFd>, &str)> = vec![
        ("no descriptor", shape, None, "without its descriptor"),
        ("a pipe", shape, Some(&pipe_r), "takes no seals"),
        (
            "an unsealed memfd",
            shape,
            Some(&unsealed),
            "not sealed against shrinking",
        ),
        ("a memfd of the wrong size", shape, Some(&short), "holds"),
        (
            "a read-only descriptor",
            shape,
            Some(&read_only),
            "cannot map",
        ),
        ("a shape out of bounds", bad_shape, Some(&good), "slots"),
    ];
    for (i, (what, shape, fd, says)) in cases.into_iter().enumerate() {
        let (_h, answer) = Host::connect_offering(
            &set,
            new_job(),
            0,
            1,
            placement(&set, 0, 1),
            Some((shape, fd)),
        );
        let why = ring_off(&answer).unwrap_or_else(|| panic!("case {i} ({what}): ring taken"));
        assert!(why.contains(says), "case {i} ({what}): {why}");
    }
    // A good ring passed with two more descriptors: refused, all three closed by the SP.
    let (_h, answer) = Host::connect_offering_fds(
        &set,
        new_job(),
        0,
        1,
        placement(&set, 0, 1),
        shape,
        vec![&good, &unsealed, &short],
    );
    let why = ring_off(&answer).expect("three descriptors: ring taken");
    assert!(why.contains("more than one descriptor"), "{why}");
    // A hugetlbfs memfd takes seals too, but is not tmpfs (only where huge pages can be
    // created here).
    match nix::sys::memfd::memfd_create(
        c"test-huge-ring",
        nix::sys::memfd::MemFdCreateFlag::MFD_HUGETLB
            | nix::sys::memfd::MemFdCreateFlag::MFD_ALLOW_SEALING,
    ) {
        Ok(huge) => {
            let (_h, answer) = Host::connect_offering(
                &set,
                new_job(),
                0,
                1,
                placement(&set, 0, 1),
                Some((shape, Some(&huge))),
            );
            let why = ring_off(&answer).expect("a hugetlbfs ring taken");
            assert!(
                why.contains("not a plain memfd") || why.contains("sealed"),
                "{why}"
            );
        }
        Err(e) => eprintln!("no hugetlbfs memfd here ({e}): that case not run"),
    }
    // An SP that sleeps until a message arrives reads no ring.
    drop(set);
    let set = SpSet::start(1, 1, 1, Layout::Block);
    let (_h, answer) = Host::connect_offering(
        &set,
        new_job(),
        0,
        1,
        placement(&set, 0, 1),
        Some((shape, Some(&good))),
    );
    let why = ring_off(&answer).expect("a sleeping SP reads no ring");
    assert!(why.contains("sleeps"), "{why}");
}

/// A tail no producer could have written, or an entry that is not a post: the SP says why and
/// closes the connection; it goes on serving other hosts.
#[test]
fn a_corrupted_ring_closes_the_connection() {
    let set = SpSet::start_with(1, 1, 2, Layout::Block, POLLING);
    let shape = RingShape {
        slots: 8,
        entry_bytes: 512,
        ..RingShape::default()
    };
    type Corrupt = fn(&mut bootstrap::post_ring::Producer, *mut u8);
    let cases: [(&str, Corrupt, &str); 4] = [
        (
            "tail far ahead",
            |_, base| unsafe { (base as *mut u64).write_volatile(1000) },
            "tail",
        ),
        (
            "entry longer than a slot",
            |_, base| unsafe {
                (base.add(HEADER_BYTES + 8) as *mut u32).write_volatile(4096);
                (base as *mut u64).write_volatile(1);
            },
            "bytes",
        ),
        (
            "not a post",
            |p, _| {
                let f = bootstrap::wire::encode(&HostToSp::Goodbye);
                assert!(p.push(0, &f[4..]));
            },
            "only posts",
        ),
        (
            "bytes that do not decode",
            |p, _| assert!(p.push(0, &[0xff; 7])),
            "undecodable",
        ),
    ];
    for (what, corrupt, says) in cases {
        let job = new_job();
        let (fd, mut producer, base) = make_ring(shape, shape.bytes(), sealed());
        let (mut h, answer) = Host::connect_offering(
            &set,
            job,
            0,
            1,
            placement(&set, 0, 1),
            Some((shape, Some(&fd))),
        );
        assert_eq!(ring_off(&answer), None);
        corrupt(&mut producer, base);
        match h.ch.recv::<SpToHost>() {
            Ok(SpToHost::Error {
                code: ErrorCode::BadDescriptor,
                message,
                ..
            }) => assert!(message.contains(says), "{what}: {message}"),
            other => panic!("{what}: expected a refusal, got {other:?}"),
        }
        match h.ch.recv::<SpToHost>() {
            Err(bootstrap::wire::FrameError::Closed) => {}
            other => panic!("{what}: the SP did not close the connection: {other:?}"),
        }
    }
    // The SP still serves a job on the socket.
    let job = new_job();
    let mut hosts = Host::connect_all(&set, job, 2);
    let op = make_op(
        &mut Rng(5),
        algorithms::CommId { leader: 0, id: 3 },
        0,
        vec![0, 1],
        100,
    );
    let posted = op.post(&mut hosts, &|w| w as usize, 1);
    assert_completed(&hosts, &posted, STATUS_OK, "after the corrupted rings");
    op.check();
}

/// Descriptors passed where none is taken (before the hello, beside a post, more than one
/// beside the registration) are closed: the SP's open descriptors come back to where they were.
#[test]
fn descriptors_passed_where_none_is_taken_are_closed() {
    let set = SpSet::start_with(1, 1, 1, Layout::Block, POLLING);
    let pid = set.sps[0].child.id();
    let open = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    };
    let shape = RingShape::default();
    let rings: Vec<OwnedFd> = (0..3)
        .map(|_| make_ring(shape, shape.bytes(), sealed()).0)
        .collect();
    let fds: Vec<&OwnedFd> = rings.iter().collect();
    let path = set.cluster.sp(0).unwrap().host_socket.clone();
    let burst = |n: usize| {
        for _ in 0..n {
            // Before any hello: a byte with three descriptors.
            let s = std::os::unix::net::UnixStream::connect(&path).unwrap();
            send_with_fds(&s, &[0u8], fds.clone());
            drop(s);
            // A registered host passing three beside its registration, then three beside a
            // post frame.
            let (mut h, answer) = Host::connect_offering_fds(
                &set,
                new_job(),
                0,
                1,
                placement(&set, 0, 1),
                shape,
                fds.clone(),
            );
            assert!(ring_off(&answer).is_some_and(|w| w.contains("more than one")));
            let frame = bootstrap::wire::encode(&HostToSp::Post(Box::new(bad_post(&mut h, 1))));
            send_with_fds(h.ch.get_ref(), &frame, fds.clone());
            assert!(matches!(
                h.ch.recv::<SpToHost>().unwrap(),
                SpToHost::Error { .. }
            ));
            h.goodbye();
        }
    };
    // Warm up (the closer thread, the log), then count.
    burst(3);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let before = open();
    burst(40);
    // Connections close as the SP sees them go; give it and its closer a moment.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut now = open();
    while now > before + 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
        now = open();
    }
    assert!(
        now <= before + 2,
        "the SP holds {now} descriptors after 40 rounds of 9 passed, {before} before"
    );
}
