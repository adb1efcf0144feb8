//! What the scenario tests of the two staged simulators (`sim_bcast`,
//! `sim_staged_allgather`) share: their configs have the same shape fields
//! and the same fault fields but are different types, so the shared part is
//! a macro expanded in each test file, where `SimConfig`, `SimReport`,
//! `Faults`, `Design`, `Layout`, `run` and the items below resolve to that
//! simulator's.
//!
//! Each file defines, besides the macro's arguments:
//! * `clean(name, cfg, report)`: the checks of a fault-free run;
//! * `small_extra(cfg, i)`, `faulty_extra(cfg)`, `big_extra(cfg)`: what its
//!   `small`, `faulty` and `big` configs set beyond the shared fields.
//!
//! The macro defines `run_ok`, `small`, `faulty`, `faulty_runs`,
//! `faulty_disturbed`, `big`, `grid`, `late_scenario`, `stress`,
//! `stress_faults`, `big_scenario` and `figures`, and the
//! tests it is given names for: many small clusters, SP crashes, rank
//! deaths, copy errors.

// Only the staged simulators' tests expand it.
#![allow(unused_macros, unused_imports)]

/// See the module docs. `$small_clusters`, `$sp_crash`, `$rank_death` and
/// `$copy_errors` name the tests.
macro_rules! staged_scenarios {
    (
        small_clusters: $small_clusters:ident,
        sp_crash: $sp_crash:ident,
        rank_death: $rank_death:ident,
        copy_errors: $copy_errors:ident $(,)?
    ) => {
        fn run_ok(name: &str, cfg: &SimConfig) -> SimReport {
            common::run_ok(name, cfg, run)
        }

        /// [`run_ok`] and the fault-free checks (`clean`).
        fn run_clean(name: &str, cfg: &SimConfig) -> SimReport {
            let r = run_ok(name, cfg);
            clean(name, cfg, &r);
            r
        }

        /// A small random cluster shape from `i`.
        fn small(seed: u64, i: u64) -> SimConfig {
            let mut cfg = SimConfig::new(seed);
            cfg.nodes = 1 + (i % 4) as u32;
            cfg.ranks_per_node = 1 + (i / 4 % 6) as u32;
            cfg.sps_per_node = 1 + (i / 3 % 8) as u32;
            cfg.layout = if i & 1 == 0 {
                Layout::Block
            } else {
                Layout::Cyclic
            };
            cfg.design = if (i >> 1) & 1 == 0 {
                Design::Flat
            } else {
                Design::Hier
            };
            cfg.chunk_bytes = 1 + (i / 5 % 9);
            cfg.staging_slots = 1 + (i / 7 % 4) as u32;
            cfg.max_inflight_reads = 1 + (i % 3) as usize;
            cfg.late_ranks = (i % 3) as u32;
            cfg.ops = 2;
            cfg.faults.msg_jitter_ns = 3_000;
            small_extra(&mut cfg, i);
            cfg
        }

        /// [`small`] with 2 to 4 nodes of 2 to 5 ranks, jitter and `f`.
        fn faulty(seed: u64, i: u64, f: Faults) -> SimConfig {
            let mut cfg = small(seed, i);
            cfg.nodes = 2 + (i % 3) as u32;
            cfg.ranks_per_node = 2 + (i / 3 % 4) as u32;
            cfg.faults = Faults {
                msg_jitter_ns: 2_000,
                ..f
            };
            faulty_extra(&mut cfg);
            cfg
        }

        /// Runs `n` seeds (`seed_of(base, i)`) of [`faulty`] configs with
        /// `faults(i)`; returns the base seed and the error completions.
        fn faulty_runs(
            name: &str,
            n: u64,
            seed_of: fn(u64, u64) -> u64,
            faults: impl Fn(u64) -> Faults,
        ) -> (u64, u64) {
            common::fault_scenario(name, n, seed_of, |seed, i| {
                run_ok(name, &faulty(seed, i, faults(i))).error_completions
            })
        }

        /// [`faulty_runs`] that must see errors: `{name}: {what} (base ..)`.
        fn faulty_disturbed(
            name: &str,
            n: u64,
            seed_of: fn(u64, u64) -> u64,
            faults: impl Fn(u64) -> Faults,
            what: &str,
        ) {
            let (base, errors) = faulty_runs(name, n, seed_of, faults);
            assert!(errors > 0, "{name}: {what} (base {base:#018x})");
        }

        /// 32 nodes x 32 ranks, one collective of `len` bytes.
        fn big(seed: u64, design: Design, sps: u32, len: u64, chunk: u64) -> SimConfig {
            let mut cfg = SimConfig::new(seed);
            cfg.nodes = 32;
            cfg.ranks_per_node = 32;
            cfg.sps_per_node = sps;
            cfg.design = design;
            cfg.ops = 1;
            cfg.len_bytes = Some(len);
            cfg.chunk_bytes = chunk;
            cfg.staging_slots = 4;
            big_extra(&mut cfg);
            cfg
        }

        /// 3 nodes x 4 ranks, 2 SPs per node, one collective.
        fn grid(seed: u64, design: Design, layout: Layout) -> SimConfig {
            let mut cfg = SimConfig::new(seed);
            cfg.nodes = 3;
            cfg.ranks_per_node = 4;
            cfg.sps_per_node = 2;
            cfg.layout = layout;
            cfg.design = design;
            cfg.ops = 1;
            cfg
        }

        /// The late-ranks scenarios: for each seed, 1 to 8 SPs per node
        /// and each design, `nodes` x 8 ranks (cyclic layout for an even
        /// SP count, block for an odd one), `late_ranks` ranks 500 us late,
        /// `skew_ns` random skew, `set` adjusts the rest; each run must be
        /// clean and pass `check(seed, sps, design, report)`.
        fn late_scenario(
            name: &str,
            nodes: u32,
            late_ranks: u32,
            skew_ns: u64,
            set: impl Fn(&mut SimConfig),
            check: impl Fn(u64, u32, Design, &SimReport),
        ) {
            for seed in common::seeds() {
                for sps in 1..=8 {
                    for design in [Design::Flat, Design::Hier] {
                        let mut cfg = SimConfig::new(seed);
                        cfg.nodes = nodes;
                        cfg.ranks_per_node = 8;
                        cfg.sps_per_node = sps;
                        cfg.design = design;
                        cfg.layout = if sps % 2 == 0 {
                            Layout::Cyclic
                        } else {
                            Layout::Block
                        };
                        cfg.arrival_skew_ns = skew_ns;
                        cfg.late_ranks = late_ranks;
                        cfg.late_delay_ns = 500_000;
                        set(&mut cfg);
                        let r = run_clean(name, &cfg);
                        check(seed, sps, design, &r);
                    }
                }
            }
        }

        /// The long random search: `SIM_ITERS` (default 20000) seeds from
        /// `SIM_SEED` (or the clock) on, [`small`] shapes with
        /// `set(i, seed, cfg)` applied; a failure panics with the config,
        /// a success goes to `ok(cfg, report)`.
        fn stress(
            name: &str,
            set: impl Fn(u64, u64, &mut SimConfig),
            ok: impl Fn(&SimConfig, &SimReport),
        ) {
            let n = common::iters(20_000);
            let base = common::extra_seed();
            eprintln!("{name}: base seed={base:#018x}, {n} seeds");
            for i in 0..n {
                let seed = common::spread(base, i);
                let mut cfg = small(seed, i.wrapping_mul(7919) ^ (seed >> 7));
                set(i, seed, &mut cfg);
                match run(&cfg) {
                    Ok(r) => ok(&cfg, &r),
                    Err(e) => panic!("{name}: {e}\n  config: {cfg:?}"),
                }
            }
        }

        /// The stress search's faults of kind `k = seed % 8` other than the
        /// inconsistent posts (the caller adds those): 1 and 5 crash SPs, 2
        /// and 5 kill ranks, 3 fails copies.
        fn stress_faults(k: u64) -> Faults {
            Faults {
                msg_jitter_ns: 3_000,
                sp_crashes: (k == 1 || k == 5) as u32 + (k == 5) as u32,
                crash_window_ns: 40_000,
                detect_delay_ns: 4_000,
                rank_deaths: (k == 2 || k == 5) as u32,
                death_window_ns: 40_000,
                copy_error_ppm: if k == 3 { 20_000 } else { 0 },
                ..Faults::default()
            }
        }

        /// 1024 ranks (32 nodes x 32 ranks), 4 SPs per node, random skew
        /// and 8 late ranks, per design; `cfg` adjusts the [`big`] config;
        /// prints the time and `what(report)`.
        fn big_scenario(
            name: &str,
            len: u64,
            chunk: u64,
            cfg_of: impl Fn(&mut SimConfig),
            what: impl Fn(&SimReport) -> String,
        ) {
            let seed = common::seeds()[0];
            for design in [Design::Flat, Design::Hier] {
                let t0 = std::time::Instant::now();
                let mut cfg = big(seed, design, 4, len, chunk);
                cfg_of(&mut cfg);
                cfg.late_ranks = 8;
                let r = run_clean(name, &cfg);
                eprintln!(
                    "{name}: {design:?} seed={seed:#018x} in {:?}: done at {}ns (SPs {}ns), {} events, {}, {:?}",
                    t0.elapsed(),
                    r.end_ns,
                    r.sp_end_ns,
                    r.events,
                    what(&r),
                    r.stats
                );
            }
        }

        /// The figures tables: for each `(len, chunk)` of `sizes` and 1, 2,
        /// 4, 8 SPs per node, seed 1, no skew nor late ranks, flat then
        /// hierarchical ([`big`]); `row(len, chunk, sps, [flat, hier])`
        /// prints the row, `each(len, sps, design, elapsed, report)` runs
        /// after each run.
        fn figures(
            name: &str,
            sizes: [(u64, u64); 2],
            each: impl Fn(u64, u32, Design, std::time::Duration, &SimReport),
            row: impl Fn(u64, u64, u32, &[SimReport]),
        ) {
            for (len, chunk) in sizes {
                for sps in [1, 2, 4, 8] {
                    let mut t = Vec::new();
                    for design in [Design::Flat, Design::Hier] {
                        let t0 = std::time::Instant::now();
                        let mut cfg = big(1, design, sps, len, chunk);
                        cfg.arrival_skew_ns = 0;
                        cfg.late_ranks = 0;
                        let r = run_clean(name, &cfg);
                        each(len, sps, design, t0.elapsed(), &r);
                        t.push(r);
                    }
                    row(len, chunk, sps, &t);
                }
            }
        }

        #[test]
        fn $small_clusters() {
            let name = stringify!($small_clusters);
            let base = common::extra_seed();
            eprintln!("{name}: seeds 0..300 and {base:#018x}+i");
            for i in 0..300u64 {
                let seed = if i % 2 == 0 {
                    i
                } else {
                    common::consecutive(base, i)
                };
                let cfg = small(seed, i);
                run_clean(name, &cfg);
            }
        }

        /// SP crashes (one, or two plus two rank deaths) at random times:
        /// the simulator's checkers hold (every rank of a live SP
        /// completes, Ok ones with the right bytes, none Ok after its SP
        /// learned of the fault); nothing hangs; some runs are disturbed.
        #[test]
        fn $sp_crash() {
            let crash = |i: u64| {
                let (deaths, crashes) = if i % 2 == 0 { (0, 1) } else { (2, 2) };
                Faults {
                    sp_crashes: crashes,
                    crash_window_ns: 40_000,
                    detect_delay_ns: 4_000,
                    rank_deaths: deaths,
                    death_window_ns: 40_000,
                    ..Faults::default()
                }
            };
            let name = stringify!($sp_crash);
            faulty_disturbed(name, 120, common::spread, crash, "no run was disturbed");
        }

        /// Random rank deaths: no hang, and the checkers hold (ranks
        /// upstream of the dead rank's SP may legitimately complete Ok
        /// before they learn of it).
        #[test]
        fn $rank_death() {
            let death = |i: u64| Faults {
                rank_deaths: 1 + (i % 2) as u32,
                death_window_ns: 30_000,
                ..Faults::default()
            };
            let name = stringify!($rank_death);
            faulty_disturbed(name, 100, common::spread, death, "no run was disturbed");
        }

        /// Failed copies (2%): the checkers hold and some copy failed.
        #[test]
        fn $copy_errors() {
            let copy = |_| Faults {
                copy_error_ppm: 20_000,
                ..Faults::default()
            };
            let name = stringify!($copy_errors);
            faulty_disturbed(name, 100, common::consecutive, copy, "no copy failed");
        }
    };
}

pub(crate) use staged_scenarios;
