//! One connection of the event loop: a nonblocking stream with frame reassembly on the way in
//! and a write buffer on the way out.
//!
//! mio's readiness rules apply (see `server`): a readable event means "try", so `read_frames`
//! reads until `WouldBlock`; `flush` writes until the buffer is empty or `WouldBlock`, and is
//! called again on the next writable event.

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
        }
    }

    /// Reads bytes; on a Unix socket also takes the descriptors passed with them (a
    /// descriptor is never left to a plain `read`, which would drop it unseen).
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
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
        // With room for SCM_MAX_FD descriptors the kernel does not truncate rights; if it
        // ever did, nix refuses to list them, and the message is then an error (the
        // connection closes) rather than descriptors left unseen.
        for c in msg.cmsgs().map_err(io::Error::from)? {
            if let ControlMessageOwned::ScmRights(fds) = c {
                got.extend(fds);
            }
        }
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
    pub fn read_frames(
        &mut self,
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
