//! Moves bytes between two real processes.
//!
//! The `ucx-peer` binary plays the host: it registers a buffer filled with a
//! known pattern, prints its worker address, packed rkey and buffer address,
//! and then blocks reading stdin, so it never progresses its UCX worker
//! unless told to. This test plays the service process: it connects, reads
//! the region with `get`, checks it, overwrites it with another pattern with
//! `put`, flushes, and tells the peer to verify its buffer.
//!
//! What these tests pin down about Debian's UCX 1.13.1 on one machine:
//!
//! * Memory UCX allocated itself (`MemHandle::allocate`, which uses the
//!   sysv/posix memory domains) is reachable one-sidedly over `sysv`/`posix`
//!   with `ErrorHandling::None`: the peer never progresses.
//! * Memory the application registered (`MemHandle::map`) is not: `cma`
//!   cannot be a UCP RMA lane in 1.13 (it lacks put-short/bcopy), so get/put
//!   fall back to software emulation over active messages, which completes
//!   only while the target progresses.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::rc::Rc;
use std::time::Duration;

use ucx_sys::{Context, Endpoint, ErrorHandling, Features, RemoteKey, Status, Worker};

fn pattern(seed: u8, i: usize) -> u8 {
    (i as u8)
        .wrapping_mul(31)
        .wrapping_add(seed.wrapping_mul(101))
        .wrapping_add(7)
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

struct Peer {
    child: Child,
    stdout: BufReader<ChildStdout>,
    addr: Vec<u8>,
    rkey: Vec<u8>,
    buf: u64,
    len: usize,
}

impl Peer {
    fn spawn(tls: &str, args: &[&str]) -> Peer {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ucx-peer"))
            .args(args)
            .env("UCX_TLS", tls)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn ucx-peer");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let (mut addr, mut rkey, mut buf, mut len) = (Vec::new(), Vec::new(), 0, 0);
        loop {
            let mut line = String::new();
            assert!(
                stdout.read_line(&mut line).unwrap() > 0,
                "peer exited early"
            );
            let line = line.trim();
            // UCX logs to stdout too (UCX_LOG_LEVEL); skip what is not ours.
            match line.split_once(' ') {
                Some(("addr", v)) => addr = unhex(v),
                Some(("rkey", v)) => rkey = unhex(v),
                Some(("buf", v)) => buf = u64::from_str_radix(&v[2..], 16).unwrap(),
                Some(("len", v)) => len = v.parse().unwrap(),
                _ if line == "ready" => break,
                _ => {}
            }
        }
        Peer {
            child,
            stdout,
            addr,
            rkey,
            buf,
            len,
        }
    }

    fn send(&mut self, cmd: &str) {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
    }

    /// Asks the peer to check its buffer against `pattern(seed, _)`.
    fn verify(mut self, seed: u8) {
        self.send(&format!("verify {seed}"));
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        let status = self.child.wait().unwrap();
        assert_eq!(line.trim(), "verified");
        assert!(status.success(), "peer exit status {status}");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Only reached with the child still running if a test failed.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn connect(tls: &str, peer: &Peer, err: ErrorHandling) -> (Rc<Endpoint>, RemoteKey) {
    let ctx = Context::with_config(Features::RMA, &[("TLS", tls)]).unwrap();
    let worker = Worker::new(&ctx).unwrap();
    let ep = Endpoint::connect_with(&worker, &peer.addr, err).unwrap();
    // SAFETY: the bytes are exactly what the peer's rkey_pack produced.
    let rkey = unsafe { RemoteKey::unpack(&ep, &peer.rkey) }.unwrap();
    (ep, rkey)
}

/// Gets the peer's buffer and checks it, puts a new pattern (first half with
/// put_nbx + test, second half with the blocking put), flushes, and reads it
/// back with get_nbx + wait.
fn get_check_put_flush(ep: &Rc<Endpoint>, rkey: &RemoteKey, peer: &Peer) {
    let mut got = vec![0u8; peer.len];
    ep.get(&mut got, peer.buf, rkey).unwrap();
    for (i, b) in got.iter().enumerate() {
        assert_eq!(*b, pattern(0, i), "byte {i} read from peer");
    }

    let new: Vec<u8> = (0..peer.len).map(|i| pattern(1, i)).collect();
    let half = peer.len / 2;
    // SAFETY: `new` is neither dropped nor written until the request is done.
    let mut req = unsafe { ep.put_nbx(new.as_ptr(), half, peer.buf, rkey) }.unwrap();
    while !req.test().unwrap() {
        ep.worker().progress();
    }
    ep.put(&new[half..], peer.buf + half as u64, rkey).unwrap();
    ep.flush().unwrap();

    let mut back = vec![0u8; peer.len];
    // SAFETY: `back` is untouched until wait() returns.
    let req = unsafe { ep.get_nbx(back.as_mut_ptr(), back.len(), peer.buf, rkey) }.unwrap();
    req.wait().unwrap();
    assert!(back == new, "read-back differs from what was put");
}

#[test]
fn ucx_allocated_memory_needs_no_target_progress() {
    for tls in ["sysv,posix", "posix", "sysv", "sm", "tcp,sysv,posix", "all"] {
        let peer = Peer::spawn(tls, &["--alloc", "100000"]);
        let (ep, rkey) = connect(tls, &peer, ErrorHandling::None);
        get_check_put_flush(&ep, &rkey, &peer);
        drop((rkey, ep));
        peer.verify(1);
    }
}

#[test]
fn peer_error_mode_excludes_shared_memory() {
    // sysv/posix cannot report peer failure, so with ERR_HANDLING_MODE_PEER
    // UCX finds no transport at all when only they are enabled.
    let peer = Peer::spawn("sysv,posix", &["--alloc", "64"]);
    let ctx = Context::with_config(Features::RMA, &[("TLS", "sysv,posix")]).unwrap();
    let worker = Worker::new(&ctx).unwrap();
    let err = Endpoint::connect_with(&worker, &peer.addr, ErrorHandling::Peer).unwrap_err();
    assert_eq!(err.status, Status::ERR_UNREACHABLE);
    let mut peer = peer;
    peer.send("quit");
    assert!(peer.child.wait().unwrap().success());
}

#[test]
fn registered_user_memory_needs_target_progress() {
    for (tls, err) in [
        ("cma,tcp", ErrorHandling::None),
        ("tcp", ErrorHandling::Peer),
    ] {
        let mut peer = Peer::spawn(tls, &["65536"]);
        let (ep, rkey) = connect(tls, &peer, err);

        let mut buf = vec![0u8; 4096];
        // SAFETY: buf is not touched until the request has completed (the
        // wait below), and outlives it.
        let mut req = unsafe { ep.get_nbx(buf.as_mut_ptr(), buf.len(), peer.buf, &rkey) }.unwrap();
        let done = req.wait_timeout(Duration::from_millis(500)).unwrap();
        assert!(
            !done,
            "{tls}: get completed although the target never progressed"
        );

        peer.send("progress");
        assert!(req.wait_timeout(Duration::from_secs(30)).unwrap(), "{tls}");
        drop(req);
        assert_eq!(
            buf[..8],
            (0..8).map(|i| pattern(0, i)).collect::<Vec<_>>()[..]
        );

        get_check_put_flush(&ep, &rkey, &peer);
        drop((rkey, ep));
        peer.verify(1);
    }
}

#[test]
fn rkey_from_other_endpoint_is_rejected() {
    let mut peer = Peer::spawn("sysv,posix", &["--alloc", "64"]);
    let ctx = Context::with_config(Features::RMA, &[("TLS", "sysv,posix")]).unwrap();
    let worker = Worker::new(&ctx).unwrap();
    let ep1 = Endpoint::connect(&worker, &peer.addr).unwrap();
    let ep2 = Endpoint::connect(&worker, &peer.addr).unwrap();
    // SAFETY: genuine packed key from the peer.
    let rkey = unsafe { RemoteKey::unpack(&ep1, &peer.rkey) }.unwrap();
    let mut buf = [0u8; 64];
    let err = ep2.get(&mut buf, peer.buf, &rkey).unwrap_err();
    assert_eq!(err.status, Status::ERR_INVALID_PARAM);
    ep1.get(&mut buf, peer.buf, &rkey).unwrap();
    assert_eq!(buf[5], pattern(0, 5));
    drop((rkey, ep1, ep2));
    peer.send("quit");
    assert!(peer.child.wait().unwrap().success());
}
