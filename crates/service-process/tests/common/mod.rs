//! A test harness that starts real SP processes (`service-process serve`) and plays host ranks
//! from the test process itself: each "rank" is its own Unix connection with its own mailbox,
//! and its buffers live in this process, which the SPs read and write with CMA exactly as they
//! would a real MPI rank.
#![allow(dead_code)]

pub mod alltoallv;
// `/proc` readings, SplitMix64 and the seed, shared with the workspace's integration tests
// (whose crate this one cannot depend on).
#[path = "../../../../tests/src/procfs.rs"]
pub mod procfs;
#[path = "../../../../tests/src/splitmix.rs"]
mod splitmix;
pub use splitmix::Rng;

use algorithms::CommId;
use alias_mkey::host::Registrar;
use alias_mkey::{Grant, Rights};
use bootstrap::auth::{ClusterKey, JobCredential};
use bootstrap::mailbox;
use bootstrap::post_ring::RingShape;
use bootstrap::wire::{
    Channel, CollKind, ErrorCode, Hello, HostHello, HostToSp, PostDesc, SpToHost,
};
use bootstrap::{Cluster, Layout};
use service_process::launch::{self, Sp, SpSetSpec};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub struct SpSet {
    pub sps: Vec<Sp>,
    pub cluster: Cluster,
    /// The cluster key the launcher code wrote (the tests issue job credentials with it).
    pub key: ClusterKey,
    pub cluster_path: PathBuf,
    pub run_dir: PathBuf,
    pub lines: mpsc::Receiver<(u32, String)>,
}

impl SpSet {
    pub fn start(nodes: u32, sps_per_node: u32, ranks_per_node: u32, layout: Layout) -> SpSet {
        Self::start_with(nodes, sps_per_node, ranks_per_node, layout, &[])
    }

    /// As `start`, then every rank of a new job (`nodes * ranks_per_node` of them) connected,
    /// in world-rank order.
    pub fn start_job(
        nodes: u32,
        sps_per_node: u32,
        ranks_per_node: u32,
        layout: Layout,
    ) -> (SpSet, Vec<Host>) {
        let set = Self::start(nodes, sps_per_node, ranks_per_node, layout);
        let hosts = Host::connect_all(&set, new_job(), nodes * ranks_per_node);
        (set, hosts)
    }

    /// As `start`, with more `serve` arguments for every SP.
    pub fn start_with(
        nodes: u32,
        sps_per_node: u32,
        ranks_per_node: u32,
        layout: Layout,
        serve_args: &[&str],
    ) -> SpSet {
        Self::start_each(nodes, sps_per_node, ranks_per_node, layout, serve_args, &[])
    }

    /// As `start_with`, plus `serve` arguments for single SPs: (SP id, argument).
    pub fn start_each(
        nodes: u32,
        sps_per_node: u32,
        ranks_per_node: u32,
        layout: Layout,
        serve_args: &[&str],
        sp_args: &[(usize, &str)],
    ) -> SpSet {
        let exe = PathBuf::from(env!("CARGO_BIN_EXE_service-process"));
        let run_dir = launch::new_run_dir().unwrap();
        let (tx, rx) = mpsc::channel();
        let spec = SpSetSpec {
            extra_args: serve_args.iter().map(|a| a.to_string()).collect(),
            sp_args: sp_args.iter().map(|&(sp, a)| (sp, a.to_string())).collect(),
            ..sp_set_spec(nodes, sps_per_node, ranks_per_node, layout)
        };
        let (path, mut sps) = launch::spawn_sps(&exe, &spec, &run_dir, tx).unwrap();
        launch::wait_ready(&mut sps, &rx, Duration::from_secs(30), None).unwrap();
        let cluster = Cluster::load(&path).unwrap();
        let key = ClusterKey::load(&launch::key_path(&path)).unwrap();
        SpSet {
            sps,
            cluster,
            key,
            cluster_path: path,
            run_dir,
            lines: rx,
        }
    }

    /// Every host says goodbye; once the SPs had time to take that in, [`Self::stop_and_stats`].
    pub fn stats_after_goodbyes(&mut self, hosts: Vec<Host>) -> Vec<serde_json::Value> {
        for h in hosts {
            h.goodbye();
        }
        std::thread::sleep(Duration::from_millis(100));
        self.stop_and_stats()
    }

    /// Stops every SP (SIGTERM) and returns the counters each printed at exit, by SP id.
    pub fn stop_and_stats(&mut self) -> Vec<serde_json::Value> {
        launch::stop_sps(&mut self.sps, Duration::from_secs(5));
        let mut stats = vec![serde_json::Value::Null; self.sps.len()];
        while let Ok((id, line)) = self.lines.recv_timeout(Duration::from_millis(200)) {
            if let Some(json) = line.strip_prefix("STATS ") {
                stats[id as usize] = serde_json::from_str(json).unwrap();
            }
        }
        assert!(
            stats.iter().all(|s| !s.is_null()),
            "an SP printed no stats: {stats:?}"
        );
        stats
    }

    pub fn kill(&mut self, sp: u32) {
        let c = &mut self.sps[sp as usize].child;
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// True while SP `sp` is still running.
    pub fn alive(&mut self, sp: u32) -> bool {
        matches!(self.sps[sp as usize].child.try_wait(), Ok(None))
    }
}

impl Drop for SpSet {
    fn drop(&mut self) {
        launch::stop_sps(&mut self.sps, Duration::from_secs(3));
        let _ = std::fs::remove_dir_all(&self.run_dir);
    }
}

static NEXT_JOB: AtomicU64 = AtomicU64::new(1);

pub fn new_job() -> u64 {
    (std::process::id() as u64) << 20 | NEXT_JOB.fetch_add(1, Ordering::Relaxed)
}

/// One emulated host rank.
pub struct Host {
    pub ch: Channel<UnixStream>,
    pub world_rank: u32,
    pub sp: u32,
    /// Leaked on purpose, as the shim keeps its mailbox mapped for good: an SP that has not yet
    /// seen a host go may still write a completion into it, and freed memory would take that
    /// write into the allocator's own data.
    mailbox: &'static [u64],
    pub reg: Registrar,
    /// When set, buffers are granted through UCX (and the worker is progressed while waiting).
    pub ucx: Option<std::rc::Rc<std::cell::RefCell<alias_mkey::host::UcxRegistrar>>>,
    next_token: u64,
    /// Receive grants (address, length) of posts with `host_copies`, by token.
    copy_targets: std::collections::HashMap<u64, (u64, u64)>,
    /// `SpToHost::Copy` requests served by [`Host::serve_copies`].
    pub copies_served: u64,
    /// Completions by message read but not yet asked for: token -> status.
    completed: std::collections::HashMap<u64, u32>,
}

pub const SLOTS: u32 = 64;

/// Sends a `Register` of mailbox `grant` (`slots` slots, no cores) on a welcomed connection;
/// returns the SP's answer.
pub fn register<S: std::io::Read + std::io::Write>(
    ch: &mut Channel<S>,
    grant: Grant,
    slots: u32,
) -> SpToHost {
    ch.send(&HostToSp::Register {
        cores: vec![],
        mailbox: grant,
        mailbox_slots: slots,
        post_ring: None,
    })
    .unwrap();
    ch.recv::<SpToHost>().unwrap()
}

thread_local! {
    /// Descriptors [`Host::connect_offering_fds`] adds beside the ring's.
    static EXTRA_FDS: std::cell::RefCell<Vec<i32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Sends `frame` on `sock` with `fds` attached to its first byte (`SCM_RIGHTS`).
pub fn send_with_fds(sock: &UnixStream, frame: &[u8], fds: Vec<&std::os::fd::OwnedFd>) {
    use std::os::fd::AsRawFd;
    let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
    send_with_raw_fds(sock, frame, &raw);
}

/// [`send_with_fds`] of raw descriptors (borrowed: they stay open here).
pub fn send_with_raw_fds(sock: &UnixStream, frame: &[u8], raw: &[i32]) {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    use std::os::fd::AsRawFd;
    let iov = [std::io::IoSlice::new(frame)];
    let cmsg = [ControlMessage::ScmRights(raw)];
    let cmsgs: &[ControlMessage] = if raw.is_empty() { &[] } else { &cmsg };
    let n = sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None).unwrap();
    assert_eq!(n, frame.len(), "one sendmsg sends the whole frame");
}

/// Maps `len` bytes of `fd` shared, read-write, for good.
pub fn map_shared(fd: &std::os::fd::OwnedFd, len: usize) -> *mut u8 {
    use nix::sys::mman::{mmap, MapFlags, ProtFlags};
    // SAFETY: a new shared mapping of a file; no existing memory is affected.
    let base = unsafe {
        mmap(
            None,
            std::num::NonZeroUsize::new(len.max(1)).unwrap(),
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_SHARED,
            fd,
            0,
        )
    }
    .unwrap();
    base.as_ptr().cast()
}

/// A post ring as the shim makes one: a memfd of `len` bytes (sealed with `seals`), mapped
/// here for good; returns the descriptor, the producer writing into it (push only when `len`
/// is `shape.bytes()`) and the mapping's address (for writing what no producer would).
pub fn make_ring(
    shape: RingShape,
    len: usize,
    seals: nix::fcntl::SealFlag,
) -> (
    std::os::fd::OwnedFd,
    bootstrap::post_ring::Producer,
    *mut u8,
) {
    use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
    use nix::sys::mman::{mmap, MapFlags, ProtFlags};
    use std::os::fd::AsRawFd;
    let fd = memfd_create(
        c"test-post-ring",
        MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
    )
    .unwrap();
    nix::unistd::ftruncate(&fd, len as i64).unwrap();
    if !seals.is_empty() {
        nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_ADD_SEALS(seals)).unwrap();
    }
    // SAFETY: a new shared mapping of the whole file, never unmapped (leaked with the test).
    let base = unsafe {
        mmap(
            None,
            std::num::NonZeroUsize::new(len.max(1)).unwrap(),
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_SHARED,
            &fd,
            0,
        )
    }
    .unwrap();
    // SAFETY: page-aligned, zeroed, mapped for good; the only producer.
    let producer = unsafe { bootstrap::post_ring::Producer::new(base.as_ptr().cast(), shape) };
    (fd, producer, base.as_ptr().cast())
}

/// The message of `answer`, which must be an error reply with `code`; `what` names the case
/// in the panics.
pub fn refusal(answer: SpToHost, code: ErrorCode, what: &str) -> String {
    match answer {
        SpToHost::Error {
            code: got, message, ..
        } => {
            assert_eq!(got, code, "{what}: {message}");
            message
        }
        other => panic!("{what}: expected a refusal, got {other:?}"),
    }
}

impl Host {
    /// Connects as `world_rank` of a `world_size` job and registers a mailbox.
    pub fn connect(set: &SpSet, job: u64, world_rank: u32, world_size: u32) -> Host {
        let p = set.cluster.placement(world_rank, world_size).unwrap();
        Host::connect_placed(set, job, world_rank, world_size, p)
    }

    /// As [`Host::connect`], placed at `p` (its node, local rank and SP) instead of by the
    /// emulation layout.
    pub fn connect_placed(
        set: &SpSet,
        job: u64,
        world_rank: u32,
        world_size: u32,
        p: bootstrap::Placement,
    ) -> Host {
        match Host::connect_offering(set, job, world_rank, world_size, p, None) {
            (h, SpToHost::Registered { sp, .. }) => {
                assert_eq!(sp, p.sp);
                h
            }
            (_, other) => panic!("register answered with {other:?}"),
        }
    }

    /// As [`Host::connect_placed`], offering a post ring of `shape` with `fd` (if any) passed
    /// beside the `Register` frame, as the shim does; returns the host and the SP's answer to
    /// the registration.
    pub fn connect_offering(
        set: &SpSet,
        job: u64,
        world_rank: u32,
        world_size: u32,
        p: bootstrap::Placement,
        ring: Option<(RingShape, Option<&std::os::fd::OwnedFd>)>,
    ) -> (Host, SpToHost) {
        let path = &set.cluster.sp(p.sp).unwrap().host_socket;
        let s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut ch = Channel::new(s);
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        let credential = JobCredential::issue(&set.key, job, uid, world_size).encode();
        ch.send_hello(&Hello::Host(HostHello {
            credential,
            world_rank,
            world_size,
            node: p.node,
            local_rank: p.local_rank,
            pid: std::process::id(),
        }))
        .unwrap();
        assert_eq!(ch.recv_hello().unwrap(), Hello::Welcome { sp: p.sp });
        let words = (SLOTS as u64 * mailbox::SLOT_BYTES / 8) as usize;
        let mailbox: &'static [u64] = match ring {
            // The mailbox inside the ring, as the shim puts it: a mapping of its own here.
            Some((shape, Some(fd))) if shape.mailbox_slots > 0 => {
                assert_eq!(shape.mailbox_slots, SLOTS);
                let base = map_shared(fd, shape.bytes());
                // SAFETY: the mapping holds the mailbox at its offset and stays for good.
                unsafe {
                    std::slice::from_raw_parts(
                        base.add(shape.mailbox_offset()) as *const u64,
                        words,
                    )
                }
            }
            _ => Box::leak(vec![0u64; words].into_boxed_slice()),
        };
        let mut reg = Registrar::new();
        let grant = reg.register(
            mailbox.as_ptr() as u64,
            SLOTS as u64 * mailbox::SLOT_BYTES,
            Rights::READ_WRITE,
        );
        let answer = match ring {
            None => register(&mut ch, grant, SLOTS),
            Some((shape, fd)) => {
                let frame = bootstrap::wire::encode(&HostToSp::Register {
                    cores: vec![],
                    mailbox: grant,
                    mailbox_slots: SLOTS,
                    post_ring: Some(shape),
                });
                let mut all: Vec<i32> = fd
                    .into_iter()
                    .map(|f| {
                        use std::os::fd::AsRawFd;
                        f.as_raw_fd()
                    })
                    .collect();
                all.extend(EXTRA_FDS.with(|e| e.borrow().clone()));
                send_with_raw_fds(ch.get_ref(), &frame, &all);
                ch.recv::<SpToHost>().unwrap()
            }
        };
        let host = Host {
            ch,
            world_rank,
            sp: p.sp,
            mailbox,
            reg,
            ucx: None,
            next_token: 1,
            copy_targets: Default::default(),
            copies_served: 0,
            completed: Default::default(),
        };
        (host, answer)
    }

    /// As [`Host::connect_offering`] with every descriptor of `fds` passed beside the
    /// `Register` frame.
    pub fn connect_offering_fds(
        set: &SpSet,
        job: u64,
        world_rank: u32,
        world_size: u32,
        p: bootstrap::Placement,
        shape: RingShape,
        fds: Vec<&std::os::fd::OwnedFd>,
    ) -> (Host, SpToHost) {
        use std::os::fd::AsRawFd;
        let extra: Vec<i32> = fds.iter().skip(1).map(|f| f.as_raw_fd()).collect();
        EXTRA_FDS.with(|e| *e.borrow_mut() = extra);
        let ring = Some((shape, fds.first().copied()));
        let r = Host::connect_offering(set, job, world_rank, world_size, p, ring);
        EXTRA_FDS.with(|e| e.borrow_mut().clear());
        r
    }

    /// As [`Host::post_in_ring`], or `None` when the ring is full (the caller then posts on
    /// the socket, as the shim does).
    pub fn try_post_in_ring(
        &mut self,
        ring: &mut bootstrap::post_ring::Producer,
        sock_frames: u64,
        mut d: PostDesc,
    ) -> Option<(u32, u64)> {
        d.token = self.next_token;
        let frame = bootstrap::wire::encode(&HostToSp::Post(Box::new(d.clone())));
        if !ring.push(sock_frames, &frame[4..]) {
            return None;
        }
        self.next_token += 1;
        Some((d.slot.expect("the tests post with a mailbox slot"), d.token))
    }

    /// Fills in slot and token and writes the post into `ring` (as after `sock_frames` frames
    /// on the socket since the registration); returns (slot, token).
    pub fn post_in_ring(
        &mut self,
        ring: &mut bootstrap::post_ring::Producer,
        sock_frames: u64,
        mut d: PostDesc,
    ) -> (u32, u64) {
        let token = self.next_token;
        self.next_token += 1;
        d.token = token;
        let frame = bootstrap::wire::encode(&HostToSp::Post(Box::new(d.clone())));
        assert!(
            ring.push(sock_frames, &frame[4..]),
            "the post fits the ring"
        );
        (d.slot.expect("the tests post with a mailbox slot"), token)
    }

    /// Connects every rank of a `world_size` job, in world-rank order.
    pub fn connect_all(set: &SpSet, job: u64, world_size: u32) -> Vec<Host> {
        (0..world_size)
            .map(|r| Host::connect(set, job, r, world_size))
            .collect()
    }

    pub fn grant<T>(&mut self, buf: &[T], rights: Rights) -> Grant {
        let (addr, len) = (buf.as_ptr() as u64, std::mem::size_of_val(buf) as u64);
        match &self.ucx {
            // SAFETY: the tests keep every granted buffer alive until its collective completed
            // and never free a buffer while a registration of it is cached and in use.
            Some(u) => unsafe { u.borrow_mut().register(addr, len, rights) }.expect("ucx grant"),
            None => self.reg.register(addr, len, rights),
        }
    }

    /// Fills in slot and token and posts; returns (slot, token).
    pub fn post(&mut self, mut d: PostDesc) -> (u32, u64) {
        let token = self.next_token;
        self.next_token += 1;
        d.token = token;
        if d.host_copies {
            self.copy_targets.insert(token, (d.recv.addr, d.recv.len));
        }
        self.ch.send(&HostToSp::Post(Box::new(d.clone()))).unwrap();
        (d.slot.expect("the tests post with a mailbox slot"), token)
    }

    /// Posts without a mailbox slot (the SP then completes it with a message); returns the
    /// token.
    pub fn post_slotless(&mut self, mut d: PostDesc) -> u64 {
        d.slot = None;
        let token = self.next_token;
        self.next_token += 1;
        d.token = token;
        self.ch.send(&HostToSp::Post(Box::new(d))).unwrap();
        token
    }

    /// Reads messages until `SpToHost::Completed` for `token` comes (or the channel's read
    /// timeout); completions of other tokens are kept for later calls. Any other message is a
    /// test failure.
    pub fn wait_message(&mut self, token: u64) -> Option<u32> {
        loop {
            if let Some(status) = self.completed.remove(&token) {
                return Some(status);
            }
            match self.ch.recv::<SpToHost>() {
                Ok(SpToHost::Completed { token: t, status }) => {
                    assert!(
                        self.completed.insert(t, status).is_none(),
                        "token {t} completed twice"
                    );
                }
                Ok(other) => panic!("expected completions, got {other:?}"),
                Err(_) => return None,
            }
        }
    }

    fn token_word(&self, slot: u32) -> u64 {
        let i = (mailbox::slot_offset(slot) / 8) as usize;
        // SAFETY: the SP writes the mailbox behind the compiler's back; a volatile read sees it.
        unsafe { std::ptr::read_volatile(&self.mailbox[i]) }
    }

    /// The status code of (slot, token) if it has completed.
    pub fn poll_done(&self, slot: u32, token: u64) -> Option<u32> {
        if self.token_word(slot) != token {
            return None;
        }
        std::sync::atomic::fence(Ordering::Acquire);
        let i = (mailbox::slot_offset(slot) / 8 + 1) as usize;
        // SAFETY: as above.
        let word = unsafe { std::ptr::read_volatile(&self.mailbox[i]) };
        Some((word & 0xffff_ffff) as u32)
    }

    /// Waits for the completion of (slot, token); returns the status code, or None on timeout.
    pub fn wait(&self, slot: u32, token: u64, timeout: Duration) -> Option<u32> {
        let t = Instant::now();
        while t.elapsed() < timeout {
            if let Some(code) = self.poll_done(slot, token) {
                return Some(code);
            }
            match &self.ucx {
                // The ucx backend on this UCX needs the owner to progress its worker.
                Some(u) => {
                    u.borrow().progress();
                }
                None => std::thread::sleep(Duration::from_micros(200)),
            }
        }
        None
    }

    /// Does the intra-node copies the SP has asked for so far (`SpToHost::Copy`, for posts with
    /// `host_copies`), as the shim does inside a blocking call, and answers each. The copy goes
    /// through `process_vm_readv` like the shim's; it is refused (answered `ok: false`) outside
    /// the post's receive grant.
    pub fn serve_copies(&mut self) {
        use std::os::fd::AsRawFd;
        loop {
            let mut pfd = libc::pollfd {
                fd: self.ch.get_ref().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, no timeout.
            if unsafe { libc::poll(&mut pfd, 1, 0) } <= 0 || pfd.revents & libc::POLLIN == 0 {
                return;
            }
            // A closed connection (the SP died) has nothing more to serve.
            let Ok(msg) = self.ch.recv::<SpToHost>() else {
                return;
            };
            // An SP beats to a host with posts outstanding; the shim ignores the beats too.
            if msg == SpToHost::Heartbeat {
                continue;
            }
            let SpToHost::Copy {
                token,
                ticket,
                src:
                    bootstrap::wire::CopySrc::Process {
                        pid: src_pid,
                        addr: src_addr,
                    },
                dst_offset,
                len,
            } = msg
            else {
                panic!("expected only copy requests from another process while waiting: {msg:?}");
            };
            let ok = match self.copy_targets.get(&token) {
                Some(&(base, glen)) if dst_offset.checked_add(len).is_some_and(|e| e <= glen) => {
                    let local = libc::iovec {
                        iov_base: (base + dst_offset) as *mut libc::c_void,
                        iov_len: len as usize,
                    };
                    let remote = libc::iovec {
                        iov_base: src_addr as *mut libc::c_void,
                        iov_len: len as usize,
                    };
                    // SAFETY: `local` lies inside a receive buffer the test keeps alive and
                    // does not touch until the collective completes.
                    let n = unsafe {
                        libc::process_vm_readv(src_pid as libc::pid_t, &local, 1, &remote, 1, 0)
                    };
                    n == len as isize
                }
                _ => false,
            };
            self.copies_served += 1;
            self.ch.send(&HostToSp::CopyDone { ticket, ok }).unwrap();
        }
    }

    /// Reads one message from the SP (with the channel's timeout).
    pub fn recv(&mut self) -> SpToHost {
        self.ch.recv().unwrap()
    }

    pub fn goodbye(mut self) {
        self.ch.send(&HostToSp::Goodbye).unwrap();
    }
}

/// A descriptor with everything but slot/token filled.
#[allow(clippy::too_many_arguments)]
pub fn desc(
    comm: CommId,
    seq: u64,
    comm_rank: u32,
    members: Vec<u32>,
    slot: u32,
    send: Grant,
    recv: Grant,
    counts: (Vec<u64>, Vec<u64>, Vec<u64>, Vec<u64>),
) -> PostDesc {
    PostDesc {
        kind: CollKind::Alltoallv,
        comm,
        seq,
        comm_rank,
        // Comm rank i is world rank i; callers of sub-communicators overwrite it.
        world_ranks: (0..members.len() as u32).collect(),
        members,
        nodes: vec![],
        slot: Some(slot),
        token: 0,
        send,
        recv,
        send_counts: counts.0,
        send_displs: counts.1,
        recv_counts: counts.2,
        recv_displs: counts.3,
        host_copies: false,
        send_packed: false,
        recv_packed: false,
        reduce: None,
        stamps: Default::default(),
        staged: None,
    }
}

/// Waits for every (host, slot, token) in `posted` while the hosts serve the copies their SPs
/// hand them; returns each status (None: timed out).
pub fn wait_all_serving(
    hosts: &mut [Host],
    posted: &[(usize, u32, u64)],
    timeout: Duration,
) -> Vec<Option<u32>> {
    let t = Instant::now();
    let mut got: Vec<Option<u32>> = vec![None; posted.len()];
    while t.elapsed() < timeout && got.iter().any(|g| g.is_none()) {
        for h in hosts.iter_mut() {
            h.serve_copies();
        }
        for (i, &(h, slot, token)) in posted.iter().enumerate() {
            if got[i].is_none() {
                got[i] = hosts[h].poll_done(slot, token);
            }
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    got
}

/// How long a test waits for a collective to complete.
pub const WAIT: Duration = Duration::from_secs(20);

/// Blocks of `sizes` in a random order with random gaps (multiples of 8 bytes); returns their
/// displacements and the end of the last one.
pub fn shuffled_layout(rng: &mut Rng, sizes: &[u64]) -> (Vec<u64>, u64) {
    let p = sizes.len();
    let mut order: Vec<usize> = (0..p).collect();
    for i in (1..p).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut displs = vec![0; p];
    let mut off = 0;
    for i in order {
        off += rng.below(3) * 8;
        displs[i] = off;
        off += sizes[i];
    }
    (displs, off)
}

/// Waits for every (host, slot, token) of `posted` and asserts that it completed with
/// `status`; `what` goes into the message.
pub fn assert_completed(hosts: &[Host], posted: &[(usize, u32, u64)], status: u32, what: &str) {
    for &(h, slot, token) in posted {
        let got = hosts[h].wait(slot, token, WAIT);
        assert_eq!(got, Some(status), "rank {h}: {what}");
    }
}

/// A seed for test inputs: `TEST_SEED` if set, else the clock; always printed.
pub fn test_seed() -> u64 {
    let seed = splitmix::env_seed().unwrap_or_else(splitmix::clock_seed);
    eprintln!("TEST_SEED={seed}");
    seed
}

/// The spec of an SP set with the defaults of the tests (no CPU pinning, 2 reads in flight, no
/// extra `serve` arguments).
pub fn sp_set_spec(
    nodes: u32,
    sps_per_node: u32,
    ranks_per_node: u32,
    layout: Layout,
) -> SpSetSpec {
    SpSetSpec {
        nodes,
        sps_per_node,
        ranks_per_node,
        layout,
        sp_cpus: None,
        max_inflight_reads: 2,
        extra_args: vec![],
        sp_args: vec![],
    }
}

/// Sum of one counter over the SPs' stats.
pub fn sum(stats: &[serde_json::Value], field: &str) -> u64 {
    stats.iter().map(|s| s[field].as_u64().unwrap()).sum()
}

/// Asserts that no SP holds a job or an instance any more.
pub fn assert_nothing_held(stats: &[serde_json::Value]) {
    assert_zero(stats, &["jobs_at_exit", "instances_at_exit"]);
}

/// Every SP's counters `fields` are 0.
pub fn assert_zero(stats: &[serde_json::Value], fields: &[&str]) {
    for s in stats {
        for f in fields {
            assert_eq!(s[*f], 0, "{f}: {s}");
        }
    }
}

/// What the SPs wrote into `buf` (through CMA, behind the compiler's back): volatile loads.
pub fn read_back(buf: &[u8]) -> Vec<u8> {
    // SAFETY: plain loads of initialized bytes.
    buf.iter()
        .map(|b| unsafe { std::ptr::read_volatile(b) })
        .collect()
}

/// The stdout of a finished command that must have succeeded (else its stderr is shown).
pub fn stdout_ok(out: std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The JSON Lines a successful command printed.
pub fn json_lines_ok(out: std::process::Output) -> Vec<serde_json::Value> {
    stdout_ok(out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

// ---- shared by the security tests ---------------------------------------------------------

/// The host socket of SP `sp`.
pub fn socket_of(set: &SpSet, sp: u32) -> String {
    set.cluster
        .sp(sp)
        .unwrap()
        .host_socket
        .display()
        .to_string()
}

pub fn my_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// A 4-rank alltoallv of the world communicator of `hosts` (comm rank = world rank): 8 bytes
/// to every peer, checked; returns each rank's status.
pub fn checked_alltoallv(hosts: &mut [Host], comm: CommId, seq: u64) -> Vec<Option<u32>> {
    let p = hosts.len();
    let members: Vec<u32> = hosts.iter().map(|h| h.sp).collect();
    let send: Vec<Vec<u8>> = (0..p)
        .map(|r| {
            (0..8 * p)
                .map(|i| (r * 31 + i + seq as usize) as u8)
                .collect()
        })
        .collect();
    let recv: Vec<Vec<u8>> = (0..p).map(|_| vec![0xEE; 8 * p]).collect();
    let mut posted = vec![];
    for r in 0..p {
        let s = hosts[r].grant(&send[r], Rights::READ);
        let d = hosts[r].grant(&recv[r], Rights::WRITE);
        let counts = vec![8u64; p];
        let displs: Vec<u64> = (0..p as u64).map(|i| 8 * i).collect();
        let d = desc(
            comm,
            seq,
            r as u32,
            members.clone(),
            (seq % 8) as u32,
            s,
            d,
            (counts.clone(), displs.clone(), counts, displs),
        );
        let (slot, token) = hosts[r].post(d);
        posted.push((r, slot, token));
    }
    let got = wait_all_serving(hosts, &posted, WAIT);
    for r in 0..p {
        if got[r] == Some(mailbox::STATUS_OK) {
            for s in 0..p {
                for i in 0..8 {
                    // SAFETY-free: read back what the SP wrote through CMA.
                    let b = unsafe { std::ptr::read_volatile(&recv[r][8 * s + i]) };
                    assert_eq!(b, send[s][8 * r + i], "rank {r} from {s} byte {i}");
                }
            }
        }
    }
    got
}

pub fn rss_kib(pid: u32) -> u64 {
    procfs::rss_kib(pid).expect("the SP under attack is alive and has a VmRSS line")
}

pub fn query(set: &SpSet, sp: u32) -> serde_json::Value {
    service_process::stats::query_within(
        set.cluster.sp(sp).unwrap(),
        &set.key,
        Duration::from_secs(2),
    )
    .expect("the SP answers a stats request")
}
