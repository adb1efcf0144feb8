use super::*;
use crate::sim::staged_common::clean_by_design;
use crate::staged_allgather::{set_mutation, Mutation};

#[test]
fn provenance_memory_splits_and_merges() {
    let mut m = Mem::new(20, Src::Init);
    assert_eq!(m.touched_from(0), None);
    let a = Ext {
        len: 5,
        src: Src::Send(1),
        base: 0,
    };
    let b = Ext {
        len: 5,
        src: Src::Send(1),
        base: 5,
    };
    m.write(10, &[b]);
    m.write(5, &[a]);
    // Merged into one extent: bytes 0..10 of rank 1 at 5..15.
    assert_eq!(m.ext.len(), 3, "{m:?}");
    assert_eq!(
        m.read(7, 4),
        vec![Ext {
            len: 4,
            src: Src::Send(1),
            base: 2
        }]
    );
    assert_eq!(m.touched_from(15), None);
    assert_eq!(m.touched_from(0), Some(5));
    let mut g = Mem::new(6, Src::Init);
    g.write(0, &m.read(5, 3));
    g.write(3, &m.read(8, 3));
    assert_eq!(
        g.wrong_block_byte(2, 3),
        Some(0),
        "rank 1 bytes where rank 0 belongs"
    );
    let mut h = Mem::new(6, Src::Init);
    h.write(
        0,
        &[
            Ext {
                len: 3,
                src: Src::Send(0),
                base: 0,
            },
            Ext {
                len: 3,
                src: Src::Send(1),
                base: 0,
            },
        ],
    );
    assert_eq!(h.wrong_block_byte(2, 3), None);
    h.write(
        4,
        &[Ext {
            len: 1,
            src: Src::Garbage,
            base: 0,
        }],
    );
    assert_eq!(h.wrong_block_byte(2, 3), Some(4));
}

/// `Mem` against a model holding each byte's provenance.
#[test]
fn provenance_memory_matches_a_byte_model() {
    use crate::sim::rng::Rng;
    type Byte = (Src, u64);
    let mut rng = Rng::new(7);
    for _ in 0..200 {
        let size = rng.range(1, 40);
        let mut mems = [Mem::new(size, Src::Init), Mem::new(size, Src::Garbage)];
        let mut model: [Vec<Byte>; 2] = [
            (0..size).map(|p| (Src::Init, p)).collect(),
            (0..size).map(|_| (Src::Garbage, 0)).collect(),
        ];
        for _ in 0..30 {
            let (d, at) = (rng.below(2) as usize, rng.below(size));
            let len = rng.range(0, size - at);
            // Pieces: read from the other buffer, or fresh send bytes.
            let pieces: Vec<Ext> = if rng.chance(1, 2) {
                let from = rng.below(size - len + 1);
                mems[1 - d].read(from, len)
            } else {
                let mut v = Vec::new();
                let mut left = len;
                while left > 0 {
                    let l = rng.range(1, left);
                    let src = match rng.below(3) {
                        0 => Src::Garbage,
                        1 => Src::Send(rng.below(2) as Rank),
                        _ => Src::Init,
                    };
                    let base = if src == Src::Garbage {
                        0
                    } else {
                        rng.below(50)
                    };
                    v.push(Ext { len: l, src, base });
                    left -= l;
                }
                v
            };
            let mut bytes = Vec::new();
            for p in &pieces {
                for k in 0..p.len {
                    let b = if p.src == Src::Garbage { 0 } else { p.base + k };
                    bytes.push((p.src, b));
                }
            }
            mems[d].write(at, &pieces);
            model[d][at as usize..(at + len) as usize].copy_from_slice(&bytes);
            for (m, want) in mems.iter().zip(&model) {
                let mut got = Vec::new();
                let mut end = 0;
                for (&s, e) in &m.ext {
                    assert_eq!(s, end, "extents tile the buffer: {m:?}");
                    end = s + e.len;
                    for k in 0..e.len {
                        got.push((e.src, if e.src == Src::Garbage { 0 } else { e.base + k }));
                    }
                }
                assert_eq!(end, m.size);
                assert_eq!(&got, want);
                // Maximal merging: no two neighbours continue each other.
                let v: Vec<&Ext> = m.ext.values().collect();
                assert!(v.windows(2).all(|w| !w[0].continued_by(w[1])), "{m:?}");
            }
        }
    }
}

fn cfg(seed: u64) -> SimConfig {
    let mut c = SimConfig::new(seed);
    c.len_bytes = Some(40);
    c.faults.msg_jitter_ns = 2_000;
    c
}

#[test]
fn a_run_writes_every_block_everywhere() {
    let cfg = |design| SimConfig { design, ..cfg(5) };
    for r in clean_by_design(cfg, run) {
        assert_eq!(r.bytes_inter_node, r.expected_inter_node_bytes);
        assert!(r.reads > 0 && r.writes > 0);
        assert!(r.stats.max_slots_in_use >= 2, "{:?}", r.stats);
        assert_eq!(r.after_finish_dropped, 0);
    }
}

/// Runs `c` under `m` for a few seeds; every seed must fail with a
/// message containing one of `want`. Returns the first failure.
fn caught(m: Mutation, c: SimConfig, want: &[&str]) -> String {
    driver::caught(m, set_mutation, c, run, want)
}

#[test]
fn checkers_catch_a_slot_freed_while_its_writes_read_it() {
    caught(
        Mutation::FreeWhileWriting,
        cfg(0),
        &["while 1 writes out of it", "writes out of it"],
    );
}

#[test]
fn checkers_catch_ranks_completing_before_every_writer_is_done() {
    caught(
        Mutation::CompleteEarly,
        cfg(0),
        &["on the receive buffer of rank", "is wrong"],
    );
}

/// SP crashes and copy errors abort while remote writes are in flight.
fn aborting(c: SimConfig) -> SimConfig {
    let mut c = c;
    c.len_bytes = Some(64);
    c.chunk_bytes = 16;
    c.late_ranks = 0;
    c.arrival_skew_ns = 2_000;
    c.faults.copy_error_ppm = 30_000;
    c
}

#[test]
fn checkers_catch_a_skipped_stop_handshake() {
    let mut c = aborting(cfg(0));
    c.design = Design::Flat;
    caught(
        Mutation::SkipStopHandshake,
        c,
        &["on the receive buffer of rank", "on the region of SP"],
    );
}

#[test]
fn checkers_catch_a_skipped_stop_handshake_hier() {
    let mut c = aborting(cfg(0));
    c.design = Design::Hier;
    caught(Mutation::SkipStopHandshake, c, &["on the region of SP"]);
}

#[test]
fn checkers_catch_send_buffers_read_after_an_abort_completed_them() {
    let mut c = aborting(cfg(0));
    c.faults.copy_error_ppm = 0;
    c.faults.rank_deaths = 1;
    c.faults.death_window_ns = 3_000;
    c.staging_slots = 8;
    c.max_inflight_reads = 16;
    caught(
        Mutation::IgnoreReadsOnAbort,
        c,
        &["on the send buffer of rank"],
    );
}

#[test]
fn checkers_catch_ok_completions_after_an_abort() {
    let mut c = cfg(0);
    c.faults.inconsistent_len = 1;
    c.faults.rank_deaths = 1;
    c.faults.death_window_ns = 10_000;
    caught(
        Mutation::OkAfterAbort,
        c,
        &["learned of a fault", "did not post the same"],
    );
}
