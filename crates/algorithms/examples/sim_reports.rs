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

/// Seed `i`'s config of the simulator whose `SimConfig` is in scope: 1 to 4
/// nodes, 1 to `ranks` ranks and 1 to `sps` SPs per node (from `i`), the
/// layout from `i`.
macro_rules! shape {
    ($i:expr, ranks: $ranks:expr, sps: $sps:expr) => {{
        let mut cfg = SimConfig::new(seed_of($i));
        cfg.nodes = 1 + ($i % 4) as u32;
        cfg.ranks_per_node = 1 + ($i / 4 % $ranks) as u32;
        cfg.sps_per_node = 1 + ($i / 3 % $sps) as u32;
        cfg.layout = layout($i);
        cfg
    }};
}

/// Seed `i`'s config of a staged simulator ([`shape!`] with up to 6 ranks
/// and 8 SPs per node): `design`, chunks, slots and lengths up to `max_len`
/// (every sixth seed a fixed length below `fixed_below`), copies in flight,
/// late ranks, collectives.
macro_rules! staged_shape {
    ($i:expr, $design:expr, max_len: $max_len:expr, fixed_below: $fixed_below:expr) => {{
        let i = $i;
        let mut cfg = shape!(i, ranks: 6, sps: 8);
        cfg.design = $design;
        cfg.chunk_bytes = 1 + (i / 5 % 9);
        cfg.staging_slots = 1 + (i / 7 % 4) as u32;
        cfg.max_len_bytes = $max_len;
        if i.is_multiple_of(6) {
            cfg.len_bytes = Some(i % $fixed_below);
        }
        cfg.max_inflight_reads = 1 + (i % 3) as usize;
        cfg.late_ranks = (i % 3) as u32;
        cfg.ops = 1 + (i % 3) as u32;
        cfg
    }};
}

/// Runs every setting of `settings` over [`SEEDS`] seeds: `cfg_of(i,
/// faults)` is seed `i`'s config, labelled `{what}/{setting}`.
fn sweep<W: Write, F: Copy, C: Debug, R: Debug>(
    out: &mut Out<W>,
    what: &str,
    settings: &[(&str, F)],
    cfg_of: impl Fn(u64, F) -> C,
    run: impl Fn(&C) -> R,
) {
    for &(name, faults) in settings {
        for i in 0..SEEDS {
            let cfg = cfg_of(i, faults);
            out.run(&format!("{what}/{name}"), i, &cfg, run(&cfg));
        }
    }
}

/// `[(name, Faults)]` of the simulator whose `Faults` is in scope: "clean"
/// and "jitter" (every simulator has them), then the settings given, each
/// written `name: { field: value, ... }` (the other fields default).
macro_rules! faults {
    ($($name:literal: { $($field:ident: $value:expr),* $(,)? }),* $(,)?) => {
        [
            ("clean", Faults::default()),
            ("jitter", Faults { msg_jitter_ns: 3_000, ..Faults::default() }),
            $(($name, Faults { $($field: $value,)* ..Faults::default() })),*
        ]
    };
}

/// The fault settings the two v-simulators share, then the kind's own.
macro_rules! v_settings {
    ($($own:tt)*) => {
        faults!(
            "crash": { msg_jitter_ns: 1_000, sp_crashes: 1, crash_window_ns: 40_000,
                detect_delay_ns: 4_000 },
            "death": { rank_deaths: 2, death_window_ns: 30_000 },
            $($own)*
        )
    };
}

/// The fault settings the two staged simulators share, then the kind's own.
macro_rules! staged_settings {
    ($($own:tt)*) => {
        faults!(
            "crash": { msg_jitter_ns: 2_000, sp_crashes: 1, crash_window_ns: 40_000,
                detect_delay_ns: 4_000 },
            "crash+death": { msg_jitter_ns: 2_000, sp_crashes: 2, crash_window_ns: 40_000,
                detect_delay_ns: 4_000, rank_deaths: 2, death_window_ns: 40_000 },
            "death": { rank_deaths: 1, death_window_ns: 30_000 },
            "copy_err": { msg_jitter_ns: 2_000, copy_error_ppm: 20_000 },
            $($own)*
        )
    };
}

fn allgatherv<W: Write>(out: &mut Out<W>) {
    use sim::allgatherv::{run, Faults, SimConfig};
    #[allow(clippy::needless_update)] // the last setting names every field
    let settings: [(&str, Faults); 5] = v_settings!(
        "crash+death": { msg_jitter_ns: 2_000, sp_crashes: 2, crash_window_ns: 40_000,
            detect_delay_ns: 3_000, rank_deaths: 2, death_window_ns: 40_000 },
    );
    let cfg_of = |i: u64, faults| {
        let mut cfg = shape!(i, ranks: 6, sps: 5);
        cfg.max_inflight_reads = 1 + (i % 3) as usize;
        cfg.max_block_bytes = i / 7 % 40;
        cfg.equal_counts = i.is_multiple_of(5);
        cfg.ops = 1 + (i % 3) as u32;
        cfg.op_gap_ns = (i % 4) * 3_000;
        cfg.late_ranks = (i % 4) as u32;
        cfg.faults = faults;
        cfg
    };
    sweep(out, "allgatherv", &settings, cfg_of, run);
}

fn alltoallv<W: Write>(out: &mut Out<W>) {
    use sim::alltoallv::{run, Faults, SimConfig};
    #[allow(clippy::needless_update)] // the last setting names every field
    let settings: [(&str, Faults); 7] = v_settings!(
        "mismatch": { count_mismatches: 1 },
        "copy_err": { copy_error_ppm: 50_000 },
        "all": { msg_jitter_ns: 2_000, sp_crashes: 1, crash_window_ns: 40_000,
            detect_delay_ns: 3_000, rank_deaths: 1, death_window_ns: 40_000,
            count_mismatches: 1, copy_error_ppm: 20_000 },
    );
    let cfg_of = |i: u64, faults| {
        let mut cfg = shape!(i, ranks: 5, sps: 3);
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
        cfg
    };
    sweep(out, "alltoallv", &settings, cfg_of, run);
}

fn bcast<W: Write>(out: &mut Out<W>) {
    use algorithms::bcast::Design;
    use sim::bcast::{run, Faults, SimConfig};
    let settings: [(&str, Faults); 8] = staged_settings!(
        "inconsistent": { inconsistent_posts: 2 },
        "kill_roots": { kill_roots: true },
    );
    for design in [Design::Flat, Design::Hier] {
        let cfg_of = |i: u64, faults| {
            let mut cfg = staged_shape!(i, design, max_len: 60, fixed_below: 50);
            if i % 4 == 1 {
                cfg.root = Some((i / 4) as u32 % cfg.world_size());
            }
            cfg.faults = faults;
            cfg
        };
        sweep(out, &format!("bcast/{design:?}"), &settings, cfg_of, run);
    }
}

fn staged_allgather<W: Write>(out: &mut Out<W>) {
    use algorithms::staged_allgather::Design;
    use sim::staged_allgather::{run, Faults, SimConfig};
    let settings: [(&str, Faults); 8] = staged_settings!(
        "bad_len": { inconsistent_len: 2 },
        "bad_comm": { msg_jitter_ns: 1_000, inconsistent_comm: 1 },
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
        let cfg_of = |i: u64, faults| {
            let mut cfg = staged_shape!(i, design, max_len: 30, fixed_below: 40);
            cfg.mixed_designs = mixed;
            cfg.faults = faults;
            cfg
        };
        let what = format!("staged_allgather/{dname}");
        sweep(out, &what, &settings, cfg_of, run);
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
