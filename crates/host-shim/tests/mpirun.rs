//! Real `mpirun` jobs with the shim preloaded: the native fallback, silence when not
//! configured, offload through the stand-in SP of `common/`, and an SP that dies mid-job.
//! Skipped (with a note) where `mpicc`/`mpirun` are missing.

mod common;

use common::*;
use std::time::Duration;

const NP: u32 = 4;
const TIMEOUT: Duration = Duration::from_secs(120);

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn shim_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.contains("host-shim:"))
        .collect()
}

macro_rules! need_mpi {
    () => {
        if !have_mpi() {
            eprintln!("skipped: mpicc/mpirun not found");
            return;
        }
    };
}

#[test]
fn no_sp_reachable_prints_one_line_per_rank_and_runs_natively() {
    need_mpi!();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("nosp");
    let prog = build_check_prog(&dir);
    let (_, cluster) = cluster(&dir, 2, 1);
    let out = mpirun(
        NP,
        &prog,
        &["1"],
        &[("SPOFF_CLUSTER", cluster.to_str().unwrap())],
        TIMEOUT,
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("a2a_check: all ok"), "{stdout}");
    let lines = shim_lines(&stderr);
    assert_eq!(lines.len(), NP as usize, "{stderr}");
    for r in 0..NP {
        assert!(
            lines.iter().any(
                |l| l.contains(&format!("rank {r}: no service process reachable at"))
                    && l.ends_with("running natively")
            ),
            "{stderr}"
        );
    }
}

#[test]
fn unconfigured_shim_is_silent_and_native() {
    need_mpi!();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("silent");
    let prog = build_check_prog(&dir);
    let (_, cluster) = cluster(&dir, 2, 1);
    for env in [
        vec![],
        vec![
            ("SPOFF_CLUSTER", cluster.to_str().unwrap()),
            ("SPOFF_OFFLOAD", "0"),
        ],
    ] {
        let out = mpirun(NP, &prog, &["1"], &env, TIMEOUT);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(
            out.status.success(),
            "{env:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
        assert!(stdout.contains("a2a_check: all ok"), "{stdout}");
        assert!(shim_lines(&stderr).is_empty(), "{env:?}: {stderr}");
    }
}

#[test]
fn offloads_through_the_stand_in_sp() {
    need_mpi!();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("mock");
    let prog = build_check_prog(&dir);
    let (c, cluster) = cluster(&dir, 2, 1);
    let sp = MockSp::start(&c, &[0, 1], Behaviour::Serve);
    let out = mpirun(
        NP,
        &prog,
        &["2", "free"],
        &[
            ("SPOFF_CLUSTER", cluster.to_str().unwrap()),
            ("SPOFF_VERBOSE", "1"),
            // Fewer slots than the 6 outstanding collectives of the check program: posting
            // must harvest completed requests to find a free slot.
            ("SPOFF_MAILBOX_SLOTS", "4"),
        ],
        TIMEOUT,
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("a2a_check: all ok"), "{stdout}");
    let lines = shim_lines(&stderr);
    assert_eq!(
        lines.len(),
        NP as usize,
        "only the activation lines: {stderr}"
    );
    assert!(
        lines.iter().all(|l| l.contains("offload active")),
        "{stderr}"
    );
    let posts = sp.posts.load(std::sync::atomic::Ordering::Acquire);
    let done = sp.completed.load(std::sync::atomic::Ordering::Acquire);
    // Every instance has 2 (half communicators) or 4 posts, and every post completed (the
    // freed request included: MPI_Finalize waited for it).
    assert!(
        done > 0 && posts >= 2 * done && posts <= NP as usize * done,
        "posts {posts}, instances {done}"
    );
    eprintln!("{posts} posts, {done} offloaded instances");
}

#[test]
fn one_unreachable_sp_keeps_the_whole_job_native() {
    need_mpi!();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("partial");
    let prog = build_check_prog(&dir);
    let (c, cluster) = cluster(&dir, 2, 1);
    let sp = MockSp::start(&c, &[0], Behaviour::Serve);
    let out = mpirun(
        NP,
        &prog,
        &["1"],
        &[("SPOFF_CLUSTER", cluster.to_str().unwrap())],
        TIMEOUT,
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("a2a_check: all ok"), "{stdout}");
    let lines = shim_lines(&stderr);
    assert_eq!(lines.len(), 3, "{stderr}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("rank 2: no service process reachable")),
        "{stderr}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("rank 3: no service process reachable")),
        "{stderr}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("offload is off for this job: 2 rank(s)")),
        "{stderr}"
    );
    assert_eq!(sp.hosts.load(std::sync::atomic::Ordering::Acquire), 2);
    assert_eq!(sp.posts.load(std::sync::atomic::Ordering::Acquire), 0);
}

#[test]
fn a_dying_sp_fails_collectives_instead_of_hanging() {
    need_mpi!();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("death");
    let prog = build_check_prog(&dir);
    let (c, cluster) = cluster(&dir, 1, 1);
    let _sp = MockSp::start(&c, &[0], Behaviour::DieAfterPosts(6));
    let out = mpirun(
        NP,
        &prog,
        &["1"],
        &[("SPOFF_CLUSTER", cluster.to_str().unwrap())],
        TIMEOUT,
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        !out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("failures"), "{stdout}\n{stderr}");
    assert!(stderr.contains("closed the connection"), "{stderr}");
    eprintln!("{stderr}");
}

#[test]
fn threads_offload_concurrently_on_their_own_communicators() {
    need_mpi!();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("threads");
    let prog = build_prog(&dir, "mt_check");
    let (c, cluster) = cluster(&dir, 2, 1);
    let sp = MockSp::start(&c, &[0, 1], Behaviour::Serve);
    let out = mpirun(
        NP,
        &prog,
        &[],
        &[("SPOFF_CLUSTER", cluster.to_str().unwrap())],
        TIMEOUT,
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    if stdout.contains("skipped") {
        eprintln!("{stdout}");
        return;
    }
    assert!(stdout.contains("mt_check: all ok"), "{stdout}\n{stderr}");
    assert!(shim_lines(&stderr).is_empty(), "{stderr}");
    // 3 threads x 20 iterations, every one offloaded.
    assert_eq!(sp.completed.load(std::sync::atomic::Ordering::Acquire), 60);
}
