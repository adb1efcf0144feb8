//! Issue 24, items 7 and 8: what a replay of captured bytes can do to real SPs whose hosts
//! reach them over TCP (`host_addr`), the attacker a separate process (this test binary run
//! again, see [`attacker_process`]).
//!
//! 7. A job credential seen on the host–DPU network, replayed in a polite hello + goodbye as
//!    rank 0 at an SP that does not serve rank 0, must not change which SP serves rank 0 for
//!    the job's other ranks: their next collectives complete.
//! 8. A `service-process stats` request recorded on the wire and sent again is not answered,
//!    neither by the SP it was meant for nor by another; a fresh request is.
#![allow(clippy::needless_range_loop)]

mod common;
mod tcp;

#[allow(dead_code)]
#[path = "security/attacker.rs"]
mod attacker;

use algorithms::CommId;
use attacker::attack;
use bootstrap::auth::JobCredential;
use bootstrap::mailbox::STATUS_OK;
use common::*;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;
use tcp::TcpSps;

/// The entry point of the attacker subprocess (not a test of its own: the other tests run it).
#[test]
#[ignore = "the attacker subprocess of the other tests; does nothing on its own"]
fn attacker_process() {
    attacker::run();
}

fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_service-process"))
}

/// The started SPs of `t` as an [`SpSet`], for the ranks of [`Host`] (on the Unix socket,
/// with cma grants), while `t` keeps the description with the SPs' TCP addresses.
fn sp_set(t: &mut TcpSps) -> SpSet {
    let (_tx, none) = mpsc::channel();
    SpSet {
        sps: std::mem::take(&mut t.sps),
        cluster: t.cluster.clone(),
        key: t.key.clone(),
        cluster_path: t.cluster_path.clone(),
        run_dir: t.run_dir.clone(),
        lines: std::mem::replace(&mut t.lines, none),
    }
}

/// The attacker replays `cred` over TCP at SP `sp`: a hello as world rank 0 of 4 placed on
/// `node` (local rank 0), a goodbye if welcomed, the connection closed. Its one-line verdict.
fn replay_hello_goodbye(t: &TcpSps, sp: u32, cred: &str, node: u32) -> String {
    let vars = [
        ("ADDR", t.host_addr(sp).to_string()),
        ("CRED", cred.to_string()),
        ("RANK", "0".to_string()),
        ("SIZE", "4".to_string()),
        ("NODE", node.to_string()),
        ("LOCAL", "0".to_string()),
    ];
    let said = attack("tcp-hello-goodbye", &vars, None);
    // The attacker has exited: give the SP a moment to take in its goodbye and close.
    std::thread::sleep(Duration::from_millis(300));
    said.join(" | ")
}

/// Two nodes, one SP each (SP 0 serves world ranks 0 and 1, SP 1 ranks 2 and 3), a 4-rank
/// job on the Unix sockets; and the job's credential, which the attacker holds (it travels in
/// clear over TCP).
fn two_sps_and_a_job() -> (TcpSps, SpSet, Vec<Host>, String) {
    let mut tcp = TcpSps::describe(&exe(), 2, 1, 2);
    tcp.start_all(&[]);
    let set = sp_set(&mut tcp);
    let job = new_job();
    let hosts = Host::connect_all(&set, job, 4);
    let cred = JobCredential::issue(&set.key, job, my_uid(), 4).encode();
    (tcp, set, hosts, cred)
}

const WORLD: CommId = CommId { leader: 0, id: 1 };

/// Item 7, once the job's collectives placed rank 0: the attacker says hello as rank 0 at SP
/// 1, claiming SP 1's node, then goodbye. Refused with the reason; the job's next collective
/// completes.
#[test]
fn a_replayed_hello_cannot_move_a_placed_rank_to_another_sp() {
    let (tcp, mut set, mut hosts, cred) = two_sps_and_a_job();
    let ok = vec![Some(STATUS_OK); 4];
    assert_eq!(
        checked_alltoallv(&mut hosts, WORLD, 0),
        ok,
        "before the replay"
    );
    let answer = replay_hello_goodbye(&tcp, 1, &cred, 1);
    eprintln!("replayed hello as rank 0 at SP 1, after a collective: {answer}");
    let after = checked_alltoallv(&mut hosts, WORLD, 1);
    assert_eq!(
        after, ok,
        "the job's next collective after the replay ({answer})"
    );
    assert!(
        answer.starts_with("REJECT")
            && answer.contains("rank 0 of this job is served by SP 0")
            && answer.contains("not this SP 1"),
        "a hello as rank 0 at SP 1 must be refused with the reason: {answer}"
    );
    let st = set.stats_after_goodbyes(hosts);
    assert_nothing_held(&st);
    assert_eq!(st[1]["hellos_refused"], 1, "{}", st[1]);
}

/// Item 7, before any collective: the replayed hello as rank 0 at SP 1 is welcomed (while
/// connected it is a rank of the job: the credential is the identity), and what it claimed
/// goes with it when it says goodbye: the job's collectives then complete.
#[test]
fn a_replayed_hello_and_goodbye_leave_nothing_behind() {
    let (tcp, mut set, mut hosts, cred) = two_sps_and_a_job();
    let answer = replay_hello_goodbye(&tcp, 1, &cred, 1);
    eprintln!("replayed hello as rank 0 at SP 1, before any collective: {answer}");
    for seq in 0..2 {
        assert_eq!(
            checked_alltoallv(&mut hosts, WORLD, seq),
            vec![Some(STATUS_OK); 4],
            "collective {seq} of the job after a replayed hello + goodbye ({answer})"
        );
    }
    let st = set.stats_after_goodbyes(hosts);
    assert_nothing_held(&st);
}

/// A TCP proxy to `to` for one connection; sends what the client wrote once it closed.
fn recording_proxy(to: SocketAddr) -> (SocketAddr, mpsc::Receiver<Vec<u8>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let (mut client, _) = l.accept().unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut up = TcpStream::connect(to).unwrap();
        let (mut up_r, mut client_w) = (up.try_clone().unwrap(), client.try_clone().unwrap());
        up_r.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let back = std::thread::spawn(move || {
            let _ = std::io::copy(&mut up_r, &mut client_w);
            let _ = client_w.shutdown(Shutdown::Write);
        });
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = client.read(&mut buf) {
            seen.extend_from_slice(&buf[..n]);
            if up.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = up.shutdown(Shutdown::Write);
        let _ = back.join();
        let _ = tx.send(seen);
    });
    (addr, rx)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Item 8. A real `stats` request to SP 0, recorded by a proxy on its way; 2 s later (well
/// inside the minute a proof's time may be off) the attacker sends the recorded bytes again to
/// SP 0 and to SP 1. Neither answers; fresh requests (the library's and the `stats` and
/// `wait-ready` commands) are answered.
#[test]
fn a_captured_admin_request_is_not_answered_again() {
    let mut tcp = TcpSps::describe(&exe(), 2, 1, 1);
    tcp.start_all(&[]);
    let (proxy, captured) = recording_proxy(tcp.host_addr(0));
    let mut via_proxy = tcp.cluster.sps[0].clone();
    via_proxy.host_addr = Some(proxy);
    let first = service_process::stats::query_within(&via_proxy, &tcp.key, WAIT)
        .expect("the request through the proxy is answered");
    assert!(first["posts"].is_u64(), "{first}");
    let bytes = captured
        .recv_timeout(Duration::from_secs(10))
        .expect("the proxy saw the request");
    assert!(bytes.len() > 8 && bytes[4..8] == *b"SPOF", "{bytes:?}");

    std::thread::sleep(Duration::from_secs(2));
    let replay_at = |sp: u32| {
        let vars = [
            ("ADDR", tcp.host_addr(sp).to_string()),
            ("BYTES", hex(&bytes)),
        ];
        attack("replay-bytes", &vars, None).join(" | ")
    };
    let again = replay_at(0);
    eprintln!("the request replayed at SP 0: {again}");
    let elsewhere = replay_at(1);
    eprintln!("the request replayed at SP 1: {elsewhere}");

    // Fresh requests are answered: the library's, `stats` and `wait-ready`.
    let fresh = service_process::stats::query(&tcp.cluster.sps[0], &tcp.key)
        .expect("a fresh request is answered");
    assert!(fresh["posts"].is_u64(), "{fresh}");
    let out = std::process::Command::new(exe())
        .args(["stats", "--json", "--cluster"])
        .arg(&tcp.cluster_path)
        .output()
        .unwrap();
    assert_eq!(json_lines_ok(out).len(), 2, "service-process stats");
    let out = std::process::Command::new(exe())
        .args(["wait-ready", "--timeout-secs", "10", "--cluster"])
        .arg(&tcp.cluster_path)
        .output()
        .unwrap();
    stdout_ok(out);

    assert!(
        again.starts_with("REJECT") && again.contains("already answered"),
        "a replayed admin request must be refused by the SP it was meant for: {again}"
    );
    assert!(
        elsewhere.starts_with("REJECT") && elsewhere.contains("not proven"),
        "a request meant for SP 0 must be refused by SP 1: {elsewhere}"
    );
    let st = tcp.stop_and_stats();
    assert_eq!(st[0]["hellos_refused"], 1, "{}", st[0]);
    assert_eq!(st[1]["hellos_refused"], 1, "{}", st[1]);
}
