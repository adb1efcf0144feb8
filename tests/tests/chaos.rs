//! Chaos: random collectives of every kind (the conformance generator, `conform.c`) on the
//! emulated cluster while a driver injects one fault per round: kill an SP, stop an SP (and
//! leave it stopped), pause an SP briefly, kill a rank, or cut the SP-to-SP connections of an
//! SP (`ss -K`). The launcher's watchdog is off: only the heartbeats detect a stopped SP.
//!
//! Every round must end within its bound (never a hang) with either the right bytes on every
//! rank or an error, never a wrong byte (no "first diff" from the generator); and nothing may
//! be left behind: no process of the job, no shared-memory segment of its cluster. A round
//! without a fault, or with a pause shorter than the timeouts, must pass.
//!
//! `CHAOS_ROUNDS` (default 4 in `make test`; `make chaos` runs many) and `TEST_SEED`.

use integration_tests::{launch_cmd, pids_matching, seed, Rng};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long a round may take before it counts as a hang.
const ROUND_LIMIT: Duration = Duration::from_secs(120);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    KillSp,
    StopSp,
    PauseSp,
    KillRank,
    CutSp,
}

const FAULTS: [Fault; 6] = [
    Fault::None,
    Fault::KillSp,
    Fault::StopSp,
    Fault::PauseSp,
    Fault::KillRank,
    Fault::CutSp,
];

/// `conform.c` built with mpicc (once).
fn conform() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let src = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../crates/host-shim/tests/progs/conform.c");
            let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("chaos-conform");
            let tmp = out.with_extension(format!("{}", std::process::id()));
            let st = Command::new("mpicc")
                .args(["-O1", "-Wall", "-pthread", "-o"])
                .arg(&tmp)
                .arg(&src)
                .status()
                .expect("mpicc runs (install Open MPI: make deps)");
            assert!(st.success(), "mpicc failed on {}", src.display());
            std::fs::rename(&tmp, &out).unwrap();
            out
        })
        .clone()
}

fn cmdline(pid: u32) -> String {
    String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default())
        .replace('\0', " ")
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a process of our own job.
    unsafe { libc::kill(pid as i32, sig) };
}

/// The run directory the launcher printed (`--keep-run-dir`).
fn run_dir_of(stderr: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(stderr).ok()?;
    text.lines().find_map(|l| {
        l.strip_prefix("service-process launch: run directory ")
            .and_then(|r| r.strip_suffix(" (kept)"))
            .map(PathBuf::from)
    })
}

/// Injects `fault` into the running job with `marker`; returns what it did.
fn inject(fault: Fault, marker: &str, run_dir: &Path, rng: &mut Rng) -> String {
    let pids = pids_matching(marker);
    let sps: Vec<u32> = pids
        .iter()
        .copied()
        .filter(|&p| cmdline(p).contains(" serve "))
        .collect();
    let ranks: Vec<u32> = pids
        .iter()
        .copied()
        .filter(|&p| cmdline(p).contains("chaos-conform") && !cmdline(p).contains("rank-exec"))
        .collect();
    let pick = |v: &[u32], rng: &mut Rng| v.get(rng.below(v.len() as u64) as usize).copied();
    match fault {
        Fault::None => "nothing".into(),
        Fault::KillSp | Fault::StopSp | Fault::PauseSp | Fault::CutSp => {
            let Some(sp) = pick(&sps, rng) else {
                return "no SP left to hit".into();
            };
            match fault {
                Fault::KillSp => signal(sp, libc::SIGKILL),
                Fault::StopSp => signal(sp, libc::SIGSTOP),
                Fault::PauseSp => {
                    signal(sp, libc::SIGSTOP);
                    std::thread::sleep(Duration::from_millis(300));
                    signal(sp, libc::SIGCONT);
                }
                _ => {
                    // The connections this SP accepted from its peers end at its peer port.
                    let id = cmdline(sp)
                        .split("--sp-id ")
                        .nth(1)
                        .and_then(|r| r.split_whitespace().next())
                        .and_then(|v| v.parse::<u32>().ok());
                    let cluster = bootstrap::Cluster::load(&run_dir.join("cluster.json"));
                    let port = id
                        .zip(cluster.ok())
                        .and_then(|(id, c)| c.sp(id).map(|e| e.peer_addr.port()));
                    if let Some(port) = port {
                        let _ = Command::new("ss")
                            .args(["-K", "dst", "127.0.0.1", "dport", "=", &port.to_string()])
                            .stdout(Stdio::null())
                            .stderr(Stdio::null())
                            .status();
                        let _ = Command::new("ss")
                            .args(["-K", "src", "127.0.0.1", "sport", "=", &port.to_string()])
                            .stdout(Stdio::null())
                            .stderr(Stdio::null())
                            .status();
                    }
                }
            }
            format!("{fault:?} pid {sp}")
        }
        Fault::KillRank => match pick(&ranks, rng) {
            Some(r) => {
                signal(r, libc::SIGKILL);
                format!("KillRank pid {r}")
            }
            None => "no rank left to kill".into(),
        },
    }
}

/// The shared-memory segments of the cluster whose key is in `run_dir`.
fn segments_of(run_dir: &Path) -> Vec<String> {
    let Ok(key) = bootstrap::auth::ClusterKey::load(&run_dir.join("cluster.key")) else {
        return vec![];
    };
    let prefix = format!("spoff-{}-", key.tag());
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn chaos_rounds_end_with_the_right_bytes_or_an_error_and_leave_nothing() {
    let rounds: u64 = std::env::var("CHAOS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let seed = seed();
    let mut rng = Rng(seed);
    let prog = conform();
    let mut tally = std::collections::BTreeMap::<String, u32>::new();
    for round in 0..rounds {
        // Every fault kind comes round in turn; the rest is random.
        let fault = FAULTS[(round as usize + rng.below(2) as usize) % FAULTS.len()];
        let k = 1 + rng.below(2);
        let layout = if rng.below(2) == 0 { "block" } else { "cyclic" };
        let case_seed = rng.next() % 1_000_000;
        let err =
            std::env::temp_dir().join(format!("spoff-chaos-{}-{round}.err", std::process::id()));
        let out = err.with_extension("out");
        let k_s = k.to_string();
        let case_s = case_seed.to_string();
        let mut cmd = launch_cmd(
            &[
                "--nodes",
                "2",
                "--ranks-per-node",
                "2",
                "--sps-per-node",
                &k_s,
                "--layout",
                layout,
                "--sp-watchdog-secs",
                "0",
                "--fault-grace-secs",
                "20",
                "--keep-run-dir",
                "--sp-arg=--peer-timeout-ms=2000",
            ],
            &[
                prog.to_str().unwrap(),
                "--cases",
                "600",
                "--seed",
                &case_s,
                "--timeout",
                "60",
            ],
        );
        cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env("SPOFF_SP_TIMEOUT_MS", "3000")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap());
        let mut child = cmd.spawn().unwrap();
        let marker = format!("spoff-{}-", child.id());
        let t = Instant::now();
        // Wait until the ranks run, then a random moment.
        while pids_matching(&marker).len() < 2 * k as usize + 4 && t.elapsed() < ROUND_LIMIT {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(200 + rng.below(1500)));
        let run_dir = run_dir_of(&err).expect("the launcher printed its run directory");
        let did = inject(fault, &marker, &run_dir, &mut rng);
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if t.elapsed() > ROUND_LIMIT {
                let _ = child.kill();
                panic!(
                    "round {round} (seed {seed}, {did}) hung past {ROUND_LIMIT:?}\n{}",
                    std::fs::read_to_string(&err).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let stdout = std::fs::read_to_string(&out).unwrap_or_default();
        let stderr = std::fs::read_to_string(&err).unwrap_or_default();
        let context = format!(
            "round {round}: seed {seed}, conform --seed {case_seed}, {k} SPs/node, {layout}, \
             {did}, exit {status}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
        );
        // Never a wrong byte: only errors may come of a fault.
        assert!(!stdout.contains("first diff"), "wrong bytes\n{context}");
        let passed = status.success()
            && (0..4).all(|r| stdout.contains(&format!("conform: rank {r}: ok, ")));
        if matches!(fault, Fault::None | Fault::PauseSp) {
            assert!(
                passed,
                "a round without a lasting fault must pass\n{context}"
            );
        }
        // Nothing left behind.
        let t_left = Instant::now();
        while !pids_matching(&marker).is_empty() && t_left.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let left = pids_matching(&marker);
        let segments = segments_of(&run_dir);
        let _ = std::fs::remove_dir_all(&run_dir);
        let _ = std::fs::remove_file(&out);
        let _ = std::fs::remove_file(&err);
        assert!(left.is_empty(), "processes left: {left:?}\n{context}");
        assert!(
            segments.is_empty(),
            "segments left: {segments:?}\n{context}"
        );
        let verdict = if passed {
            "passed"
        } else {
            "failed with an error"
        };
        eprintln!(
            "chaos round {round}: {did}: {verdict} in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        *tally.entry(format!("{fault:?} {verdict}")).or_default() += 1;
    }
    eprintln!("chaos (seed {seed}, {rounds} rounds): {tally:?}");
}
