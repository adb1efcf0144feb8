//! The mesh while the SP serves: the [`Keeper`] takes back SPs that restart or start late
//! (issue 25), with the handshake and bounds of start-up (`super`).

use super::{prove_to, Acceptor};
use algorithms::SpId;
use bootstrap::auth::ClusterKey;
use bootstrap::Cluster;
use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};
use tracing::debug;

/// Keeps the mesh whole while the SP serves: a thread accepts higher-numbered SPs that
/// (re)start and prove the key, another connects again to lower-numbered SPs that were lost
/// (or missing at the start), so that a restarted SP rejoins the running ones without any of
/// them restarting. Each proven connection goes to the event loop through a channel, with a
/// wake of its poll; the loop replaces any connection it still had to that SP.
pub struct Keeper {
    /// Lower-numbered SPs to connect to again, each not before its instant.
    want: std::sync::mpsc::Sender<(SpId, Instant)>,
    /// The SP is stopping: take no peer any more (see [`Keeper::stop`]).
    stopping: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Proven connections, by SP.
    pub joined: std::sync::mpsc::Receiver<(SpId, TcpStream)>,
}

/// How long after an SP said it stops (`SpToSp::Shutdown`) its peers first try to reach it
/// again: an SP exits within a fraction of a second of its goodbye.
pub const LEAVING_PEER_GRACE: Duration = Duration::from_secs(1);

/// Pause between two tries of the keeper to reach a lost lower-numbered SP.
const REJOIN_RETRY: Duration = Duration::from_millis(250);

impl Keeper {
    pub fn spawn(
        me: SpId,
        cluster: &Cluster,
        listener: std::net::TcpListener,
        key: &ClusterKey,
        wake: std::sync::Arc<mio::Waker>,
    ) -> anyhow::Result<Keeper> {
        let (tx, joined) = std::sync::mpsc::channel();
        let (want, wanted) = std::sync::mpsc::channel::<(SpId, Instant)>();
        listener.set_nonblocking(true)?;
        let mut acceptor = Acceptor::new(me, cluster, key);
        let (tx_a, wake_a) = (tx.clone(), wake.clone());
        let stopping = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (stop_a, stop_c) = (stopping.clone(), stopping.clone());
        std::thread::Builder::new()
            .name("mesh-accept".into())
            .spawn(move || loop {
                // Stopping: the listener closes with this thread, so a peer trying to rejoin
                // is refused instead of joining an SP about to exit.
                if stop_a.load(std::sync::atomic::Ordering::Acquire) {
                    return;
                }
                // Any proven SP is handed over: the loop replaces a connection it still had
                // (the SP restarted before its old connection was seen to end).
                let (done, progressed) = acceptor.round(&listener, &|_| false);
                if stop_a.load(std::sync::atomic::Ordering::Acquire) {
                    return;
                }
                for d in done {
                    if tx_a.send(d).is_err() {
                        return;
                    }
                    let _ = wake_a.wake();
                }
                if !progressed {
                    wait_readable(&listener, &acceptor.fds(), Duration::from_millis(500));
                }
            })?;
        let addrs: HashMap<SpId, SocketAddr> =
            cluster.sps.iter().map(|e| (e.id, e.peer_addr)).collect();
        let fingerprint = cluster.fingerprint();
        let key = key.clone();
        std::thread::Builder::new()
            .name("mesh-rejoin".into())
            .spawn(move || {
                // Lower-numbered SPs to reach, each not before its instant.
                let mut wanted_set: std::collections::BTreeMap<SpId, Instant> = Default::default();
                loop {
                    if stop_c.load(std::sync::atomic::Ordering::Acquire) {
                        return;
                    }
                    // Wait for work, or take what came while trying.
                    if wanted_set.is_empty() {
                        match wanted.recv() {
                            Ok((sp, at)) => {
                                wanted_set.insert(sp, at);
                            }
                            Err(_) => return,
                        }
                    }
                    loop {
                        match wanted.try_recv() {
                            Ok((sp, at)) => {
                                wanted_set.insert(sp, at);
                            }
                            Err(std::sync::mpsc::TryRecvError::Empty) => break,
                            Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
                        }
                    }
                    let now = Instant::now();
                    let round: Vec<SpId> = wanted_set
                        .iter()
                        .filter(|(_, at)| **at <= now)
                        .map(|(sp, _)| *sp)
                        .collect();
                    for sp in round {
                        let Some(&addr) = addrs.get(&sp) else {
                            wanted_set.remove(&sp);
                            continue;
                        };
                        let got = std::net::TcpStream::connect_timeout(&addr, REJOIN_RETRY)
                            .map_err(anyhow::Error::from)
                            .and_then(|s| prove_to(me, sp, s, fingerprint, &key));
                        match got {
                            Ok(s) => {
                                wanted_set.remove(&sp);
                                if tx.send((sp, s)).is_err() {
                                    return;
                                }
                                let _ = wake.wake();
                            }
                            // Not up yet, or refusing (it may be starting with another
                            // description): tried again, quietly; the loop reports it lost.
                            Err(e) => debug!("SP {me}: SP {sp} not back yet: {e:#}"),
                        }
                    }
                    if !wanted_set.is_empty() {
                        std::thread::sleep(REJOIN_RETRY);
                    }
                }
            })?;
        Ok(Keeper {
            want,
            stopping,
            joined,
        })
    }

    /// The SP is stopping: its keeper takes no peer any more, and its peer listener closes
    /// within one of its waits (500 ms at most), so that peers which saw it go do not rejoin
    /// it in the moments before it exits (each would count a join of an SP that is leaving).
    pub fn stop(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Lower-numbered SP `sp` was lost: connect to it again whenever it comes back, the first
    /// try after `after` (an SP that said it stops is given the moment it takes to exit, so
    /// that this SP does not rejoin it on its way out). A higher-numbered one connects to this
    /// SP by itself.
    pub fn rejoin(&self, me: SpId, sp: SpId, after: Duration) {
        if sp < me {
            let _ = self.want.send((sp, Instant::now() + after));
        }
    }
}

/// Waits (bounded) until the listener or one of the handshake sockets is readable.
fn wait_readable(listener: &std::net::TcpListener, fds: &[std::os::fd::RawFd], t: Duration) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::{AsFd, BorrowedFd};
    // SAFETY: the descriptors are of sockets the acceptor holds for the whole call.
    let borrowed: Vec<BorrowedFd> = fds
        .iter()
        .map(|fd| unsafe { BorrowedFd::borrow_raw(*fd) })
        .collect();
    let mut set: Vec<PollFd> = std::iter::once(listener.as_fd())
        .chain(borrowed.iter().copied())
        .map(|fd| PollFd::new(fd, PollFlags::POLLIN))
        .collect();
    let ms = t.as_millis().min(u16::MAX as u128) as u16;
    let _ = poll(&mut set, PollTimeout::from(ms));
}

#[cfg(test)]
mod tests {
    use super::*;
    use bootstrap::rendezvous::{connect_with_backoff, Backoff};

    /// The peer listener stays open while an SP serves: a would-be peer without the key is
    /// refused and handed to nobody, the real SP 1 (restarted) is handed to the event loop.
    #[test]
    fn the_keeper_refuses_an_impostor_and_hands_over_the_real_peer() {
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
                host_socket: std::env::temp_dir().join(format!("keeper-test-{i}.sock")),
                host_addr: None,
            })
            .collect();
        let cluster = Cluster::new(2, 1, Some(1), bootstrap::Layout::Block, sps).unwrap();
        let key = ClusterKey::generate();
        let poll = mio::Poll::new().unwrap();
        let waker = std::sync::Arc::new(mio::Waker::new(poll.registry(), mio::Token(0)).unwrap());
        let addr = l0.local_addr().unwrap();
        let keeper = Keeper::spawn(0, &cluster, l0, &key, waker).unwrap();
        let fp = cluster.fingerprint();
        let backoff = Backoff {
            deadline: Duration::from_secs(5),
            ..Backoff::default()
        };
        let s = connect_with_backoff(addr, backoff).unwrap();
        let err = prove_to(1, 0, s, fp, &ClusterKey::generate()).unwrap_err();
        assert!(err.to_string().contains("did not prove"), "{err}");
        assert!(
            keeper
                .joined
                .recv_timeout(Duration::from_millis(300))
                .is_err(),
            "an impostor was handed over"
        );
        let s = connect_with_backoff(addr, backoff).unwrap();
        prove_to(1, 0, s, fp, &key).unwrap();
        let (sp, _) = keeper.joined.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(sp, 1);
        // Stopping: the next one is not taken.
        keeper.stop();
        std::thread::sleep(Duration::from_millis(600));
        let taken = connect_with_backoff(
            addr,
            Backoff {
                deadline: Duration::from_millis(500),
                ..Backoff::default()
            },
        )
        .ok()
        .and_then(|s| prove_to(1, 0, s, fp, &key).ok());
        assert!(taken.is_none(), "a stopping keeper took a peer");
        drop(l1);
    }
}
