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

use algorithms::SpId;
use anyhow::{bail, Context};
use bootstrap::auth::{self, ClusterKey};
use bootstrap::rendezvous::{connect_with_backoff, Backoff};
use bootstrap::wire::{self, Hello, SpHello};
use bootstrap::Cluster;
use std::collections::HashMap;
use std::io;
use std::net::TcpStream;
use std::time::{Duration, Instant};
use tracing::warn;

/// A would-be peer must finish its handshake within this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before the connecting side tries a failed handshake again.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// What a handshake read's error says: a read that timed out is reported as such (the socket's
/// read timeout shows as `EAGAIN`, "Resource temporarily unavailable", which told nothing).
fn read_error(e: wire::FrameError) -> String {
    match e {
        wire::FrameError::Io(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            format!("nothing within {HANDSHAKE_TIMEOUT:?}")
        }
        e => e.to_string(),
    }
}

/// Whether the connecting side's handshake failed on the connection (a peer slow to answer,
/// a connection closed or reset: worth another connection) rather than on what the peer said
/// (a refusal, a failed proof: final).
fn worth_retrying(e: &anyhow::Error) -> bool {
    e.downcast_ref::<wire::FrameError>()
        .is_some_and(|f| matches!(f, wire::FrameError::Io(_) | wire::FrameError::Closed))
        || e.downcast_ref::<io::Error>().is_some()
}

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

/// The accepting side: the id of the SP that proved itself, or why not.
fn check_peer(
    me: SpId,
    total: SpId,
    s: &TcpStream,
    fingerprint: u64,
    key: &ClusterKey,
    have: &HashMap<SpId, TcpStream>,
) -> Result<SpId, String> {
    let _ = s.set_nodelay(true);
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let mut ch = wire::Channel::new(s.try_clone().map_err(|e| e.to_string())?);
    let reject = |ch: &mut wire::Channel<TcpStream>, reason: String| {
        let _ = ch.send_hello(&Hello::Reject {
            reason: reason.clone(),
        });
        Err(reason)
    };
    let h = match ch.recv_hello() {
        Ok(Hello::Sp(h)) => h,
        Ok(other) => return reject(&mut ch, format!("expected an SP hello, got {other:?}")),
        Err(e) => return Err(format!("bad hello: {}", read_error(e))),
    };
    if h.cluster_fingerprint != fingerprint {
        return reject(
            &mut ch,
            format!("SP {} has a different cluster description", h.sp),
        );
    }
    if h.sp <= me || h.sp >= total || have.contains_key(&h.sp) {
        return reject(&mut ch, format!("unexpected SP id {} at SP {me}", h.sp));
    }
    let nb = auth::nonce();
    ch.send_hello(&Hello::SpWelcome {
        sp: me,
        nonce: nb,
        proof: auth::sp_proof(key, me, h.sp, me, &h.nonce, &nb),
    })
    .map_err(|e| e.to_string())?;
    match ch.recv_hello() {
        Ok(Hello::SpProof { proof })
            if proof == auth::sp_proof(key, h.sp, h.sp, me, &h.nonce, &nb) =>
        {
            Ok(h.sp)
        }
        Ok(Hello::SpProof { .. }) => reject(
            &mut ch,
            format!("the would-be SP {} did not prove the cluster key", h.sp),
        ),
        Ok(other) => reject(&mut ch, format!("expected the SP's proof, got {other:?}")),
        Err(e) => Err(format!(
            "no proof from the would-be SP {}: {}",
            h.sp,
            read_error(e)
        )),
    }
}

/// Connects to every lower-numbered SP and accepts every higher-numbered one, each proven by
/// the handshake; returns the streams by SP id. Bounded by the backoff's deadline.
///
/// A handshake that fails on its connection (the peer did not answer in time: it is slow to
/// start on a loaded machine, or held; or the connection was closed) is tried again on a new
/// connection until the deadline: a slow peer delays the mesh, it does not fail it. A peer
/// that refuses, or does not prove the key, fails it at once.
pub fn connect_mesh(
    me: SpId,
    cluster: &Cluster,
    listener: &std::net::TcpListener,
    backoff: Backoff,
    key: &ClusterKey,
) -> anyhow::Result<HashMap<SpId, TcpStream>> {
    let fingerprint = cluster.fingerprint();
    let mut peers = HashMap::new();
    let deadline = Instant::now() + backoff.deadline;
    for peer in 0..me {
        let addr = cluster
            .sp(peer)
            .context("peer missing from cluster")?
            .peer_addr;
        let mut tries = 0u32;
        let s = loop {
            tries += 1;
            let left = Backoff {
                deadline: deadline.saturating_duration_since(Instant::now()),
                ..backoff
            };
            let s = connect_with_backoff(addr, left)
                .with_context(|| format!("SP {me}: connecting to SP {peer} at {addr}"))?;
            match prove_to(me, peer, s, fingerprint, key) {
                Ok(s) => break s,
                Err(e) if worth_retrying(&e) && Instant::now() + RETRY_PAUSE < deadline => {
                    if tries <= 10 {
                        warn!(
                            "SP {me}: handshake with SP {peer} at {addr} failed ({e:#}); \
                             trying again"
                        );
                    }
                    std::thread::sleep(RETRY_PAUSE);
                }
                Err(e) => {
                    return Err(e.context(format!(
                        "SP {me}: handshake with SP {peer} at {addr} ({tries} tries)"
                    )))
                }
            }
        };
        peers.insert(peer, s);
    }
    let total = cluster.sps.len() as SpId;
    listener.set_nonblocking(true)?;
    let mut refused = 0u32;
    while (peers.len() as SpId) < total - 1 {
        let (s, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    let missing: Vec<SpId> =
                        (me + 1..total).filter(|p| !peers.contains_key(p)).collect();
                    bail!(
                        "SP {me}: SPs {missing:?} did not connect within {:?}",
                        backoff.deadline
                    );
                }
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        s.set_nonblocking(false)?;
        match check_peer(me, total, &s, fingerprint, key, &peers) {
            Ok(sp) => {
                s.set_read_timeout(None)?;
                peers.insert(sp, s);
            }
            Err(why) => {
                refused += 1;
                // Bounded: a flood of impostors must not flood the log.
                if refused <= 10 {
                    warn!(%from, "refusing a would-be peer SP: {why}");
                }
            }
        }
    }
    Ok(peers)
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
        let sp0 = std::thread::spawn(move || connect_mesh(0, &c0, &l0, backoff, &k0));
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
        let peers = sp0.join().unwrap().unwrap();
        assert_eq!(peers.keys().copied().collect::<Vec<_>>(), [1]);
    }
}
