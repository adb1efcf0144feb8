//! What one instance of a collective costs its machine alone, without an SP around it: a
//! one-rank call of 4 KiB (the breakdown benchmark's case: `Ialltoallv`, `Iallgatherv`, flat
//! `Ibcast`) made, posted, its one copy reported done and dropped, in a loop. Prints the time
//! and the heap allocations per instance (docs/BENCHMARKS.md, section O).
//!
//! `cargo run --release -p algorithms --example instance_cost [-- INSTANCES]`

use algorithms::{allgatherv, alltoallv, bcast, direct, CollKey, CommId, Status};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// The system allocator, counting allocations and their bytes.
struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to `System` unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(l.size() as u64, Relaxed);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(n as u64, Relaxed);
        System.realloc(p, l, n)
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// A key of 96 bytes, near the size of the SP's `AliasKey` (112), so that moving it costs
/// about what it costs there.
type Key = [u64; 12];

fn key(seq: u64) -> CollKey {
    CollKey {
        job: 1,
        comm: CommId { leader: 0, id: 1 },
        seq,
    }
}

fn bcast_one(seq: u64) {
    let key = key(seq);
    let cfg = bcast::Config {
        me: 0,
        chunk_bytes: 256 * 1024,
        staging_slots: 4,
    };
    let mut b: bcast::Bcast<Key> = bcast::Bcast::new(key, cfg);
    let post = bcast::Post {
        rank: 0,
        root: 0,
        members: vec![0],
        nodes: vec![0],
        key: [seq; 12],
        len: 4096,
        design: bcast::Design::Flat,
        shared_key: None,
        shared_at: 0,
    };
    b.handle_post(seq, post).expect("a valid post");
    let mut completed = 0;
    while let Some(a) = b.poll_action() {
        match a {
            bcast::Action::Copy(c) => b.handle_copy_done(seq, c.id, Status::Ok),
            bcast::Action::Complete { status, .. } => {
                assert_eq!(status, Status::Ok);
                completed += 1;
            }
            other => panic!("a one-rank broadcast asked for {other:?}"),
        }
    }
    assert!(
        completed == 1 && b.is_finished(),
        "the instance did not finish"
    );
}

/// Drains a direct machine (`Ialltoallv`, `Iallgatherv`): its one copy done, its one rank
/// complete.
macro_rules! drain_direct {
    ($m:expr, $seq:expr) => {{
        let mut completed = 0;
        while let Some(a) = $m.poll_action() {
            match a {
                direct::Action::Copy(c) => $m.handle_copy_done($seq, c.id, Status::Ok),
                direct::Action::Complete { status, .. } => {
                    assert_eq!(status, Status::Ok);
                    completed += 1;
                }
                other => panic!("a one-rank call asked for {other:?}"),
            }
        }
        assert!(
            completed == 1 && $m.is_finished(),
            "the instance did not finish"
        );
    }};
}

/// A one-rank direct post of 4 KiB with the kind's own part `own`.
fn direct_post<O>(seq: u64, own: O) -> direct::Post<Key, O> {
    direct::Post {
        rank: 0,
        members: vec![0],
        send_key: [seq; 12],
        recv_key: [seq + 1; 12],
        recv_counts: vec![4096],
        recv_displs: vec![0],
        own,
    }
}

fn alltoallv_one(seq: u64) {
    let mut m: alltoallv::Alltoallv<Key> =
        alltoallv::Alltoallv::new(key(seq), direct::Config { me: 0 });
    let own = alltoallv::Own {
        send_counts: vec![4096],
        send_displs: vec![0],
    };
    m.handle_post(seq, direct_post(seq, own))
        .expect("a valid post");
    drain_direct!(m, seq);
}

fn allgatherv_one(seq: u64) {
    let mut m: allgatherv::Allgatherv<Key> =
        allgatherv::Allgatherv::new(key(seq), direct::Config { me: 0 });
    let own = allgatherv::Own {
        nodes: vec![0],
        send_len: 4096,
    };
    m.handle_post(seq, direct_post(seq, own))
        .expect("a valid post");
    drain_direct!(m, seq);
}

fn measure(name: &str, n: u64, one: fn(u64)) {
    for seq in 0..1000 {
        one(seq);
    }
    let (a0, b0) = (ALLOCS.load(Relaxed), BYTES.load(Relaxed));
    let t = Instant::now();
    for seq in 0..n {
        one(seq);
    }
    let ns = t.elapsed().as_nanos() as f64 / n as f64;
    let allocs = (ALLOCS.load(Relaxed) - a0) as f64 / n as f64;
    let bytes = (BYTES.load(Relaxed) - b0) as f64 / n as f64;
    println!("{name:<12} {ns:>8.0} {allocs:>8.1} {bytes:>8.0}");
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .map_or(200_000, |s| s.parse().expect("INSTANCES is a number"));
    println!("# one-rank calls of 4 KiB, {n} instances each; per instance (the post's vectors included):");
    println!("{:<12} {:>8} {:>8} {:>8}", "coll", "ns", "allocs", "bytes");
    measure("ialltoallv", n, alltoallv_one);
    measure("iallgatherv", n, allgatherv_one);
    measure("ibcast flat", n, bcast_one);
}
