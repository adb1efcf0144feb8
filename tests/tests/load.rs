//! Issue 24, item 9: the offloaded collectives on a loaded machine. Every core is kept busy by
//! other processes (two busy loops per core) while `service-process launch` runs validating
//! benchmark programs (`coll-bench overlap`: each rank checks every byte it received against
//! the pattern its senders wrote; a wrong byte exits 1) of nonblocking Ibcast (flat), Iallgather
//! and Ialltoall, 1 B to 1 MiB, 2 nodes x 2 ranks, with the SPs' default `--ucx=auto`, under
//! Open MPI and under the MPICH ABI (`launch --mpi mpich`). Every program must pass, and no SP
//! may find a peer silent or see its own event loop held: its longest pass and the longest gap
//! between its looks at the clock stay far below the 10 s peer timeout.
//!
//! The mechanism itself (a transfer that stalls while the loop must go on, a peer slow to
//! start) is provoked directly in `crates/service-process/tests/load.rs`.

use integration_tests::*;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const JOB_TIMEOUT: Duration = Duration::from_secs(90);

/// Busy-loop processes, two per core, stopped (by pid) when dropped.
struct Saturation(Vec<Child>);

impl Saturation {
    fn start() -> Saturation {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let loops = (0..2 * cores)
            .map(|_| {
                Command::new("sh")
                    .args(["-c", "while :; do :; done"])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("starting a busy loop")
            })
            .collect();
        Saturation(loops)
    }
}

impl Drop for Saturation {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn mpi_collectives_on_saturated_cores_under_both_mpis() {
    let _load = Saturation::start();
    let mut summary = Vec::new();
    for (mpi, bench) in [("openmpi", "coll-bench"), ("mpich", "coll-bench-mpich")] {
        let bench = artifact(bench).display().to_string();
        for coll in [
            &["ibcast", "--design", "flat"][..],
            &["iallgather"],
            &["ialltoall"],
        ] {
            let mut program = vec![bench.as_str(), "overlap", "--coll"];
            program.extend_from_slice(coll);
            program.extend_from_slice(&["--sizes", "1,1K,64K,1M", "--iters", "4", "--warmup", "1"]);
            let what = format!("{} under {mpi} on saturated cores", coll.join(" "));
            let run = run(
                launch_cmd(
                    &["--mpi", mpi, "--nodes", "2", "--ranks-per-node", "2"],
                    &program,
                ),
                JOB_TIMEOUT,
            );
            run.assert_ok(&what);
            // The overlap table's rows (the stage breakdown that follows it has rows too).
            let rows: Vec<&str> = run
                .stdout
                .lines()
                .take_while(|l| !l.starts_with("# where an offloaded call's time goes"))
                .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
                .collect();
            assert_eq!(rows.len(), 4, "{what}: one row per size\n{}", run.stdout);
            assert!(
                rows.iter().all(|r| r.trim_end().ends_with("true")),
                "{what}: a size was not validated\n{}",
                run.stdout
            );
            let stats = run.sp_stats();
            assert_eq!(stats.len(), 2, "{what}: every SP reported\n{}", run.stderr);
            assert!(run.sp_total("posts") > 0, "{what}: nothing offloaded");
            for field in ["peers_silent", "copies_failed", "errors_sent"] {
                assert_eq!(run.sp_total(field), 0, "{what}: {field}\n{}", run.stderr);
            }
            for s in &stats {
                let pass = s["loop_pass_max_us"].as_u64().expect("loop_pass_max_us");
                let gap = s["timer_gap_max_ms"].as_u64().expect("timer_gap_max_ms");
                assert!(
                    pass < 3_000_000 && gap < 5_000,
                    "{what}: an SP's event loop was held (longest pass {pass} us, longest gap \
                     between looks at the clock {gap} ms)\n{}",
                    run.stderr
                );
                summary.push(format!(
                    "{what}: pass {pass} us, clock gap {gap} ms, {:?}",
                    run.elapsed
                ));
            }
        }
    }
    for l in summary {
        eprintln!("{l}");
    }
}
