//! Harness for the integration tests: real SP processes started by the real launcher, real
//! `mpirun` jobs with the real host shim, results compared with native MPI inside the MPI
//! programs themselves (`alltoallv_check` compares every intercepted call with `PMPI_*`).
//!
//! The binaries come from the same target directory as the test executable; `make test` builds
//! them first. A missing binary or `mpirun` is a failure with a message, never a skip.

pub mod procfs;
pub mod splitmix;

pub use splitmix::Rng;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// `target/<profile>` of this build.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/<test binary>
    exe.parent()
        .and_then(|p| p.parent())
        .expect("target dir")
        .to_path_buf()
}

/// A built artifact of the workspace; panics with how to build it if it is missing.
pub fn artifact(name: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: build the workspace first (`cargo build --release --workspace`, or \
         `make test` which does it)",
        p.display()
    );
    p
}

pub fn service_process() -> PathBuf {
    artifact("service-process")
}

pub fn shim() -> PathBuf {
    artifact("libhost_shim.so")
}

/// The output of a finished process.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    pub pid: u32,
}

impl Finished {
    pub fn ok(&self) -> bool {
        self.status.success()
    }

    /// Panics with the whole output unless the process exited 0.
    pub fn assert_ok(&self, what: &str) {
        assert!(
            self.ok(),
            "{what} failed with {}\n--- stdout\n{}\n--- stderr\n{}",
            self.status,
            self.stdout,
            self.stderr
        );
    }

    /// The `sp N stats: {json}` lines the launcher prints at exit.
    pub fn sp_stats(&self) -> Vec<serde_json::Value> {
        self.stderr
            .lines()
            .filter_map(|l| l.split_once(" stats: ").map(|(_, j)| j))
            .filter_map(|j| serde_json::from_str(j).ok())
            .collect()
    }

    /// Sum of one counter over every SP.
    pub fn sp_total(&self, field: &str) -> u64 {
        self.sp_stats()
            .iter()
            .map(|s| s[field].as_u64().unwrap_or(0))
            .sum()
    }
}

/// Runs `cmd` to completion; kills its process group and panics if it takes longer than
/// `timeout` (a hang is a failure, not something to wait out).
pub fn run(mut cmd: Command, timeout: Duration) -> Finished {
    use std::os::unix::process::CommandExt;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    cmd.process_group(0);
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let pid = child.id();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > timeout {
            // SAFETY: kill(2) on the process group we created for the child.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            let stdout = t_out.join().unwrap_or_default();
            let stderr = t_err.join().unwrap_or_default();
            panic!(
                "{cmd:?} did not finish within {timeout:?} (hang)\n--- stdout\n{stdout}\n--- \
                 stderr\n{stderr}"
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Finished {
        status,
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
        elapsed: start.elapsed(),
        pid,
    }
}

/// `service-process launch ARGS -- PROGRAM...` as a command.
pub fn launch_cmd(args: &[&str], program: &[&str]) -> Command {
    let mut cmd = Command::new(service_process());
    cmd.arg("launch").args(args).arg("--").args(program);
    cmd
}

/// `mpirun` of `np` ranks of this machine with the host shim preloaded, given the cluster
/// description and a job credential (`SPOFF_CLUSTER`, `SPOFF_JOB_CREDENTIAL`): an MPI job
/// that talks to SPs started elsewhere. The caller adds the program and its arguments.
pub fn mpirun_offloaded(np: u32, cluster: &Path, credential: String) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "--oversubscribe",
        "--bind-to",
        "none",
        "-np",
        &np.to_string(),
    ])
    .args([
        "-x",
        "LD_PRELOAD",
        "-x",
        "SPOFF_CLUSTER",
        "-x",
        "SPOFF_JOB_CREDENTIAL",
    ])
    .env("LD_PRELOAD", shim())
    .env("SPOFF_CLUSTER", cluster)
    .env("SPOFF_JOB_CREDENTIAL", credential);
    cmd
}

/// A seed for randomized inputs: `TEST_SEED` if set, else the clock; always printed.
pub fn seed() -> u64 {
    let s = splitmix::env_seed().unwrap_or_else(|| splitmix::clock_seed() % 1_000_000_007);
    eprintln!("TEST_SEED={s}");
    s
}

/// The command line of process `pid`, its arguments joined by spaces (empty if it is gone).
pub fn cmdline(pid: u32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&raw).replace('\0', " ")
}

/// The parent of process `pid`, if it is still there.
pub fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')')
        .next()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Pids of live processes whose command line or environment contains `needle`.
pub fn pids_matching(needle: &str) -> Vec<u32> {
    let mut out = vec![];
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == std::process::id() {
            continue;
        }
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let mut cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if let Ok(env) = std::fs::read(e.path().join("environ")) {
            cmdline.push_str(&String::from_utf8_lossy(&env).replace('\0', " "));
        }
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rsplit(')')
            .next()
            .is_some_and(|s| s.trim_start().starts_with('Z'));
        if cmdline.contains(needle) && !zombie {
            out.push(pid);
        }
    }
    out
}
