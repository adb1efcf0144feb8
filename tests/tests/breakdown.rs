//! Where an offloaded call's time goes (`bootstrap::stamps`), for a real job: `coll-bench
//! overlap` under the launcher prints the shim's per-stage breakdown of rank 0's calls, and
//! the SP reports its side in its counters. Every call must have every stage, in order: a
//! stamp lost or taken out of order shows as a missing count or as `disordered`.

use integration_tests::splitmix::Rng;
use integration_tests::*;
use std::time::Duration;

const JOB_TIMEOUT: Duration = Duration::from_secs(240);
const STAGES: [&str; 7] = [
    "post", "accept", "issue", "copy", "complete", "notice", "total",
];

/// An SP that sleeps until a message arrives reads no post ring: every post came on the
/// socket.
#[test]
fn breakdown_has_every_stage_in_order_for_a_real_job() {
    let stats = breakdown_for(&[]);
    assert_eq!(stats["ring_posts"], 0, "{stats}");
    assert_eq!(stats["ring_completions"], 0, "{stats}");
    // No ring, no arena.
    assert_eq!(stats["arena_sides"], 0, "{stats}");
}

/// The same with the SP busy-polling on a CPU of its own (`launch --sp-cpus` with a CPU per SP
/// implies `serve --busy-poll`; every copy then runs on the polling thread): the results are
/// still right, every stage is there (the `post` stage of a post read from the shared-memory
/// ring included), the SP did poll (it looked and found nothing many times) rather than sleep,
/// and every post of the two ranks came through their post rings and every completion went
/// into the mailboxes inside them.
#[test]
fn breakdown_has_every_stage_in_order_with_a_busy_polling_sp() {
    let stats = breakdown_for(&["--sp-cpus", "1"]);
    assert!(
        stats["empty_polls"].as_u64().is_some_and(|n| n > 0),
        "the SP did not poll: {stats}"
    );
    assert_eq!(stats["ring_posts"], stats["posts"], "{stats}");
    // Their mailboxes are in the rings too: every completion was a store into shared memory.
    assert_eq!(stats["ring_completions"], stats["completions"], "{stats}");
    // The small size's sides went through the ranks' arenas (both ranks at this one SP), and
    // their blocks moved by plain copies.
    assert!(
        stats["arena_sides"].as_u64().is_some_and(|n| n > 0),
        "no side in an arena: {stats}"
    );
    assert!(
        stats["copies_own"].as_u64().is_some_and(|n| n > 0),
        "no plain copy: {stats}"
    );
}

/// Runs the job with `extra` launcher arguments, checks the breakdowns, and returns the SP's
/// counters.
fn breakdown_for(extra: &[&str]) -> serde_json::Value {
    let mut rng = Rng(seed());
    // Three sizes: two copied on the SP's loop thread, one on a datapath thread (serve's
    // --inline-copy-bytes is 64 KiB by default), each a random length; the small one's sides
    // (two blocks) fit the ranks' arenas, the middle one's do not.
    let small = 1 + rng.below(2048);
    let middle = 4097 + rng.below(4096);
    let large = 65537 + rng.below(256 << 10);
    let sizes = format!("{small},{middle},{large}");
    let iters = 6 + rng.below(6);
    // The receive buffers at a random offset in their cache line against the send buffers':
    // most offsets make a direct copy a slow one on some CPUs, and the SP then bounces at an
    // offset of its choosing (alias_mkey::copy); the bytes must arrive all the same.
    let recv_offset = rng.below(64).to_string();
    eprintln!("recv offset {recv_offset}");
    let warmup = 2u64;
    let json = std::env::temp_dir().join(format!(
        "spoff-breakdown-{}-{}.json",
        std::process::id(),
        extra.len()
    ));
    let json_s = json.display().to_string();
    let bench = artifact("coll-bench").display().to_string();
    let ranks = 2u64;
    let run = run(
        launch_cmd(
            &[&["--nodes", "1", "--ranks-per-node", "2"], extra].concat(),
            &[
                &bench,
                "overlap",
                "--coll",
                "ialltoallv",
                "--sizes",
                &sizes,
                "--iters",
                &iters.to_string(),
                "--warmup",
                &warmup.to_string(),
                "--json",
                &json_s,
                "--recv-offset",
                &recv_offset,
            ],
        ),
        JOB_TIMEOUT,
    );
    run.assert_ok("coll-bench overlap");
    let text = std::fs::read_to_string(&json).unwrap();
    std::fs::remove_file(&json).ok();
    let rows: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3, "{text}");
    for r in &rows {
        assert_eq!(r["validated"], true, "{r}");
        let b = &r["breakdown"];
        assert_eq!(
            b["disordered"], 0,
            "calls with a stamp lost or out of order: {r}"
        );
        // Rank 0's timed calls of the pure phase, each with every stage.
        for s in STAGES {
            assert_eq!(b[s]["n"].as_u64(), Some(iters), "stage {s}: {r}");
        }
        let p50 = |s: &str| b[s]["p50_us"].as_f64().unwrap();
        assert!(p50("total") > 0.0 && p50("copy") > 0.0, "{r}");
        assert!(r["readv_us"].as_f64().is_some_and(|t| t > 0.0), "{r}");
    }
    assert!(
        run.stdout.contains("where an offloaded call's time goes"),
        "no breakdown table:\n{}",
        run.stdout
    );
    // The SP's side: every completed post has the SP's four stages and its post stage; the
    // notice stage comes with a rank's next post (each rank's last call has none).
    let stats = run.sp_stats();
    assert_eq!(stats.len(), 1);
    let st = &stats[0];
    let posts = st["posts"].as_u64().unwrap();
    assert_eq!(posts, ranks * 3 * 2 * (iters + warmup), "{st}");
    let s = &st["stages"];
    assert_eq!(s["disordered"], 0, "{s}");
    for name in ["post", "accept", "issue", "copy", "complete"] {
        assert_eq!(s[name]["n"].as_u64(), Some(posts), "stage {name}: {s}");
    }
    assert_eq!(s["notice"]["n"].as_u64(), Some(posts - ranks), "{s}");
    st.clone()
}
