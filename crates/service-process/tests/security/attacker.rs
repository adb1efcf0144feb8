//! The attacker of the security tests: this test binary run again with `SPOFF_ATTACK` set (its
//! `attacker_process` test calls [`run`]), as another process and, where a finding needs it,
//! under another uid; it says what happened in `ATTACK:` lines.

use crate::common::desc;
use algorithms::CommId;
use alias_mkey::Rights;
use bootstrap::auth::{self, ClusterKey};
use bootstrap::mailbox;
use bootstrap::wire::{self, AdminHello, Channel, Hello, HostHello, HostToSp, SpHello, SpToHost};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::{Duration, Instant};

/// Runs this test binary again as an attacker: `mode` and `vars` in its environment, under
/// `uid` if given. Returns its `ATTACK:` lines.
pub fn attack(mode: &str, vars: &[(&str, String)], uid: Option<u32>) -> Vec<String> {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "attacker_process",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("SPOFF_ATTACK", mode);
    for (k, v) in vars {
        cmd.env(k, v);
    }
    if let Some(uid) = uid {
        cmd.uid(uid).gid(uid);
    }
    let out = cmd.output().expect("the attacker process runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<String> = stdout
        .lines()
        // The harness prints "test attacker_process ... " before the first line.
        .filter_map(|l| l.split_once("ATTACK: ").map(|(_, a)| a.to_string()))
        .collect();
    assert!(
        !lines.is_empty(),
        "the attacker ({mode}) said nothing\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    lines
}

/// The attacker says hello on `socket` with `cred` as rank `rank` of `size` (as `uid` if
/// given); its answer.
pub fn attack_hello(
    socket: &str,
    cred: String,
    rank: u32,
    size: u32,
    uid: Option<u32>,
) -> Vec<String> {
    let vars = [
        ("SOCK", socket.to_string()),
        ("CRED", cred),
        ("RANK", rank.to_string()),
        ("SIZE", size.to_string()),
    ];
    attack("hello", &vars, uid)
}

fn var(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("attacker: {k} is not set"))
}

fn say(what: impl std::fmt::Display) {
    println!("ATTACK: {what}");
}

/// [`hello_as_on`] node 0.
fn hello_as(
    socket: &str,
    cred: String,
    rank: u32,
    size: u32,
) -> (Option<Channel<UnixStream>>, String) {
    hello_as_on(socket, cred, rank, size, 0)
}

/// Connects to a host socket and says hello as `rank` of `size` on `node` (local rank: the
/// rank); the answer as a line.
fn hello_as_on(
    socket: &str,
    cred: String,
    rank: u32,
    size: u32,
    node: u32,
) -> (Option<Channel<UnixStream>>, String) {
    let s = match UnixStream::connect(socket) {
        Ok(s) => s,
        Err(e) => return (None, format!("CONNECT-FAILED {e}")),
    };
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut ch = Channel::new(s);
    if let Err(e) = ch.send_hello(&Hello::Host(HostHello {
        credential: cred,
        world_rank: rank,
        world_size: size,
        node,
        local_rank: rank,
        pid: std::process::id(),
    })) {
        return (None, format!("SEND-FAILED {e}"));
    }
    match ch.recv_hello() {
        Ok(Hello::Welcome { .. }) => (Some(ch), "WELCOME".into()),
        Ok(Hello::Reject { reason }) => (None, format!("REJECT {reason}")),
        Ok(other) => (None, format!("OTHER {other:?}")),
        Err(e) => (None, format!("CLOSED {e}")),
    }
}

/// [`hello_as_on`], then a mailbox of 4 slots registered on the welcomed connection; `None`,
/// the answer said, if the SP did not welcome it.
fn registered(
    socket: &str,
    cred: String,
    rank: u32,
    size: u32,
    node: u32,
) -> Option<Channel<UnixStream>> {
    let (ch, out) = hello_as_on(socket, cred, rank, size, node);
    let Some(mut ch) = ch else {
        say(out);
        return None;
    };
    let mb: &'static [u64] = Box::leak(vec![0u64; 64].into_boxed_slice());
    let grant = alias_mkey::host::Registrar::new().register(
        mb.as_ptr() as u64,
        4 * mailbox::SLOT_BYTES,
        Rights::READ_WRITE,
    );
    match crate::common::register(&mut ch, grant, 4) {
        SpToHost::Registered { .. } => Some(ch),
        other => panic!("attacker: register answered {other:?}"),
    }
}

/// A post of an alltoallv on a 2-rank communicator where the other rank never posts (rank 0
/// sends 8 bytes to rank 1 only, so nothing of it can start before rank 1 posts).
fn stuck_post(seq: u64, members: Vec<u32>, world: Vec<u32>) -> wire::PostDesc {
    let g = alias_mkey::host::Registrar::new().register(0x1000, 16, Rights::READ_WRITE);
    let mut d = desc(
        CommId { leader: 0, id: 77 },
        seq,
        0,
        members,
        0,
        g.clone(),
        g,
        (vec![0, 8], vec![0, 8], vec![0, 8], vec![0, 8]),
    );
    d.slot = None;
    d.world_ranks = world;
    d
}

/// A post of `kind` by world rank `rank` (its comm rank) on a communicator of all `world` ranks
/// of the job, every one served by SP 0, with empty blocks in grant `g`: laid out as the kind's
/// facts say (`bootstrap::kinds`; a rooted kind's root is rank 0, a staged kind's design flat).
fn wide_post(
    kind: wire::CollKind,
    world: u32,
    rank: u32,
    seq: u64,
    id: u32,
    g: &alias_mkey::Grant,
) -> wire::PostDesc {
    let f = kind.facts();
    let p = world as usize;
    let (s, r) = (f.send_blocks.entries(p), f.recv_blocks.entries(p));
    let mut d = desc(
        CommId { leader: 0, id },
        seq,
        rank,
        vec![0; p],
        0,
        g.clone(),
        g.clone(),
        (vec![0; s], vec![0; s], vec![0; r], vec![0; r]),
    );
    d.kind = kind;
    d.slot = None;
    d.token = seq + 1;
    d.world_ranks = (0..world).collect();
    if f.lists_nodes {
        d.nodes = vec![0; p];
    }
    if f.posts_staged_fields() {
        d.staged = Some(wire::Staged {
            root: 0,
            design: wire::StagedDesign::Flat,
            segment: None,
        });
    }
    if f.reduces {
        d.reduce = Some(algorithms::allreduce::Reduce {
            op: algorithms::allreduce::Op::Bor,
            elem: algorithms::allreduce::Elem::U8,
        });
    }
    d
}

/// A rank (world rank 0 of 1, at the SP of `SOCK` with `CRED`) with its post ring as the shim
/// makes it: 4 mailbox slots inside, `arena_chunks` chunks of arena, and the ring said to be
/// mapped at `rank_base` (0: not said; the attacks may lie).
struct RingRank {
    _ch: Channel<UnixStream>,
    _fd: std::os::fd::OwnedFd,
    producer: bootstrap::post_ring::Producer,
    /// The ring's real mapping here, and the shape as offered.
    base: *mut u8,
    shape: bootstrap::post_ring::RingShape,
    reg: alias_mkey::host::Registrar,
}

impl RingRank {
    /// Says hello, registers with the ring's memfd beside the frame, and checks that the SP
    /// reads the ring (and takes sides from the arena, if one is offered); `None` after
    /// saying why not.
    fn register(arena_chunks: u32, rank_base: u64) -> Option<RingRank> {
        use bootstrap::post_ring::RingShape;
        use std::os::fd::AsRawFd;
        let (ch, out) = hello_as(&var("SOCK"), var("CRED"), 0, 1);
        let Some(mut ch) = ch else {
            say(out);
            return None;
        };
        let shape = RingShape {
            mailbox_slots: 4,
            arena_chunks,
            ..RingShape::default()
        };
        let seals = nix::fcntl::SealFlag::F_SEAL_SHRINK
            | nix::fcntl::SealFlag::F_SEAL_GROW
            | nix::fcntl::SealFlag::F_SEAL_SEAL;
        let (fd, producer, base) = crate::common::make_ring(shape, shape.bytes(), seals);
        let shape = RingShape { rank_base, ..shape };
        let mut reg = alias_mkey::host::Registrar::new();
        let mailbox = reg.register(
            Self::mailbox_at(base, &shape) as u64,
            4 * mailbox::SLOT_BYTES,
            Rights::READ_WRITE,
        );
        let frame = wire::encode(&HostToSp::Register {
            cores: vec![],
            mailbox,
            mailbox_slots: 4,
            post_ring: Some(shape),
        });
        crate::common::send_with_raw_fds(ch.get_ref(), &frame, &[fd.as_raw_fd()]);
        match ch.recv::<SpToHost>() {
            Ok(SpToHost::Registered {
                post_ring_off: None,
                arena_off,
                ..
            }) if arena_off.is_none() || arena_chunks == 0 => {}
            other => {
                say(format!("NOT-TAKEN {other:?}"));
                return None;
            }
        }
        Some(RingRank {
            _ch: ch,
            _fd: fd,
            producer,
            base,
            shape,
            reg,
        })
    }

    fn mailbox_at(base: *mut u8, shape: &bootstrap::post_ring::RingShape) -> *mut u8 {
        // SAFETY: the mailbox lies inside the ring's mapping, which stays for good.
        unsafe { base.add(shape.mailbox_offset()) }
    }

    /// A 1-rank alltoallv of `recv.len()` bytes from `send` (an address of this process,
    /// granted as given) into `recv`, posted through the ring with mailbox slot `slot`: the
    /// status its completion carries, `None` if none came within 10 s.
    fn alltoallv(&mut self, slot: u32, send: u64, recv: &[u8]) -> Option<u32> {
        let len = recv.len() as u64;
        let sg = self.reg.register(send, len, Rights::READ);
        let rg = self.reg.register(recv.as_ptr() as u64, len, Rights::WRITE);
        let mut d = desc(
            CommId { leader: 0, id: 5 },
            slot as u64,
            0,
            vec![0],
            slot,
            sg,
            rg,
            (vec![len], vec![0], vec![len], vec![0]),
        );
        d.world_ranks = vec![0];
        d.token = 7 + slot as u64;
        let f = wire::encode(&HostToSp::Post(Box::new(d)));
        assert!(self.producer.push(0, &f[4..]));
        let mb = Self::mailbox_at(self.base, &self.shape);
        let token = mb.wrapping_add(mailbox::slot_offset(slot) as usize) as *const u64;
        let t = Instant::now();
        // SAFETY: the slot's token word, written by the SP through its own mapping.
        while unsafe { std::ptr::read_volatile(token) } != 7 + slot as u64 {
            if t.elapsed() > Duration::from_secs(10) {
                return None;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        // SAFETY: the status word of the same slot.
        Some(unsafe { std::ptr::read_volatile(token.cast::<u8>().add(8).cast::<u32>()) })
    }
}

/// The attacker subprocess: what `SPOFF_ATTACK` names, or nothing without it.
pub fn run() {
    let Ok(mode) = std::env::var("SPOFF_ATTACK") else {
        return;
    };
    let n = |k: &str| var(k).parse::<u64>().unwrap();
    match mode.as_str() {
        // Hello with the given credential, then close without goodbye.
        "hello" => {
            let (_, out) = hello_as(
                &var("SOCK"),
                var("CRED"),
                n("RANK") as u32,
                n("SIZE") as u32,
            );
            say(out);
        }
        // A bad post, and the connection closed at once, many times.
        "bad-post-then-close" => {
            for i in 0..n("TIMES") {
                let Some(mut ch) = registered(&var("SOCK"), var("CRED"), 0, 1, 0) else {
                    return;
                };
                let mut d = stuck_post(i, vec![0], vec![0]);
                d.send_counts = vec![1 << 40];
                ch.send(&HostToSp::Post(Box::new(d))).unwrap();
                drop(ch);
            }
            say("DONE");
        }
        // Posts that can never complete, as many as asked for: rank 1 of the job is connected
        // to its SP (so the job is there) and never posts.
        "flood-posts" => {
            let Some(mut ch) = registered(&var("SOCK"), var("CRED"), 0, 2, 0) else {
                return;
            };
            // Rank 1 is the only rank of node 1 (SOCK1 is its SP); it stays connected.
            let Some(_other) = registered(&var("SOCK1"), var("CRED"), 1, 2, 1) else {
                return;
            };
            let other_sp = n("OTHER_SP") as u32;
            for i in 0..n("POSTS") {
                let d = stuck_post(i, vec![0, other_sp], vec![0, 1]);
                if ch.send(&HostToSp::Post(Box::new(d))).is_err() {
                    break;
                }
            }
            // Count the refusals that came back.
            ch.get_ref()
                .set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            let mut refused = 0;
            let mut first = None;
            while let Ok(m) = ch.recv::<SpToHost>() {
                if let SpToHost::Error { message, .. } = m {
                    refused += 1;
                    first.get_or_insert(message);
                }
            }
            say(format!("REFUSED {refused}"));
            say(format!("FIRST {}", first.unwrap_or_default()));
        }
        // A rank with its post ring (mailbox inside, as the shim makes it): a 1-rank
        // alltoallv of random bytes posted through the ring, its completion awaited in the
        // ring's mailbox, the bytes checked.
        "ring-post" => {
            let Some(mut rank) = RingRank::register(0, 0) else {
                return;
            };
            let seed = n("SEED");
            let send: Vec<u8> = (0..4096u64)
                .map(|i| (i.wrapping_mul(seed) >> 3) as u8)
                .collect();
            let recv = vec![0u8; 4096];
            let Some(status) = rank.alltoallv(0, send.as_ptr() as u64, &recv) else {
                return say("NO-COMPLETION");
            };
            let same = crate::common::read_back(&recv) == send;
            say(format!("RING-DONE status {status} same {same}"));
        }
        // A rank with an arena that lies about where it mapped its ring (`rank_base`, an
        // address where it has nothing): its grant inside the claimed arena is served from its
        // own memfd (the bytes it wrote there), and a grant straddling the claimed arena's
        // start is an ordinary grant of memory it does not have (the copy fails, the rank
        // learns it). Two 1-rank alltoallvs through the ring; the SP's answers printed.
        "arena-lie" => {
            use bootstrap::post_ring::ARENA_SIDE_BYTES;
            // The lie: a page-aligned address far from anything mapped here.
            let lie = 0x3f00_0000_0000u64;
            let Some(mut rank) = RingRank::register(1, lie) else {
                return;
            };
            let seed = n("SEED");
            let len = ARENA_SIDE_BYTES;
            let pattern: Vec<u8> = (0..len)
                .map(|i| (i.wrapping_mul(seed) >> 5) as u8)
                .collect();
            // SAFETY: the arena's first side holds `len` bytes of the ring's mapping, which
            // stays for good.
            unsafe {
                let arena = rank.base.add(rank.shape.arena_offset());
                std::ptr::copy_nonoverlapping(pattern.as_ptr(), arena, len as usize)
            };
            let claimed = lie + rank.shape.arena_offset() as u64;
            let mut lines = vec![];
            for (i, (addr, glen)) in [(claimed, len), (claimed - 8, 16)].into_iter().enumerate() {
                let recv = vec![0u8; glen as usize];
                let Some(status) = rank.alltoallv(i as u32, addr, &recv) else {
                    return say("NO-COMPLETION");
                };
                let got = crate::common::read_back(&recv);
                let what = if got == pattern {
                    "its-memfd"
                } else if got.iter().all(|&b| b == 0) {
                    "nothing"
                } else {
                    "other"
                };
                lines.push(format!("post {i} status {status} got {what}"));
            }
            say(lines.join("; "));
        }
        // Register, fork a child that keeps the socket, exit: the SP must drop the connection
        // (the process it served is gone, and its pid may be another process's tomorrow).
        "fork-and-exit" => {
            let Some(ch) = registered(&var("SOCK"), var("CRED"), 0, 1, 0) else {
                return;
            };
            // SAFETY: fork in this single-threaded attacker (the test harness runs one test,
            // on one thread); the child only uses the socket and exits.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // The child: wait for the parent to exit, then for the SP to close.
                std::thread::sleep(Duration::from_millis(200));
                let s = ch.get_ref();
                s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
                let mut b = [0u8; 64];
                let verdict = match (&*s).read(&mut b) {
                    Ok(0) => "CLOSED",
                    Ok(_) => "DATA",
                    Err(_) => "OPEN",
                };
                let _ = std::fs::write(var("OUT"), verdict);
                // SAFETY: leaves the forked child at once.
                unsafe { libc::_exit(0) };
            }
            say("PARENT-EXITS");
            // SAFETY: exit without dropping the connection (the child holds it).
            unsafe { libc::_exit(0) };
        }
        // Pose as a peer SP with the public fingerprint and a forged proof.
        "impostor-sp" => {
            let s = std::net::TcpStream::connect(var("ADDR")).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut ch = Channel::new(s);
            ch.send_hello(&Hello::Sp(SpHello {
                sp: n("AS_SP") as u32,
                cluster_fingerprint: n("FINGERPRINT"),
                nonce: auth::nonce(),
            }))
            .unwrap();
            match ch.recv_hello() {
                Ok(Hello::SpWelcome { .. }) => {
                    ch.send_hello(&Hello::SpProof { proof: [0x42; 32] })
                        .unwrap();
                    match ch.recv_hello() {
                        Ok(Hello::Reject { reason }) => say(format!("REJECT {reason}")),
                        Ok(other) => say(format!("ACCEPTED {other:?}")),
                        Err(e) => say(format!("CLOSED {e}")),
                    }
                }
                Ok(Hello::Reject { reason }) => say(format!("REJECT {reason}")),
                Ok(other) => say(format!("OTHER {other:?}")),
                Err(e) => say(format!("CLOSED {e}")),
            }
        }
        // An admin request without the key.
        "stats-without-key" => {
            let s = UnixStream::connect(var("SOCK")).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut ch = Channel::new(s);
            let (nonce, unix_secs) = (auth::nonce(), auth::unix_secs());
            ch.send_hello(&Hello::Admin(AdminHello {
                nonce,
                unix_secs,
                proof: auth::admin_proof(&ClusterKey::generate(), 0, &nonce, unix_secs),
            }))
            .unwrap();
            match ch.recv_hello() {
                Ok(Hello::Reject { reason }) => say(format!("REJECT {reason}")),
                Ok(other) => say(format!("OTHER {other:?}")),
                Err(e) => say(format!("CLOSED-OR-DATA {e}")),
            }
        }
        // Undecodable frames after a good hello, and hellos that fail, many of them.
        "log-flood" => {
            let (ch, out) = hello_as(&var("SOCK"), var("CRED"), 0, 1);
            let Some(ch) = ch else {
                say(out);
                return;
            };
            let mut s = ch.get_ref().try_clone().unwrap();
            let junk = wire::frame(&[0xff; 16]);
            for _ in 0..n("FRAMES") {
                if s.write_all(&junk).is_err() {
                    break;
                }
            }
            for _ in 0..n("HELLOS") {
                let _ = hello_as(&var("SOCK"), "spoffjob1:1:0:1:00".into(), 0, 1);
            }
            say("DONE");
        }
        // Connect and say nothing: when does the SP close?
        "silent" => {
            let mut s = UnixStream::connect(var("SOCK")).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let t = Instant::now();
            let mut b = [0u8; 8];
            let r = s.read(&mut b);
            say(format!("CLOSED-AFTER-MS {} {r:?}", t.elapsed().as_millis()));
        }
        // Many connections without a hello at once: how many does the SP drop at once?
        "many-silent" => {
            let conns: Vec<UnixStream> = (0..n("CONNS"))
                .filter_map(|_| UnixStream::connect(var("SOCK")).ok())
                .collect();
            std::thread::sleep(Duration::from_millis(300));
            let mut closed = 0;
            for mut c in conns {
                c.set_nonblocking(true).unwrap();
                let mut b = [0u8; 8];
                if matches!(c.read(&mut b), Ok(0)) {
                    closed += 1;
                }
            }
            say(format!("CLOSED {closed}"));
        }
        // Many connections that never say hello (issue 24, items 5 and 6): `CONNS` to each
        // target of `TARGETS` (`unix:PATH` or `tcp:ADDR`, comma-separated), each sending the
        // 4-byte length `HEADER` and `SEND` bytes of that frame's payload if given (else
        // nothing); `READY n` once they are open, then, for `HOLD_MS`, every closed one is
        // opened again (with `REFILL`) and `GROW` more are opened to each target every 100 ms.
        "flood" => {
            let targets: Vec<String> = var("TARGETS").split(',').map(String::from).collect();
            let opt = |k: &str| std::env::var(k).ok().map(|v| v.parse::<u64>().unwrap());
            let (conns, hold) = (n("CONNS"), Duration::from_millis(n("HOLD_MS")));
            let (header, send) = (opt("HEADER"), opt("SEND").unwrap_or(0));
            let (refill, grow) = (opt("REFILL").unwrap_or(0) > 0, opt("GROW").unwrap_or(0));
            let open = |t: &str| -> Option<FloodConn> {
                let mut c = if let Some(p) = t.strip_prefix("unix:") {
                    FloodConn::Unix(UnixStream::connect(p).ok()?)
                } else {
                    let a = t.strip_prefix("tcp:").expect("unix:PATH or tcp:ADDR");
                    FloodConn::Tcp(std::net::TcpStream::connect(a).ok()?)
                };
                if let Some(len) = header {
                    c.set_write_timeout(Duration::from_secs(2));
                    let mut bytes = (len as u32).to_le_bytes().to_vec();
                    bytes.resize(4 + send as usize, 0x5a);
                    // Refused and closed by the SP at any point: that is its right.
                    let _ = c.write_all(&bytes);
                }
                c.set_nonblocking();
                Some(c)
            };
            let mut held: Vec<(usize, Option<FloodConn>)> = vec![];
            for (i, t) in targets.iter().enumerate() {
                for _ in 0..conns {
                    held.push((i, open(t)));
                }
            }
            let opened = held.iter().filter(|h| h.1.is_some()).count();
            say(format!("READY {opened}"));
            let (t0, mut reopened, mut last_grow) = (Instant::now(), 0u64, Instant::now());
            while t0.elapsed() < hold {
                std::thread::sleep(Duration::from_millis(20));
                if refill {
                    for (i, c) in held.iter_mut() {
                        if c.as_mut().is_none_or(|c| c.closed()) {
                            *c = open(&targets[*i]);
                            reopened += 1;
                        }
                    }
                }
                if grow > 0 && last_grow.elapsed() >= Duration::from_millis(100) {
                    last_grow = Instant::now();
                    for (i, t) in targets.iter().enumerate() {
                        for _ in 0..grow {
                            held.push((i, open(t)));
                        }
                    }
                }
            }
            say(format!("DONE reopened {reopened} held {}", held.len()));
        }
        // Issue 24, item 7: a captured job credential replayed over TCP (`ADDR`): a hello
        // as rank `RANK` of `SIZE` on node `NODE` (local rank `LOCAL`), a goodbye at once if
        // welcomed, then the connection closed, as a rank that leaves politely.
        "tcp-hello-goodbye" => {
            let s = std::net::TcpStream::connect(var("ADDR")).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut ch = Channel::new(s);
            ch.send_hello(&Hello::Host(HostHello {
                credential: var("CRED"),
                world_rank: n("RANK") as u32,
                world_size: n("SIZE") as u32,
                node: n("NODE") as u32,
                local_rank: n("LOCAL") as u32,
                pid: 0,
            }))
            .unwrap();
            match ch.recv_hello() {
                Ok(Hello::Welcome { sp }) => {
                    ch.send(&HostToSp::Goodbye).unwrap();
                    say(format!("WELCOME {sp}"));
                }
                Ok(Hello::Reject { reason }) => say(format!("REJECT {reason}")),
                Ok(other) => say(format!("OTHER {other:?}")),
                Err(e) => say(format!("CLOSED {e}")),
            }
        }
        // Issue 24, item 8: bytes captured on the wire (`BYTES`, hex) sent again as they were
        // to `ADDR` (TCP): is the request answered?
        "replay-bytes" => {
            let hex = var("BYTES");
            let bytes: Vec<u8> = (0..hex.len() / 2)
                .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
                .collect();
            let mut s = std::net::TcpStream::connect(var("ADDR")).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.write_all(&bytes).unwrap();
            let mut ch = Channel::new(s);
            match ch.recv_raw() {
                Ok(p) if p.starts_with(&wire::MAGIC) => match wire::decode_hello(&p) {
                    Ok(Hello::Reject { reason }) => say(format!("REJECT {reason}")),
                    other => say(format!("OTHER {other:?}")),
                },
                Ok(p) => match wire::decode::<String>(&p) {
                    Ok(json) => say(format!("ANSWERED {json}")),
                    Err(e) => say(format!("OTHER {e}")),
                },
                Err(e) => say(format!("CLOSED {e}")),
            }
        }
        // Issue 24, item 3: staged broadcasts that never complete, as many as asked for, from
        // rank 0 (the root) of a 2-rank job whose rank 1 (on the same SP) stays connected and
        // never posts; the answers are counted, then the connections are held until the file
        // HOLD_UNTIL exists.
        "hold-bcasts" => {
            let sock = var("SOCK");
            let Some(mut ch) = registered(&sock, var("CRED"), 0, 2, 0) else {
                return;
            };
            let Some(_other) = registered(&sock, var("CRED"), 1, 2, 0) else {
                return;
            };
            let data: &'static [u8] = Box::leak(vec![7u8; 64].into_boxed_slice());
            let mut reg = alias_mkey::host::Registrar::new();
            for i in 0..n("POSTS") {
                let mut d = desc(
                    CommId { leader: 0, id: 78 },
                    i,
                    0,
                    vec![0, 0],
                    0,
                    reg.register(data.as_ptr() as u64, 64, Rights::READ),
                    reg.register(data.as_ptr() as u64, 0, Rights::WRITE),
                    (vec![64], vec![0], vec![0], vec![0]),
                );
                d.kind = wire::CollKind::Bcast;
                d.slot = None;
                d.token = i + 1;
                d.world_ranks = vec![0, 1];
                d.nodes = vec![0, 0];
                d.staged = Some(wire::Staged {
                    root: 0,
                    design: wire::StagedDesign::Flat,
                    segment: None,
                });
                ch.send(&HostToSp::Post(Box::new(d))).unwrap();
            }
            // The sentinel: a post of another communicator refused at once (a second receive
            // block), answered after every post above.
            let mut bad = stuck_post(0, vec![0, 0], vec![0, 1]);
            bad.comm = CommId { leader: 0, id: 79 };
            bad.recv_counts.push(0);
            bad.recv_displs.push(0);
            ch.send(&HostToSp::Post(Box::new(bad))).unwrap();
            ch.get_ref()
                .set_read_timeout(Some(Duration::from_secs(60)))
                .unwrap();
            let (mut refused, mut ok, mut failed, mut first) = (0, 0, 0, String::new());
            loop {
                match ch.recv::<SpToHost>() {
                    Ok(SpToHost::Error {
                        comm: Some(CommId { leader: 0, id: 79 }),
                        ..
                    }) => break,
                    Ok(SpToHost::Error { message, .. }) => {
                        refused += 1;
                        if first.is_empty() {
                            first = message;
                        }
                    }
                    Ok(SpToHost::Completed { status, .. }) if status == mailbox::STATUS_OK => {
                        ok += 1
                    }
                    Ok(SpToHost::Completed { .. }) => failed += 1,
                    Ok(_) => {}
                    Err(e) => {
                        say(format!("LOST {e}"));
                        break;
                    }
                }
            }
            // Completions so far (the roots' may come later); refusals: all of them.
            say(format!("HELD ok {ok} failed {failed} refused {refused}"));
            say(format!("FIRST-REFUSAL {first}"));
            // Hold the job's collectives until the test is done with its own job (at most 60 s).
            let t = Instant::now();
            let until = std::path::PathBuf::from(var("HOLD_UNTIL"));
            while !until.exists() && t.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // Issue 24, item 4: alltoallv posts on a communicator of all WORLD ranks of the job (the
        // credential's world size), every one served by this SP, which only rank 0 ever posts:
        // each instance waits for ranks that never come. Once the SP has taken them in (a
        // bad post at the end is answered after them), the SP's resident memory (SP_PID) is
        // said, and the connection closed.
        "wide-posts" => {
            let world = n("WORLD") as u32;
            let Some(mut ch) = registered(&var("SOCK"), var("CRED"), 0, world, 0) else {
                return;
            };
            let mut reg = alias_mkey::host::Registrar::new();
            let g = reg.register(0x1000, 16, Rights::READ_WRITE);
            // KIND: the name of a kind (`KindFacts::name`; alltoallv when unset).
            let name = std::env::var("KIND").unwrap_or_else(|_| "alltoallv".into());
            let kind = wire::CollKind::all()
                .find(|k| k.facts().name == name)
                .unwrap_or_else(|| panic!("KIND={name}: no such kind"));
            let post = |seq: u64, id: u32| wide_post(kind, world, 0, seq, id, &g);
            let t = Instant::now();
            for i in 0..n("POSTS") {
                ch.send(&HostToSp::Post(Box::new(post(i, 79)))).unwrap();
            }
            // The sentinel: refused (counts of another length), answered after every post.
            let mut bad = post(0, 80);
            bad.send_counts.pop();
            ch.send(&HostToSp::Post(Box::new(bad))).unwrap();
            ch.get_ref()
                .set_read_timeout(Some(Duration::from_secs(60)))
                .unwrap();
            let (mut refused, mut first) = (0, String::new());
            loop {
                match ch.recv::<SpToHost>() {
                    Ok(SpToHost::Error { comm, message, .. }) => {
                        if comm == Some(CommId { leader: 0, id: 80 }) {
                            break;
                        }
                        refused += 1;
                        if first.is_empty() {
                            first = message;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        say(format!("LOST {e}"));
                        break;
                    }
                }
            }
            let rss = crate::common::procfs::rss_kib(n("SP_PID") as u32).unwrap_or(0);
            say(format!(
                "TAKEN-IN refused {refused} rss_kib {rss} in_ms {}",
                t.elapsed().as_millis()
            ));
            say(format!("FIRST-REFUSAL {first}"));
        }
        // Issue 24, item 4: wide alltoallv posts (see `wide_post`) from several connections at
        // once: world ranks RANKS (comma-separated) of the job of CRED, then RANKS2 of the job of
        // CRED2 (both of WORLD ranks), POSTS each, one connection after the other while all
        // stay open; for each, the posts refused and the first refusal.
        "wide-posts-jobs" => {
            let world = n("WORLD") as u32;
            let mut reg = alias_mkey::host::Registrar::new();
            let g = reg.register(0x1000, 16, Rights::READ_WRITE);
            let mut conns = vec![];
            for (cred, ranks) in [("CRED", "RANKS"), ("CRED2", "RANKS2")] {
                let Ok(list) = std::env::var(ranks) else {
                    continue;
                };
                for r in list.split(',').map(|r| r.parse::<u32>().unwrap()) {
                    let Some(ch) = registered(&var("SOCK"), var(cred), r, world, 0) else {
                        return;
                    };
                    conns.push((format!("{cred}:{r}"), r, ch));
                }
            }
            for (name, r, ch) in conns.iter_mut() {
                for i in 0..n("POSTS") {
                    let d = wide_post(wire::CollKind::Alltoallv, world, *r, i, 81, &g);
                    ch.send(&HostToSp::Post(Box::new(d))).unwrap();
                }
                let mut bad = wide_post(wire::CollKind::Alltoallv, world, *r, 0, 82, &g);
                bad.send_counts.pop();
                ch.send(&HostToSp::Post(Box::new(bad))).unwrap();
                ch.get_ref()
                    .set_read_timeout(Some(Duration::from_secs(60)))
                    .unwrap();
                let (mut refused, mut first) = (0, String::new());
                loop {
                    match ch.recv::<SpToHost>() {
                        Ok(SpToHost::Error { comm, message, .. }) => {
                            if comm == Some(CommId { leader: 0, id: 82 }) {
                                break;
                            }
                            refused += 1;
                            if first.is_empty() {
                                first = message;
                            }
                        }
                        Ok(_) => {}
                        Err(e) => {
                            say(format!("LOST {e}"));
                            break;
                        }
                    }
                }
                say(format!("{name} refused {refused}: {first}"));
            }
        }
        other => panic!("unknown attack {other}"),
    }
}

/// A connection of the `flood` attack.
enum FloodConn {
    Unix(UnixStream),
    Tcp(std::net::TcpStream),
}

impl FloodConn {
    fn set_write_timeout(&self, t: Duration) {
        let _ = match self {
            FloodConn::Unix(s) => s.set_write_timeout(Some(t)),
            FloodConn::Tcp(s) => s.set_write_timeout(Some(t)),
        };
    }

    fn set_nonblocking(&self) {
        let _ = match self {
            FloodConn::Unix(s) => s.set_nonblocking(true),
            FloodConn::Tcp(s) => s.set_nonblocking(true),
        };
    }

    fn write_all(&mut self, b: &[u8]) -> std::io::Result<()> {
        match self {
            FloodConn::Unix(s) => s.write_all(b),
            FloodConn::Tcp(s) => s.write_all(b),
        }
    }

    /// Whether the SP closed it (read on a nonblocking socket: end of stream or an error).
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 256];
        let r = match self {
            FloodConn::Unix(s) => s.read(&mut b),
            FloodConn::Tcp(s) => s.read(&mut b),
        };
        match r {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        }
    }
}

/// An attacker running alongside the test (see [`attack_spawn`]).
#[allow(dead_code)]
pub struct Running {
    pub child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

#[allow(dead_code)]
impl Running {
    /// The next `ATTACK:` line, if one comes within `t`.
    pub fn line(&self, t: Duration) -> Option<String> {
        self.lines.recv_timeout(t).ok()
    }

    /// Waits for the attacker to end; its remaining `ATTACK:` lines.
    pub fn finish(mut self) -> Vec<String> {
        let _ = self.child.wait();
        self.lines.try_iter().collect()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// As [`attack`], but returns at once: the attacker runs alongside the test, its `ATTACK:`
/// lines come through [`Running::line`].
#[allow(dead_code)]
pub fn attack_spawn(mode: &str, vars: &[(&str, String)], uid: Option<u32>) -> Running {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "attacker_process",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("SPOFF_ATTACK", mode)
    .stdout(std::process::Stdio::piped());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    if let Some(uid) = uid {
        cmd.uid(uid).gid(uid);
    }
    let mut child = cmd.spawn().expect("the attacker process runs");
    let out = child.stdout.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if let Some((_, a)) = l.split_once("ATTACK: ") {
                if tx.send(a.to_string()).is_err() {
                    return;
                }
            }
        }
    });
    Running { child, lines }
}
