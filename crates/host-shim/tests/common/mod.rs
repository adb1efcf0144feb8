//! What the shim's `mpirun` tests share: building `progs/*.c` with `mpicc`, running a job
//! under the real launcher (`service-process launch`, real SPs) or under plain `mpirun` with
//! the shim preloaded, one job at a time, and checking a program's verdict and the SPs'
//! counters.
//!
//! The launcher, the SP and the shim come from the target directory of the test executable:
//! build the workspace first (`cargo build --release --workspace`; `make test` does). A missing
//! artifact, `mpicc` or `mpirun` is a failure, never a skip.
//!
//! Every test runs under the MPI of [`mpi`]: Open MPI, or MPICH when `SPOFF_TEST_MPI=mpich`
//! (`make test-mpich` runs every test file so) or when the test file chose it with
//! [`use_mpi`] (`mpirun_mpich.rs`). Under MPICH the programs are built with `mpicc.mpich`, the
//! launcher finds their MPI itself (and so preloads `libhost_shim_mpich.so` and runs Hydra's
//! `mpiexec.mpich`), and plain preloaded runs use `mpiexec.mpich` and that shim.
#![allow(dead_code)]

use integration_tests::{launch_cmd, run, shim, Finished};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

pub const NP: u64 = 4;

pub const TIMEOUT: Duration = Duration::from_secs(120);

/// The shim's settings: every job gets the ones its test sets, never the caller's (these, and
/// every kind's design variable, `KindFacts::design_var`).
pub const SHIM_VARS: [&str; 11] = [
    "SPOFF_HOST_COPIES",
    "SPOFF_HIER_MIN_RANKS",
    "SPOFF_SEGMENT_BYTES",
    "SPOFF_CLUSTER",
    "SPOFF_OFFLOAD",
    "SPOFF_JOB_CREDENTIAL",
    "SPOFF_VERBOSE",
    "SPOFF_MAILBOX_SLOTS",
    "SPOFF_BACKEND",
    "SPOFF_INIT_TIMEOUT_MS",
    "SPOFF_ALLREDUCE_DESIGN",
];

/// A well-formed job credential of a cluster no SP knows: for runs against fake or missing
/// SPs (without one the shim does not even try to offload).
pub fn some_credential() -> String {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let key = bootstrap::auth::ClusterKey::generate();
    bootstrap::auth::JobCredential::issue(&key, 1, uid, NP as u32).encode()
}

/// The MPI the jobs of this test process run under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mpi {
    OpenMpi,
    Mpich,
}

/// 0: not chosen yet; 1: Open MPI; 2: MPICH.
static MPI: AtomicU8 = AtomicU8::new(0);

/// Makes `mpi` the MPI of this test process (every test of a file that calls it must call it
/// first, with the same value).
pub fn use_mpi(mpi: Mpi) {
    let code = match mpi {
        Mpi::OpenMpi => 1,
        Mpi::Mpich => 2,
    };
    let was = MPI.swap(code, Ordering::AcqRel);
    assert!(was == 0 || was == code, "one MPI per test process");
}

/// The MPI of this test process: the one [`use_mpi`] chose, else `SPOFF_TEST_MPI`
/// (`openmpi`, the default, or `mpich`).
pub fn mpi() -> Mpi {
    match MPI.load(Ordering::Acquire) {
        1 => return Mpi::OpenMpi,
        2 => return Mpi::Mpich,
        _ => {}
    }
    let mpi = match std::env::var("SPOFF_TEST_MPI").as_deref() {
        Err(_) | Ok("") | Ok("openmpi") => Mpi::OpenMpi,
        Ok("mpich") => Mpi::Mpich,
        Ok(other) => panic!("SPOFF_TEST_MPI={other}: expected openmpi or mpich"),
    };
    use_mpi(mpi);
    mpi
}

/// The shim of [`mpi`]'s ABI.
pub fn mpi_shim() -> std::path::PathBuf {
    match mpi() {
        Mpi::OpenMpi => shim(),
        Mpi::Mpich => {
            let s = integration_tests::artifact("libhost_shim_mpich.so");
            assert!(
                s.exists(),
                "{} is missing: build it with `make build` (scripts/build-mpich.sh)",
                s.display()
            );
            s
        }
    }
}

/// One MPI job at a time (the machine has few cores).
pub fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// `progs/<name>.c` compiled with [`mpi`]'s `mpicc` (once per test process).
pub fn prog(name: &'static str) -> String {
    prog_for(mpi(), name)
}

/// `progs/<name>.c` compiled with `mpi`'s `mpicc` (once per test process), for a test that runs
/// a job under an MPI of its own choosing.
pub fn prog_for(mpi: Mpi, name: &'static str) -> String {
    let (mpicc, subdir, flags): (&str, &str, &[&str]) = match mpi {
        Mpi::OpenMpi => ("mpicc", "host-shim-progs", &[]),
        // GCC takes MPICH's MPI_STATUSES_IGNORE, (MPI_Status *)1, for an empty array.
        Mpi::Mpich => (
            "mpicc.mpich",
            "host-shim-progs-mpich",
            &["-Wno-stringop-overflow"],
        ),
    };
    static BUILT: Mutex<BTreeMap<(&str, &str), String>> = Mutex::new(BTreeMap::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    built
        .entry((subdir, name))
        .or_insert_with(|| {
            let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/progs/{name}.c"));
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(subdir);
            std::fs::create_dir_all(&dir).unwrap();
            // Built under a private name, then renamed: concurrent test runs never see a
            // half-written binary.
            let tmp = dir.join(format!("{name}.{}", std::process::id()));
            let st = Command::new(mpicc)
                .args(["-O1", "-Wall", "-pthread"])
                .args(flags)
                .arg("-o")
                .arg(&tmp)
                .arg(&src)
                .status()
                .unwrap_or_else(|e| panic!("cannot run {mpicc} (install it: `make deps`): {e}"));
            assert!(st.success(), "{mpicc} failed on {}", src.display());
            let out = dir.join(name);
            std::fs::rename(&tmp, &out).unwrap();
            out.display().to_string()
        })
        .clone()
}

/// `cmd` with the shim's settings cleared, then `env` set.
pub fn with_env(mut cmd: Command, env: &[(&str, &str)]) -> Command {
    let designs = bootstrap::kinds::KINDS.iter().filter_map(|f| f.design_var);
    for k in SHIM_VARS.into_iter().chain(designs) {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// `program` on 2 nodes x 2 ranks under the real launcher, with `sps_per_node` real SPs per
/// node. The launcher's mpirun, and so every rank, inherits `env`.
pub fn launch(sps_per_node: u32, program: &[&str], env: &[(&str, &str)]) -> Finished {
    launch_with(sps_per_node, &[], program, env)
}

/// [`launch`] with more launcher arguments (`--sp-arg=...`).
pub fn launch_with(
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
    // Under MPICH the MPI is named: a program may be a script (`sh -c ...`), which links no
    // MPI for the launcher to find.
    if mpi() == Mpi::Mpich {
        args.extend_from_slice(&["--mpi", "mpich"]);
    }
    args.extend_from_slice(extra);
    let run = run(with_env(launch_cmd(&args, program), env), TIMEOUT);
    eprintln!("{} under the launcher: {:?}", shown(program), run.elapsed);
    run
}

/// `program` on `NP` ranks under plain `mpirun` (`mpiexec.mpich` under MPICH) with the shim
/// preloaded and `env` exported.
pub fn mpirun_preloaded(program: &[&str], env: &[(&str, &str)]) -> Finished {
    mpirun_preloaded_within(program, env, TIMEOUT)
}

/// [`mpirun_preloaded`], a hang being anything longer than `timeout`.
pub fn mpirun_preloaded_within(
    program: &[&str],
    env: &[(&str, &str)],
    timeout: Duration,
) -> Finished {
    let mut cmd = match mpi() {
        Mpi::OpenMpi => {
            let mut cmd = Command::new("mpirun");
            cmd.args([
                "--oversubscribe",
                "--bind-to",
                "none",
                "-np",
                &NP.to_string(),
            ])
            .args(["-x", "LD_PRELOAD"]);
            for (k, _) in env {
                cmd.arg("-x").arg(k);
            }
            cmd
        }
        Mpi::Mpich => {
            let mut cmd = Command::new("mpiexec.mpich");
            let mut vars = vec!["LD_PRELOAD"];
            vars.extend(env.iter().map(|(k, _)| *k));
            cmd.args(["-np", &NP.to_string(), "-bind-to", "none", "-genvlist"])
                .arg(vars.join(","));
            cmd
        }
    };
    cmd.env("LD_PRELOAD", mpi_shim());
    cmd.args(program);
    let run = run(with_env(cmd, env), timeout);
    eprintln!("{} under mpirun: {:?}", shown(program), run.elapsed);
    run
}

/// A command line for the log: file names of paths, scripts left out.
pub fn shown(program: &[&str]) -> String {
    let words = program.iter().filter(|a| !a.contains('\n'));
    let words: Vec<&str> = words.map(|a| a.rsplit('/').next().unwrap_or(a)).collect();
    words.join(" ")
}

pub fn shim_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.contains("host-shim:"))
        .collect()
}

/// Asserts the job passed by the program's own verdict; returns the calls per rank the
/// program counted as eligible for offload.
pub fn verdict(run: &Finished, prog: &str) -> u64 {
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
pub fn assert_offloaded(run: &Finished, prog: &str, sps: usize) {
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

/// The node segments' names in /dev/shm.
pub fn shm_segments() -> std::collections::BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("spoff-") && n.contains("-node"))
                .collect()
        })
        .unwrap_or_default()
}

/// Checks a `conform` run of `np` ranks and `cases` cases each (seed `seed`): it succeeded,
/// no case failed, every rank passed, and the SPs posted and completed exactly the calls the
/// ranks counted, some of them packed. Returns the calls.
#[allow(dead_code)] // not every test file checks conform runs
pub fn assert_conform_offloaded(run: &Finished, seed: &str, np: u64, cases: u32) -> u64 {
    let all = format!("--- stdout\n{}\n--- stderr\n{}", run.stdout, run.stderr);
    run.assert_ok(&format!("conform --seed {seed}"));
    assert!(!run.stdout.contains("FAIL"), "{all}");
    let mut calls = 0;
    for r in 0..np {
        let head = format!("conform: rank {r}: ok, {cases} cases, ");
        calls += run
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix(head.as_str()))
            .and_then(|l| l.strip_suffix(" calls"))
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("rank {r} did not pass (seed {seed})\n{all}"));
    }
    assert_eq!(run.sp_total("posts"), calls, "every call offloaded\n{all}");
    assert_eq!(run.sp_total("completions"), calls, "{all}");
    assert!(run.sp_total("posts_packed") > 0, "{all}");
    calls
}
