//! The control connection to this rank's SP: its Unix socket (an SP on this kernel) or TCP
//! (its DPU over the host-DPU network).
//!
//! Which one ([`target`]): `SPOFF_HOST_TRANSPORT=unix|tcp|auto`. `auto` (the default) takes
//! TCP when the SP's entry in the cluster description has a `host_addr` (the admin declared
//! that hosts reach it over the network: on a real cluster its Unix socket is on the DPU, out
//! of reach) and the Unix socket otherwise. Over TCP the SP cannot attach to this process's
//! memory, unless `SPOFF_HOSTS_SAME_KERNEL=1` says it runs on this kernel (network namespaces of
//! one machine, with the SP started with `--hosts-same-kernel`): then this is a
//! [`Conn::remote`] connection, which registers no mailbox (completions come as messages) and
//! grants memory through `ucx` unless `SPOFF_BACKEND` says otherwise.
//!
//! Start-up uses it blocking, with read and write timeouts, through [`wire::Channel`]. After
//! registration the shim only writes posts (blocking, bounded by the write timeout) and reads
//! opportunistically with `MSG_DONTWAIT` while waiting ([`Conn::poll_incoming`]), so the SP can
//! refuse a post or be seen to die. Writes use `send(..., MSG_NOSIGNAL)`: a dead SP must turn
//! into an error code, never a `SIGPIPE` that kills the MPI program.
//!
//! A connection found unusable (a failed or partial write, a read error, a bad frame, the SP
//! gone) is shut down at once ([`Conn::mark_broken`]), not merely flagged: the SP must learn
//! that this rank is gone. It treats a host that disconnects without saying goodbye as a failed
//! rank and aborts its job on every SP, so it stops copying into receive buffers whose
//! collectives the shim has already failed, and the peers fail instead of waiting for this rank.

use bootstrap::cluster::SpEntry;
use bootstrap::wire::{self, FrameDecoder, FrameError, HostToSp, SpToHost};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Where this rank's SP is reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Unix(p) => write!(f, "{}", p.display()),
            Target::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

/// The SP's address for this rank, by `transport` (`SPOFF_HOST_TRANSPORT`: `unix`, `tcp` or
/// `auto`/unset, see the module documentation).
pub fn target(entry: &SpEntry, transport: Option<&str>) -> Result<Target, String> {
    match transport.map(str::trim).unwrap_or("") {
        "" | "auto" => Ok(match entry.host_addr {
            Some(a) => Target::Tcp(a),
            None => Target::Unix(entry.host_socket.clone()),
        }),
        "unix" => Ok(Target::Unix(entry.host_socket.clone())),
        "tcp" => entry.host_addr.map(Target::Tcp).ok_or_else(|| {
            format!(
                "SPOFF_HOST_TRANSPORT=tcp, but SP {} has no host_addr in the cluster description",
                entry.id
            )
        }),
        other => Err(format!(
            "SPOFF_HOST_TRANSPORT={other} is none of unix, tcp, auto"
        )),
    }
}

/// `SPOFF_HOSTS_SAME_KERNEL=1`: an SP reached over TCP runs on this kernel and may attach to
/// this process (its `serve --hosts-same-kernel` must say so too).
pub fn hosts_same_kernel() -> bool {
    std::env::var_os("SPOFF_HOSTS_SAME_KERNEL").is_some_and(|v| v == "1")
}

/// The stream to the SP.
#[derive(Debug)]
pub enum Socket {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Socket {
    fn fd(&self) -> RawFd {
        match self {
            Socket::Unix(s) => s.as_raw_fd(),
            Socket::Tcp(s) => s.as_raw_fd(),
        }
    }

    fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Socket::Unix(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
            Socket::Tcp(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
        }
    }

    fn shutdown(&self) {
        let _ = match self {
            Socket::Unix(s) => s.shutdown(std::net::Shutdown::Both),
            Socket::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }

    #[cfg(test)]
    fn try_clone(&self) -> io::Result<Socket> {
        Ok(match self {
            Socket::Unix(s) => Socket::Unix(s.try_clone()?),
            Socket::Tcp(s) => Socket::Tcp(s.try_clone()?),
        })
    }
}

/// Bounds on connecting: total time, first and largest delay between attempts.
pub const CONNECT_TOTAL: Duration = Duration::from_secs(2);
const CONNECT_DELAY_MIN: Duration = Duration::from_millis(5);
const CONNECT_DELAY_MAX: Duration = Duration::from_millis(200);
/// A connect blocked on a full listen backlog gives up after this.
const CONNECT_ATTEMPT_TIMEOUT: Duration = Duration::from_millis(500);
/// Replies during start-up and posts afterwards: a dead or stuck SP cannot hang the rank longer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// A `Read + Write` view of the socket whose writes never raise `SIGPIPE`.
pub struct NoSigPipe<'a>(pub &'a Socket);

impl Read for NoSigPipe<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.0 {
            Socket::Unix(s) => (&mut &*s).read(buf),
            Socket::Tcp(s) => (&mut &*s).read(buf),
        }
    }
}

impl Write for NoSigPipe<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        loop {
            // SAFETY: `buf` is a valid readable slice for its length; the fd is open (owned by
            // the borrowed stream).
            let n = unsafe {
                libc::send(
                    self.0.fd(),
                    buf.as_ptr().cast(),
                    buf.len(),
                    libc::MSG_NOSIGNAL,
                )
            };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn connect_once(path: &Path) -> io::Result<UnixStream> {
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long or not a valid path",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: plain socket(2) call.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket nobody else owns; the stream closes it on drop.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    // SO_SNDTIMEO also bounds a connect that waits for room in the listener's backlog.
    stream.set_write_timeout(Some(CONNECT_ATTEMPT_TIMEOUT))?;
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    loop {
        // SAFETY: `addr` is an initialised sockaddr_un and `len` does not exceed its size.
        let rc = unsafe {
            libc::connect(
                fd,
                (&addr as *const libc::sockaddr_un).cast(),
                len as libc::socklen_t,
            )
        };
        if rc == 0 {
            return Ok(stream);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Whether a failed connect may succeed later (the SP is not listening yet, or is busy).
fn retryable(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::ENOENT | libc::ECONNREFUSED | libc::EAGAIN | libc::ETIMEDOUT | libc::EINPROGRESS
        )
    )
}

/// One TCP connect, bounded by [`CONNECT_ATTEMPT_TIMEOUT`], without Nagle's delay (a post is
/// one small frame the SP should see at once).
fn connect_once_tcp(addr: &SocketAddr) -> io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(addr, CONNECT_ATTEMPT_TIMEOUT)?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// Connects to `target`, retrying refused or missing sockets with doubling delays for at most
/// `total`. The stream comes back blocking, with [`IO_TIMEOUT`] on reads and writes.
pub fn connect(target: &Target, total: Duration) -> io::Result<Socket> {
    let start = Instant::now();
    let mut delay = CONNECT_DELAY_MIN;
    loop {
        let attempt = match target {
            Target::Unix(path) => connect_once(path).map(Socket::Unix),
            Target::Tcp(addr) => connect_once_tcp(addr).map(Socket::Tcp),
        };
        match attempt {
            Ok(s) => {
                s.set_timeouts(Some(IO_TIMEOUT))?;
                return Ok(s);
            }
            Err(e) if retryable(&e) && start.elapsed() + delay < total => {
                std::thread::sleep(delay);
                delay = (delay * 2).min(CONNECT_DELAY_MAX);
            }
            Err(e) => return Err(e),
        }
    }
}

/// The registered connection.
pub struct Conn {
    stream: Socket,
    decoder: FrameDecoder,
    /// Where the SP is, for messages: its socket path or `tcp:ADDR`.
    pub path: PathBuf,
    /// The SP cannot attach to this process (TCP without `SPOFF_HOSTS_SAME_KERNEL=1`).
    remote: bool,
    /// Why the connection is unusable, once it is (set only by [`Conn::mark_broken`]).
    pub broken: Option<String>,
    /// When the SP last showed life (CLOCK_MONOTONIC ns, `bootstrap::stamps::now_ns`): bytes
    /// read from it, or a post sent to it (which it answers with heartbeats while the post is
    /// outstanding).
    last_heard_ns: u64,
    /// The post ring the SP reads, if it does (`post_ring.rs`).
    ring: Option<crate::post_ring::ShimRing>,
    /// Frames sent on the socket since the registration (each ring entry records it).
    sock_frames: u64,
    /// The frame being sent, kept between sends so that a post allocates nothing for it.
    frame: Vec<u8>,
}

impl Conn {
    pub fn new(stream: Socket, target: &Target) -> Self {
        let remote = matches!(stream, Socket::Tcp(_)) && !hosts_same_kernel();
        Conn {
            stream,
            decoder: FrameDecoder::default(),
            path: PathBuf::from(target.to_string()),
            remote,
            broken: None,
            last_heard_ns: bootstrap::stamps::now_ns(),
            ring: None,
            sock_frames: 0,
            frame: Vec::new(),
        }
    }

    /// The socket's descriptor if it is a Unix socket (which can pass descriptors).
    pub fn unix_fd(&self) -> Option<RawFd> {
        match &self.stream {
            Socket::Unix(s) => Some(s.as_raw_fd()),
            Socket::Tcp(_) => None,
        }
    }

    /// Posts go through `ring` from now on, where they fit (the SP reads it).
    pub fn set_ring(&mut self, ring: Option<crate::post_ring::ShimRing>) {
        self.ring = ring;
    }

    /// Whether the SP cannot attach to this process's memory (see the module documentation):
    /// no mailbox, `ucx` grants by default.
    pub fn remote(&self) -> bool {
        self.remote
    }

    /// Records why the connection is unusable (the first reason is kept) and shuts the socket
    /// down both ways, so the SP sees this rank disconnect without a goodbye (see the module
    /// documentation). The descriptor stays open until the `Conn` is dropped, so its number is
    /// never reused under us.
    pub fn mark_broken(&mut self, why: String) {
        if self.broken.is_none() {
            self.broken = Some(why);
        }
        self.stream.shutdown();
    }

    /// A blocking channel for the start-up exchange.
    pub fn channel(&self) -> wire::Channel<NoSigPipe<'_>> {
        wire::Channel::new(NoSigPipe(&self.stream))
    }

    /// Sends one message (blocking, bounded by [`IO_TIMEOUT`]). A failure breaks the connection:
    /// a partly written frame leaves the stream unusable.
    pub fn send(&mut self, msg: &HostToSp) -> Result<(), String> {
        let post = matches!(msg, HostToSp::Post(_)).then(bootstrap::stamps::now_ns);
        self.send_encoded(|frame| wire::encode_into(msg, frame), post)
    }

    /// [`Conn::send`] of a post built as a view (`HostToSp::Post` on the wire), which
    /// allocates nothing; its `stamps.sent_ns` (unless 0) is taken as the time it is sent (a
    /// moment early when the socket is slow to take it: the SP's silence is judged in seconds).
    pub fn send_post(&mut self, view: &wire::PostView<'_>) -> Result<(), String> {
        let sent = match view.stamps.sent_ns {
            0 => bootstrap::stamps::now_ns(),
            t => t,
        };
        self.send_encoded(|frame| wire::encode_post_into(view, frame), Some(sent))
    }

    /// How long the SP has shown no life (see `last_heard_ns`).
    pub fn silent_for(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(
            bootstrap::stamps::now_ns().saturating_sub(self.last_heard_ns),
        )
    }

    /// Sends the frame `encode` writes; `post`: it is a post, sent at this time (ns), which
    /// may go through the ring.
    fn send_encoded(
        &mut self,
        encode: impl FnOnce(&mut Vec<u8>) -> Result<(), wire::FrameError>,
        post: Option<u64>,
    ) -> Result<(), String> {
        if let Some(why) = &self.broken {
            return Err(why.clone());
        }
        let mut frame = std::mem::take(&mut self.frame);
        let sent = encode(&mut frame)
            .map_err(|e| e.to_string())
            .and_then(|()| self.send_frame(&frame, post));
        // Kept unless a large post grew it (a communicator of many thousands of ranks).
        if frame.capacity() <= 64 << 10 {
            self.frame = frame;
        }
        sent
    }

    /// Sends one encoded `frame` (a post sent at `post` ns through the ring when it fits).
    fn send_frame(&mut self, frame: &[u8], post: Option<u64>) -> Result<(), String> {
        if let (Some(now), Some(ring)) = (post, self.ring.as_mut()) {
            // The payload without its length prefix; one that does not fit, or a full ring,
            // goes on the socket (the SP keeps the order: see `bootstrap::post_ring`).
            if ring.push(self.sock_frames, &frame[4..]) {
                self.last_heard_ns = now;
                return Ok(());
            }
        }
        self.sock_frames += 1;
        if let Err(e) = NoSigPipe(&self.stream).write_all(frame) {
            let why = format!(
                "sending to the service process at {} failed: {e}",
                self.path.display()
            );
            self.mark_broken(why.clone());
            return Err(why);
        }
        if let Some(now) = post {
            self.last_heard_ns = now;
        }
        Ok(())
    }

    /// Reads whatever the SP has sent without blocking and returns the complete messages. When
    /// the connection is found closed or broken, `broken` is set (once) and the messages read
    /// before are still returned.
    pub fn poll_incoming(&mut self) -> Vec<SpToHost> {
        let mut out = Vec::new();
        if self.broken.is_some() {
            return out;
        }
        let mut buf = [0u8; 4096];
        // Bounded: at most 64 reads per call; the rest waits for the next check.
        for _ in 0..64 {
            // SAFETY: `buf` is writable for its length; the fd is open.
            let n = unsafe {
                libc::recv(
                    self.stream.fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n == 0 {
                self.mark_broken(format!(
                    "the service process at {} closed the connection",
                    self.path.display()
                ));
                break;
            }
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => break,
                    io::ErrorKind::Interrupted => continue,
                    _ => {
                        self.mark_broken(format!(
                            "reading from the service process at {} failed: {e}",
                            self.path.display()
                        ));
                        break;
                    }
                }
            }
            self.decoder.extend(&buf[..n as usize]);
            self.last_heard_ns = bootstrap::stamps::now_ns();
        }
        loop {
            match self.decoder.next_frame() {
                Ok(Some(p)) => match wire::decode::<SpToHost>(&p) {
                    Ok(m) => out.push(m),
                    Err(e) => {
                        self.mark_broken(format!(
                            "undecodable message from the service process: {e}"
                        ));
                        break;
                    }
                },
                Ok(None) => break,
                Err(e) => {
                    self.mark_broken(format!("bad frame from the service process: {e}"));
                    break;
                }
            }
        }
        out
    }

    /// Says goodbye (best effort) and closes.
    pub fn close(mut self) {
        let _ = self.send(&HostToSp::Goodbye);
        self.stream.shutdown();
    }
}

/// Formats a frame error from the start-up exchange.
pub fn describe(e: &FrameError) -> String {
    match e {
        FrameError::Io(io)
            if matches!(
                io.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            format!("no answer within {} s", IO_TIMEOUT.as_secs())
        }
        FrameError::Closed => "the service process closed the connection".into(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn tmp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("host-shim-{}-{name}.sock", std::process::id()))
    }

    #[test]
    fn missing_socket_fails_within_the_bound() {
        let t = Instant::now();
        let err = connect(&Target::Unix(tmp("missing")), Duration::from_millis(100)).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn connects_and_detects_close_without_sigpipe() {
        let path = tmp("close");
        let _ = std::fs::remove_file(&path);
        let l = UnixListener::bind(&path).unwrap();
        let target = Target::Unix(path.clone());
        let s = connect(&target, CONNECT_TOTAL).unwrap();
        let (peer, _) = l.accept().unwrap();
        let mut c = Conn::new(s, &target);
        assert!(c.poll_incoming().is_empty());
        assert!(c.broken.is_none());
        // The SP sends a refusal, then dies.
        let msg = SpToHost::Registered {
            sp: 3,
            segment: "/spoff-test".into(),
            serves: wire::Serves::default(),
            mcast_off: None,
            canary_off: None,
            post_ring_off: None,
            arena_off: None,
        };
        (&peer).write_all(&wire::encode(&msg)).unwrap();
        drop(peer);
        let got = c.poll_incoming();
        assert_eq!(got, vec![msg]);
        assert!(c.broken.as_deref().unwrap().contains("closed"));
        // Writing to the dead peer is an error, not a signal.
        let mut c2 = Conn::new(c.stream.try_clone().unwrap(), &target);
        for _ in 0..3 {
            let _ = c2.send(&HostToSp::Goodbye);
        }
        assert!(c2.send(&HostToSp::Goodbye).is_err());
        std::fs::remove_file(&path).ok();
    }

    /// A connection the shim finds unusable is shut down, so the SP sees the rank go (end of
    /// stream) instead of a silent socket it would keep serving.
    #[test]
    fn a_broken_connection_is_shut_down_for_the_peer() {
        let path = tmp("broken");
        let _ = std::fs::remove_file(&path);
        let l = UnixListener::bind(&path).unwrap();
        let target = Target::Unix(path.clone());
        let s = connect(&target, CONNECT_TOTAL).unwrap();
        let (mut peer, _) = l.accept().unwrap();
        peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut c = Conn::new(s, &target);
        // A frame whose payload is not a message: the stream can no longer be trusted.
        peer.write_all(&wire::frame(&[0xff; 3])).unwrap();
        let t = Instant::now();
        while c.broken.is_none() && t.elapsed() < Duration::from_secs(5) {
            c.poll_incoming();
        }
        assert!(c.broken.is_some(), "the bad frame was not noticed");
        let mut b = [0u8; 16];
        match peer.read(&mut b) {
            Ok(0) => {}
            other => panic!("the peer must see the end of the stream, got {other:?}"),
        }
        // Later sends fail with the first reason, and close() is harmless.
        let first = c.broken.clone().unwrap();
        assert_eq!(c.send(&HostToSp::Goodbye).unwrap_err(), first);
        c.close();
        std::fs::remove_file(&path).ok();
    }

    fn entry(host_addr: Option<&str>) -> SpEntry {
        SpEntry {
            id: 3,
            node: 1,
            index: 0,
            peer_addr: "127.0.0.1:1".parse().unwrap(),
            host_socket: "/run/spoff/sp-3.sock".into(),
            host_addr: host_addr.map(|a| a.parse().unwrap()),
        }
    }

    #[test]
    fn the_transport_follows_the_description_unless_the_environment_says() {
        let tcp = entry(Some("10.1.0.2:7100"));
        let unix = entry(None);
        let a: SocketAddr = "10.1.0.2:7100".parse().unwrap();
        assert_eq!(target(&tcp, None), Ok(Target::Tcp(a)));
        assert_eq!(target(&tcp, Some("auto")), Ok(Target::Tcp(a)));
        assert_eq!(
            target(&tcp, Some("unix")),
            Ok(Target::Unix("/run/spoff/sp-3.sock".into()))
        );
        assert_eq!(
            target(&unix, None),
            Ok(Target::Unix("/run/spoff/sp-3.sock".into()))
        );
        let err = target(&unix, Some("tcp")).unwrap_err();
        assert!(err.contains("SP 3 has no host_addr"), "{err}");
        let err = target(&tcp, Some("rdma")).unwrap_err();
        assert!(err.contains("none of unix, tcp, auto"), "{err}");
        assert_eq!(Target::Tcp(a).to_string(), "tcp:10.1.0.2:7100");
    }

    /// An SP that starts listening a little after the rank looks for it is still found (the
    /// retry covers TCP's refused connects), and the stream carries frames both ways.
    #[test]
    fn tcp_connects_retry_until_the_sp_listens() {
        // A free port: bind, note it, close, listen again later.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let server = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            let l = std::net::TcpListener::bind(addr).unwrap();
            let (mut s, _) = l.accept().unwrap();
            let msg = SpToHost::Heartbeat;
            s.write_all(&wire::encode(&msg)).unwrap();
            let mut b = [0u8; 64];
            let n = s.read(&mut b).unwrap();
            b[..n].to_vec()
        });
        let target = Target::Tcp(addr);
        let t = Instant::now();
        let s = connect(&target, CONNECT_TOTAL).unwrap();
        assert!(t.elapsed() >= Duration::from_millis(100));
        let mut c = Conn::new(s, &target);
        assert_eq!(c.remote(), !hosts_same_kernel());
        let got = (0..200)
            .find_map(|_| {
                let m = c.poll_incoming();
                std::thread::sleep(Duration::from_millis(5));
                (!m.is_empty()).then_some(m)
            })
            .expect("no frame over TCP");
        assert_eq!(got, vec![SpToHost::Heartbeat]);
        c.send(&HostToSp::Goodbye).unwrap();
        assert_eq!(server.join().unwrap(), wire::encode(&HostToSp::Goodbye));
        // Nobody listening at all: refused within the bound, not hung.
        let t = Instant::now();
        assert!(connect(&target, Duration::from_millis(100)).is_err());
        assert!(t.elapsed() < Duration::from_secs(2));
    }
}
