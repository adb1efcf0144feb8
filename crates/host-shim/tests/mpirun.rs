//! Real `mpirun` jobs of unmodified MPI programs (`progs/*.c`, built with `mpicc`) with the
//! shim preloaded.
//!
//! Offload runs go through the real launcher (`service-process launch`) and real SPs, on 2
//! nodes x 2 ranks: alltoall(v) (`a2a_check`) and randomized allgather(v) (`ag_check`, with
//! one consistently late rank, 1 and 2 SPs per node, block and cyclic placement). Each checks the program's own verdict and, from the SPs' counters, that
//! exactly the calls the program counted as eligible were posted (so nothing it must keep
//! native, a non-contiguous type or `MPI_IN_PLACE`, was offloaded) and completed, without a
//! failed copy; two of them grant with the `ucx` backend (`SPOFF_BACKEND=ucx`, SPs with
//! UCX on), one freeing and reallocating its buffers between collectives. The fallback runs
//! use no SP, a cluster description naming one that is not there, or real SPs with offload
//! disabled; two runs kill a real SP mid-job (the program with `MPI_ERRORS_RETURN`, and with the
//! default `MPI_ERRORS_ARE_FATAL`, which must abort the job as a native failure would), and two
//! run against a fake SP that refuses every post (the mailbox slots all end quarantined).
//!
//! The launcher, the SP and the shim come from the target directory of this test executable:
//! build the workspace first (`cargo build --release --workspace`; `make test` does). A missing
//! artifact, `mpicc` or `mpirun` is a failure, never a skip.

use bootstrap::cluster::{Cluster, Layout, SpEntry};
use integration_tests::{launch_cmd, pids_matching, run, shim, Finished};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const NP: u64 = 4;
const TIMEOUT: Duration = Duration::from_secs(120);
/// The shim's settings: every job gets the ones its test sets, never the caller's.
const SHIM_VARS: [&str; 11] = [
    "SPOFF_IALLGATHER_DESIGN",
    "SPOFF_HOST_COPIES",
    "SPOFF_BCAST_DESIGN",
    "SPOFF_HIER_MIN_RANKS",
    "SPOFF_SEGMENT_BYTES",
    "SPOFF_CLUSTER",
    "SPOFF_OFFLOAD",
    "SPOFF_JOB_CREDENTIAL",
    "SPOFF_VERBOSE",
    "SPOFF_MAILBOX_SLOTS",
    "SPOFF_BACKEND",
];

/// A well-formed job credential of a cluster no SP knows: for runs against fake or missing
/// SPs (without one the shim does not even try to offload).
fn some_credential() -> String {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let key = bootstrap::auth::ClusterKey::generate();
    bootstrap::auth::JobCredential::issue(&key, 1, uid, NP as u32).encode()
}

/// One MPI job at a time (the machine has few cores).
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// `progs/<name>.c` compiled with `mpicc` (once per test process).
fn prog(name: &'static str) -> String {
    static BUILT: Mutex<BTreeMap<&str, String>> = Mutex::new(BTreeMap::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    built
        .entry(name)
        .or_insert_with(|| {
            let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/progs/{name}.c"));
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("host-shim-progs");
            std::fs::create_dir_all(&dir).unwrap();
            // Built under a private name, then renamed: concurrent test runs never see a
            // half-written binary.
            let tmp = dir.join(format!("{name}.{}", std::process::id()));
            let st = Command::new("mpicc")
                .args(["-O1", "-Wall", "-pthread", "-o"])
                .arg(&tmp)
                .arg(&src)
                .status()
                .unwrap_or_else(|e| {
                    panic!("cannot run mpicc (install Open MPI: `make deps`): {e}")
                });
            assert!(st.success(), "mpicc failed on {}", src.display());
            let out = dir.join(name);
            std::fs::rename(&tmp, &out).unwrap();
            out.display().to_string()
        })
        .clone()
}

/// `cmd` with the shim's settings cleared, then `env` set.
fn with_env(mut cmd: Command, env: &[(&str, &str)]) -> Command {
    for k in SHIM_VARS {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// `program` on 2 nodes x 2 ranks under the real launcher, with `sps_per_node` real SPs per
/// node. The launcher's mpirun, and so every rank, inherits `env`.
fn launch(sps_per_node: u32, program: &[&str], env: &[(&str, &str)]) -> Finished {
    launch_with(sps_per_node, &[], program, env)
}

/// [`launch`] with more launcher arguments (`--sp-arg=...`).
fn launch_with(
    sps_per_node: u32,
    extra: &[&str],
    program: &[&str],
    env: &[(&str, &str)],
) -> Finished {
    let k = sps_per_node.to_string();
    let mut args = vec![
        "--nodes",
        "2",
        "--ranks-per-node",
        "2",
        "--sps-per-node",
        &k,
    ];
    args.extend_from_slice(extra);
    let run = run(with_env(launch_cmd(&args, program), env), TIMEOUT);
    eprintln!("{} under the launcher: {:?}", shown(program), run.elapsed);
    run
}

/// `program` on `NP` ranks under plain `mpirun` with the shim preloaded and `env` exported.
fn mpirun_preloaded(program: &[&str], env: &[(&str, &str)]) -> Finished {
    mpirun_preloaded_within(program, env, TIMEOUT)
}

/// [`mpirun_preloaded`], a hang being anything longer than `timeout`.
fn mpirun_preloaded_within(program: &[&str], env: &[(&str, &str)], timeout: Duration) -> Finished {
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "--oversubscribe",
        "--bind-to",
        "none",
        "-np",
        &NP.to_string(),
    ])
    .args(["-x", "LD_PRELOAD"])
    .env("LD_PRELOAD", shim());
    for (k, _) in env {
        cmd.arg("-x").arg(k);
    }
    cmd.args(program);
    let run = run(with_env(cmd, env), timeout);
    eprintln!("{} under mpirun: {:?}", shown(program), run.elapsed);
    run
}

/// A command line for the log: file names of paths, scripts left out.
fn shown(program: &[&str]) -> String {
    let words = program.iter().filter(|a| !a.contains('\n'));
    let words: Vec<&str> = words.map(|a| a.rsplit('/').next().unwrap_or(a)).collect();
    words.join(" ")
}

fn shim_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.contains("host-shim:"))
        .collect()
}

/// Asserts the job passed by the program's own verdict; returns the calls per rank the
/// program counted as eligible for offload.
fn verdict(run: &Finished, prog: &str) -> u64 {
    run.assert_ok(prog);
    let ok = format!("{prog}: all ok (");
    run.stdout
        .lines()
        .find_map(|l| l.strip_prefix(&ok))
        .and_then(|l| l.strip_suffix(" eligible calls per rank)"))
        .and_then(|l| l.rsplit([' ', '(']).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "no \"{ok}... eligible calls per rank)\" verdict\n--- stdout\n{}\n--- stderr\n{}",
                run.stdout, run.stderr
            )
        })
}

/// The program passed, and the `sps` SPs posted exactly its eligible calls (so they did
/// offload) and completed every one, without a failed copy or an error sent.
fn assert_offloaded(run: &Finished, prog: &str, sps: usize) {
    let eligible = verdict(run, prog);
    let posts = run.sp_total("posts");
    assert!(posts > 0, "nothing was offloaded\n{}", run.stderr);
    assert_eq!(
        posts,
        NP * eligible,
        "the SPs must see every eligible call of every rank and nothing else\n{}",
        run.stderr
    );
    assert_eq!(run.sp_total("completions"), posts, "{}", run.stderr);
    assert_eq!(run.sp_total("copies_failed"), 0, "{}", run.stderr);
    assert_eq!(run.sp_total("errors_sent"), 0, "{}", run.stderr);
    assert_eq!(
        run.sp_stats().len(),
        sps,
        "every SP reports\n{}",
        run.stderr
    );
    eprintln!("{prog}: {posts} posts offloaded");
}

/// Every Wait/Test variant mixed with point-to-point and null requests, the contiguous derived
/// type, split/reversed/dup communicators, the vector type (packed) and `MPI_IN_PLACE`, six
/// collectives outstanding at once on a mailbox of `slots` (< 6) slots, and a request freed
/// before completion.
fn a2a_check_offloads(sps_per_node: u32, slots: &str) {
    let _serial = serial();
    let prog = prog("a2a_check");
    let run = launch(
        sps_per_node,
        &[&prog, "2", "free"],
        &[("SPOFF_VERBOSE", "1"), ("SPOFF_MAILBOX_SLOTS", slots)],
    );
    assert_offloaded(&run, "a2a_check", 2 * sps_per_node as usize);
    // The settings reached every rank through the launcher's environment: each one says it
    // activated with that many slots, and says nothing else.
    let lines = shim_lines(&run.stderr);
    assert_eq!(lines.len(), NP as usize, "{}", run.stderr);
    for r in 0..NP {
        assert!(
            lines
                .iter()
                .any(|l| l.contains(&format!("rank {r}: offload active"))
                    && l.ends_with(&format!(", {slots} mailbox slots"))),
            "rank {r} did not activate with {slots} slots\n{}",
            run.stderr
        );
    }
}

/// `legal_mix MODE` on 2 nodes x 2 ranks with `sps_per_node` SPs per node, `layout`, and
/// `env`: every rank must print its own "ok" line (there is no final reduction: in mode
/// `early` the root leaves as soon as its part is done), and the SPs must have been posted
/// every call of every rank, completed each, and failed no copy. Returns the run.
fn legal_mix(mode: &str, sps_per_node: u32, layout: &str, env: &[(&str, &str)]) -> Finished {
    let _serial = serial();
    let prog = prog("legal_mix");
    let run = launch_with(sps_per_node, &["--layout", layout], &[&prog, mode], env);
    run.assert_ok(&format!("legal_mix {mode}"));
    let mut calls = 0;
    for r in 0..NP {
        let head = format!("legal_mix {mode}: rank {r} ok (");
        let line = run
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix(head.as_str()));
        let n: u64 = line
            .and_then(|l| l.strip_suffix(" eligible calls)"))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("rank {r} did not pass\n{}\n{}", run.stdout, run.stderr));
        calls += n;
    }
    assert_eq!(run.sp_total("posts"), calls, "{}", run.stderr);
    assert_eq!(run.sp_total("completions"), calls, "{}", run.stderr);
    assert_eq!(run.sp_total("copies_failed"), 0, "{}", run.stderr);
    assert_eq!(run.sp_total("errors_sent"), 0, "{}", run.stderr);
    run
}

/// Symptom 1 of issue 11: single-block derived types whose data do not start at the buffer
/// address (wrong bytes, then hangs). Every byte around the data is compared too.
#[test]
fn derived_types_with_offset_data_match_native() {
    for (k, layout, design) in [(1, "block", "flat"), (2, "cyclic", "hier")] {
        let run = legal_mix("offsets", k, layout, &[("SPOFF_BCAST_DESIGN", design)]);
        assert!(run.sp_total("posts_packed") > 0, "{}", run.stderr);
    }
}

/// Symptom 2: one message described with different type maps by different ranks (contiguous
/// against vector, a struct listed out of address order, `MPI_IN_PLACE` on some ranks only)
/// once split the ranks between the offloaded and the native path. All of it is offloaded
/// now, the packed sides counted by the SPs.
#[test]
fn ranks_describing_one_message_differently_agree() {
    for (k, layout, design) in [(1, "cyclic", "flat"), (2, "block", "hier")] {
        let run = legal_mix("mixed", k, layout, &[("SPOFF_BCAST_DESIGN", design)]);
        assert!(run.sp_total("posts_packed") > 0, "{}", run.stderr);
    }
}

/// Symptom 3: the root of a broadcast finalizes and exits while ranks of the other node have
/// not entered it yet; its SP must still deliver the message, and nobody fails.
#[test]
fn a_root_that_finalizes_at_once_fails_nobody() {
    for (k, layout, design) in [
        (1, "block", "flat"),
        (2, "block", "hier"),
        (1, "cyclic", "hier"),
    ] {
        legal_mix("early", k, layout, &[("SPOFF_BCAST_DESIGN", design)]);
    }
}

/// Symptom 4: 2 x 1100 nonblocking alltoallvs on two communicators posted in opposite orders
/// by even and odd ranks, with 8 mailbox slots and with the default 1024: more outstanding
/// collectives than slots, which a post that waited for a slot would deadlock on.
#[test]
fn more_outstanding_collectives_than_mailbox_slots_do_not_deadlock() {
    legal_mix("many", 1, "block", &[("SPOFF_MAILBOX_SLOTS", "8")]);
    legal_mix("many", 2, "cyclic", &[]);
}

/// The conformance generator (`progs/conform.c`, see its header) at a modest count: random
/// type maps per rank with equal signatures, counts with zeros, `MPI_IN_PLACE` (on some ranks
/// only too), sub-communicators, outstanding batches completed by every Wait/Test variant,
/// ranks that finalize as soon as they are done; every byte compared with `PMPI_*`. Each
/// configuration forces designs of the staged collectives. `make conformance` runs it at
/// scale.
#[test]
fn conformance_generator_matches_native_byte_for_byte() {
    let _serial = serial();
    let prog = prog("conform");
    let seed = integration_tests::seed();
    for (i, (k, layout, bcast, iallgather)) in [
        (1, "block", "flat", "lb"),
        (2, "cyclic", "hier", "hier"),
        (1, "cyclic", "hier", "flat"),
    ]
    .into_iter()
    .enumerate()
    {
        let s = (seed + i as u64).to_string();
        let run = launch_with(
            k,
            &["--layout", layout],
            &[
                &prog,
                "--cases",
                "120",
                "--seed",
                &s,
                "--timeout",
                "60",
                "--mixed-in-place",
                "--finalize-early",
            ],
            &[
                ("SPOFF_BCAST_DESIGN", bcast),
                ("SPOFF_IALLGATHER_DESIGN", iallgather),
            ],
        );
        let all = format!("--- stdout\n{}\n--- stderr\n{}", run.stdout, run.stderr);
        run.assert_ok(&format!("conform --seed {s}"));
        assert!(!run.stdout.contains("FAIL"), "{all}");
        let mut calls = 0;
        for r in 0..NP {
            let head = format!("conform: rank {r}: ok, 121 cases, ");
            calls += run
                .stdout
                .lines()
                .find_map(|l| l.strip_prefix(head.as_str()))
                .and_then(|l| l.strip_suffix(" calls"))
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("rank {r} did not pass (seed {s})\n{all}"));
        }
        assert_eq!(run.sp_total("posts"), calls, "every call offloaded\n{all}");
        assert_eq!(run.sp_total("completions"), calls, "{all}");
        assert!(run.sp_total("posts_packed") > 0, "{all}");
        eprintln!(
            "conform seed {s}: {calls} calls offloaded, {} packed",
            run.sp_total("posts_packed")
        );
    }
}

#[test]
fn offload_one_sp_per_node_four_mailbox_slots() {
    a2a_check_offloads(1, "4");
}

#[test]
fn offload_two_sps_per_node_one_mailbox_slot() {
    a2a_check_offloads(2, "1");
}

/// `ag_check` (randomized Iallgatherv / Allgatherv / Iallgather / Allgather, each compared
/// byte for byte with `PMPI_Allgatherv`; a non-contiguous type, packed, and `MPI_IN_PLACE`
/// among them) on 2 nodes x 2 ranks with `sps_per_node` SPs per node and `layout`, the last world
/// rank consistently late, `extra` program arguments (`mixed`: a blocking alltoall among the
/// outstanding allgathers of each batch). Checks the verdict and the SP accounting as
/// [`assert_offloaded`] does, and that the blocking calls' ranks did intra-node copies handed
/// to them by the SPs (host copies); returns the run.
fn ag_check_offloads(sps_per_node: u32, layout: &str, extra: &[&str]) -> Finished {
    let run = ag_check_offloads_env(sps_per_node, layout, extra, &[]);
    assert!(run.sp_total("host_copies") > 0, "{}", run.stderr);
    assert_eq!(run.sp_total("host_copies_failed"), 0, "{}", run.stderr);
    run
}

/// [`ag_check_offloads`] with `env` exported to the ranks, without the host-copy checks.
fn ag_check_offloads_env(
    sps_per_node: u32,
    layout: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Finished {
    let _serial = serial();
    let prog = prog("ag_check");
    let seed = integration_tests::seed().to_string();
    let mut program = vec![prog.as_str(), "30", &seed, "late"];
    program.extend_from_slice(extra);
    let run = launch_with(sps_per_node, &["--layout", layout], &program, env);
    assert_offloaded(&run, "ag_check", 2 * sps_per_node as usize);
    assert!(shim_lines(&run.stderr).is_empty(), "{}", run.stderr);
    eprintln!(
        "ag_check seed {seed}: no_ready_rank {}, parked {}, served_after_pass {}",
        run.sp_total("no_ready_rank"),
        run.sp_total("parked"),
        run.sp_total("served_after_pass")
    );
    run
}

/// With one rank consistently late, an SP often has no ready rank to serve a segment from and
/// must park it or pass it on: the late-arrival paths ran, and still gave the right bytes.
fn assert_late_arrivals(run: &Finished) {
    assert!(run.sp_total("no_ready_rank") > 0, "{}", run.stderr);
    assert!(
        run.sp_total("parked") + run.sp_total("served_after_pass") > 0,
        "{}",
        run.stderr
    );
}

#[test]
fn allgather_offloads_one_sp_per_node_block() {
    let run = ag_check_offloads(1, "block", &[]);
    assert!(run.sp_total("no_ready_rank") > 0, "{}", run.stderr);
}

#[test]
fn allgather_host_copies_can_be_turned_off() {
    // SPOFF_HOST_COPIES=0: the SPs do every intra-node copy, blocking calls included.
    let run = ag_check_offloads_env(1, "block", &[], &[("SPOFF_HOST_COPIES", "0")]);
    assert_eq!(run.sp_total("host_copies"), 0, "{}", run.stderr);
    assert!(run.sp_total("bytes_intra_node") > 0, "{}", run.stderr);
}

#[test]
fn iallgather_staged_designs_offload_with_late_arrivals() {
    // SPOFF_IALLGATHER_DESIGN: MPI_Iallgather takes the staged designs (the other calls of
    // ag_check stay on the load-balanced one); still byte-identical to PMPI_Allgatherv. With 2
    // SPs per node, the hierarchical design writes one region per node, which the ranks of the
    // node's other SP copy out of too, and the node segments' names are gone at the end.
    for (k, layout, design) in [(1, "cyclic", "flat"), (2, "block", "hier")] {
        let shm_before = shm_segments();
        let run =
            ag_check_offloads_env(k, layout, &["late"], &[("SPOFF_IALLGATHER_DESIGN", design)]);
        assert!(
            run.sp_total("staging_peak_bytes") > 0,
            "no staged instance\n{}",
            run.stderr
        );
        assert_eq!(run.sp_total("staging_refused"), 0, "{}", run.stderr);
        if design == "hier" {
            assert!(run.sp_total("host_copies") > 0, "{}", run.stderr);
            assert!(run.sp_total("regions_shared") > 0, "{}", run.stderr);
        }
        let left: Vec<_> = shm_segments().difference(&shm_before).cloned().collect();
        assert!(left.is_empty(), "segment names left behind: {left:?}");
    }
}

#[test]
fn allgather_and_alltoall_offload_one_sp_per_node_cyclic() {
    ag_check_offloads(1, "cyclic", &["mixed"]);
}

#[test]
fn allgather_offloads_two_sps_per_node_block_with_late_arrivals() {
    let run = ag_check_offloads(2, "block", &[]);
    assert_late_arrivals(&run);
}

#[test]
fn allgather_and_alltoall_offload_two_sps_per_node_cyclic_with_late_arrivals() {
    let run = ag_check_offloads(2, "cyclic", &["mixed"]);
    assert_late_arrivals(&run);
}

/// `bcast_check` (randomized MPI_Bcast / MPI_Ibcast from every root, 0 bytes to several MiB
/// with sizes off the chunk size, sub-communicators, several outstanding, each compared byte
/// for byte with `PMPI_Bcast`; a non-contiguous type going native) on 2 nodes x 2 ranks with
/// `sps_per_node` SPs per node, `layout`, the design forced by `SPOFF_BCAST_DESIGN=design` and
/// `extra` program arguments. Checks the verdict and the SP accounting as [`assert_offloaded`]
/// does, that chunks moved between the SPs, and for `hier` that the ranks copied out of the
/// segment (with 2 SPs per node: out of regions their node's leader wrote for the other SP)
/// and that the node segments' names are gone at the end; returns the run.
fn bcast_check_offloads(sps_per_node: u32, layout: &str, design: &str, extra: &[&str]) -> Finished {
    bcast_check_offloads_with(sps_per_node, &["--layout", layout], design, extra)
}

/// [`bcast_check_offloads`] with launcher arguments `launcher`.
fn bcast_check_offloads_with(
    sps_per_node: u32,
    launcher: &[&str],
    design: &str,
    extra: &[&str],
) -> Finished {
    let _serial = serial();
    let shm_before = shm_segments();
    let prog = prog("bcast_check");
    let seed = integration_tests::seed().to_string();
    let mut program = vec![prog.as_str(), "12", &seed];
    program.extend_from_slice(extra);
    let run = launch_with(
        sps_per_node,
        launcher,
        &program,
        &[("SPOFF_BCAST_DESIGN", design)],
    );
    assert_offloaded(&run, "bcast_check", 2 * sps_per_node as usize);
    assert!(shim_lines(&run.stderr).is_empty(), "{}", run.stderr);
    assert!(run.sp_total("chunks_moved") > 0, "{}", run.stderr);
    assert_eq!(run.sp_total("staging_refused"), 0, "{}", run.stderr);
    match design {
        "hier" => assert!(run.sp_total("host_copies") > 0, "{}", run.stderr),
        _ => assert_eq!(run.sp_total("host_copies"), 0, "{}", run.stderr),
    }
    let shared = run.sp_total("regions_shared");
    if design == "hier" && sps_per_node > 1 {
        assert!(shared > 0, "no SP read its leader's region\n{}", run.stderr);
    } else {
        assert_eq!(shared, 0, "{}", run.stderr);
    }
    let left: Vec<_> = shm_segments().difference(&shm_before).cloned().collect();
    assert!(left.is_empty(), "segment names left behind: {left:?}");
    eprintln!(
        "bcast_check seed {seed} {design}: chunks moved {}, host copies {}, regions shared {shared}",
        run.sp_total("chunks_moved"),
        run.sp_total("host_copies")
    );
    run
}

/// The node segments' names in /dev/shm.
fn shm_segments() -> std::collections::BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("spoff-") && n.contains("-node"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn bcast_flat_offloads_one_sp_per_node_block() {
    bcast_check_offloads(1, "block", "flat", &["big"]);
}

#[test]
fn bcast_flat_offloads_two_sps_per_node_cyclic_with_a_late_rank() {
    let run = bcast_check_offloads(2, "cyclic", "flat", &["late"]);
    assert_eq!(run.sp_total("empty_polls"), 0, "{}", run.stderr);
}

#[test]
fn polling_sps_offload_bcast_with_a_late_rank() {
    // `serve --poll-us` (SPs on reserved cores, as on a DPU): the loop never waits on its
    // connections, and everything still arrives, a late rank included.
    for design in ["flat", "hier"] {
        let run = bcast_check_offloads_with(
            2,
            &["--layout", "cyclic", "--sp-arg=--poll-us=100"],
            design,
            &["late"],
        );
        assert!(run.sp_total("empty_polls") > 0, "{}", run.stderr);
        // The chunks went as UCX puts, which complete only while the target SP progresses
        // its worker: a polling SP must do that without arming it.
        let moved = run.sp_total("chunks_moved");
        assert_eq!(run.sp_total("chunks_moved_ucx"), moved, "{}", run.stderr);
        assert!(!run.stderr.contains("UCX is off"), "{}", run.stderr);
    }
}

#[test]
fn bcast_hier_offloads_one_sp_per_node_cyclic_with_a_late_rank() {
    bcast_check_offloads(1, "cyclic", "hier", &["big", "late"]);
}

#[test]
fn bcast_hier_offloads_two_sps_per_node_block() {
    bcast_check_offloads(2, "block", "hier", &[]);
}

#[test]
fn bcast_chunks_move_between_sps_as_ucx_puts() {
    // By default (--ucx=auto, UCX available) the SPs grant their staging slots through UCX:
    // every chunk goes from one SP's staging into the next one's as a UCX put (its message
    // follows over TCP). With --ucx=off, or when UCX cannot initialise in the SPs (auto then
    // says so once per SP), the chunks travel as frames on the SPs' TCP connections.
    for design in ["flat", "hier"] {
        for (how, extra, env) in [
            ("default", None, None),
            ("off", Some("--sp-arg=--ucx=off"), None),
            (
                "no UCX",
                Some("--sp-arg=--ucx=auto"),
                Some(("UCX_TLS", "no_such_transport")),
            ),
        ] {
            let _serial = serial();
            let prog = prog("bcast_check");
            let seed = integration_tests::seed().to_string();
            let mut vars = vec![("SPOFF_BCAST_DESIGN", design)];
            vars.extend(env);
            let run = launch_with(
                1,
                &extra.into_iter().collect::<Vec<_>>(),
                &[prog.as_str(), "8", &seed, "big", "late"],
                &vars,
            );
            assert_offloaded(&run, "bcast_check", 2);
            let moved = run.sp_total("chunks_moved");
            assert!(moved > 0, "{how}\n{}", run.stderr);
            let warned = run.stderr.matches("UCX is off").count();
            if how == "default" {
                assert_eq!(run.sp_total("chunks_moved_ucx"), moved, "{}", run.stderr);
                assert_eq!(run.sp_total("bytes_staged_in"), 0, "{}", run.stderr);
                assert_eq!(warned, 0, "{}", run.stderr);
            } else {
                assert_eq!(run.sp_total("chunks_moved_ucx"), 0, "{how}\n{}", run.stderr);
                assert!(run.sp_total("bytes_staged_in") > 0, "{how}\n{}", run.stderr);
                let want = if how == "no UCX" { 2 } else { 0 };
                assert_eq!(warned, want, "{how}\n{}", run.stderr);
            }
        }
    }
}

#[test]
fn bcast_hier_without_room_in_the_segment_is_delivered_flat() {
    // Every message fits the 64 KiB segment part of an SP alone but no two at once: a leader
    // whose part is taken by an outstanding Ibcast delivers the next one flat (writing its
    // ranks' buffers itself and, with 2 SPs per node, sending the chunks on to the other SP,
    // which writes its ranks' buffers), and the results are still right.
    for sps in [1, 2] {
        let _serial = serial();
        let prog = prog("bcast_check");
        let seed = integration_tests::seed().to_string();
        let run = launch_with(
            sps,
            &[],
            &[prog.as_str(), "12", &seed, "fit=65536"],
            &[
                ("SPOFF_BCAST_DESIGN", "hier"),
                ("SPOFF_SEGMENT_BYTES", "65536"),
            ],
        );
        assert_offloaded(&run, "bcast_check", 2 * sps as usize);
        assert!(run.sp_total("hier_delivered_flat") > 0, "{}", run.stderr);
        assert!(run.sp_total("host_copies") > 0, "{}", run.stderr);
        if sps == 2 {
            assert!(run.sp_total("regions_shared") > 0, "{}", run.stderr);
        }
    }
}

#[test]
fn iallgather_hier_owner_without_room_makes_its_node_flat() {
    // Three hierarchical Iallgathers outstanding, each fitting a node owner's 64 KiB part of
    // the segment alone but no two at once: owners deliver some of them flat, and then the
    // node's other SP (2 SPs per node) delivers flat too; the others go through one region
    // per node. Every result is compared with PMPI_Allgather.
    let _serial = serial();
    let prog = prog("iag_fit");
    let run = launch_with(
        2,
        &[],
        &[prog.as_str(), "65536", "4"],
        &[
            ("SPOFF_IALLGATHER_DESIGN", "hier"),
            ("SPOFF_SEGMENT_BYTES", "65536"),
        ],
    );
    assert_offloaded(&run, "iag_fit", 4);
    assert!(run.sp_total("hier_delivered_flat") > 0, "{}", run.stderr);
    assert!(run.sp_total("regions_shared") > 0, "{}", run.stderr);
    assert!(run.sp_total("host_copies") > 0, "{}", run.stderr);
}

/// `program` offloaded with `SPOFF_BACKEND=ucx` (and verbose) on SPs started with `--ucx`:
/// checks it as [`assert_offloaded`] does, that every copy took the ucx path (the SP never
/// runs a ucx copy inline; with cma every copy of these programs is inline), and that every
/// rank saw the setting (each says it grants with ucx, memory events on). Returns each rank's
/// report line from `MPI_Finalize`.
fn ucx_offloads(program: &[&str], name: &str, slots: &str) -> Vec<String> {
    let run = launch_with(
        1,
        &["--sp-arg=--ucx"],
        program,
        &[
            ("SPOFF_BACKEND", "ucx"),
            ("SPOFF_VERBOSE", "1"),
            ("SPOFF_MAILBOX_SLOTS", slots),
        ],
    );
    assert_offloaded(&run, name, 2);
    assert!(run.sp_total("copies_started") > 0, "{}", run.stderr);
    assert_eq!(
        run.sp_total("copies_inline"),
        0,
        "a copy ran inline: not the ucx path\n{}",
        run.stderr
    );
    let lines = shim_lines(&run.stderr);
    (0..NP)
        .map(|r| {
            assert!(
                lines
                    .iter()
                    .any(|l| l.ends_with(&format!("rank {r}: ucx grants, memory events on"))),
                "rank {r} did not grant with ucx\n{}",
                run.stderr
            );
            let report = format!("rank {r}: ucx grants: ");
            lines
                .iter()
                .find(|l| l.contains(&report))
                .unwrap_or_else(|| panic!("no ucx report from rank {r}\n{}", run.stderr))
                .to_string()
        })
        .collect()
}

/// The number before `word` in `line` (`"... 16 invalidated ..."`).
fn count_before(line: &str, word: &str) -> u64 {
    let words: Vec<&str> = line.split([' ', ',']).filter(|w| !w.is_empty()).collect();
    words
        .windows(2)
        .find(|w| w[1] == word)
        .and_then(|w| w[0].parse().ok())
        .unwrap_or_else(|| panic!("no count before {word:?} in {line:?}"))
}

#[test]
fn ucx_backend_offloads_every_wait_and_test_variant() {
    let _serial = serial();
    let prog = prog("a2a_check");
    ucx_offloads(&[&prog, "2", "free"], "a2a_check", "4");
}

#[test]
fn ucx_grants_of_freed_and_reallocated_buffers_are_invalidated() {
    let _serial = serial();
    let prog = prog("realloc_check");
    for line in ucx_offloads(&[&prog, "6"], "realloc_check", "1024") {
        // Every round unmaps the previous round's buffers: their registrations must have been
        // invalidated (new generation, new ucp_mem_map) before the addresses were granted again.
        assert!(count_before(&line, "invalidated") > 0, "{line}");
        assert!(count_before(&line, "unmap") > 0, "{line}");
    }
}

/// Allgather(v) with ucx grants: the receive grant is read-write (the SP serves the node's
/// other ranks from it), which the ucx registration must carry too.
#[test]
fn ucx_backend_offloads_allgather() {
    let _serial = serial();
    let prog = prog("ag_check");
    let seed = integration_tests::seed().to_string();
    ucx_offloads(&[&prog, "10", &seed, "late", "mixed"], "ag_check", "1024");
}

/// Rank 0 loops on `MPI_Testsome` over an offloaded Iallgather and a native receive that rank 1
/// sends only after its own Iallgather completed, which needs the SPs' UCX reads of rank 0's
/// block, which need rank 0 to progress UCX (emulated RMA): its Testsome must, native request
/// pending or not.
#[test]
fn ucx_progress_in_testsome_while_a_native_request_is_pending() {
    let _serial = serial();
    let prog = prog("testsome_dep");
    ucx_offloads(&[&prog, "65536"], "testsome_dep", "1024");
}

#[test]
fn ucx_backend_offloads_bcast() {
    // The default design here (2 ranks per SP) is flat: every staged copy is between a ucx
    // grant and the SP's own staging, none inline.
    let _serial = serial();
    let prog = prog("bcast_check");
    let seed = integration_tests::seed().to_string();
    ucx_offloads(&[&prog, "8", &seed, "late"], "bcast_check", "1024");
}

/// Ranks may grant differently: rank 1 asks for cma, rank 2's UCX cannot initialise (it says
/// so once and uses cma), ranks 0 and 3 use ucx. The SPs serve each grant with its own
/// backend, so mixed cma/ucx copies are correct too.
#[test]
fn ranks_mixing_cma_and_ucx_grants_agree() {
    let _serial = serial();
    let prog = prog("a2a_check");
    let script = "case $OMPI_COMM_WORLD_RANK in\n\
                  1) export SPOFF_BACKEND=cma;;\n\
                  2) export UCX_TLS=no_such_transport;;\n\
                  esac\n\
                  exec \"$@\"";
    let run = launch_with(
        1,
        &["--sp-arg=--ucx"],
        &["sh", "-c", script, "sh", &prog, "2", "free"],
        &[("SPOFF_BACKEND", "ucx"), ("SPOFF_VERBOSE", "1")],
    );
    assert_offloaded(&run, "a2a_check", 2);
    let lines = shim_lines(&run.stderr);
    let said = |needle: &str| lines.iter().filter(|l| l.contains(needle)).count();
    assert_eq!(said("ucx grants, memory events on"), 2, "{}", run.stderr);
    assert_eq!(said("rank 2: cannot initialise UCX"), 1, "{}", run.stderr);
    let inline = run.sp_total("copies_inline");
    assert!(
        inline > 0 && inline < run.sp_total("copies_started"),
        "both backends copied\n{}",
        run.stderr
    );
}

#[test]
fn threads_offload_concurrently_on_their_own_communicators() {
    let _serial = serial();
    let prog = prog("mt_check");
    let run = launch(1, &[&prog], &[]);
    assert_offloaded(&run, "mt_check", 2);
    assert!(shim_lines(&run.stderr).is_empty(), "{}", run.stderr);
}

#[test]
fn no_sp_reachable_prints_one_line_per_rank_and_runs_natively() {
    let _serial = serial();
    let prog = prog("a2a_check");
    let dir = std::env::temp_dir().join(format!("host-shim-nosp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sps = (0..2)
        .map(|i| SpEntry {
            id: i,
            node: i,
            index: 0,
            peer_addr: "127.0.0.1:9".parse().unwrap(),
            host_socket: dir.join(format!("absent-{i}.sock")),
        })
        .collect();
    let cluster: PathBuf = dir.join("cluster.json");
    Cluster::new(2, 1, None, Layout::Block, sps)
        .unwrap()
        .save(&cluster)
        .unwrap();
    let cred = some_credential();
    let run = mpirun_preloaded(
        &[&prog, "1"],
        &[
            ("SPOFF_CLUSTER", cluster.to_str().unwrap()),
            ("SPOFF_JOB_CREDENTIAL", &cred),
        ],
    );
    std::fs::remove_dir_all(&dir).ok();
    verdict(&run, "a2a_check");
    let lines = shim_lines(&run.stderr);
    assert_eq!(lines.len(), NP as usize, "{}", run.stderr);
    for r in 0..NP {
        assert!(
            lines.iter().any(
                |l| l.contains(&format!("rank {r}: no service process reachable at"))
                    && l.ends_with("running natively")
            ),
            "{}",
            run.stderr
        );
    }
}

#[test]
fn unconfigured_or_disabled_shim_is_silent_and_native() {
    let _serial = serial();
    let prog = prog("a2a_check");
    // No SPOFF_CLUSTER at all.
    let run = mpirun_preloaded(&[&prog, "1"], &[]);
    verdict(&run, "a2a_check");
    assert!(shim_lines(&run.stderr).is_empty(), "{}", run.stderr);
    // Real SPs are up and reachable, but SPOFF_OFFLOAD=0.
    let run = launch(1, &[&prog, "1"], &[("SPOFF_OFFLOAD", "0")]);
    verdict(&run, "a2a_check");
    assert!(shim_lines(&run.stderr).is_empty(), "{}", run.stderr);
    assert_eq!(run.sp_stats().len(), 2, "{}", run.stderr);
    assert_eq!(run.sp_total("posts"), 0, "offload was disabled");
}

#[test]
fn one_unreachable_sp_keeps_the_whole_job_native() {
    let _serial = serial();
    let prog = prog("a2a_check");
    // Real SPs, but every rank gets a copy of the cluster description in which SP 1's socket
    // is a path where nothing listens: ranks 0 and 1 register with the real SP 0, ranks 2 and
    // 3 reach nothing, and the whole job agrees to run natively.
    let broken = r##"c="$SPOFF_CLUSTER.rank$OMPI_COMM_WORLD_RANK"
        sed 's#/sp-1\.sock"#/absent.sock"#' "$SPOFF_CLUSTER" > "$c" && grep -q absent.sock "$c" &&
        SPOFF_CLUSTER="$c" exec "$0" "$@""##;
    let run = launch(1, &["sh", "-c", broken, &prog, "1"], &[]);
    verdict(&run, "a2a_check");
    let lines = shim_lines(&run.stderr);
    assert_eq!(lines.len(), 3, "{}", run.stderr);
    for r in [2, 3] {
        assert!(
            lines
                .iter()
                .any(|l| l.contains(&format!("rank {r}: no service process reachable"))),
            "{}",
            run.stderr
        );
    }
    assert!(
        lines
            .iter()
            .any(|l| l.contains("offload is off for this job: 2 rank(s)")),
        "{}",
        run.stderr
    );
    assert_eq!(run.sp_stats().len(), 2, "{}", run.stderr);
    assert_eq!(run.sp_total("posts"), 0, "{}", run.stderr);
}

fn cmdline(pid: u32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&raw).replace('\0', " ")
}

fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')')
        .next()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Polls `f` every 50 ms until it gives a value, for at most 60 s.
fn poll<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> Result<T, String> {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if t.elapsed() > Duration::from_secs(60) {
            return Err(format!("{what} did not happen within 60 s"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits for the launcher this test process started and its job, lets the ranks offload for
/// a while, then kills SP 1 of that job. Returns the job's marker (the run directory prefix,
/// in every process of the job) and when the SP died. Interrupts the launcher if it cannot.
fn kill_sp_1_mid_job() -> Result<(String, Instant), String> {
    let me = std::process::id();
    let launcher = poll("the launcher start", || {
        pids_matching("")
            .into_iter()
            .find(|&p| parent(p) == Some(me) && cmdline(p).contains("service-process launch "))
    })?;
    let marker = format!("spoff-{launcher}-");
    let killed = (|| {
        // 2 SPs, mpirun and 4 ranks carry the run directory (command line or environment).
        poll("the job start", || {
            (pids_matching(&marker).len() >= 7).then_some(())
        })?;
        std::thread::sleep(Duration::from_millis(1500));
        let sp = pids_matching(&marker)
            .into_iter()
            .find(|&p| {
                let c = cmdline(p);
                c.contains(" serve ") && c.contains(" --sp-id 1 ") && c.contains(&marker)
            })
            .ok_or("SP 1 is not running")?;
        // SAFETY: kill(2) on a process of the job this test started.
        unsafe { libc::kill(sp as i32, libc::SIGKILL) };
        Ok(Instant::now())
    })();
    if killed.is_err() {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(launcher as i32, libc::SIGINT) };
    }
    killed.map(|t| (marker, t))
}

/// `a2a_check ROUNDS extra...` on 2 nodes x 2 ranks, SP 1 killed mid-job. Rounds enough to
/// outlast the test; the program stops after the first round that failed. The launcher's grace
/// after an SP death is longer than the bounds the tests check: the job must end because its
/// collectives fail, not because the launcher killed it. Returns the run, the job's marker and
/// how long after the kill the job ended.
fn run_and_kill_sp_1(extra: &[&str]) -> (Finished, String, Duration) {
    let prog = prog("a2a_check");
    let mut program = vec![prog.as_str(), "1000000"];
    program.extend_from_slice(extra);
    let cmd = launch_cmd(
        &[
            "--nodes",
            "2",
            "--ranks-per-node",
            "2",
            "--fault-grace-secs",
            "60",
        ],
        &program,
    );
    let killer = std::thread::spawn(kill_sp_1_mid_job);
    let run = run(with_env(cmd, &[]), TIMEOUT);
    let (marker, killed_at) = killer.join().unwrap().unwrap_or_else(|e| {
        panic!(
            "{e}\n--- stdout\n{}\n--- stderr\n{}",
            run.stdout, run.stderr
        )
    });
    let took = killed_at.elapsed();
    eprintln!("the job ended {took:?} after SP 1 was killed");
    (run, marker, took)
}

/// Every process of the job is gone within 5 s.
fn assert_nothing_left(marker: &str) {
    let t = Instant::now();
    loop {
        let left = pids_matching(marker);
        if left.is_empty() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "processes left behind: {:?}",
            left.iter().map(|&p| cmdline(p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// With `MPI_ERRORS_RETURN` the program sees the failed collectives' codes and ends itself.
#[test]
fn a_killed_sp_fails_collectives_and_ends_the_job_with_an_error() {
    let _serial = serial();
    let (run, marker, took) = run_and_kill_sp_1(&["return"]);
    let all = format!("--- stdout\n{}\n--- stderr\n{}", run.stdout, run.stderr);
    assert!(!run.ok(), "a job that lost an SP reported success\n{all}");
    assert!(took < Duration::from_secs(20), "took {took:?}\n{all}");
    assert!(
        !run.stderr.contains("did not end after an SP failure"),
        "{all}"
    );
    assert!(
        run.stdout.contains("a2a_check: ") && run.stdout.contains(" failures"),
        "{all}"
    );
    // Ranks 2 and 3 lost their SP: one of them at least says so, naming its socket (whether it
    // found the connection closed while reading or broken while posting). Not necessarily
    // both: once one of them ends with an error, mpirun may stop the other before it looks.
    assert!(
        [2, 3].iter().any(|r| shim_lines(&run.stderr)
            .iter()
            .any(|l| l.contains(&format!("rank {r}: ")) && l.contains("/sp-1.sock"))),
        "no rank of SP 1 reported the lost SP\n{all}"
    );
    // SP 0 served posts before the failure and reported at exit.
    assert_eq!(run.sp_stats().len(), 1, "{all}");
    assert!(run.sp_total("posts") > 0, "{all}");
    assert_nothing_left(&marker);
}

/// Under the default `MPI_ERRORS_ARE_FATAL` the first failed collective aborts the job through
/// the error handler, as a native failure does: the program never gets to count failures (with
/// unfilled receive buffers) and print its verdict.
#[test]
fn a_killed_sp_aborts_a_job_under_errors_are_fatal() {
    let _serial = serial();
    let (run, marker, took) = run_and_kill_sp_1(&[]);
    let all = format!("--- stdout\n{}\n--- stderr\n{}", run.stdout, run.stderr);
    assert!(!run.ok(), "a job that lost an SP reported success\n{all}");
    assert!(took < Duration::from_secs(20), "took {took:?}\n{all}");
    assert!(
        !run.stdout.contains(" failures") && !run.stdout.contains("all ok"),
        "the program went on after a failed collective\n{all}"
    );
    // Open MPI's "*** MPI_ERRORS_ARE_FATAL" lines come from the aborting rank and can be lost
    // when mpirun tears the job down first: logged, not required.
    eprintln!(
        "errors-are-fatal notice seen: {}",
        run.stderr.contains("MPI_ERRORS_ARE_FATAL")
    );
    assert!(
        !run.stderr.contains("did not end after an SP failure"),
        "{all}"
    );
    assert_nothing_left(&marker);
}

/// A stand-in for the SPs of a 2-node cluster: registers every rank, then refuses every post by
/// message (as an SP refuses a bad descriptor), so the shim quarantines each post's slot.
/// Returns the cluster description; the listeners serve until the test process ends.
fn refusing_sps(dir: &Path) -> PathBuf {
    use bootstrap::wire::{Channel, ErrorCode, Hello, HostToSp, SpToHost};
    use std::os::unix::net::{UnixListener, UnixStream};
    fn serve(stream: UnixStream, sp: u32) {
        let mut ch = Channel::new(stream);
        let Ok(Hello::Host(_)) = ch.recv_hello() else {
            return;
        };
        if ch.send_hello(&Hello::Welcome { sp }).is_err() {
            return;
        }
        while let Ok(msg) = ch.recv::<HostToSp>() {
            let reply = match msg {
                HostToSp::Register { .. } => SpToHost::Registered {
                    sp,
                    segment: format!("/spoff-fake-{}-{sp}", std::process::id()),
                },
                HostToSp::Post(d) => SpToHost::Error {
                    comm: Some(d.comm),
                    seq: Some(d.seq),
                    code: ErrorCode::BadDescriptor,
                    message: "refused by the test's fake SP".into(),
                },
                // Never asks for copies, so never gets answers to them.
                HostToSp::Goodbye | HostToSp::CopyDone { .. } => return,
            };
            if ch.send(&reply).is_err() {
                return;
            }
        }
    }
    std::fs::create_dir_all(dir).unwrap();
    let sps = (0..2)
        .map(|i| {
            let sock = dir.join(format!("fake-{i}.sock"));
            let _ = std::fs::remove_file(&sock);
            let l = UnixListener::bind(&sock).unwrap();
            std::thread::spawn(move || {
                for s in l.incoming().flatten() {
                    std::thread::spawn(move || serve(s, i));
                }
            });
            SpEntry {
                id: i,
                node: i,
                index: 0,
                peer_addr: "127.0.0.1:9".parse().unwrap(),
                host_socket: sock,
            }
        })
        .collect();
    let cluster = dir.join("cluster.json");
    Cluster::new(2, 1, None, Layout::Block, sps)
        .unwrap()
        .save(&cluster)
        .unwrap();
    cluster
}

/// One mailbox slot, every post refused: after the first refusal the only slot is quarantined
/// for good; every later collective is still posted (without a slot: the SP would complete it
/// by a message) and fails with the refusal, never waits for a slot.
#[test]
fn refused_posts_fail_even_once_every_mailbox_slot_is_quarantined() {
    let _serial = serial();
    let prog = prog("a2a_check");
    let dir = std::env::temp_dir().join(format!("host-shim-quarantine-{}", std::process::id()));
    let cluster = refusing_sps(&dir);
    let cred = some_credential();
    let run = mpirun_preloaded_within(
        &[&prog, "1", "return"],
        &[
            ("SPOFF_CLUSTER", cluster.to_str().unwrap()),
            ("SPOFF_JOB_CREDENTIAL", &cred),
            ("SPOFF_MAILBOX_SLOTS", "1"),
        ],
        Duration::from_secs(60),
    );
    let all = format!("--- stdout\n{}\n--- stderr\n{}", run.stdout, run.stderr);
    assert!(!run.ok(), "refused collectives reported success\n{all}");
    let failures: u64 = run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("a2a_check: "))
        .and_then(|l| l.strip_suffix(" failures"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no failure count\n{all}"));
    // Every collective of the run failed, not only the first: each was posted and refused.
    assert!(failures >= 2, "{all}");
    for r in 0..NP {
        let refused = shim_lines(&run.stderr)
            .iter()
            .filter(|l| {
                l.contains(&format!("rank {r}: ")) && l.contains("refused by the test's fake SP")
            })
            .count();
        assert!(refused >= 2, "rank {r} saw {refused} refusals\n{all}");
    }
    // The same run with the default error handler aborts at the first refused collective.
    let run = mpirun_preloaded_within(
        &[&prog, "1"],
        &[
            ("SPOFF_CLUSTER", cluster.to_str().unwrap()),
            ("SPOFF_JOB_CREDENTIAL", &cred),
            ("SPOFF_MAILBOX_SLOTS", "1"),
        ],
        Duration::from_secs(60),
    );
    std::fs::remove_dir_all(&dir).ok();
    let all = format!("--- stdout\n{}\n--- stderr\n{}", run.stdout, run.stderr);
    assert!(!run.ok(), "{all}");
    assert!(
        !run.stdout.contains("a2a_check: "),
        "the program went on\n{all}"
    );
    // Open MPI's "*** MPI_ERRORS_ARE_FATAL" lines come from the aborting rank and can be lost
    // when mpirun tears the job down first: logged, not required.
    eprintln!(
        "errors-are-fatal notice seen: {}",
        run.stderr.contains("MPI_ERRORS_ARE_FATAL")
    );
}
