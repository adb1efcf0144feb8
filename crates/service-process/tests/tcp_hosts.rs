//! Hosts over TCP (`host_addr`), against real SP processes started as a site's tools start
//! them: the job credential is a TCP host's whole identity; a host on another machine gets no
//! cross-memory attach; a host on the SP's kernel (`--hosts-same-kernel`) must name a live
//! process of the credential's uid; hostile clients (no or a wrong credential, an oversized
//! frame, a hello that never comes) are refused without affecting the SP or its other hosts.

mod common;
mod tcp;

use algorithms::CommId;
use alias_mkey::host::Registrar;
use alias_mkey::Rights;
use bootstrap::auth::{ClusterKey, JobCredential};
use bootstrap::mailbox::SLOT_BYTES;
use bootstrap::wire::{self, Channel, ErrorCode, Hello, HostHello, HostToSp, SpToHost};
use common::{desc, new_job, register};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tcp::TcpSps;

fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_service-process"))
}

fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

fn connect(sps: &TcpSps, sp: u32) -> Channel<TcpStream> {
    let s = TcpStream::connect(sps.host_addr(sp)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    Channel::new(s)
}

fn hello(credential: String, rank: u32, size: u32, pid: u32) -> Hello {
    Hello::Host(HostHello {
        credential,
        world_rank: rank,
        world_size: size,
        node: 0,
        local_rank: rank,
        pid,
    })
}

/// Says hello with `hello`; the SP's answer.
fn say(ch: &mut Channel<TcpStream>, h: &Hello) -> Hello {
    ch.send_hello(h).unwrap();
    ch.recv_hello().unwrap()
}

fn refused_because(answer: Hello, why: &str) {
    match answer {
        Hello::Reject { reason } => assert!(reason.contains(why), "{reason:?} lacks {why:?}"),
        other => panic!("expected a refusal ({why}), got {other:?}"),
    }
}

/// Reads until the SP closes the connection; how long that took (`None`: not within 10 s).
fn closed_within(mut s: &TcpStream) -> Option<Duration> {
    let t = Instant::now();
    let mut b = [0u8; 256];
    loop {
        match s.read(&mut b) {
            Ok(0) => return Some(t.elapsed()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Some(t.elapsed()),
            Err(_) => return None,
        }
    }
}

/// Says goodbye on the host connection `ch` and closes it; once the SP has seen it go, stops
/// the SPs: the counters each printed at exit.
fn goodbye_and_stats(mut ch: Channel<TcpStream>, sps: &mut TcpSps) -> Vec<serde_json::Value> {
    ch.send(&HostToSp::Goodbye).unwrap();
    drop(ch);
    std::thread::sleep(Duration::from_millis(100));
    sps.stop_and_stats()
}

fn stats_over_tcp(sps: &TcpSps, sp: u32) -> serde_json::Value {
    service_process::stats::query(&sps.cluster.sps[sp as usize], &sps.key).unwrap()
}

#[test]
fn a_tcp_host_is_its_credential_and_gets_no_cross_memory_attach() {
    let mut sps = TcpSps::describe(&exe(), 1, 1, 2);
    sps.start_all(&[]);
    // Any uid: over TCP no kernel vouches for one, the credential's is taken.
    let job = new_job();
    let cred = JobCredential::issue(&sps.key, job, 4242, 2).encode();
    let mut ch = connect(&sps, 0);
    assert_eq!(
        say(&mut ch, &hello(cred.clone(), 0, 2, 0)),
        Hello::Welcome { sp: 0 }
    );
    // The same rank of the same job cannot connect twice.
    let mut twin = connect(&sps, 0);
    refused_because(say(&mut twin, &hello(cred, 0, 2, 0)), "already connected");
    // A mailbox the SP would write by cross-memory attach is refused; none is accepted.
    let mailbox = vec![0u64; (64 * SLOT_BYTES / 8) as usize];
    let mut reg = Registrar::new();
    let grant = reg.register(mailbox.as_ptr() as u64, 64 * SLOT_BYTES, Rights::READ_WRITE);
    match register(&mut ch, grant.clone(), 64) {
        SpToHost::Error { message, .. } => {
            assert!(message.contains("cannot attach"), "{message}");
            assert!(message.contains("register 0 slots"), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(matches!(
        register(&mut ch, grant, 0),
        SpToHost::Registered { sp: 0, .. }
    ));
    // A post granting memory through cma is refused with the reason, before any check.
    let (sbuf, rbuf) = (vec![1u8; 16], vec![0u8; 16]);
    let s = reg.register(sbuf.as_ptr() as u64, 16, Rights::READ);
    let r = reg.register(rbuf.as_ptr() as u64, 16, Rights::WRITE);
    let mut d = desc(
        CommId { leader: 0, id: 1 },
        0,
        0,
        vec![0, 1],
        0,
        s,
        r,
        (vec![8, 8], vec![0, 8], vec![8, 8], vec![0, 8]),
    );
    d.slot = None;
    ch.send(&HostToSp::Post(Box::new(d))).unwrap();
    match ch.recv::<SpToHost>().unwrap() {
        SpToHost::Error {
            code: ErrorCode::BadDescriptor,
            message,
            seq: Some(0),
            ..
        } => assert!(message.contains("cma grant"), "{message}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    // The Unix socket still serves same-kernel hosts beside TCP, under the kernel's uid
    // policy: a credential for uid 4242 is refused there unless this process runs as 4242.
    let unix = |cred: String| {
        let s = std::os::unix::net::UnixStream::connect(&sps.cluster.sps[0].host_socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut ch = Channel::new(s);
        ch.send_hello(&hello(cred, 1, 2, 0)).unwrap();
        ch.recv_hello().unwrap()
    };
    if uid() != 4242 {
        refused_because(
            unix(JobCredential::issue(&sps.key, job, 4242, 2).encode()),
            &format!("runs as uid {}", uid()),
        );
    }
    assert_eq!(
        unix(JobCredential::issue(&sps.key, job, uid(), 2).encode()),
        Hello::Welcome { sp: 0 }
    );
    let st = goodbye_and_stats(ch, &mut sps);
    assert_eq!(st[0]["host_conns_unix"], 2, "{}", st[0]);
    assert_eq!(st[0]["posts"], 1, "{}", st[0]);
    assert_eq!(st[0]["posts_refused"], 1, "{}", st[0]);
    assert_eq!(st[0]["host_conns_tcp"], 2, "{}", st[0]);
    let refused = if uid() != 4242 { 2 } else { 1 };
    assert_eq!(st[0]["hellos_refused"], refused, "{}", st[0]);
    assert_eq!(st[0]["jobs_at_exit"], 0, "{}", st[0]);
}

#[test]
fn hostile_tcp_clients_are_refused_without_affecting_the_sp() {
    let mut sps = TcpSps::describe(&exe(), 1, 1, 2);
    sps.start_all(&["--hello-timeout-ms", "400"]);
    // A real host of a real job, connected first, must be untouched by what follows.
    let job = new_job();
    let mut good = connect(&sps, 0);
    let cred = JobCredential::issue(&sps.key, job, uid(), 2).encode();
    assert_eq!(
        say(&mut good, &hello(cred.clone(), 0, 2, 0)),
        Hello::Welcome { sp: 0 }
    );

    // No credential, a garbled one, another cluster's: refused, connection closed.
    let foreign = JobCredential::issue(&ClusterKey::generate(), job, uid(), 2).encode();
    for (cred, why) in [
        (String::new(), "invalid job credential"),
        ("spoffjob1:garbage".to_string(), "invalid job credential"),
        (foreign, "does not match"),
    ] {
        let mut ch = connect(&sps, 0);
        refused_because(say(&mut ch, &hello(cred, 1, 2, 0)), why);
        assert!(closed_within(ch.get_ref()).is_some());
    }
    // A right credential claiming another world size.
    let mut ch = connect(&sps, 0);
    refused_because(
        say(&mut ch, &hello(cred.clone(), 1, 3, 0)),
        "the hello says 3 ranks",
    );

    // An oversized frame (as its first frame, and after a good hello): the length alone gets
    // the connection closed; nothing that size is ever allocated.
    let mut raw = TcpStream::connect(sps.host_addr(0)).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    raw.write_all(&(wire::MAX_FRAME_BYTES + 1).to_le_bytes())
        .unwrap();
    raw.write_all(&[0u8; 64]).unwrap();
    assert!(closed_within(&raw).is_some(), "oversized first frame");
    let mut ch = connect(&sps, 0);
    let cred1 = JobCredential::issue(&sps.key, new_job(), uid(), 2).encode();
    assert_eq!(
        say(&mut ch, &hello(cred1, 1, 2, 0)),
        Hello::Welcome { sp: 0 }
    );
    let mut w = ch.get_ref();
    w.write_all(&u32::MAX.to_le_bytes()).unwrap();
    assert!(closed_within(ch.get_ref()).is_some(), "oversized frame");

    // Silent, and half a hello: closed at the hello timeout, not held.
    let silent = TcpStream::connect(sps.host_addr(0)).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut half = TcpStream::connect(sps.host_addr(0)).unwrap();
    half.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    half.write_all(&[40, 0]).unwrap();
    for (s, what) in [(&silent, "silent"), (&half, "half a hello")] {
        let took = closed_within(s).unwrap_or_else(|| panic!("{what}: never closed"));
        assert!(
            took < Duration::from_secs(5),
            "{what}: closed after {took:?}"
        );
    }

    // Garbage instead of a hello.
    let mut junk = TcpStream::connect(sps.host_addr(0)).unwrap();
    junk.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    junk.write_all(&wire::frame(b"GET / HTTP/1.0\r\n\r\n"))
        .unwrap();
    assert!(closed_within(&junk).is_some(), "junk hello");

    // The SP still serves: the first host registers now, stats answer over TCP, and the
    // counters saw every refusal.
    let mailbox = [0u64; 2];
    let grant = Registrar::new().register(mailbox.as_ptr() as u64, 16, Rights::READ_WRITE);
    assert!(matches!(
        register(&mut good, grant, 0),
        SpToHost::Registered { .. }
    ));
    let st = stats_over_tcp(&sps, 0);
    assert!(st["hellos_refused"].as_u64().unwrap() >= 5, "{st}");
    assert!(st["hellos_timed_out"].as_u64().unwrap() >= 2, "{st}");
    let st = goodbye_and_stats(good, &mut sps);
    assert!(!st[0].is_null(), "the SP must stop cleanly and report");
    assert_eq!(st[0]["jobs_at_exit"], 0, "{}", st[0]);
}

#[test]
fn same_kernel_tcp_hosts_must_name_a_live_process_of_their_uid() {
    let mut sps = TcpSps::describe(&exe(), 1, 1, 2);
    sps.start_all(&["--hosts-same-kernel"]);
    let key = sps.key.clone();
    let cred = |uid| JobCredential::issue(&key, new_job(), uid, 2).encode();
    let me = std::process::id();
    let mut ch = connect(&sps, 0);
    refused_because(
        say(&mut ch, &hello(cred(uid()), 0, 2, 0)),
        "must name its pid",
    );
    let mut ch = connect(&sps, 0);
    refused_because(
        say(&mut ch, &hello(cred(uid()), 0, 2, i32::MAX as u32 - 1)),
        "no live process",
    );
    // A credential of another uid cannot name this process (nor any process not its own).
    let other = if uid() == 65534 { 65533 } else { 65534 };
    let mut ch = connect(&sps, 0);
    refused_because(
        say(&mut ch, &hello(cred(other), 0, 2, me)),
        &format!("runs as uid {}", uid()),
    );
    // The truth: welcomed, and its cma mailbox is taken (the SP pinned this process).
    let mut ch = connect(&sps, 0);
    assert_eq!(
        say(&mut ch, &hello(cred(uid()), 0, 2, me)),
        Hello::Welcome { sp: 0 }
    );
    let mailbox: &'static [u64] =
        Box::leak(vec![0u64; (64 * SLOT_BYTES / 8) as usize].into_boxed_slice());
    let grant =
        Registrar::new().register(mailbox.as_ptr() as u64, 64 * SLOT_BYTES, Rights::READ_WRITE);
    assert!(matches!(
        register(&mut ch, grant, 64),
        SpToHost::Registered { .. }
    ));
    let st = goodbye_and_stats(ch, &mut sps);
    assert_eq!(st[0]["hellos_refused"], 3, "{}", st[0]);
    assert_eq!(st[0]["jobs_at_exit"], 0, "{}", st[0]);
}
