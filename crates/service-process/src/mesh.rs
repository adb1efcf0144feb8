//! The SP mesh at start-up: every SP connects to every lower-numbered SP and accepts every
//! higher-numbered one, and each connection is authenticated both ways before it counts.
//!
//! The handshake (`bootstrap::auth::sp_proof`, HMAC-SHA256 under the cluster key):
//!
//! ```text
//!  A (connects, id a)                      B (accepts, id b)
//!  Sp { sp: a, fingerprint, na }  ───────►  checks the fingerprint and that a > b is expected
//!                                 ◄───────  SpWelcome { sp: b, nb, proof(b; a, b, na, nb) }
//!  checks B's proof
//!  SpProof { proof(a; a, b, na, nb) } ───►  checks A's proof: A is now SP a
//! ```
//!
//! Both nonces are fresh, so a recorded handshake proves nothing later; the prover's id is
//! inside the MAC, so B's proof cannot be reflected back as A's. The cluster description, and
//! so its fingerprint, is world-readable: it only guards against a peer started with another
//! description. A would-be peer that fails any step is refused with a reason and does not
//! take the place of the SP it claimed to be: the real one can still connect until the
//! deadline. Every read during the handshake is bounded by a timeout.
//!
//! The accepting side runs the handshakes of all would-be peers at once (nonblocking sockets,
//! polled in one loop): a connection that says nothing, or stops halfway, holds only its own
//! slot until its timeout, never the real SPs queued behind it (issue 24, item 6). Each
//! holds at most one hello frame ([`wire::MAX_HELLO_FRAME_BYTES`]); beyond
//! [`MAX_PENDING_PEERS`] at once the oldest of those that have not said hello is dropped.

use algorithms::SpId;
use anyhow::{bail, Context};
use bootstrap::auth::{self, ClusterKey};
use bootstrap::rendezvous::{connect_with_backoff, Backoff};
use bootstrap::wire::{self, FrameDecoder, Hello, SpHello};
use bootstrap::Cluster;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};
use tracing::warn;

mod keeper;
pub use keeper::{Keeper, LEAVING_PEER_GRACE};

/// A would-be peer must finish its handshake within this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before the connecting side tries a failed handshake again.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Whether the connecting side's handshake failed on the connection (a peer slow to answer,
/// a connection closed or reset: worth another connection) rather than on what the peer said
/// (a refusal, a failed proof: final).
fn worth_retrying(e: &anyhow::Error) -> bool {
    e.downcast_ref::<wire::FrameError>()
        .is_some_and(|f| matches!(f, wire::FrameError::Io(_) | wire::FrameError::Closed))
        || e.downcast_ref::<io::Error>().is_some()
}

/// Would-be peers in their handshake at once; a new one beyond this drops the oldest that has
/// not said hello yet (or, if all have, the oldest).
pub const MAX_PENDING_PEERS: usize = 64;

/// Connections accepted per round of the handshake loop (well below [`MAX_PENDING_PEERS`]).
const ACCEPTS_PER_ROUND: usize = 16;

fn ch_into_inner(ch: wire::Channel<TcpStream>) -> TcpStream {
    ch.get_ref().try_clone().expect("dup of a connected socket")
}

/// The connecting side of the handshake with SP `peer`.
fn prove_to(
    me: SpId,
    peer: SpId,
    s: TcpStream,
    fingerprint: u64,
    key: &ClusterKey,
) -> anyhow::Result<TcpStream> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut ch = wire::Channel::new(s);
    let na = auth::nonce();
    ch.send_hello(&Hello::Sp(SpHello {
        sp: me,
        cluster_fingerprint: fingerprint,
        nonce: na,
    }))?;
    let answer = ch.recv_hello().map_err(|e| match e {
        wire::FrameError::Io(io)
            if matches!(
                io.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            wire::FrameError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("SP {peer} did not answer the hello within {HANDSHAKE_TIMEOUT:?}"),
            ))
        }
        e => e,
    })?;
    match answer {
        Hello::SpWelcome {
            sp,
            nonce: nb,
            proof,
        } if sp == peer => {
            if proof != auth::sp_proof(key, peer, me, peer, &na, &nb) {
                bail!("the SP at SP {peer}'s address did not prove the cluster key");
            }
            ch.send_hello(&Hello::SpProof {
                proof: auth::sp_proof(key, me, me, peer, &na, &nb),
            })?;
        }
        Hello::Reject { reason } => bail!("SP {peer} refused SP {me}: {reason}"),
        other => bail!("SP {peer} answered the hello with {other:?}"),
    }
    let s = ch_into_inner(ch);
    s.set_read_timeout(None)?;
    Ok(s)
}

/// Where the handshake of an accepted would-be peer stands.
enum Stage {
    /// Waiting for its [`SpHello`].
    Hello,
    /// Welcomed as SP `sp` (our nonce `nb`, its `na`): waiting for its proof.
    Proof {
        sp: SpId,
        na: auth::Nonce,
        nb: auth::Nonce,
    },
}

/// One accepted would-be peer (its socket nonblocking), in its handshake.
struct Pending {
    s: TcpStream,
    from: SocketAddr,
    since: Instant,
    /// Bounded by [`wire::MAX_HELLO_FRAME_BYTES`]: reads only what the next frame needs.
    dec: FrameDecoder,
    stage: Stage,
}

/// What one step of a handshake came to.
enum Step {
    /// Nothing more to read now.
    Wait,
    /// A frame was handled and the handshake goes on.
    Progress,
    /// The peer proved itself: SP `sp`.
    Done(SpId),
    /// Refused (the reason was sent to it when it could be).
    Refused(String),
}

impl Pending {
    fn new(s: TcpStream, from: SocketAddr) -> io::Result<Pending> {
        s.set_nonblocking(true)?;
        let _ = s.set_nodelay(true);
        Ok(Pending {
            s,
            from,
            since: Instant::now(),
            dec: FrameDecoder::new(wire::MAX_HELLO_FRAME_BYTES),
            stage: Stage::Hello,
        })
    }

    /// Sends a hello frame; a fresh socket's buffer takes it whole (if not, the peer is not
    /// reading and is refused).
    fn send(&mut self, h: &Hello) -> Result<(), String> {
        self.s
            .write_all(&wire::frame(&wire::encode_hello(h)))
            .map_err(|e| format!("cannot answer: {e}"))
    }

    fn reject(&mut self, reason: String) -> Step {
        let _ = self.send(&Hello::Reject {
            reason: reason.clone(),
        });
        Step::Refused(reason)
    }

    /// Reads what the next frame still needs (never more) and handles the frame once whole.
    fn step(
        &mut self,
        me: SpId,
        total: SpId,
        fingerprint: u64,
        key: &ClusterKey,
        have: &dyn Fn(SpId) -> bool,
    ) -> Step {
        let payload = loop {
            match self.dec.next_frame() {
                Ok(Some(p)) => break p,
                Ok(None) => {}
                Err(e) => return self.reject(format!("bad hello: {e}")),
            }
            let mut buf = [0u8; 1024];
            let want = self.dec.wanted().min(buf.len());
            match self.s.read(&mut buf[..want]) {
                Ok(0) => return Step::Refused("closed before its handshake ended".into()),
                Ok(n) => self.dec.extend(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Wait,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Step::Refused(format!("bad hello: {e}")),
            }
        };
        let hello = match wire::decode_hello(&payload) {
            Ok(h) => h,
            Err(e) => return self.reject(format!("bad hello: {e}")),
        };
        let stage = match self.stage {
            Stage::Hello => None,
            Stage::Proof { sp, na, nb } => Some((sp, na, nb)),
        };
        match (stage, hello) {
            (None, Hello::Sp(h)) => {
                if h.cluster_fingerprint != fingerprint {
                    return self.reject(format!("SP {} has a different cluster description", h.sp));
                }
                if h.sp <= me || h.sp >= total || have(h.sp) {
                    return self.reject(format!("unexpected SP id {} at SP {me}", h.sp));
                }
                let nb = auth::nonce();
                let welcome = Hello::SpWelcome {
                    sp: me,
                    nonce: nb,
                    proof: auth::sp_proof(key, me, h.sp, me, &h.nonce, &nb),
                };
                if let Err(e) = self.send(&welcome) {
                    return Step::Refused(e);
                }
                self.stage = Stage::Proof {
                    sp: h.sp,
                    na: h.nonce,
                    nb,
                };
                Step::Progress
            }
            (None, other) => self.reject(format!("expected an SP hello, got {other:?}")),
            (Some((sp, na, nb)), Hello::SpProof { proof }) => {
                if proof != auth::sp_proof(key, sp, sp, me, &na, &nb) {
                    return self.reject(format!(
                        "the would-be SP {sp} did not prove the cluster key"
                    ));
                }
                if have(sp) {
                    return self.reject(format!("SP {sp} is already connected to SP {me}"));
                }
                Step::Done(sp)
            }
            (Some(_), other) => self.reject(format!("expected the SP's proof, got {other:?}")),
        }
    }
}

/// The accepting side of the handshake: the would-be peers in their handshake, all at once.
/// Used while the mesh forms ([`connect_mesh`]) and, after that, by the [`Keeper`]'s
/// accepting thread, which takes back an SP that restarted.
struct Acceptor {
    me: SpId,
    total: SpId,
    fingerprint: u64,
    key: ClusterKey,
    pending: Vec<Pending>,
    refused: u32,
}

impl Acceptor {
    fn new(me: SpId, cluster: &Cluster, key: &ClusterKey) -> Acceptor {
        Acceptor {
            me,
            total: cluster.sps.len() as SpId,
            fingerprint: cluster.fingerprint(),
            key: key.clone(),
            pending: Vec::new(),
            refused: 0,
        }
    }

    fn refuse(&mut self, from: SocketAddr, why: &str) {
        self.refused += 1;
        // Bounded: a flood of impostors must not flood the log.
        if self.refused <= 10 {
            warn!(%from, "refusing a would-be peer SP: {why}");
        }
    }

    /// One round: accepts a few new connections from `listener` (nonblocking) and steps every
    /// handshake. Returns the peers that proved themselves, and whether anything happened.
    /// `have` tells which SPs are connected already (refused as duplicates).
    fn round(
        &mut self,
        listener: &std::net::TcpListener,
        have: &dyn Fn(SpId) -> bool,
    ) -> (Vec<(SpId, TcpStream)>, bool) {
        let mut progressed = false;
        // A few at a time, each round reading all of them: a connection is read at least once
        // before newer ones can push it out (a real SP's hello is there as soon as it connects).
        for _ in 0..ACCEPTS_PER_ROUND {
            match listener.accept() {
                Ok((s, from)) => {
                    progressed = true;
                    if self.pending.len() >= MAX_PENDING_PEERS {
                        let oldest = self
                            .pending
                            .iter()
                            .position(|p| matches!(p.stage, Stage::Hello))
                            .unwrap_or(0);
                        let p = self.pending.remove(oldest);
                        self.refuse(
                            p.from,
                            "dropped for a newer connection: too many would-be peers",
                        );
                    }
                    match Pending::new(s, from) {
                        Ok(p) => self.pending.push(p),
                        Err(e) => self.refuse(from, &e.to_string()),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // One client's trouble (ECONNABORTED) or descriptors running out: try again
                // on the next round.
                Err(e) => {
                    warn!("SP {}: accept on the peer listener failed: {e}", self.me);
                    break;
                }
            }
        }
        let now = Instant::now();
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            let step = if now.duration_since(self.pending[i].since) > HANDSHAKE_TIMEOUT {
                Step::Refused(format!("no handshake within {HANDSHAKE_TIMEOUT:?}"))
            } else {
                let (me, total, fp) = (self.me, self.total, self.fingerprint);
                let taken = |sp: SpId| have(sp) || done.iter().any(|(d, _)| *d == sp);
                self.pending[i].step(me, total, fp, &self.key, &taken)
            };
            match step {
                Step::Wait => i += 1,
                Step::Progress => {
                    progressed = true;
                    i += 1;
                }
                Step::Done(sp) => {
                    progressed = true;
                    let p = self.pending.remove(i);
                    match p.s.set_nonblocking(false) {
                        Ok(()) => done.push((sp, p.s)),
                        Err(e) => self.refuse(p.from, &e.to_string()),
                    }
                }
                Step::Refused(why) => {
                    progressed = true;
                    let p = self.pending.remove(i);
                    self.refuse(p.from, &why);
                }
            }
        }
        (done, progressed)
    }

    /// The sockets of the handshakes in progress (to wait on).
    fn fds(&self) -> Vec<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.pending.iter().map(|p| p.s.as_raw_fd()).collect()
    }
}

/// Connects to SP `peer` (lower-numbered) and proves this SP to it, trying again on a new
/// connection while the handshake fails on its connection, until `deadline`. `Ok(None)`: the
/// peer could not be reached by then; `Err`: it refused, or did not prove the key.
fn join_lower(
    me: SpId,
    peer: SpId,
    addr: SocketAddr,
    fingerprint: u64,
    key: &ClusterKey,
    backoff: Backoff,
    deadline: Instant,
) -> anyhow::Result<Option<TcpStream>> {
    let mut tries = 0u32;
    loop {
        tries += 1;
        let left = Backoff {
            deadline: deadline.saturating_duration_since(Instant::now()),
            ..backoff
        };
        let s = match connect_with_backoff(addr, left) {
            Ok(s) => s,
            Err(_) if Instant::now() >= deadline => return Ok(None),
            Err(e) => {
                return Err(anyhow::Error::from(e)
                    .context(format!("SP {me}: connecting to SP {peer} at {addr}")))
            }
        };
        match prove_to(me, peer, s, fingerprint, key) {
            Ok(s) => return Ok(Some(s)),
            Err(e) if worth_retrying(&e) && Instant::now() + RETRY_PAUSE < deadline => {
                if tries <= 10 {
                    warn!(
                        "SP {me}: handshake with SP {peer} at {addr} failed ({e:#}); \
                         trying again"
                    );
                }
                std::thread::sleep(RETRY_PAUSE);
            }
            Err(e) if worth_retrying(&e) => return Ok(None),
            Err(e) => {
                return Err(e.context(format!(
                    "SP {me}: handshake with SP {peer} at {addr} ({tries} tries)"
                )))
            }
        }
    }
}

/// What forming the mesh came to: the connected peers by SP id, and those that were not there
/// by the deadline (they join later, through the [`Keeper`]).
pub struct Mesh {
    pub peers: HashMap<SpId, TcpStream>,
    pub missing: Vec<SpId>,
}

/// Connects to every lower-numbered SP and accepts every higher-numbered one, each proven by
/// the handshake, until all are connected or the backoff's deadline passes. The lower ones are
/// connected to at the same time as the higher ones are accepted.
///
/// A handshake that fails on its connection (the peer did not answer in time: it is slow to
/// start on a loaded machine, or held; or the connection was closed) is tried again on a new
/// connection until the deadline: a slow peer delays the mesh, it does not fail it. A peer
/// that refuses, or does not prove the key, fails it at once. A peer not there by the deadline
/// (its DPU is down, or it starts later) is returned in [`Mesh::missing`]: the SP serves
/// without it, and it joins when it comes (issue 25: one DPU's reboot does not need a
/// cluster-wide restart).
pub fn connect_mesh(
    me: SpId,
    cluster: &Cluster,
    listener: &std::net::TcpListener,
    backoff: Backoff,
    key: &ClusterKey,
    heartbeat: Duration,
) -> anyhow::Result<Mesh> {
    let fingerprint = cluster.fingerprint();
    let mut peers = HashMap::new();
    let deadline = Instant::now() + backoff.deadline;
    // Peers that are serving already (this SP restarted, or started late) judge it by its
    // heartbeats as soon as it joined them: keep beating on every connection while the mesh
    // forms, or they would count it stuck while it waits for a peer that is down.
    let beats = Beats::start(heartbeat)?;
    let mut joins = Vec::new();
    for peer in 0..me {
        let addr = cluster
            .sp(peer)
            .context("peer missing from cluster")?
            .peer_addr;
        let key = key.clone();
        let beats = beats.conns.clone();
        joins.push((
            peer,
            std::thread::Builder::new()
                .name(format!("mesh-{peer}"))
                .spawn(move || {
                    let got = join_lower(me, peer, addr, fingerprint, &key, backoff, deadline);
                    if let Ok(Some(s)) = &got {
                        Beats::add(&beats, s);
                    }
                    got
                })?,
        ));
    }
    let total = cluster.sps.len() as SpId;
    listener.set_nonblocking(true)?;
    let mut acceptor = Acceptor::new(me, cluster, key);
    while (peers.len() as SpId) < total - me - 1 {
        let (done, progressed) = acceptor.round(listener, &|sp| peers.contains_key(&sp));
        for (_, s) in &done {
            Beats::add(&beats.conns, s);
        }
        peers.extend(done);
        if (peers.len() as SpId) >= total - me - 1 || Instant::now() > deadline {
            break;
        }
        if !progressed {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    for (peer, j) in joins {
        match j.join() {
            Ok(Ok(Some(s))) => {
                peers.insert(peer, s);
            }
            Ok(Ok(None)) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => bail!("SP {me}: the thread connecting to SP {peer} panicked"),
        }
    }
    // No heartbeat of this thread may go out halfway through the event loop's first frames.
    beats.stop();
    let missing: Vec<SpId> = (0..total)
        .filter(|p| *p != me && !peers.contains_key(p))
        .collect();
    if !missing.is_empty() {
        warn!(
            "SP {me}: SPs {missing:?} were not there within {:?}; serving without them \
             (each joins when it starts)",
            backoff.deadline
        );
    }
    Ok(Mesh { peers, missing })
}

/// The heartbeats a forming mesh sends on its connections (see [`connect_mesh`]).
struct Beats {
    conns: std::sync::Arc<std::sync::Mutex<Vec<TcpStream>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Beats {
    fn start(period: Duration) -> io::Result<Beats> {
        let conns = std::sync::Arc::new(std::sync::Mutex::new(Vec::<TcpStream>::new()));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (c, st) = (conns.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("mesh-beats".into())
            .spawn(move || {
                let beat = wire::encode(&wire::SpToSp::Heartbeat);
                let mut next = Instant::now() + period;
                while !st.load(std::sync::atomic::Ordering::Acquire) {
                    if Instant::now() < next {
                        std::thread::sleep(Duration::from_millis(10).min(period));
                        continue;
                    }
                    next = Instant::now() + period;
                    let mut conns = c.lock().unwrap_or_else(|e| e.into_inner());
                    // A peer that does not read gets no more (its connection fails later).
                    conns.retain_mut(|s| s.write_all(&beat).is_ok());
                }
            })?;
        Ok(Beats {
            conns,
            stop,
            thread: Some(thread),
        })
    }

    fn add(conns: &std::sync::Mutex<Vec<TcpStream>>, s: &TcpStream) {
        if let Ok(s) = s.try_clone() {
            // A tiny frame: only a peer that stopped reading for long fills the buffer.
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            conns.lock().unwrap_or_else(|e| e.into_inner()).push(s);
        }
    }

    /// Stops the thread and waits for it: no beat is sent after this returns.
    fn stop(self) {
        drop(self)
    }
}

impl Drop for Beats {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-SP "cluster" of SP 0 listening, and a second SP id the tests pose as.
    fn pair() -> (Cluster, std::net::TcpListener, std::net::TcpListener) {
        let l0 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let l1 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let sps = [&l0, &l1]
            .iter()
            .enumerate()
            .map(|(i, l)| bootstrap::cluster::SpEntry {
                id: i as u32,
                node: i as u32,
                index: 0,
                peer_addr: l.local_addr().unwrap(),
                host_socket: std::env::temp_dir().join(format!("mesh-test-{i}.sock")),
                host_addr: None,
            })
            .collect();
        let c = Cluster::new(2, 1, Some(1), bootstrap::Layout::Block, sps).unwrap();
        (c, l0, l1)
    }

    #[test]
    fn an_impostor_without_the_key_is_refused_and_the_real_peer_still_joins() {
        let (cluster, l0, _l1) = pair();
        let key = ClusterKey::generate();
        let addr = cluster.sp(0).unwrap().peer_addr;
        let fp = cluster.fingerprint();
        let backoff = Backoff {
            deadline: Duration::from_secs(10),
            ..Backoff::default()
        };
        let k0 = key.clone();
        let c0 = cluster.clone();
        let sp0 = std::thread::spawn(move || {
            connect_mesh(0, &c0, &l0, backoff, &k0, Duration::from_secs(1))
        });
        // The impostor knows the (public) fingerprint but not the key.
        let s = connect_with_backoff(addr, backoff).unwrap();
        let err = prove_to(1, 0, s, fp, &ClusterKey::generate()).unwrap_err();
        assert!(err.to_string().contains("did not prove"), "{err}");
        // An impostor that sends a forged proof is refused by SP 0.
        let s = connect_with_backoff(addr, backoff).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut ch = wire::Channel::new(s);
        ch.send_hello(&Hello::Sp(SpHello {
            sp: 1,
            cluster_fingerprint: fp,
            nonce: auth::nonce(),
        }))
        .unwrap();
        assert!(matches!(
            ch.recv_hello().unwrap(),
            Hello::SpWelcome { sp: 0, .. }
        ));
        ch.send_hello(&Hello::SpProof { proof: [7; 32] }).unwrap();
        assert!(matches!(ch.recv_hello().unwrap(), Hello::Reject { .. }));
        // The real SP 1 still joins.
        let s = connect_with_backoff(addr, backoff).unwrap();
        prove_to(1, 0, s, fp, &key).unwrap();
        let peers = sp0.join().unwrap().unwrap().peers;
        assert_eq!(peers.keys().copied().collect::<Vec<_>>(), [1]);
    }

    #[test]
    fn silent_and_oversized_would_be_peers_do_not_hold_up_the_real_one() {
        let (cluster, l0, _l1) = pair();
        let key = ClusterKey::generate();
        let addr = cluster.sp(0).unwrap().peer_addr;
        let fp = cluster.fingerprint();
        let backoff = Backoff {
            deadline: Duration::from_secs(10),
            ..Backoff::default()
        };
        // Queued before SP 0 even looks: silent ones, one that stops halfway through its
        // hello, one that announces a frame far beyond a hello's.
        let mut held: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let mut half = TcpStream::connect(addr).unwrap();
        half.write_all(&100u32.to_le_bytes()).unwrap();
        half.write_all(b"SPOF").unwrap();
        held.push(half);
        let mut big = TcpStream::connect(addr).unwrap();
        big.write_all(&(4u32 << 20).to_le_bytes()).unwrap();
        held.push(big);
        let (k0, c0) = (key.clone(), cluster.clone());
        let sp0 = std::thread::spawn(move || {
            connect_mesh(0, &c0, &l0, backoff, &k0, Duration::from_secs(1))
        });
        let t = Instant::now();
        let s = connect_with_backoff(addr, backoff).unwrap();
        prove_to(1, 0, s, fp, &key).unwrap();
        let peers = sp0.join().unwrap().unwrap().peers;
        assert_eq!(peers.keys().copied().collect::<Vec<_>>(), [1]);
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        drop(held);
    }
}
