//! The `ucx` backend between real processes: this test plays the SP (a [`UcxMover`]), and
//! `alias-mkey-ucx-host` children play host ranks that register buffers with a
//! [`alias_mkey::host::UcxRegistrar`] and progress their UCX worker. No mock: real UCX (Debian
//! 1.13.1), real bytes, checked by the hosts themselves.
#![cfg(feature = "ucx")]

use alias_mkey::mover::{
    CmaMover, DynMover, ErrorHandling, Mover, MoverConfig, UcxMover, UcxMoverConfig,
};
use alias_mkey::{AccessError, AliasKey, BackendData, Grant, Owner, Rights};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// Same as the helper's.
fn pattern(seed: u8, i: u64) -> u8 {
    let x = (i ^ (u64::from(seed) << 40)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8
}

fn unhex(s: &str) -> Vec<u8> {
    if s == "-" {
        return Vec::new();
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Aborts the whole test binary if it runs far longer than it should: a hang is a failure.
fn watchdog() {
    static START: std::sync::Once = std::sync::Once::new();
    START.call_once(|| {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_secs(300));
            eprintln!("ucx_hosts: watchdog: still running after 300 s, aborting");
            std::process::abort();
        });
    });
}

struct Host {
    child: Child,
    stdout: BufReader<ChildStdout>,
    rank: u32,
    len: u64,
}

impl Host {
    fn spawn(tls: Option<&str>, rank: u32, len: u64, seed: u8) -> Host {
        watchdog();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_alias-mkey-ucx-host"));
        cmd.args([len.to_string(), seed.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        match tls {
            Some(t) => cmd.env("UCX_TLS", t),
            None => cmd.env_remove("UCX_TLS"),
        };
        let mut child = cmd.spawn().expect("spawn alias-mkey-ucx-host");
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut h = Host {
            child,
            stdout,
            rank,
            len,
        };
        assert!(h.reply().starts_with("buf "));
        assert_eq!(h.reply(), "ready");
        h
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn reply(&mut self) -> String {
        loop {
            let mut line = String::new();
            assert!(
                self.stdout.read_line(&mut line).unwrap() > 0,
                "host exited early"
            );
            if let Some(r) = line.trim_end().strip_prefix("@ ") {
                return r.to_string();
            }
        }
    }

    fn send(&mut self, cmd: &str) {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
    }

    fn cmd(&mut self, cmd: &str) -> String {
        self.send(cmd);
        self.reply()
    }

    /// Registers `[off, off+len)` and returns the alias key an SP would build (owner pid as
    /// learned from the kernel: here, the child's pid).
    fn grant(&mut self, off: u64, len: u64, rights: &str) -> AliasKey {
        let r = self.cmd(&format!("register {off} {len} {rights}"));
        let f: Vec<&str> = r.split(' ').collect();
        assert_eq!(f[0], "grant", "{r}");
        let rights = match f[5] {
            "1" => Rights::READ,
            "2" => Rights::WRITE,
            "3" => Rights::READ_WRITE,
            b => panic!("rights bits {b}"),
        };
        AliasKey {
            owner: Owner {
                job: 7,
                world_rank: self.rank,
                pid: self.pid(),
                start: alias_mkey::process::start_time(self.pid()).unwrap_or(0),
                uid: 0,
                gid: 0,
            },
            grant: Grant {
                region: f[1].parse().unwrap(),
                generation: f[2].parse().unwrap(),
                addr: f[3].parse().unwrap(),
                len: f[4].parse().unwrap(),
                rights,
                backend: BackendData::Ucx {
                    worker_address: unhex(f[6]),
                    rkey: unhex(f[7]),
                },
            },
        }
    }

    /// The host checks `buf[off..off+len] == pattern(seed, from..)`.
    fn expect(&mut self, off: u64, len: u64, seed: u8, from: u64) {
        let r = self.cmd(&format!("expect {off} {len} {seed} {from}"));
        assert_eq!(r, "ok", "host rank {} [{off}, +{len})", self.rank);
    }

    /// The host's whole buffer still holds its initial pattern.
    fn untouched(&mut self, seed: u8) {
        let len = self.len;
        self.expect(0, len, seed, 0);
    }

    fn quit(mut self) {
        self.send("quit");
        let st = self.child.wait().unwrap();
        assert!(st.success(), "host exit status {st}");
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn mover(tls: Option<&str>, eh: ErrorHandling, chunk: usize, timeout: Duration) -> UcxMover {
    UcxMover::new(UcxMoverConfig {
        chunk_bytes: chunk,
        timeout,
        error_handling: eh,
        tls: tls.map(str::to_string),
        ..Default::default()
    })
    .expect("UcxMover")
}

const A_SEED: u8 = 11;
const B_SEED: u8 = 22;

/// Copy A → B through a small staging buffer (many chunks), write into B, read back from B and
/// A, and let both hosts check every byte of their buffers.
fn copy_read_write(tls: Option<&str>, eh: ErrorHandling) {
    const LEN: u64 = 300_000;
    let mut a = Host::spawn(tls, 0, LEN, A_SEED);
    let mut b = Host::spawn(tls, 1, LEN, B_SEED);
    let ka = a.grant(0, LEN, "r");
    let kb = b.grant(1000, 200_000, "rw");
    let mut m = mover(tls, eh, 16 << 10, Duration::from_secs(20));

    // 150_001 bytes from A[77..] to B[1000 + 5..]: ten chunks, the last one partial.
    m.copy(&ka, 77, &kb, 5, 150_001)
        .unwrap_or_else(|e| panic!("copy with UCX_TLS={tls:?} {eh:?}: {e}"));
    b.expect(1005, 150_001, A_SEED, 77);
    b.expect(0, 1005, B_SEED, 0);
    b.expect(151_006, LEN - 151_006, B_SEED, 151_006);
    a.untouched(A_SEED);

    // Read back through the mover and compare with what A holds.
    let mut back = vec![0u8; 150_001];
    m.read(&kb, 5, &mut back).unwrap();
    assert!(back
        .iter()
        .enumerate()
        .all(|(i, &x)| x == pattern(A_SEED, 77 + i as u64)));
    let mut from_a = vec![0u8; 40_000];
    m.read(&ka, LEN - 40_000, &mut from_a).unwrap();
    assert!(from_a
        .iter()
        .enumerate()
        .all(|(i, &x)| x == pattern(A_SEED, LEN - 40_000 + i as u64)));

    // Write a pattern into B (two chunks and a bit), host checks.
    let data: Vec<u8> = (0..40_000u64).map(|i| pattern(99, i)).collect();
    m.write(&kb, 160_000, &data).unwrap();
    b.expect(161_000, 40_000, 99, 0);
    b.expect(151_006, 9_994, B_SEED, 151_006);

    // The keys were unpacked once and then reused.
    let st = m.stats();
    assert_eq!(
        (st.endpoints, st.rkeys, st.rkey_misses),
        (2, 2, 2),
        "{st:?}"
    );
    assert_eq!(st.timeouts, 0);
    drop(m);
    a.quit();
    b.quit();
}

#[test]
fn copy_between_two_hosts_over_tcp() {
    copy_read_write(Some("tcp"), ErrorHandling::Peer);
    copy_read_write(Some("tcp"), ErrorHandling::None);
}

#[test]
fn copy_between_two_hosts_with_default_and_cma_tcp_transports() {
    for eh in [ErrorHandling::Peer, ErrorHandling::None] {
        copy_read_write(None, eh);
        copy_read_write(Some("cma,tcp"), eh);
    }
}

#[test]
fn copy_between_two_hosts_over_shared_memory() {
    for tls in ["sm", "posix", "sysv"] {
        copy_read_write(Some(tls), ErrorHandling::None);
    }
}

#[test]
fn shared_memory_transports_cannot_detect_peer_failure() {
    let mut a = Host::spawn(Some("sm"), 0, 4096, A_SEED);
    let ka = a.grant(0, 4096, "r");
    let mut m = mover(
        Some("sm"),
        ErrorHandling::Peer,
        4096,
        Duration::from_secs(5),
    );
    let err = m.read(&ka, 0, &mut [0u8; 16]).unwrap_err();
    assert!(
        matches!(&err, AccessError::Ucx { op: "ucp_ep_create", status, .. } if status.contains("unreachable")),
        "{err}"
    );
    a.quit();
}

#[test]
fn refused_accesses_touch_nothing() {
    let tls = Some("tcp");
    let mut a = Host::spawn(tls, 0, 8192, A_SEED);
    let mut b = Host::spawn(tls, 1, 8192, B_SEED);
    let ka = a.grant(100, 4000, "r");
    let kb = b.grant(0, 4096, "w");
    let kb_read = b.grant(4096, 4096, "r");
    let mut m = mover(tls, ErrorHandling::Peer, 4096, Duration::from_secs(10));
    let mut out = [0u8; 64];

    let refusals: Vec<AccessError> = vec![
        // Outside the grant (by one byte), overflowing, and past the end with zero length.
        m.copy(&ka, 0, &kb, 97, 4000).unwrap_err(),
        m.copy(&ka, 1, &kb, 0, 4000).unwrap_err(),
        m.read(&ka, 3990, &mut out).unwrap_err(),
        m.write(&kb, 4090, &[1; 7]).unwrap_err(),
        m.copy(&ka, u64::MAX - 1, &kb, 0, 2).unwrap_err(),
        m.read(&ka, 4001, &mut []).unwrap_err(),
        // Wrong rights: write on a read grant, read from a write grant, copy the wrong way.
        m.write(&ka, 0, &[1]).unwrap_err(),
        m.read(&kb, 0, &mut out).unwrap_err(),
        m.copy(&kb, 0, &ka, 0, 8).unwrap_err(),
        m.copy(&ka, 0, &kb_read, 0, 8).unwrap_err(),
    ];
    for (i, e) in refusals.iter().enumerate() {
        assert!(
            matches!(
                e,
                AccessError::OutOfRange { .. }
                    | AccessError::Overflow { .. }
                    | AccessError::NoRight { .. }
            ),
            "refusal {i}: {e}"
        );
    }
    // A cma key is not this mover's business.
    let mut cma = kb.clone();
    cma.grant.backend = BackendData::Cma;
    assert!(matches!(
        m.copy(&ka, 0, &cma, 0, 8),
        Err(AccessError::Unsupported(_))
    ));
    // Nothing was set up, let alone moved: no endpoint, no key, and both buffers intact.
    assert_eq!(m.stats(), Default::default());
    a.untouched(A_SEED);
    b.untouched(B_SEED);

    // The same mover then does the legitimate copy at the very edge of both grants.
    m.copy(&ka, 0, &kb, 96, 4000).unwrap();
    b.expect(96, 4000, A_SEED, 100);
    b.expect(0, 96, B_SEED, 0);
    b.expect(4096, 4096, B_SEED, 4096);
    drop(m);
    a.quit();
    b.quit();
}

#[test]
fn stale_generation_is_refused_after_invalidate() {
    let tls = Some("tcp");
    let mut a = Host::spawn(tls, 0, 65536, A_SEED);
    let mut m = mover(tls, ErrorHandling::Peer, 4096, Duration::from_secs(10));
    let old = a.grant(0, 65536, "rw");
    let mut out = [0u8; 32];
    m.read(&old, 1000, &mut out).unwrap();
    assert_eq!(out[0], pattern(A_SEED, 1000));

    // The host frees/remaps part of the buffer: the registration is unmapped and its next
    // grant has a new generation.
    assert_eq!(a.cmd("invalidate 4096 1"), "invalidated 1");
    let new = a.grant(0, 65536, "rw");
    assert_eq!(new.grant.region, old.grant.region);
    assert_eq!(new.grant.generation, old.grant.generation + 1);
    // (Over tcp the packed key of the new mapping may equal the old one byte for byte: the tcp
    // memory domain packs an empty key. The generation is what tells them apart.)

    m.write(&new, 2000, &[0x5a; 100]).unwrap();
    let st = m.stats();
    assert_eq!(st.rkeys, 1, "the old generation's key was released: {st:?}");
    // An SP that has seen the new generation refuses the old key, before any UCX call.
    assert_eq!(
        m.read(&old, 1000, &mut out),
        Err(AccessError::StaleGeneration {
            have: new.grant.generation,
            got: old.grant.generation
        })
    );
    assert_eq!(
        m.write(&old, 0, &[1]),
        Err(AccessError::StaleGeneration {
            have: new.grant.generation,
            got: old.grant.generation
        })
    );
    assert_eq!(m.stats(), st, "the refusals did nothing");
    // A mover told about the new generation by a control message refuses the old key without
    // ever having used the new one.
    let mut m2 = mover(tls, ErrorHandling::Peer, 4096, Duration::from_secs(10));
    m2.note_generation(new.owner, new.grant.region, new.grant.generation);
    assert!(matches!(
        m2.copy(&old, 0, &new, 0, 8),
        Err(AccessError::StaleGeneration { .. })
    ));
    a.expect(0, 2000, A_SEED, 0);
    a.expect(2100, 65536 - 2100, A_SEED, 2100);
    drop((m, m2));
    a.quit();
}

/// Kills a host, then accesses its grant: an error within a bounded time, never a hang.
fn dead_host(
    tls: Option<&str>,
    eh: ErrorHandling,
    timeout: Duration,
    used_before: bool,
) -> (AccessError, Duration) {
    let mut a = Host::spawn(tls, 0, 65536, A_SEED);
    let mut b = Host::spawn(tls, 1, 65536, B_SEED);
    let ka = a.grant(0, 65536, "r");
    let kb = b.grant(0, 65536, "w");
    let mut m = mover(tls, eh, 4096, timeout);
    if used_before {
        m.copy(&ka, 0, &kb, 0, 100).unwrap();
    }
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    let t = Instant::now();
    let err = m.copy(&ka, 0, &kb, 0, 65536).unwrap_err();
    let took = t.elapsed();
    // The SP survives it and keeps serving the live host.
    m.write(&kb, 200, &[7; 10]).unwrap();
    if used_before {
        b.expect(0, 100, A_SEED, 0);
    }
    b.expect(100, 100, B_SEED, 100);
    drop(m);
    b.quit();
    (err, took)
}

#[test]
fn dead_host_is_an_error_not_a_hang() {
    let limit = Duration::from_secs(3);
    for (tls, eh) in [
        // Peer error handling: the broken connection fails the request at once.
        ("tcp", ErrorHandling::Peer),
        // No error handling: the mover's timeout bounds the wait.
        ("tcp", ErrorHandling::None),
        ("sm", ErrorHandling::None),
    ] {
        for used_before in [false, true] {
            let (err, took) = dead_host(Some(tls), eh, limit, used_before);
            eprintln!("{tls} {eh:?}, used before {used_before}: {err} after {took:?}");
            assert!(
                matches!(err, AccessError::Ucx { .. } | AccessError::Timeout { .. }),
                "{err}"
            );
            assert!(took < limit * 2, "{took:?}");
        }
    }
}

#[test]
fn host_that_stops_progressing_times_out_and_the_staging_buffer_is_quarantined() {
    for (tls, eh) in [("tcp", ErrorHandling::Peer), ("sm", ErrorHandling::None)] {
        stop_progressing(Some(tls), eh);
    }
}

fn stop_progressing(tls: Option<&str>, eh: ErrorHandling) {
    let mut a = Host::spawn(tls, 0, 65536, A_SEED);
    let ka = a.grant(0, 65536, "r");
    let mut m = mover(tls, eh, 4096, Duration::from_millis(500));
    let mut out = vec![0u8; 4096];
    m.read(&ka, 0, &mut out).unwrap();

    assert_eq!(a.cmd("pause"), "paused");
    out.fill(0xcc);
    let t = Instant::now();
    let err = m.read(&ka, 4096, &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            AccessError::Timeout {
                op: "ucp_get_nbx",
                ..
            }
        ),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(
        out.iter().all(|&x| x == 0xcc),
        "the caller's buffer was never given to UCX"
    );
    let st = m.stats();
    assert_eq!(
        (st.quarantined, st.timeouts, st.endpoints),
        (1, 1, 0),
        "{st:?}"
    );

    // The host resumes (any command does); the late get completes into the quarantined buffer
    // and the next access releases it, reconnects and works.
    a.expect(0, 16, A_SEED, 0);
    let t = Instant::now();
    loop {
        match m.read(&ka, 8192, &mut out) {
            Ok(()) => break,
            Err(e) => assert!(t.elapsed() < Duration::from_secs(20), "{e}"),
        }
    }
    assert!(out
        .iter()
        .enumerate()
        .all(|(i, &x)| x == pattern(A_SEED, 8192 + i as u64)));
    assert_eq!(m.stats().quarantined, 0, "{:?}", m.stats());
    drop(m);
    a.quit();
}

#[test]
fn quarantine_is_bounded_and_a_mover_with_pending_requests_drops_without_blocking() {
    let tls = Some("tcp");
    let mut a = Host::spawn(tls, 0, 65536, A_SEED);
    let ka = a.grant(0, 65536, "r");
    let mut m = UcxMover::new(UcxMoverConfig {
        chunk_bytes: 4096,
        timeout: Duration::from_millis(200),
        tls: tls.map(str::to_string),
        max_quarantined: 2,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(a.cmd("pause"), "paused");
    let mut out = [0u8; 64];
    for _ in 0..2 {
        assert!(matches!(
            m.read(&ka, 0, &mut out),
            Err(AccessError::Timeout { .. })
        ));
    }
    let err = m.read(&ka, 0, &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            AccessError::Ucx {
                op: "quarantine",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(m.stats().quarantined, 2);
    let t = Instant::now();
    drop(m);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    a.untouched(A_SEED);
    a.quit();
}

#[test]
fn dyn_mover_serves_cma_and_ucx_grants() {
    let tls = Some("tcp");
    const LEN: u64 = 100_000;
    let mut a = Host::spawn(tls, 0, LEN, A_SEED);
    let mut b = Host::spawn(tls, 1, LEN, B_SEED);
    let ka = a.grant(0, LEN, "r");
    let kb = b.grant(0, LEN, "rw");
    // CMA grants on the same buffers (the SP reads the hosts with process_vm_readv/writev).
    let cma = |k: &AliasKey| {
        let mut c = k.clone();
        c.grant.backend = BackendData::Cma;
        c.grant.region += 1000;
        c
    };
    let (ca, cb) = (cma(&ka), cma(&kb));

    // The default config is cma only: ucx keys are refused, cma keys work.
    let mut plain = DynMover::new(&MoverConfig::default()).unwrap();
    assert!(matches!(
        plain.copy(&ka, 0, &kb, 0, 8),
        Err(AccessError::Unsupported(_))
    ));
    assert!(matches!(
        plain.copy(&ca, 0, &kb, 0, 8),
        Err(AccessError::Unsupported(_))
    ));
    b.untouched(B_SEED);

    let mut m = DynMover::with_movers(
        CmaMover::new(8192),
        Some(mover(
            tls,
            ErrorHandling::Peer,
            8192,
            Duration::from_secs(10),
        )),
        8192,
    );
    m.copy(&ka, 0, &kb, 0, 10_000).unwrap(); // ucx → ucx
    m.copy(&ca, 10_000, &kb, 10_000, 20_000).unwrap(); // cma → ucx (staged)
    m.copy(&ka, 30_000, &cb, 30_000, 20_000).unwrap(); // ucx → cma (staged)
    plain.copy(&ca, 50_000, &cb, 50_000, 20_000).unwrap(); // cma → cma
    b.expect(0, 70_000, A_SEED, 0);
    b.expect(70_000, LEN - 70_000, B_SEED, 70_000);
    // A mixed copy checks both keys before moving anything.
    assert!(matches!(
        m.copy(&ca, 0, &kb, LEN - 10, 11),
        Err(AccessError::OutOfRange { .. })
    ));
    let mut r_only = kb.clone();
    r_only.grant.rights = Rights::READ;
    assert!(matches!(
        m.copy(&ca, 0, &r_only, 0, 11),
        Err(AccessError::NoRight { .. })
    ));
    b.expect(70_000, LEN - 70_000, B_SEED, 70_000);
    drop((m, plain));
    a.quit();
    b.quit();
}
