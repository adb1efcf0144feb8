//! `coll-bench`: see `coll-bench --help`.

mod coll;
mod compare;
mod fft;
mod late;
mod overlap;
mod run;
mod traffic_run;
mod traffic_table;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "coll-bench",
    version,
    about = "Benchmarks for MPI collectives (`overlap`, `late`, `traffic`, `fft` run under mpirun).",
    long_about = "Benchmarks for MPI collectives. An ordinary MPI program: run `overlap`, `fft`, \
                  `late` and `traffic` under mpirun (or `service-process launch`), natively or \
                  with the host shim LD_PRELOADed (the same binary serves both); `compare` puts \
                  a native result and one or more offloaded results side by side and `traffic-table` renders \
                  traffic results; these two need no MPI."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Communication/computation overlap, OSU method.
    ///
    /// Per size: t_pure = mean time of (post; wait) after warmup, a barrier before every
    /// iteration, then the maximum over ranks of each rank's mean. Then per iteration: post,
    /// compute for t_pure or --compute-us (a busy loop of arithmetic calibrated once per size
    /// to that much of the rank's CPU time, no MPI calls), wait; t_overall and t_compute (its
    /// wall-clock time) are the means (maximum over ranks), and so are post_us and wait_us,
    /// the time spent in the post call and in the wait call; loop_us is the wall-clock time per
    /// iteration of that phase, each iteration's setup (the send buffer refilled with the
    /// validation pattern) and barrier included (maximum over ranks).
    /// overlap_pct = 100 - 100 * (t_overall - t_compute) / t_pure, clamped to [0, 100].
    ///
    /// Every iteration sends a pattern derived from (sender, receiver, iteration, byte); the
    /// receive buffer is pre-filled with a sentinel and checked exactly after the last iteration
    /// of each phase. For ibcast the root is rank (iteration % ranks), so it rotates through
    /// every rank; the root's buffer carries the pattern and every rank, the root included,
    /// checks its buffer. A failed check prints rank, peer (root) and offset, and the exit code
    /// is 1 (after the table). Rank 0 prints the table; --json writes one JSON object per size
    /// per line with: coll, bytes, ranks, nodes (env SPOFF_NODES, default 1), pure_us,
    /// overall_us, compute_us, post_us, wait_us, host_p50_us (the median per call of post +
    /// wait with compute), host_p50_quiet_us and preempted_pct (that median over the calls no
    /// involuntary context switch of the rank reached from the post to the end of the wait,
    /// the compute included, and the share of calls one reached;
    /// printed under the table when --compute-us is given), post_p50_quiet_us and
    /// wait_p50_quiet_us (the post's and the wait's own medians over those calls), loop_us,
    /// overlap_pct, validated, iters, warmup, mode ("offload" if LD_PRELOAD contains
    /// host_shim, else "native"), design (the --design given for ibcast and iallgather, e.g.
    /// "auto"; null for the other collectives, which have no design choice), datatype,
    /// readv_us and breakdown.
    Overlap(overlap::OverlapArgs),

    /// A blocking collective where one rank per node enters late (see `late --help`).
    ///
    /// Reports, per size, `tail_us` (from the last rank's entry to the last rank's exit: how
    /// long the collective still takes once everybody arrived) and `mean_in_call_us` (mean
    /// time per rank inside the call). JSON fields: coll, bytes, ranks, nodes, delay_ms,
    /// tail_us, mean_in_call_us, validated, mode.
    Late(late::LateArgs),

    /// Inter-node bytes per call of an allgather: a ring vs the offloaded call vs the minimum.
    ///
    /// Run it under `service-process launch` (it reads SPOFF_CLUSTER, SPOFF_NODES,
    /// SPOFF_RANKS_PER_NODE and SPOFF_LAYOUT; the node of a world rank is the launcher's
    /// placement: r / ranks_per_node for block, r % nodes for cyclic; without these variables
    /// all ranks are on one node). Per size (bytes per rank, equal counts), --iters calls each:
    ///
    /// 1. ring: an allgatherv written here with MPI_Sendrecv (P - 1 steps; rank r sends to
    ///    r + 1 the block it received in the step before; not intercepted by the shim, so
    ///    native). Every rank counts the bytes it sent to a rank of another node; summed over
    ///    ranks (MPI_Allreduce).
    ///
    /// 2. offload: the ordinary MPI_Allgatherv (or MPI_Allgather); with the shim preloaded and
    ///    SPOFF_CLUSTER set it is offloaded. Rank 0 runs `service-process stats --cluster
    ///    $SPOFF_CLUSTER --json` before and after the calls (barriers around) and takes the
    ///    change of bytes_inter_node summed over all SPs (what the SPs copied from a rank of
    ///    another node). The binary is --service-process, else env SPOFF_SERVICE_PROCESS, else
    ///    `service-process` next to this executable. If the counters cannot be read, if the SPs
    ///    saw no posts, or if the shim is not active (launch --native, SPOFF_OFFLOAD=0), the
    ///    figure is null and offload_note says why; nothing is estimated.
    ///
    /// 3. min: computed, not measured: the sum over ranks of the block size times (number of
    ///    nodes with members - 1): every block enters every other node once.
    ///
    /// Both the ring's and the collective's results are checked byte for byte after every
    /// call (exit code 1 on a mismatch). Figures are per call (total / iters). Rank 0 prints a
    /// table; --json writes one object per size per line with: coll, bytes, ranks, nodes,
    /// layout, ring_inter_node_bytes, offload_inter_node_bytes, min_inter_node_bytes,
    /// validated, iters, mode, offload_posts (SP posts per call) and offload_note (null, or why the offload figures are null).
    Traffic(traffic_run::TrafficArgs),

    /// Renders `traffic --json` files as one table (plain text, or Markdown with --markdown).
    ///
    /// Columns: coll, ranks, nodes, layout, bytes, ring_B, offload_B, min_B (inter-node bytes
    /// per call), ring/min, offload/min, validated; a null figure shows as `-` with the
    /// row's offload_note under the table. Exit code 1 if a row did not validate. Needs no
    /// MPI.
    TrafficTable(traffic_table::TrafficTableArgs),

    /// Compares a native run with one or more offloaded runs (`overlap` or `late` --json).
    ///
    /// With one --offload: joins the two JSON Lines files on (coll, bytes, design) (and
    /// delay_ms for `late` rows) and prints, per row: pure_us, overall_us and overlap_pct of
    /// both, the pure-latency ratio native/offload (above 1 means the offload is faster), the
    /// host time of both and whether both runs validated. A design column is shown when some
    /// row has a design. An offload row whose design the native file lacks is joined with the
    /// native file's rows of that (coll, bytes) if they all have one design (the design changes
    /// nothing natively): one native run serves offloaded runs of several designs, e.g. an
    /// offload file holding a flat and a hier run. Rows present on only one side are listed too.
    ///
    /// With several --offload files (e.g. `--offload flat.json --offload hier.json`): one
    /// table, rows joined on (coll, bytes) (and delay_ms), design ignored: the native columns,
    /// then one column group per offload file, labelled by its design (by its file name if its
    /// rows do not share one design): LABEL_pure_us, LABEL_pure_ratio (native / LABEL),
    /// LABEL_overall_us, LABEL_overlap_pct, LABEL_host_us (`late`: LABEL_tail_us,
    /// LABEL_tail_ratio, LABEL_mean_in_call_us). A file with two rows for one (coll, bytes) is
    /// refused (exit code 2).
    ///
    /// Exit code 1 if a row did not validate or is missing on one side. Needs no MPI: run it
    /// directly, not under mpirun.
    Compare(compare::CompareArgs),

    /// An application proxy: the transpose loop of a slab-decomposed 3D FFT (issue 28).
    ///
    /// Per N and field, a complex N x N x N grid split in x-slabs of ceil(N / P) planes (uneven
    /// when P does not divide N, empty on the last ranks when P * ceil(N / P) - N >=
    /// ceil(N / P)). One 3D FFT of a field: 1D FFTs (mixed radix, any length) along z and y of
    /// the local planes and the pack (stage 1), MPI_Ialltoallv of the transpose to y-slabs
    /// (uneven counts, zeros for empty slabs), 1D FFTs along x (stage 2). Three phases of
    /// --iters timed iterations, each from the same seeded input, a barrier before each:
    /// comm_us (the transposes alone, post then wait, field after field), compute_us (the
    /// stages alone), pipelined_us (post the transpose of field k, run stage 1 of field k + 1,
    /// wait, stage 2 of field k), with post_us and wait_us the time in those calls; means,
    /// maximum over ranks. overlap_pct = 100 - 100 * (pipelined_us - compute_us) / comm_us,
    /// clamped to [0, 100]. The *_min_us fields and overlap_min_pct are the same on each
    /// phase's fastest iteration (less exposed to preemption on a shared machine).
    ///
    /// Checked after the pipelined phase: every received byte and every output byte of every
    /// field equal (bitwise) a reference run of the same computation without overlap whose
    /// transpose is MPI_Isend/MPI_Irecv (point-to-point, never offloaded), and --spot-checks
    /// output points per field and rank equal a direct 3D DFT of the input (to 1e-9 N^3). A
    /// failure prints rank, field and offset; the exit code is then 1. JSON fields: bench, n,
    /// ranks, nodes, fields, iters, seed, max_sent_bytes, comm_us, compute_us, pipelined_us,
    /// comm_min_us, compute_min_us, pipelined_min_us, overlap_min_pct, post_us, wait_us,
    /// overlap_pct, moved_bitwise, spot_checked, validated, mode.
    Fft(fft::FftArgs),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Compare(args) => compare::compare(args),
        Command::Fft(args) => fft::fft(args),
        Command::Late(args) => late::late(args),
        Command::Traffic(args) => traffic_run::traffic(args),
        Command::TrafficTable(args) => traffic_table::traffic_table(args),
        Command::Overlap(args) => overlap::overlap(args),
    };
    std::process::exit(code);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coll::{Coll, Design};
    use crate::overlap::OverlapArgs;
    use std::path::PathBuf;

    #[test]
    fn cli_parses() {
        let cli = Cli::try_parse_from([
            "coll-bench",
            "overlap",
            "--coll",
            "ialltoallv",
            "--sizes",
            "1K,4M",
        ])
        .unwrap();
        let Command::Overlap(a) = cli.command else {
            panic!("not overlap")
        };
        assert_eq!(a.sizes, vec![1024, 4 << 20]);
        assert!(Cli::try_parse_from(["coll-bench", "overlap", "--coll", "nope"]).is_err());
        assert!(Cli::try_parse_from([
            "coll-bench",
            "overlap",
            "--coll",
            "ialltoall",
            "--iters",
            "0"
        ])
        .is_err());
    }

    fn overlap_args(extra: &[&str]) -> OverlapArgs {
        let mut argv = vec!["coll-bench", "overlap"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Overlap(a) => a,
            _ => panic!("not overlap"),
        }
    }

    #[test]
    fn design_option() {
        let a = overlap_args(&["--coll", "ibcast"]);
        assert_eq!((a.coll, a.design), (Coll::Ibcast, Design::Auto));
        let a = overlap_args(&["--coll", "iallgather", "--design", "lb"]);
        assert_eq!(a.design, Design::Lb);
        assert!(Cli::try_parse_from([
            "coll-bench",
            "overlap",
            "--coll",
            "ibcast",
            "--design",
            "ring"
        ])
        .is_err());
    }

    #[test]
    fn compare_takes_several_offload_files() {
        let cli = Cli::try_parse_from([
            "coll-bench",
            "compare",
            "--native",
            "n",
            "--offload",
            "a",
            "--offload",
            "b",
        ])
        .unwrap();
        let Command::Compare(a) = cli.command else {
            panic!("not compare")
        };
        assert_eq!(a.offload, [PathBuf::from("a"), PathBuf::from("b")]);
        assert!(Cli::try_parse_from(["coll-bench", "compare", "--native", "n"]).is_err());
    }
}
