//! The multicast fast path of the multicast-based Bcast and Allgather
//! (`../shared/papers/multicast-bcast-allgather-dpa.txt`; issue 26): the datagram
//! ([`datagram`]), the emulated fabric of real IP multicast groups ([`fabric`]), the receive
//! workers that stand in for the DPA receive kernels ([`worker`]), and the send side
//! ([`send_chunks`]). The reliability layer (cutoff timer, fetch ring, final handshake) and
//! the collectives themselves are built on these.

pub mod bench;
pub mod datagram;
pub mod fabric;
pub mod plane;
pub mod worker;

use std::io;
use std::net::{SocketAddrV4, UdpSocket};

/// Chunks of a `len`-byte buffer at `mtu` bytes each (a 0-byte buffer is one 0-byte chunk, so
/// every receiver still sees the collective).
pub fn chunks(len: u64, mtu: usize) -> u32 {
    len.div_ceil(mtu as u64).max(1) as u32
}

/// The subgroup that carries chunk `psn` of `chunks`: contiguous runs of the buffer per
/// subgroup (§IV, "Multicast subgroups": a worker's bitmap then covers one run, and workers
/// need not share state).
pub fn subgroup_of(psn: u32, chunks: u32, subgroups: u16) -> u16 {
    (u64::from(psn) * u64::from(subgroups.max(1)) / u64::from(chunks.max(1))) as u16
}

/// Sends every chunk of `data` (collective `coll`, tag `tag`) to its subgroup's group in
/// `groups` (indexed by subgroup), `mtu` bytes each, in PSN order. Returns the datagrams sent.
pub fn send_chunks(
    s: &UdpSocket,
    groups: &[SocketAddrV4],
    coll: u64,
    tag: u64,
    data: &[u8],
    mtu: usize,
) -> io::Result<u64> {
    let n = chunks(data.len() as u64, mtu);
    let mut out = Vec::with_capacity(datagram::HEADER_BYTES + mtu);
    for psn in 0..n {
        let sub = subgroup_of(psn, n, groups.len() as u16);
        let from = (psn as usize * mtu).min(data.len());
        let to = (from + mtu).min(data.len());
        let h = datagram::Header {
            subgroup: sub,
            coll,
            tag,
            psn,
            chunks: n,
        };
        datagram::encode(&h, &data[from..to], &mut out);
        send_datagram(s, &out, groups[sub as usize])?;
    }
    Ok(u64::from(n))
}

/// Sends one datagram to `to`, waiting while the sender's own buffer is full (only receivers
/// drop): what the SP's send workers and `send_chunks` share.
pub fn send_datagram(s: &UdpSocket, bytes: &[u8], to: SocketAddrV4) -> io::Result<()> {
    loop {
        match s.send_to(bytes, to) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => std::thread::yield_now(),
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fabric::{self, FabricConfig};
    use super::worker::{Event, Injection, RecvWorker, Registration, Sink, WorkerStats};
    use super::*;
    use std::sync::atomic::{AtomicU16, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    /// A buffer the chunks land in, as a rank's receive buffer would.
    struct Buf {
        bytes: Mutex<Vec<u8>>,
        mtu: usize,
    }

    impl Sink for Buf {
        fn land(&self, psn: u32, payload: &[u8]) -> Result<(), String> {
            let mut b = self.bytes.lock().unwrap();
            let at = psn as usize * self.mtu;
            if at + payload.len() > b.len() {
                return Err(format!("chunk {psn} beyond the buffer"));
            }
            b[at..at + payload.len()].copy_from_slice(payload);
            Ok(())
        }
    }

    /// A port range of its own per test (tests run in parallel in one process).
    fn fabric_cfg() -> FabricConfig {
        static NEXT: AtomicU16 = AtomicU16::new(0);
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        FabricConfig {
            port_base: 48_000 + (std::process::id() % 64) as u16 * 64 + k * 4,
            ..FabricConfig::default()
        }
    }

    fn seed() -> u64 {
        let s = std::env::var("TEST_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        eprintln!("TEST_SEED={s}");
        s
    }

    /// One receiving "SP": a worker per subgroup, each with its subgroup's socket.
    struct Receiver {
        workers: Vec<RecvWorker>,
        events: crossbeam_channel::Receiver<Event>,
        buf: Arc<Buf>,
    }

    fn receiver(
        cfg: &FabricConfig,
        slot: u32,
        subgroups: u16,
        inject: Injection,
        len: usize,
        mtu: usize,
    ) -> Receiver {
        let (tx, events) = crossbeam_channel::unbounded();
        let workers: Vec<RecvWorker> = (0..subgroups)
            .map(|g| {
                let w = RecvWorker::start(
                    &format!("mcast-rx-{g}"),
                    tx.clone(),
                    Injection {
                        seed: inject.seed.wrapping_add(u64::from(g)),
                        ..inject
                    },
                )
                .unwrap();
                w.add_socket(
                    fabric::receiver(cfg.group(slot, g, subgroups), cfg.interface, 4 << 20)
                        .unwrap(),
                );
                w
            })
            .collect();
        Receiver {
            workers,
            events,
            buf: Arc::new(Buf {
                bytes: Mutex::new(vec![0xEE; len]),
                mtu,
            }),
        }
    }

    impl Receiver {
        fn register(&self, coll: u64, tag: u64, chunks: u32) {
            for w in &self.workers {
                w.register(Registration {
                    coll,
                    tag,
                    chunks,
                    sink: self.buf.clone(),
                    skip: vec![],
                });
            }
        }

        /// The PSNs landed until `n` landed or nothing came for `quiet`.
        fn landed(&self, n: usize, quiet: Duration) -> Vec<u32> {
            let mut got = vec![];
            while got.len() < n {
                match self.events.recv_timeout(quiet) {
                    Ok(Event::Landed { psn, .. }) => got.push(psn),
                    Ok(e) => panic!("{e:?}"),
                    Err(_) => break,
                }
            }
            got.sort();
            got
        }

        fn sum(&self, f: impl Fn(&WorkerStats) -> &std::sync::atomic::AtomicU64) -> u64 {
            self.workers
                .iter()
                .map(|w| WorkerStats::get(f(&w.stats)))
                .sum()
        }
    }

    fn data(len: usize, seed: u64) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u64).wrapping_mul(seed | 1).rotate_left(17) as u8)
            .collect()
    }

    #[test]
    fn every_chunk_reaches_every_receiver_over_its_subgroups() {
        let s = seed();
        let cfg = fabric_cfg();
        let (mtu, subgroups) = (4096, 3u16);
        let len = 50 * mtu + 123 + (s % 1000) as usize;
        let src = data(len, s);
        let n = chunks(len as u64, mtu);
        let rx: Vec<Receiver> = (0..2)
            .map(|_| receiver(&cfg, 1, subgroups, Injection::default(), len, mtu))
            .collect();
        let (coll, tag) = (7, s ^ 0x5555);
        for r in &rx {
            r.register(coll, tag, n);
        }
        let groups: Vec<_> = (0..subgroups).map(|g| cfg.group(1, g, subgroups)).collect();
        let tx = fabric::sender(&cfg).unwrap();
        assert_eq!(
            send_chunks(&tx, &groups, coll, tag, &src, mtu).unwrap(),
            u64::from(n)
        );
        for r in &rx {
            let got = r.landed(n as usize, Duration::from_secs(5));
            assert_eq!(got, (0..n).collect::<Vec<_>>(), "landed chunks");
            assert_eq!(*r.buf.bytes.lock().unwrap(), src, "received bytes");
            assert_eq!(r.sum(|s| &s.duplicates), 0);
            // Each worker saw only its own subgroup's run.
            for (g, w) in r.workers.iter().enumerate() {
                let want = (0..n)
                    .filter(|&p| subgroup_of(p, n, subgroups) == g as u16)
                    .count();
                assert_eq!(WorkerStats::get(&w.stats.landed), want as u64, "worker {g}");
            }
        }
    }

    #[test]
    fn forged_foreign_and_malformed_datagrams_are_counted_and_change_no_byte() {
        let s = seed();
        let cfg = fabric_cfg();
        let mtu = 1024;
        let len = 20 * mtu;
        let src = data(len, s);
        let n = chunks(len as u64, mtu);
        let r = receiver(&cfg, 2, 1, Injection::default(), len, mtu);
        let (coll, tag) = (11, s | 1);
        r.register(coll, tag, n);
        let g = [cfg.group(2, 0, 1)];
        let tx = fabric::sender(&cfg).unwrap();
        let mut d = Vec::new();
        // A wrong tag, an unknown collective, a wrong chunk count, garbage: before and after.
        let forge = |d: &mut Vec<u8>| {
            for (c, t, k) in [(coll, tag ^ 1, n), (coll + 1, tag, n), (coll, tag, n + 1)] {
                let h = datagram::Header {
                    subgroup: 0,
                    coll: c,
                    tag: t,
                    psn: 3,
                    chunks: k,
                };
                datagram::encode(&h, &[0x66; 1024], d);
                tx.send_to(d, g[0]).unwrap();
            }
            tx.send_to(b"GET / HTTP/1.1\r\n\r\n", g[0]).unwrap();
        };
        forge(&mut d);
        send_chunks(&tx, &g, coll, tag, &src, mtu).unwrap();
        forge(&mut d);
        // And a replay of a real chunk: a duplicate.
        datagram::encode(
            &datagram::Header {
                subgroup: 0,
                coll,
                tag,
                psn: 0,
                chunks: n,
            },
            &src[..mtu],
            &mut d,
        );
        tx.send_to(&d, g[0]).unwrap();
        let got = r.landed(n as usize, Duration::from_secs(5));
        assert_eq!(got.len(), n as usize);
        let t = Instant::now();
        while r.sum(|s| &s.datagrams) < u64::from(n) + 9 && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(*r.buf.bytes.lock().unwrap(), src);
        assert_eq!(r.sum(|s| &s.bad_tag), 4, "wrong tag or chunk count");
        assert_eq!(r.sum(|s| &s.unknown_coll), 2);
        assert_eq!(r.sum(|s| &s.malformed), 2);
        assert_eq!(r.sum(|s| &s.duplicates), 1);
        assert_eq!(r.sum(|s| &s.landed), u64::from(n));
    }

    #[test]
    fn injected_drops_and_reorder_are_counted_and_the_rest_lands_in_place() {
        let s = seed();
        let cfg = fabric_cfg();
        let mtu = 512;
        let len = 400 * mtu;
        let src = data(len, s);
        let n = chunks(len as u64, mtu);
        let inject = Injection {
            drop_ppm: 100_000,
            reorder_ppm: 50_000,
            seed: s,
        };
        let r = receiver(&cfg, 3, 2, inject, len, mtu);
        let (coll, tag) = (5, 99);
        r.register(coll, tag, n);
        let groups: Vec<_> = (0..2).map(|g| cfg.group(3, g, 2)).collect();
        let tx = fabric::sender(&cfg).unwrap();
        send_chunks(&tx, &groups, coll, tag, &src, mtu).unwrap();
        let got = r.landed(n as usize, Duration::from_millis(500));
        let dropped = r.sum(|s| &s.injected_drops);
        assert!(
            dropped > 0 && dropped < u64::from(n) / 4,
            "{dropped} of {n} dropped at 10 %"
        );
        assert!(r.sum(|s| &s.reordered) > 0);
        assert_eq!(
            got.len() as u64 + dropped + r.sum(|s| &s.overflow_drops),
            u64::from(n)
        );
        // Every landed chunk holds its bytes; every other one is untouched.
        let b = r.buf.bytes.lock().unwrap();
        for p in 0..n as usize {
            let (from, to) = (p * mtu, ((p + 1) * mtu).min(len));
            if got.binary_search(&(p as u32)).is_ok() {
                assert_eq!(b[from..to], src[from..to], "chunk {p}");
            } else {
                assert!(
                    b[from..to].iter().all(|&x| x == 0xEE),
                    "chunk {p} written though dropped"
                );
            }
        }
    }

    #[test]
    fn a_receiver_that_is_not_ready_loses_datagrams_and_counts_the_loss() {
        let cfg = fabric_cfg();
        let mtu = 4096;
        let len = 2000 * mtu;
        let src = data(len, 3);
        let n = chunks(len as u64, mtu);
        let g = cfg.group(4, 0, 1);
        // A small socket buffer and nobody reading while the burst arrives.
        let sock = fabric::receiver(g, cfg.interface, 64 << 10).unwrap();
        let tx = fabric::sender(&cfg).unwrap();
        send_chunks(&tx, &[g], 9, 9, &src, mtu).unwrap();
        let (etx, events) = crossbeam_channel::unbounded();
        let w = RecvWorker::start("mcast-rx-late", etx, Injection::default()).unwrap();
        let buf = Arc::new(Buf {
            bytes: Mutex::new(vec![0; len]),
            mtu,
        });
        w.register(Registration {
            coll: 9,
            tag: 9,
            chunks: n,
            sink: buf,
            skip: vec![],
        });
        w.add_socket(sock);
        let mut landed = 0u64;
        while let Ok(Event::Landed { .. }) = events.recv_timeout(Duration::from_millis(500)) {
            landed += 1;
        }
        // Drain once more after the last datagram so the kernel's count is read.
        let overflow = WorkerStats::get(&w.stats.overflow_drops);
        assert!(overflow > 0, "no overflow counted ({landed} of {n} landed)");
        assert_eq!(
            landed + overflow,
            u64::from(n),
            "every datagram landed or counted lost"
        );
    }
}
