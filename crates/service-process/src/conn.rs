//! One connection of the event loop: a nonblocking stream with frame reassembly on the way in
//! and a write buffer on the way out.
//!
//! mio's readiness rules apply (see `server`): a readable event means "try", so `read_frames`
//! reads until `WouldBlock` (a read that did not fill the buffer is taken as the end, unless
//! told to drain: see there); `flush` writes until the buffer is empty or `WouldBlock`,
//! and is called again on the next writable event.

use bootstrap::wire::{FrameDecoder, FrameError};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Descriptors a connection keeps from what its peer passed (`SCM_RIGHTS` on a Unix socket):
/// a host passes one, its post ring, with its `Register`, and only then ([`Conn::fds_allowed`]);
/// any other is closed at once, off the loop ([`close_later`]).
pub const MAX_FDS_IN: usize = 1;

/// Room for the most descriptors one message can carry (Linux's `SCM_MAX_FD`), so that the
/// kernel never truncates the control data: a truncated message's descriptors could not be
/// taken, and so not closed.
const SCM_MAX_FD: usize = 253;

/// Closes `fd` on a thread of its own: a descriptor a client passed may be a file of a
/// filesystem that client serves (FUSE), whose `close` waits for that client; the event loop
/// never does. One thread for the process, started on first use; if it is ever stuck, the
/// descriptors queue behind it and the loop goes on.
pub fn close_later(fd: OwnedFd) {
    use std::sync::mpsc::{channel, Sender};
    use std::sync::{Mutex, OnceLock};
    static CLOSER: OnceLock<Mutex<Sender<OwnedFd>>> = OnceLock::new();
    let tx = CLOSER.get_or_init(|| {
        let (tx, rx) = channel::<OwnedFd>();
        let spawned = std::thread::Builder::new()
            .name("fd-closer".into())
            .spawn(move || rx.into_iter().for_each(drop));
        if spawned.is_err() {
            tracing::warn!("cannot start the descriptor closer; passed descriptors stay open");
        }
        Mutex::new(tx)
    });
    if let Err(e) = tx.lock().unwrap_or_else(|e| e.into_inner()).send(fd) {
        // No closer thread: keep the descriptor open rather than close it here.
        std::mem::forget(e.0);
    }
}

pub enum Stream {
    Unix(mio::net::UnixStream),
    Tcp(mio::net::TcpStream),
}

impl Stream {
    pub fn source(&mut self) -> &mut dyn mio::event::Source {
        match self {
            Stream::Unix(s) => s,
            Stream::Tcp(s) => s,
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What reading found besides frames.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadEnd {
    /// More may come later.
    Open,
    /// The peer closed its side.
    Closed,
}

/// Most bytes a connection may have waiting to be written.
pub const MAX_PENDING_OUT_BYTES: usize = 256 << 20;

pub struct Conn<R> {
    pub stream: Stream,
    pub role: R,
    /// Unique for the life of the process (slab keys are reused; this is not).
    pub serial: u64,
    decoder: FrameDecoder,
    out: Vec<u8>,
    out_pos: usize,
    /// Most bytes this connection may have waiting to be written.
    out_limit: usize,
    /// Descriptors passed with the bytes read so far and not taken yet (at most
    /// [`MAX_FDS_IN`]).
    pub fds_in: Passed,
    /// Whether descriptors passed now are kept (a host between its hello and its `Register`);
    /// otherwise they are closed on arrival.
    pub fds_allowed: bool,
    /// More descriptors arrived than were kept (the keeper's business: a ring offered with
    /// them is refused).
    pub fds_dropped: bool,
    /// The control-message buffer of a Unix connection's reads, made once.
    cmsg: Vec<u8>,
    /// Reads made (the system calls), for the tests.
    pub reads: u64,
    /// The last read took descriptors (a Unix socket's receive ends at such a message).
    fds_in_last: bool,
}

/// Descriptors a peer passed and the connection kept: closed off the loop when dropped.
#[derive(Default)]
pub struct Passed(pub Vec<OwnedFd>);

impl Drop for Passed {
    fn drop(&mut self) {
        for fd in self.0.drain(..) {
            close_later(fd);
        }
    }
}

impl<R> Conn<R> {
    pub fn new(stream: Stream, role: R, serial: u64) -> Self {
        Conn {
            stream,
            role,
            serial,
            decoder: FrameDecoder::default(),
            out: Vec::new(),
            out_pos: 0,
            out_limit: MAX_PENDING_OUT_BYTES,
            fds_in: Passed::default(),
            fds_allowed: false,
            fds_dropped: false,
            cmsg: Vec::new(),
            reads: 0,
            fds_in_last: false,
        }
    }

    /// Reads bytes; on a Unix socket also takes the descriptors passed with them (a
    /// descriptor is never left to a plain `read`, which would drop it unseen).
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reads += 1;
        let Stream::Unix(s) = &self.stream else {
            return self.stream.read(buf);
        };
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags, UnixAddr};
        let fd = s.as_raw_fd();
        let mut iov = [io::IoSliceMut::new(buf)];
        if self.cmsg.is_empty() {
            self.cmsg = nix::cmsg_space!([RawFd; SCM_MAX_FD]);
        }
        let msg = recvmsg::<UnixAddr>(
            fd,
            &mut iov,
            Some(&mut self.cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
        )
        .map_err(io::Error::from)?;
        let n = msg.bytes;
        let mut got: Vec<RawFd> = Vec::new();
        self.fds_in_last = false;
        // With room for SCM_MAX_FD descriptors the kernel does not truncate rights; if it
        // ever did, nix refuses to list them, and the message is then an error (the
        // connection closes) rather than descriptors left unseen.
        for c in msg.cmsgs().map_err(io::Error::from)? {
            if let ControlMessageOwned::ScmRights(fds) = c {
                got.extend(fds);
            }
        }
        self.fds_in_last = !got.is_empty();
        for raw in got {
            // SAFETY: the kernel installed this descriptor in this process for us; nothing
            // else owns it.
            let owned = unsafe { OwnedFd::from_raw_fd(raw) };
            if self.fds_allowed && self.fds_in.0.len() < MAX_FDS_IN {
                self.fds_in.0.push(owned);
            } else {
                self.fds_dropped |= self.fds_allowed;
                close_later(owned);
            }
        }
        Ok(n)
    }

    /// Lowers the most bytes this connection may leave unwritten (a host's messages are
    /// small: it gets far less room than a peer SP).
    pub fn with_out_limit(mut self, bytes: usize) -> Self {
        self.out_limit = bytes.min(MAX_PENDING_OUT_BYTES);
        self
    }

    /// Changes the largest frame this connection may send from now on (what is buffered is
    /// kept): a connection that has not said hello gets a hello's
    /// ([`bootstrap::wire::MAX_HELLO_FRAME_BYTES`]).
    pub fn set_max_frame(&mut self, max: u32) {
        self.decoder.set_max(max);
    }

    /// Reads one frame at most and not a byte past it (what follows stays in the socket for
    /// [`Self::read_frames`], under the limits set after the frame is handled): the bytes held
    /// are bounded by the frame maximum. `Open` also when it handed over a frame, without
    /// having seen `WouldBlock`: read on with `read_frames`, or close.
    pub fn read_one_frame(
        &mut self,
        on_frame: impl FnOnce(Vec<u8>),
    ) -> Result<ReadEnd, FrameError> {
        let mut buf = [0u8; 4096];
        loop {
            if let Some(f) = self.decoder.next_frame()? {
                on_frame(f);
                return Ok(ReadEnd::Open);
            }
            let want = self.decoder.wanted().min(buf.len());
            match self.recv(&mut buf[..want]) {
                Ok(0) => return Ok(ReadEnd::Closed),
                Ok(n) => self.decoder.extend(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(ReadEnd::Open),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Ok(ReadEnd::Closed),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Reads until `WouldBlock` or end of stream, handing every whole frame to `on_frame`.
    /// Stops early (with the error) on an oversized frame.
    ///
    /// Unless `drain`, a read that returns less than the buffer ends it: the socket had no
    /// more (a stream receive takes all that is queued, up to the buffer), and whatever comes
    /// after it raises a new edge-triggered event, so the read that would only say
    /// `WouldBlock` (one system call per message received) is spared. Not after a read that
    /// took descriptors: a Unix socket's receive stops at such a message, whatever follows it.
    /// (Nor does it see past out-of-band data, a Unix socket's mark or TCP's urgent byte:
    /// only a host's own stray `MSG_OOB` sends them, and it delays only that host's messages.) `drain` (the event said the peer
    /// closed or the socket failed, or the caller reads without an event) reads on to
    /// `WouldBlock` or the end of the stream.
    pub fn read_frames(
        &mut self,
        drain: bool,
        mut on_frame: impl FnMut(Vec<u8>),
    ) -> Result<ReadEnd, FrameError> {
        let mut buf = [0u8; 64 * 1024];
        loop {
            match self.recv(&mut buf) {
                Ok(0) => {
                    while let Some(f) = self.decoder.next_frame()? {
                        on_frame(f);
                    }
                    return Ok(ReadEnd::Closed);
                }
                Ok(n) => {
                    self.decoder.extend(&buf[..n]);
                    while let Some(f) = self.decoder.next_frame()? {
                        on_frame(f);
                    }
                    if !drain && n < buf.len() && !self.fds_in_last {
                        return Ok(ReadEnd::Open);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(ReadEnd::Open),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Ok(ReadEnd::Closed),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Queues a whole frame and tries to send it now. A peer that lets more than its limit
    /// ([`MAX_PENDING_OUT_BYTES`] at most) pile up is not reading: the send fails (and the caller closes
    /// the connection, which fails what depended on it) instead of buffering without bound.
    pub fn send(&mut self, frame: &[u8]) -> io::Result<()> {
        if self.pending_out() + frame.len() > self.out_limit {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!(
                    "the other side is not reading: {} bytes already waiting to be sent",
                    self.pending_out()
                ),
            ));
        }
        self.out.extend_from_slice(frame);
        self.flush()
    }

    /// Writes as much of the buffer as the socket takes.
    pub fn flush(&mut self) -> io::Result<()> {
        while self.out_pos < self.out.len() {
            match self.stream.write(&self.out[self.out_pos..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        if self.out_pos == self.out.len() {
            self.out.clear();
            self.out_pos = 0;
        } else if self.out_pos > (1 << 20) {
            self.out.drain(..self.out_pos);
            self.out_pos = 0;
        }
        Ok(())
    }

    pub fn pending_out(&self) -> usize {
        self.out.len() - self.out_pos
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn frame(n: usize) -> Vec<u8> {
        let mut f = (n as u32).to_le_bytes().to_vec();
        f.extend((0..n).map(|i| i as u8));
        f
    }

    /// Reads until `want` frames came (a loopback send can land in pieces), or 5 s.
    fn read_all(c: &mut Conn<()>, drain: bool, want: usize) -> (Vec<Vec<u8>>, ReadEnd) {
        let t = Instant::now();
        let mut got = Vec::new();
        loop {
            let end = c.read_frames(drain, |f| got.push(f)).unwrap();
            if got.len() >= want || end == ReadEnd::Closed || t.elapsed() > Duration::from_secs(5) {
                return (got, end);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn tcp_pair() -> (std::net::TcpStream, Conn<()>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        server.set_nonblocking(true).unwrap();
        let conn = Conn::new(Stream::Tcp(mio::net::TcpStream::from_std(server)), (), 1);
        (client, conn)
    }

    /// A read that does not fill the buffer ends `read_frames` (one read for what was queued,
    /// no read that only says `WouldBlock`), on TCP and on a Unix socket, except after a read
    /// that took a descriptor (the receive stopped at that message: what follows is read on);
    /// and a peer that sent a frame and closed is seen closed when `drain` is asked, as the
    /// event loop does when the event says the other side closed.
    #[test]
    fn a_short_read_ends_the_read_unless_told_to_drain_or_it_took_descriptors() {
        let (mut client, mut conn) = tcp_pair();
        let mut both = frame(100);
        both.extend(frame(3000));
        client.write_all(&both).unwrap();
        let (got, end) = read_all(&mut conn, false, 2);
        assert_eq!((got.len(), end), (2, ReadEnd::Open));
        assert_eq!(got[1].len(), 3000);
        // Every read returned data: none was made only to see `WouldBlock`.
        let reads = conn.reads;
        assert!(reads <= 2, "{reads} reads for two frames queued together");

        // Drained: one more read, which says `WouldBlock`.
        client.write_all(&frame(10)).unwrap();
        let (got, _) = read_all(&mut conn, true, 1);
        assert_eq!(got.len(), 1);
        assert!(conn.reads >= reads + 2, "a drain reads to WouldBlock");

        // A frame and the end of the stream: without drain the frame comes and the stream
        // looks open (the end is for the next read); with drain the end is seen.
        client.write_all(&frame(20)).unwrap();
        drop(client);
        let (got, end) = read_all(&mut conn, false, 1);
        assert_eq!((got.len(), end), (1, ReadEnd::Open));
        let t = Instant::now();
        while conn.read_frames(true, |_| {}).unwrap() != ReadEnd::Closed {
            assert!(t.elapsed() < Duration::from_secs(5), "the end never came");
            std::thread::sleep(Duration::from_millis(1));
        }

        // Unix: the same, except after a message that carried a descriptor, where the
        // receive stopped whatever followed.
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let mut conn = Conn::new(Stream::Unix(mio::net::UnixStream::from_std(b)), (), 2);
        conn.fds_allowed = true;
        let (one, two) = (frame(100), frame(200));
        let devnull = std::fs::File::open("/dev/null").unwrap();
        nix::sys::socket::sendmsg::<()>(
            a.as_raw_fd(),
            &[io::IoSlice::new(&one)],
            &[nix::sys::socket::ControlMessage::ScmRights(&[
                devnull.as_raw_fd()
            ])],
            nix::sys::socket::MsgFlags::empty(),
            None,
        )
        .unwrap();
        (&a).write_all(&two).unwrap();
        let mut got = Vec::new();
        let end = conn.read_frames(false, |f| got.push(f)).unwrap();
        assert_eq!(end, ReadEnd::Open);
        assert_eq!(
            got.len(),
            2,
            "the frame behind the descriptor's message is read too"
        );
        assert_eq!(conn.fds_in.0.len(), 1);
        let reads = conn.reads;
        (&a).write_all(&frame(10)).unwrap();
        let (got, _) = read_all(&mut conn, false, 1);
        assert_eq!(got.len(), 1);
        assert_eq!(
            conn.reads,
            reads + 1,
            "one read for a frame without descriptors"
        );
    }
}
