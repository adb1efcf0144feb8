//! Evidence harness for refactorings of this crate: runs every simulator
//! over 100 seeds x several fault settings (and several cluster shapes,
//! layouts, SPs per node, designs and sizes derived from the seed index) and
//! prints each run's config and full report (or failure) with `Debug`, one
//! run per two lines, deterministically.
//!
//!     cargo run --release -p algorithms --example sim_reports > /tmp/sim_after.txt
//!     cmp /tmp/sim_before.txt /tmp/sim_after.txt
//!
//! A refactoring that changes no behaviour leaves this output byte-identical.

use std::fmt::Debug;
use std::io::{self, BufWriter, Write};

use algorithms::sim::{self, Layout};

const SEEDS: u64 = 100;

/// Seed `i` of a setting, spread over the seed space (0 and small values
/// included: `i` itself for even `i`).
fn seed_of(i: u64) -> u64 {
    if i.is_multiple_of(2) {
        i
    } else {
        0x5EED_0000_0000_0000 ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
}

fn layout(i: u64) -> Layout {
    if i & 1 == 0 {
        Layout::Block
    } else {
        Layout::Cyclic
    }
}

struct Out<W: Write> {
    w: W,
    runs: u64,
}

impl<W: Write> Out<W> {
    fn run<C: Debug, R: Debug>(&mut self, what: &str, i: u64, cfg: &C, r: R) {
        self.runs += 1;
        writeln!(self.w, "{what} i={i} cfg={cfg:?}").unwrap();
        writeln!(self.w, "  => {r:?}").unwrap();
    }
}

fn allgatherv<W: Write>(out: &mut Out<W>) {
    use sim::allgatherv::{run, Faults, SimConfig};
    let settings: [(&str, Faults); 5] = [
        ("clean", Faults::default()),
        (
            "jitter",
            Faults {
                msg_jitter_ns: 3_000,
                ..Faults::default()
            },
        ),
        (
            "crash",
            Faults {
                msg_jitter_ns: 1_000,
                sp_crashes: 1,
                crash_window_ns: 40_000,
                detect_delay_ns: 4_000,
                ..Faults::default()
            },
        ),
        (
            "death",
            Faults {
                rank_deaths: 2,
                death_window_ns: 30_000,
                ..Faults::default()
            },
        ),
        (
            "crash+death",
            Faults {
                msg_jitter_ns: 2_000,
                sp_crashes: 2,
                crash_window_ns: 40_000,
                detect_delay_ns: 3_000,
                rank_deaths: 2,
                death_window_ns: 40_000,
            },
        ),
    ];
    for (name, faults) in settings {
        for i in 0..SEEDS {
            let mut cfg = SimConfig::new(seed_of(i));
            cfg.nodes = 1 + (i % 4) as u32;
            cfg.ranks_per_node = 1 + (i / 4 % 6) as u32;
            cfg.sps_per_node = 1 + (i / 3 % 5) as u32;
            cfg.layout = layout(i);
            cfg.max_inflight_reads = 1 + (i % 3) as usize;
            cfg.max_block_bytes = i / 7 % 40;
            cfg.equal_counts = i % 5 == 0;
            cfg.ops = 1 + (i % 3) as u32;
            cfg.op_gap_ns = (i % 4) * 3_000;
            cfg.late_ranks = (i % 4) as u32;
            cfg.faults = faults;
            out.run(&format!("allgatherv/{name}"), i, &cfg, run(&cfg));
        }
    }
}

fn alltoallv<W: Write>(out: &mut Out<W>) {
    use sim::alltoallv::{run, Faults, SimConfig};
    let settings: [(&str, Faults); 7] = [
        ("clean", Faults::default()),
        (
            "jitter",
            Faults {
                msg_jitter_ns: 3_000,
                ..Faults::default()
            },
        ),
        (
            "crash",
            Faults {
                msg_jitter_ns: 1_000,
                sp_crashes: 1,
                crash_window_ns: 40_000,
                detect_delay_ns: 4_000,
                ..Faults::default()
            },
        ),
        (
            "death",
            Faults {
                rank_deaths: 2,
                death_window_ns: 30_000,
                ..Faults::default()
            },
        ),
        (
            "mismatch",
            Faults {
                count_mismatches: 1,
                ..Faults::default()
            },
        ),
        (
            "copy_err",
            Faults {
                copy_error_ppm: 50_000,
                ..Faults::default()
            },
        ),
        (
            "all",
            Faults {
                msg_jitter_ns: 2_000,
                sp_crashes: 1,
                crash_window_ns: 40_000,
                detect_delay_ns: 3_000,
                rank_deaths: 1,
                death_window_ns: 40_000,
                count_mismatches: 1,
                copy_error_ppm: 20_000,
            },
        ),
    ];
    for (name, faults) in settings {
        for i in 0..SEEDS {
            let mut cfg = SimConfig::new(seed_of(i));
            cfg.nodes = 1 + (i % 4) as u32;
            cfg.ranks_per_node = 1 + (i / 4 % 5) as u32;
            cfg.sps_per_node = 1 + (i / 3 % 3) as u32;
            cfg.layout = layout(i);
            cfg.max_inflight_reads = (i % 3) as usize;
            cfg.max_block_bytes = i / 7 % 20;
            cfg.zero_block_percent = (i % 5) as u32 * 12;
            cfg.ops = 1 + (i % 3) as u32;
            cfg.overlap_ops = i % 4 < 2;
            cfg.op_gap_ns = (i % 4) * 2_000;
            cfg.sub_comms = (i / 2 % 3) as u32;
            cfg.late_ranks = (i % 3) as u32;
            cfg.late_delay_ns = 50_000;
            cfg.faults = faults;
            out.run(&format!("alltoallv/{name}"), i, &cfg, run(&cfg));
        }
    }
}

/// The fault settings the two staged simulators share (each has its own `Faults` type with
/// these fields), followed by the kind's own settings.
macro_rules! staged_settings {
    ($($own:expr),* $(,)?) => {
        [
            ("clean", Faults::default()),
            (
                "jitter",
                Faults {
                    msg_jitter_ns: 3_000,
                    ..Faults::default()
                },
            ),
            (
                "crash",
                Faults {
                    msg_jitter_ns: 2_000,
                    sp_crashes: 1,
                    crash_window_ns: 40_000,
                    detect_delay_ns: 4_000,
                    ..Faults::default()
                },
            ),
            (
                "crash+death",
                Faults {
                    msg_jitter_ns: 2_000,
                    sp_crashes: 2,
                    crash_window_ns: 40_000,
                    detect_delay_ns: 4_000,
                    rank_deaths: 2,
                    death_window_ns: 40_000,
                    ..Faults::default()
                },
            ),
            (
                "death",
                Faults {
                    rank_deaths: 1,
                    death_window_ns: 30_000,
                    ..Faults::default()
                },
            ),
            (
                "copy_err",
                Faults {
                    msg_jitter_ns: 2_000,
                    copy_error_ppm: 20_000,
                    ..Faults::default()
                },
            ),
            $($own),*
        ]
    };
}

fn bcast<W: Write>(out: &mut Out<W>) {
    use algorithms::bcast::Design;
    use sim::bcast::{run, Faults, SimConfig};
    let settings: [(&str, Faults); 8] = staged_settings!(
        (
            "inconsistent",
            Faults {
                inconsistent_posts: 2,
                ..Faults::default()
            },
        ),
        (
            "kill_roots",
            Faults {
                kill_roots: true,
                ..Faults::default()
            },
        ),
    );
    for design in [Design::Flat, Design::Hier] {
        for (name, faults) in settings {
            for i in 0..SEEDS {
                let mut cfg = SimConfig::new(seed_of(i));
                cfg.nodes = 1 + (i % 4) as u32;
                cfg.ranks_per_node = 1 + (i / 4 % 6) as u32;
                cfg.sps_per_node = 1 + (i / 3 % 8) as u32;
                cfg.layout = layout(i);
                cfg.design = design;
                cfg.chunk_bytes = 1 + (i / 5 % 9);
                cfg.staging_slots = 1 + (i / 7 % 4) as u32;
                cfg.max_len_bytes = 60;
                if i % 6 == 0 {
                    cfg.len_bytes = Some(i % 50);
                }
                if i % 4 == 1 {
                    cfg.root = Some((i / 4) as u32 % cfg.world_size());
                }
                cfg.max_inflight_reads = 1 + (i % 3) as usize;
                cfg.late_ranks = (i % 3) as u32;
                cfg.ops = 1 + (i % 3) as u32;
                cfg.faults = faults;
                out.run(&format!("bcast/{design:?}/{name}"), i, &cfg, run(&cfg));
            }
        }
    }
}

fn staged_allgather<W: Write>(out: &mut Out<W>) {
    use algorithms::staged_allgather::Design;
    use sim::staged_allgather::{run, Faults, SimConfig};
    let settings: [(&str, Faults); 8] = staged_settings!(
        (
            "bad_len",
            Faults {
                inconsistent_len: 2,
                ..Faults::default()
            },
        ),
        (
            "bad_comm",
            Faults {
                msg_jitter_ns: 1_000,
                inconsistent_comm: 1,
                ..Faults::default()
            },
        ),
    );
    for (design, mixed) in [
        (Design::Flat, false),
        (Design::Hier, false),
        (Design::Flat, true),
    ] {
        let dname = if mixed {
            "Mixed".to_string()
        } else {
            format!("{design:?}")
        };
        for (name, faults) in settings {
            for i in 0..SEEDS {
                let mut cfg = SimConfig::new(seed_of(i));
                cfg.nodes = 1 + (i % 4) as u32;
                cfg.ranks_per_node = 1 + (i / 4 % 6) as u32;
                cfg.sps_per_node = 1 + (i / 3 % 8) as u32;
                cfg.layout = layout(i);
                cfg.design = design;
                cfg.mixed_designs = mixed;
                cfg.chunk_bytes = 1 + (i / 5 % 9);
                cfg.staging_slots = 1 + (i / 7 % 4) as u32;
                cfg.max_len_bytes = 30;
                if i % 6 == 0 {
                    cfg.len_bytes = Some(i % 40);
                }
                cfg.max_inflight_reads = 1 + (i % 3) as usize;
                cfg.late_ranks = (i % 3) as u32;
                cfg.ops = 1 + (i % 3) as u32;
                cfg.faults = faults;
                out.run(
                    &format!("staged_allgather/{dname}/{name}"),
                    i,
                    &cfg,
                    run(&cfg),
                );
            }
        }
    }
}

fn main() {
    let stdout = io::stdout();
    let mut out = Out {
        w: BufWriter::new(stdout.lock()),
        runs: 0,
    };
    allgatherv(&mut out);
    alltoallv(&mut out);
    bcast(&mut out);
    staged_allgather(&mut out);
    let runs = out.runs;
    writeln!(out.w, "runs={runs}").unwrap();
    out.w.flush().unwrap();
}
