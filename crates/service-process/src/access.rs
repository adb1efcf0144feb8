//! Who may use an SP, and how much of it.
//!
//! Threat model (docs/ARCHITECTURE.md, "Reliability and security"): an SP serves every job of
//! its node for a long time and may read and write any host process's memory it is granted;
//! any local user can reach its host socket (if its mode allows), any process that can reach
//! its TCP port can try to pose as a peer. So:
//!
//! - a host on the SP's Unix socket is identified by the kernel ([`PeerCred`]: pid, uid, and a
//!   pidfd pinning the very process that connected) and by its job credential
//!   ([`check_hello`]), never by what it says about itself: the job comes from a credential
//!   MAC'd with the cluster key, which must name the connecting uid, and a (job, world rank)
//!   pair has at most one connection;
//! - a host over TCP ([`HostPeer::Tcp`]) has no kernel to vouch for it: its job credential is
//!   its whole identity (job, uid, world size). On another machine the SP cannot attach to its
//!   memory, so it serves only grants that carry their own access (`ucx`) and completes its
//!   posts by message; only when the SP is told its hosts share its kernel
//!   (`serve --hosts-same-kernel`, the namespace emulation) does it take the pid the hello
//!   names, check that this process is alive and runs under the credential's uid
//!   ([`pin_claimed`]), and pin it as it pins a Unix peer;
//! - everything a client can make the SP hold is bounded ([`Limits`]), and what it can make
//!   the SP log is rate-limited ([`LogLimit`]).

use bootstrap::auth::{ClusterKey, JobCredential};
use bootstrap::wire::HostHello;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// `SO_PEERPIDFD` (Linux 6.5): a pidfd of the peer process as of `connect`.
const SO_PEERPIDFD: libc::c_int = 77;

/// What the kernel says about the process at the other end of a Unix socket.
#[derive(Debug)]
pub struct PeerCred {
    pub pid: u32,
    pub uid: u32,
    /// The gid its memory is opened with (with `uid`: the client's ids, `alias_mkey::ids`).
    pub gid: u32,
    /// Pins that process (see `alias_mkey::process`): readable once it has exited.
    pub pidfd: OwnedFd,
    /// Its start time, with `pid` its identity for cross-memory access.
    pub start: u64,
    /// The process was pinned before on an image it has left by `exec` since: the
    /// connections of that image must end (`Server::end_old_images`).
    pub exec_since: bool,
}

/// Who is at the other end of a host connection, as far as the SP can know.
pub enum HostPeer {
    /// The Unix socket: the kernel says which process connected.
    Local(PeerCred),
    /// TCP: nobody vouches for the process; the job credential is its identity. `pinned`: the
    /// process its hello named, checked and pinned, on an SP told that its hosts share its
    /// kernel (set at the hello); `None` before, and always for hosts on other machines.
    Tcp {
        addr: std::net::SocketAddr,
        same_kernel: bool,
        pinned: Option<PeerCred>,
    },
}

impl HostPeer {
    /// The pinned process, if the SP knows one (what the `cma` backend reaches).
    pub fn pinned(&self) -> Option<&PeerCred> {
        match self {
            HostPeer::Local(p) => Some(p),
            HostPeer::Tcp { pinned, .. } => pinned.as_ref(),
        }
    }

    /// The uid the kernel vouches for; `None` over TCP (the credential's uid is taken).
    pub fn kernel_uid(&self) -> Option<u32> {
        match self {
            HostPeer::Local(p) => Some(p.uid),
            HostPeer::Tcp { .. } => None,
        }
    }

    /// The owner pid and start time of this host's grants (0 when no process is pinned: then
    /// no `cma` grant of it is ever served, see [`HostPeer::serves_cma`]).
    pub fn pid(&self) -> u32 {
        self.pinned().map_or(0, |p| p.pid)
    }

    pub fn start(&self) -> u64 {
        self.pinned().map_or(0, |p| p.start)
    }

    /// Whether the SP can reach this host's memory by cross-memory attach: a Unix peer, or a
    /// TCP host on this kernel whose claimed process was checked and pinned.
    pub fn serves_cma(&self) -> bool {
        self.pinned().is_some()
    }

    /// For logs: `pid 12 uid 1000` or `tcp 10.0.0.1:40000`.
    pub fn describe(&self) -> String {
        match self {
            HostPeer::Local(p) => format!("pid {} uid {}", p.pid, p.uid),
            HostPeer::Tcp { addr, pinned, .. } => match pinned {
                Some(p) => format!("tcp {addr} pid {}", p.pid),
                None => format!("tcp {addr}"),
            },
        }
    }
}

/// A TCP host on this kernel (`serve --hosts-same-kernel`) named `pid` in its hello: checks
/// what can be checked (the process exists, its uid is `uid`, the credential's) and pins it,
/// reached as `uid` with the process's own real gid: the kernel then refuses it unless that
/// user could `ptrace` it (its real, effective and saved ids all the user's and that gid's,
/// dumpable: not a setuid, setgid or non-dumpable program). A holder of a job credential of
/// uid `uid` can thus name only what that uid's own processes may reach anyway; never another
/// user's process, never one that gained rights by `exec`.
pub fn pin_claimed(pid: u32, uid: u32) -> Result<PeerCred, String> {
    if pid == 0 || pid > i32::MAX as u32 {
        return Err(format!(
            "a host over TCP on this kernel must name its pid in its hello (it said {pid})"
        ));
    }
    let pidfd = alias_mkey::process::pidfd_open(pid)
        .map_err(|e| format!("the pid {pid} the hello names is no live process here: {e}"))?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("cannot read the status of pid {pid}: {e}"))?;
    let ids = |key: &str| -> Option<Vec<u32>> {
        let line = status.lines().find_map(|l| l.strip_prefix(key))?;
        line.split_whitespace().map(|v| v.parse().ok()).collect()
    };
    let (uids, gids) = ids("Uid:")
        .zip(ids("Gid:"))
        .filter(|(u, g)| u.len() == 4 && g.len() == 4)
        .ok_or_else(|| format!("no uid or gid in the status of pid {pid}"))?;
    if uids[1] != uid {
        return Err(format!(
            "the job credential is for uid {uid}, but pid {pid} runs as uid {}",
            uids[1]
        ));
    }
    // The status read above is the pidfd's process's only if that process was still running
    // after the read (a pid is reused only once its process is gone).
    if !alias_mkey::process::alive(&pidfd) {
        return Err(format!("pid {pid} exited while it was checked"));
    }
    let gid = gids[0];
    let pin = pidfd
        .try_clone()
        .and_then(|fd| alias_mkey::process::pin(fd, pid, uid, gid))
        .map_err(|e| refused_pin(pid, uid, gid, &e))?;
    Ok(PeerCred {
        pid,
        uid,
        gid,
        pidfd,
        start: pin.start,
        exec_since: pin.exec_since,
    })
}

/// Why a process cannot be served, in the words of the kernel's refusal.
fn refused_pin(pid: u32, uid: u32, gid: u32, e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) => format!(
            "pid {pid} may not be reached as uid {uid} gid {gid} (the kernel refuses it, as it \
             would refuse that user's ptrace: a setuid, setgid or non-dumpable program, or \
             another user's): {e}"
        ),
        _ => format!("cannot pin pid {pid}: {e}"),
    }
}

/// The capabilities an SP keeps when it runs as root (a site daemon serving every user of a
/// node), and why; every other one is dropped for good at start ([`drop_capabilities`]).
/// Above all `CAP_SYS_PTRACE` goes: a host's memory is opened with its client's ids
/// (`alias_mkey::ids`), and only without that capability does the kernel judge the open as it
/// would judge that user's `ptrace`.
pub const KEPT_CAPABILITIES: &[(u32, &str)] = &[
    (
        0,
        "CAP_CHOWN: the socket directory and socket it creates for other users",
    ),
    (
        1,
        "CAP_DAC_OVERRIDE: the run directory, key file and shared-memory segments",
    ),
    (
        3,
        "CAP_FOWNER: removing its cluster's stale segments from the sticky /dev/shm",
    ),
    (
        6,
        "CAP_SETGID: taking a client's gid on one thread to open its memory",
    ),
    (
        7,
        "CAP_SETUID: taking a client's uid on one thread to open its memory",
    ),
    (
        10,
        "CAP_NET_BIND_SERVICE: peer and host addresses a site may put below 1024",
    ),
    (14, "CAP_IPC_LOCK: UCX registers (pins) staging memory"),
    (
        19,
        "CAP_SYS_PTRACE: permitted but never effective, except on the thread that opens the \
         memory of a root client's process (root could trace it itself)",
    ),
    (23, "CAP_SYS_NICE: serve --realtime (SCHED_FIFO)"),
    (24, "CAP_SYS_RESOURCE: UCX raising its locked-memory limit"),
];

/// Drops every capability but [`KEPT_CAPABILITIES`] from the bounding, permitted, effective
/// and inheritable sets of this thread (call it before any other thread starts), then
/// `CAP_SYS_PTRACE` from the effective set, and checks that it is not effective. An SP that is
/// not root has none of them: nothing changes.
pub fn drop_capabilities() -> anyhow::Result<()> {
    let last: u32 = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40);
    let drop: Vec<u32> = (0..=last)
        .filter(|c| !KEPT_CAPABILITIES.iter().any(|(k, _)| k == c))
        .collect();
    alias_mkey::ids::drop_for_good(&drop)?;
    alias_mkey::ids::drop_effective(&[alias_mkey::ids::CAP_SYS_PTRACE])?;
    if alias_mkey::ids::has_effective(alias_mkey::ids::CAP_SYS_PTRACE)? {
        anyhow::bail!("CAP_SYS_PTRACE is still effective after dropping it");
    }
    Ok(())
}

/// UCX transports that reach another process of this machine by what a worker address names
/// (its pid, a segment or file): a `ucx` grant's worker address comes from the host, so on a
/// root SP they would reach any root process with the SP's own rights.
const UCX_LOCAL_TRANSPORTS: &[&str] = &[
    "all", "sm", "shm", "mm", "posix", "sysv", "cma", "knem", "xpmem",
];

/// Keeps a root SP's UCX off the transports that reach processes of this machine
/// ([`UCX_LOCAL_TRANSPORTS`]): with `UCX_TLS` unset it becomes `tcp` (what a `ucx` grant then
/// reaches is whatever the host's worker serves over the network, with the host's rights);
/// a `UCX_TLS` that names one of them (or excludes with `^`) is refused. An SP that is not
/// root is left alone: UCX then acts with its own user's rights. Call it before UCX starts.
pub fn confine_ucx_transports() -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(());
    }
    match std::env::var("UCX_TLS") {
        Err(_) => std::env::set_var("UCX_TLS", "tcp"),
        Ok(tls) => {
            let local = tls.starts_with('^')
                || tls
                    .split(',')
                    .map(|t| t.trim().trim_start_matches('\\'))
                    .any(|t| UCX_LOCAL_TRANSPORTS.contains(&t));
            if local {
                anyhow::bail!(
                    "UCX_TLS={tls}: an SP running as root uses no UCX transport that reaches \
                     processes of this machine ({}): a host's worker address would make it \
                     reach them as root; name network transports only (e.g. tcp, rc, dc, ud), \
                     or serve --ucx=off",
                    UCX_LOCAL_TRANSPORTS.join(", ")
                );
            }
        }
    }
    Ok(())
}

/// TCP options of a host or admin connection: no Nagle delay (a post is one small frame the SP
/// should see at once), and keepalive probes so that a host whose machine vanished is noticed
/// (after about a minute) even when it had nothing outstanding.
pub fn tune_tcp(fd: &impl AsRawFd) -> std::io::Result<()> {
    let set = |level, opt, v: libc::c_int| {
        // SAFETY: setsockopt with a pointer to a live c_int and its size.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                level,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    set(libc::IPPROTO_TCP, libc::TCP_NODELAY, 1)?;
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 30)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3)
}

/// The peer credentials of `fd`, a connected Unix socket.
pub fn peer_cred(fd: &impl AsRawFd) -> std::io::Result<PeerCred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes given; the fd is open.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let pid = cred.pid as u32;
    let pidfd = peer_pidfd(fd).or_else(|_| alias_mkey::process::pidfd_open(pid))?;
    // Pins the process: with SO_PEERPIDFD the one that connected, with the fallback the one
    // that has the pid now (alive, so it is the same unless it exited before pidfd_open). Its
    // memory is opened as the ids it connected with: the kernel refuses a process that user
    // could not ptrace.
    let pin = alias_mkey::process::pin(pidfd.try_clone()?, pid, cred.uid, cred.gid)
        .map_err(|e| std::io::Error::new(e.kind(), refused_pin(pid, cred.uid, cred.gid, &e)))?;
    Ok(PeerCred {
        pid,
        uid: cred.uid,
        gid: cred.gid,
        pidfd,
        start: pin.start,
        exec_since: pin.exec_since,
    })
}

fn peer_pidfd(fd: &impl AsRawFd) -> std::io::Result<OwnedFd> {
    let mut pidfd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `pidfd` and `len` are valid for writes of the sizes given; the fd is open.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut pidfd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 || pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd the kernel just gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(pidfd) })
}

/// The bounds of one SP. Every one of them is a reason to refuse a client with a clear error,
/// never to fail another job.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest world size a job may have.
    pub max_world_size: u32,
    /// Host connections at once (all jobs).
    pub max_hosts: usize,
    /// Connections that have not said hello yet, and how long one may take to.
    pub max_pending_hellos: usize,
    pub hello_timeout: Duration,
    /// Posts of one connection not completed yet.
    pub max_posts_per_rank: usize,
    /// Open collective instances of one job on this SP.
    pub max_instances_per_job: usize,
    /// Bytes a host connection may leave unread (completions, copies, errors are small).
    pub max_host_out_bytes: usize,
    /// SP memory the posts of one rank connection, one job and one uid may hold.
    pub held: crate::held::HeldLimits,
    /// The shares of the staging memory one job and one uid's jobs may hold.
    pub staging_shares: crate::staging::Shares,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_world_size: 1 << 20,
            max_hosts: 4096,
            max_pending_hellos: 256,
            hello_timeout: Duration::from_secs(5),
            max_posts_per_rank: 8192,
            max_instances_per_job: 1 << 16,
            max_host_out_bytes: 16 << 20,
            held: Default::default(),
            staging_shares: Default::default(),
        }
    }
}

/// Why a host hello is refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    BadCredential(String),
    /// The credential is for another uid than the connecting process's.
    WrongUid {
        credential: u32,
        peer: u32,
    },
    WorldSize(String),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::BadCredential(why) => write!(f, "invalid job credential: {why}"),
            Refusal::WrongUid { credential, peer } => write!(
                f,
                "the job credential is for uid {credential}, but this process runs as uid {peer}"
            ),
            Refusal::WorldSize(why) => f.write_str(why),
        }
    }
}

/// Checks a host hello against the cluster key and the connecting uid (`None` over TCP, where
/// no kernel vouches for one and the credential's uid is the identity); returns the job's
/// credential. The world rank's place in the cluster is checked by the caller.
pub fn check_hello(
    hello: &HostHello,
    key: &ClusterKey,
    peer_uid: Option<u32>,
    limits: &Limits,
) -> Result<JobCredential, Refusal> {
    let cred = JobCredential::decode(&hello.credential)
        .map_err(|e| Refusal::BadCredential(e.to_string()))?;
    if !cred.verify(key) {
        return Err(Refusal::BadCredential(
            "its MAC does not match (not issued for this cluster)".into(),
        ));
    }
    if let Some(peer) = peer_uid.filter(|&u| u != cred.uid) {
        return Err(Refusal::WrongUid {
            credential: cred.uid,
            peer,
        });
    }
    if cred.world_size != hello.world_size {
        return Err(Refusal::WorldSize(format!(
            "the hello says {} ranks, the job credential {}",
            hello.world_size, cred.world_size
        )));
    }
    if hello.world_size == 0 || hello.world_size > limits.max_world_size {
        return Err(Refusal::WorldSize(format!(
            "a world of {} ranks is outside 1..={}",
            hello.world_size, limits.max_world_size
        )));
    }
    if hello.world_rank >= hello.world_size {
        return Err(Refusal::WorldSize(format!(
            "rank {} of a world of {} ranks",
            hello.world_rank, hello.world_size
        )));
    }
    Ok(cred)
}

/// The segment name of `job` on `node` for this cluster: a prefix naming the cluster (so an
/// SP can find its cluster's leftovers) and a MAC of the job and node (so the name discloses
/// no job id and no other user can guess it).
pub fn segment_name(key: &ClusterKey, job: u64, node: u32) -> String {
    let mac = key.mac(
        "spoff segment name v1",
        &[&job.to_le_bytes(), &node.to_le_bytes()],
    );
    let tail: String = mac[..12].iter().map(|b| format!("{b:02x}")).collect();
    format!("{}{tail}", segment_prefix(key))
}

/// The prefix of every segment name of the cluster of `key`.
pub fn segment_prefix(key: &ClusterKey) -> String {
    format!("/spoff-{}-", key.tag())
}

/// Removes the segments of the cluster of `key` left in /dev/shm (by SPs that were killed):
/// at an SP's start, when nothing of the cluster can be in use. Returns how many.
pub fn remove_stale_segments(key: &ClusterKey) -> usize {
    let prefix = segment_prefix(key);
    let file_prefix = &prefix[1..];
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return 0;
    };
    let mut n = 0;
    for e in dir.flatten() {
        if e.file_name().to_string_lossy().starts_with(file_prefix)
            && std::fs::remove_file(e.path()).is_ok()
        {
            n += 1;
        }
    }
    n
}

/// A log rate limit: at most `burst` lines per `period` for one kind of client-caused event,
/// the rest counted and summarised once the period ends.
#[derive(Debug)]
pub struct LogLimit {
    burst: u32,
    period: Duration,
    window_start: Instant,
    in_window: u32,
    suppressed: u64,
}

impl LogLimit {
    pub fn new(burst: u32, period: Duration) -> LogLimit {
        LogLimit {
            burst,
            period,
            window_start: Instant::now(),
            in_window: 0,
            suppressed: 0,
        }
    }

    /// Whether to log the next line now; `Some(n)` as the second value when `n` lines were
    /// suppressed in the window that just ended (say so first).
    pub fn admit(&mut self, now: Instant) -> (bool, Option<u64>) {
        let mut ended = None;
        if now.duration_since(self.window_start) >= self.period {
            if self.suppressed > 0 {
                ended = Some(self.suppressed);
            }
            self.window_start = now;
            self.in_window = 0;
            self.suppressed = 0;
        }
        if self.in_window < self.burst {
            self.in_window += 1;
            (true, ended)
        } else {
            self.suppressed += 1;
            (false, ended)
        }
    }
}

/// The network interface that holds `ip` (e.g. `lo` for 127.0.0.1), from `getifaddrs`.
pub fn interface_of(ip: std::net::IpAddr) -> Option<String> {
    let mut addrs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list it allocates; freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut addrs) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = addrs;
    while !cur.is_null() {
        // SAFETY: a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points to a sockaddr whose family says which one it is.
        let here = unsafe {
            match (*ifa.ifa_addr).sa_family as libc::c_int {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    Some(std::net::IpAddr::from(
                        u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
                    ))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    Some(std::net::IpAddr::from(sin6.sin6_addr.s6_addr))
                }
                _ => None,
            }
        };
        if here == Some(ip) {
            // SAFETY: ifa_name is a NUL-terminated string of the list.
            let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
            found = Some(name.to_string_lossy().into_owned());
            break;
        }
    }
    // SAFETY: the list from getifaddrs above, freed once.
    unsafe { libc::freeifaddrs(addrs) };
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(cred: &JobCredential, rank: u32, size: u32) -> HostHello {
        HostHello {
            credential: cred.encode(),
            world_rank: rank,
            world_size: size,
            node: 0,
            local_rank: 0,
            pid: 0,
        }
    }

    #[test]
    fn a_hello_needs_a_credential_of_this_cluster_for_this_uid() {
        let key = ClusterKey::generate();
        let l = Limits::default();
        let c = JobCredential::issue(&key, 7, 1000, 4);
        assert_eq!(
            check_hello(&hello(&c, 3, 4), &key, Some(1000), &l),
            Ok(c.clone())
        );
        // Another cluster's credential, or a forged job id.
        let other = JobCredential::issue(&ClusterKey::generate(), 7, 1000, 4);
        assert!(matches!(
            check_hello(&hello(&other, 0, 4), &key, Some(1000), &l),
            Err(Refusal::BadCredential(_))
        ));
        let forged = JobCredential {
            job: 8,
            ..c.clone()
        };
        assert!(matches!(
            check_hello(&hello(&forged, 0, 4), &key, Some(1000), &l),
            Err(Refusal::BadCredential(_))
        ));
        // Another user's process presenting it.
        assert_eq!(
            check_hello(&hello(&c, 0, 4), &key, Some(1001), &l),
            Err(Refusal::WrongUid {
                credential: 1000,
                peer: 1001
            })
        );
        // Sizes: as in the credential, within the limit, rank inside.
        assert!(matches!(
            check_hello(&hello(&c, 0, 5), &key, Some(1000), &l),
            Err(Refusal::WorldSize(_))
        ));
        assert!(matches!(
            check_hello(&hello(&c, 4, 4), &key, Some(1000), &l),
            Err(Refusal::WorldSize(_))
        ));
        let huge = JobCredential::issue(&key, 9, 1000, u32::MAX);
        assert!(matches!(
            check_hello(&hello(&huge, 0, u32::MAX), &key, Some(1000), &l),
            Err(Refusal::WorldSize(_))
        ));
        let mut garbled = hello(&c, 0, 4);
        garbled.credential = "x".into();
        assert!(matches!(
            check_hello(&garbled, &key, Some(1000), &l),
            Err(Refusal::BadCredential(_))
        ));
    }

    #[test]
    fn over_tcp_the_credential_is_the_identity() {
        let key = ClusterKey::generate();
        let l = Limits::default();
        // No kernel uid to compare: any uid's credential of this cluster is taken...
        let c = JobCredential::issue(&key, 7, 4242, 4);
        assert_eq!(check_hello(&hello(&c, 1, 4), &key, None, &l), Ok(c.clone()));
        // ...and everything else is checked as on the socket.
        let other = JobCredential::issue(&ClusterKey::generate(), 7, 4242, 4);
        assert!(matches!(
            check_hello(&hello(&other, 1, 4), &key, None, &l),
            Err(Refusal::BadCredential(_))
        ));
        assert!(matches!(
            check_hello(&hello(&c, 4, 4), &key, None, &l),
            Err(Refusal::WorldSize(_))
        ));
    }

    #[test]
    fn a_claimed_pid_must_be_alive_and_of_the_credentials_uid() {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let pid = std::process::id();
        let p = pin_claimed(pid, me).unwrap();
        assert_eq!((p.pid, p.uid), (pid, me));
        assert_eq!(p.start, alias_mkey::process::start_time(pid).unwrap());
        alias_mkey::process::check(&alias_mkey::Owner {
            job: 1,
            world_rank: 0,
            pid,
            start: p.start,
            uid: p.uid,
            gid: p.gid,
        })
        .unwrap();
        alias_mkey::process::unpin(pid, p.start);
        let err = pin_claimed(pid, me ^ 1).unwrap_err();
        assert!(err.contains(&format!("runs as uid {me}")), "{err}");
        assert!(pin_claimed(0, me)
            .unwrap_err()
            .contains("must name its pid"));
        assert!(pin_claimed(u32::MAX, me).is_err());
        // An exited (reaped) process is no claim.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        assert!(pin_claimed(gone, me).is_err());
    }

    #[test]
    fn the_log_limit_admits_a_burst_per_period_and_counts_the_rest() {
        let t0 = Instant::now();
        let mut l = LogLimit::new(2, Duration::from_secs(1));
        assert_eq!(l.admit(t0), (true, None));
        assert_eq!(l.admit(t0), (true, None));
        assert_eq!(l.admit(t0), (false, None));
        assert_eq!(l.admit(t0), (false, None));
        assert_eq!(l.admit(t0 + Duration::from_secs(2)), (true, Some(2)));
    }

    #[test]
    fn loopback_is_on_lo() {
        assert_eq!(
            interface_of("127.0.0.1".parse().unwrap()).as_deref(),
            Some("lo")
        );
        assert_eq!(interface_of("192.0.2.254".parse().unwrap()), None);
    }

    #[test]
    fn segment_names_hide_the_job_and_carry_the_cluster_prefix() {
        let key = ClusterKey::generate();
        let a = segment_name(&key, 0xabcdef, 0);
        assert!(a.starts_with(&segment_prefix(&key)));
        assert!(!a.contains("abcdef"));
        assert_ne!(a, segment_name(&key, 0xabcdef, 1));
        assert_ne!(a, segment_name(&ClusterKey::generate(), 0xabcdef, 0));
    }
}
