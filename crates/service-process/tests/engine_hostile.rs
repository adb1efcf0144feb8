//! Hostile input to real SP processes, with this test process playing the host ranks (see
//! `engine.rs`): descriptors that lie, garbage frames, a wrong protocol version, a rank of
//! another SP, and UCX grants to an SP without UCX. Each is refused and the SP keeps serving.
#![allow(clippy::needless_range_loop)]

mod common;

use algorithms::CommId;
use alias_mkey::Rights;
use bootstrap::mailbox;
use bootstrap::wire::{self, ErrorCode, Hello, HostHello, SpToHost};
use bootstrap::Layout;
use common::alltoallv::still_serves;
use common::*;
use std::io::Write;
use std::time::Duration;

#[test]
fn hostile_descriptors_get_errors_and_the_sp_keeps_serving() {
    let (mut set, mut hosts) = SpSet::start_job(2, 1, 2, Layout::Block);
    let buf = vec![0u8; 64];
    let members = vec![hosts[0].sp, hosts[1].sp];
    let comm = CommId { leader: 0, id: 9 };

    let send = hosts[0].grant(&buf, Rights::READ);
    let recv = hosts[0].grant(&buf, Rights::WRITE);
    let cases: Vec<(&str, wire::PostDesc, ErrorCode)> = vec![
        (
            "block outside the grant",
            desc(
                comm,
                0,
                0,
                members.clone(),
                1,
                send.clone(),
                recv.clone(),
                (vec![8, 60], vec![0, 8], vec![8, 8], vec![0, 8]),
            ),
            ErrorCode::BadDescriptor,
        ),
        (
            "displacement + count overflows",
            desc(
                comm,
                1,
                0,
                members.clone(),
                1,
                send.clone(),
                recv.clone(),
                (vec![8, 2], vec![0, u64::MAX], vec![8, 8], vec![0, 8]),
            ),
            ErrorCode::BadDescriptor,
        ),
        (
            "send grant without read rights",
            desc(
                comm,
                2,
                0,
                members.clone(),
                1,
                recv.clone(),
                recv.clone(),
                (vec![8, 8], vec![0, 8], vec![8, 8], vec![0, 8]),
            ),
            ErrorCode::BadDescriptor,
        ),
        (
            "vector lengths disagree",
            desc(
                comm,
                3,
                0,
                members.clone(),
                1,
                send.clone(),
                recv.clone(),
                (vec![8], vec![0, 8], vec![8, 8], vec![0, 8]),
            ),
            ErrorCode::BadDescriptor,
        ),
        (
            "member SP that does not exist",
            desc(
                comm,
                4,
                0,
                vec![members[0], 999],
                1,
                send.clone(),
                recv.clone(),
                (vec![8, 8], vec![0, 8], vec![8, 8], vec![0, 8]),
            ),
            ErrorCode::UnknownComm,
        ),
        (
            "comm rank served by another SP",
            desc(
                comm,
                5,
                1,
                vec![members[0], members[0] + 1],
                1,
                send.clone(),
                recv.clone(),
                (vec![8, 8], vec![0, 8], vec![8, 8], vec![0, 8]),
            ),
            ErrorCode::UnknownComm,
        ),
        (
            "mailbox slot outside the mailbox",
            desc(
                comm,
                6,
                0,
                members.clone(),
                SLOTS + 5,
                send.clone(),
                recv.clone(),
                (vec![8, 8], vec![0, 8], vec![8, 8], vec![0, 8]),
            ),
            ErrorCode::BadDescriptor,
        ),
    ];
    for (what, d, code) in cases {
        let (slot, token) = hosts[0].post(d);
        let message = refusal(hosts[0].recv(), code, what);
        eprintln!("{what}: refused: {message}");
        if slot < SLOTS {
            assert_eq!(
                hosts[0].wait(slot, token, WAIT),
                Some(mailbox::status_code(algorithms::Status::InvalidPost)),
                "{what}: the rank's request must complete with an error"
            );
        }
    }
    // Nothing was written into the buffers by any refused post.
    assert!(read_back(&buf).iter().all(|&b| b == 0));
    still_serves(&mut hosts, 2, 3, 100);
    still_serves(&mut hosts, 1, 2, 101);

    // An oversized frame closes that connection only.
    let p = set.cluster.placement(0, 4).unwrap();
    let path = &set.cluster.sp(p.sp).unwrap().host_socket;
    let mut raw = std::os::unix::net::UnixStream::connect(path).unwrap();
    raw.write_all(&u32::MAX.to_le_bytes()).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut sink = vec![];
    let _ = std::io::Read::read_to_end(&mut raw, &mut sink);
    // Garbage after a valid hello: an error reply, then the connection is closed.
    let mut h = Host::connect(&set, new_job(), 0, 4);
    h.ch.send_raw(&wire::frame(&[0xff; 32])).unwrap();
    assert!(matches!(
        h.recv(),
        SpToHost::Error {
            code: ErrorCode::BadDescriptor,
            ..
        }
    ));
    still_serves(&mut hosts, 0, 1, 102);
    // The refused posts left nothing behind once the ranks are gone.
    for host in hosts.into_iter().chain([h]) {
        host.goodbye();
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_nothing_held(&set.stop_and_stats());
}

#[test]
fn wrong_protocol_version_is_refused_with_a_clear_reason() {
    let set = SpSet::start(1, 1, 1, Layout::Block);
    let path = &set.cluster.sp(0).unwrap().host_socket;
    let s = std::os::unix::net::UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut ch = wire::Channel::new(s);
    let hello = Hello::Host(HostHello {
        credential: String::new(),
        world_rank: 0,
        world_size: 1,
        node: 0,
        local_rank: 0,
        pid: std::process::id(),
    });
    ch.send_raw(&wire::frame(&wire::encode_hello_with_version(&hello, 99)))
        .unwrap();
    match ch.recv_hello().unwrap() {
        Hello::Reject { reason } => {
            assert!(
                reason.contains("99") && reason.contains("version"),
                "{reason}"
            )
        }
        other => panic!("expected a reject, got {other:?}"),
    }
    // A rank that belongs to another SP is refused too.
    let set2 = SpSet::start(2, 1, 1, Layout::Block);
    let s =
        std::os::unix::net::UnixStream::connect(&set2.cluster.sp(0).unwrap().host_socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut ch = wire::Channel::new(s);
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    ch.send_hello(&Hello::Host(HostHello {
        credential: bootstrap::auth::JobCredential::issue(&set2.key, 1, uid, 2).encode(),
        world_rank: 1,
        world_size: 2,
        node: 1,
        local_rank: 0,
        pid: std::process::id(),
    }))
    .unwrap();
    assert!(matches!(ch.recv_hello().unwrap(), Hello::Reject { .. }));
}

#[test]
fn ucx_grants_are_refused_by_an_sp_without_ucx() {
    let set = SpSet::start_with(1, 1, 2, Layout::Block, &["--ucx=off"]);
    let mut hosts: Vec<Host> = (0..2)
        .map(|r| Host::connect(&set, new_job(), r, 2))
        .collect();
    let ucx = std::rc::Rc::new(std::cell::RefCell::new(
        alias_mkey::host::UcxRegistrar::new().expect("UCX context"),
    ));
    hosts[0].ucx = Some(ucx);
    let (sbuf, rbuf) = (vec![0u8; 16], vec![0u8; 16]);
    let s = hosts[0].grant(&sbuf, Rights::READ);
    let r = hosts[0].grant(&rbuf, Rights::WRITE);
    let d = desc(
        CommId { leader: 0, id: 1 },
        0,
        0,
        vec![0],
        0,
        s,
        r,
        (vec![8], vec![0], vec![8], vec![0]),
    );
    hosts[0].post(d);
    let message = refusal(hosts[0].recv(), ErrorCode::BadDescriptor, "a ucx grant");
    assert!(message.contains("ucx"), "{message}");
}

/// A `ucx-export` grant (BlueField alias key) whose exported memory handle this SP cannot
/// import: built against UCX < 1.15 the SP lacks the export API; built against 1.22 it refuses
/// these bytes (0xff: the buffer that crashes UCX 1.22's importer) before UCX sees them. Either
/// way the collective fails with an access error, promptly, and the SP keeps serving. An SP with
/// UCX off refuses the grant outright.
#[test]
fn ucx_export_grants_the_sp_cannot_import_fail_the_collective_and_the_sp_keeps_serving() {
    for ucx in ["--ucx=on", "--ucx=off"] {
        let set = SpSet::start_with(1, 1, 2, Layout::Block, &[ucx]);
        let job = new_job();
        let mut hosts: Vec<Host> = (0..2).map(|r| Host::connect(&set, job, r, 2)).collect();
        let (sbuf, rbuf) = (vec![7u8; 16], vec![0u8; 16]);
        let mut s = hosts[0].grant(&sbuf, Rights::READ);
        s.backend = alias_mkey::BackendData::UcxExport {
            memh: vec![0xff; 300],
        };
        let r = hosts[0].grant(&rbuf, Rights::WRITE);
        let d = desc(
            CommId { leader: 0, id: 1 },
            0,
            0,
            vec![0],
            0,
            s,
            r,
            (vec![8], vec![0], vec![8], vec![0]),
        );
        let (slot, token) = hosts[0].post(d);
        if ucx == "--ucx=off" {
            let message = refusal(hosts[0].recv(), ErrorCode::BadDescriptor, ucx);
            assert!(message.contains("ucx-export"), "{message}");
            continue;
        }
        let t = std::time::Instant::now();
        let got = hosts[0].wait(slot, token, Duration::from_secs(30));
        assert_eq!(
            got,
            Some(mailbox::status_code(algorithms::Status::AccessError)),
            "the collective fails with an access error"
        );
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert!(rbuf.iter().all(|&b| b == 0), "nothing was written");
        still_serves(&mut hosts, 0, 1, 1);
    }
}
