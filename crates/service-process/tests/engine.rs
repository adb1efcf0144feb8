//! The SP engine end to end with real SP processes, real sockets and real CMA copies, with this
//! test process playing the host ranks (no MPI here: that is `tests/` at the workspace root):
//! randomized alltoallvs checked byte for byte, several jobs and communicators at once,
//! completions by message, UCX grants and the `stats` command. Hostile input is in
//! `engine_hostile.rs`, failures of ranks and SPs in `engine_failures.rs`.
#![allow(clippy::needless_range_loop)]

mod common;

use algorithms::CommId;
use bootstrap::mailbox::STATUS_OK;
use bootstrap::Layout;
use common::alltoallv::{first_op, make_op, Op};
use common::*;
use std::time::Duration;

fn run_random_ops(sps_per_node: u32, layout_kind: Layout, seed: u64) {
    let stats = run_random_ops_with(sps_per_node, layout_kind, seed, &[]);
    let inline = sum(&stats, "copies_inline");
    assert!(inline > 0, "small copies should run inline: {stats:?}");
}

/// Runs randomized rounds and returns the SPs' counters.
fn run_random_ops_with(
    sps_per_node: u32,
    layout_kind: Layout,
    seed: u64,
    serve_args: &[&str],
) -> Vec<serde_json::Value> {
    run_random_rounds(sps_per_node, layout_kind, seed, serve_args, 12, 300)
}

/// `rounds` randomized rounds of blocks up to `max` bytes; returns the SPs' counters.
fn run_random_rounds(
    sps_per_node: u32,
    layout_kind: Layout,
    seed: u64,
    serve_args: &[&str],
    rounds: u32,
    max: u64,
) -> Vec<serde_json::Value> {
    let (nodes, rpn) = (2u32, 2u32);
    let world = nodes * rpn;
    let mut set = SpSet::start_with(nodes, sps_per_node, rpn, layout_kind, serve_args);
    let job = new_job();
    let mut hosts = Host::connect_all(&set, job, world);
    let mut rng = Rng(seed);
    let mut seqs = std::collections::HashMap::new();
    for round in 0..rounds {
        // Two to three collectives outstanding at once, on world or a random sub-communicator.
        let outstanding = 2 + rng.below(2) as usize;
        let mut ops = vec![];
        for k in 0..outstanding {
            let mut members: Vec<u32> = (0..world).collect();
            if rng.below(2) == 0 {
                members.retain(|_| rng.below(3) != 0);
                if members.is_empty() {
                    members.push(rng.below(world as u64) as u32);
                }
                for i in (1..members.len()).rev() {
                    members.swap(i, rng.below(i as u64 + 1) as usize);
                }
            }
            let leader = *members.iter().min().unwrap();
            let comm = CommId {
                leader,
                id: 1 + (members.len() as u32) * 100 + leader,
            };
            let seq = seqs.entry(comm).or_insert(0u64);
            let op = make_op(&mut rng, comm, *seq, members, max);
            *seq += 1;
            ops.push((op, k as u32));
        }
        let mut all_posted = vec![];
        for (op, slot) in &ops {
            all_posted.push(op.post(&mut hosts, &|w| w as usize, *slot));
        }
        for (posted, (op, _)) in all_posted.iter().zip(&ops) {
            for &(h, slot, token) in posted {
                let st = hosts[h].wait(slot, token, WAIT);
                assert_eq!(
                    st,
                    Some(STATUS_OK),
                    "seed {seed} round {round}: rank {h} of {:?} got {st:?}",
                    op.comm
                );
            }
            op.check();
        }
    }
    let stats = set.stats_after_goodbyes(hosts);
    assert_zero(&stats, &["copies_failed", "errors_sent"]);
    stats
}

#[test]
fn alltoallv_through_real_sps_matches_reference_block_1sp() {
    run_random_ops(1, Layout::Block, test_seed());
}

#[test]
fn alltoallv_through_real_sps_matches_reference_cyclic_2sp() {
    run_random_ops(2, Layout::Cyclic, test_seed());
}

#[test]
fn alltoallv_every_copy_on_datapath_threads() {
    // The other tests' small blocks are copied inline on the loop thread; this one sends every
    // copy through the datapath threads.
    let stats = run_random_ops_with(1, Layout::Block, test_seed(), &["--inline-copy-bytes", "0"]);
    let started = sum(&stats, "copies_started");
    let inline = sum(&stats, "copies_inline");
    assert!(started > 0 && inline == 0, "{stats:?}");
}

/// Blocks up to 640 KiB through three datapath threads with parts of at least 64 KiB: large
/// copies are split and run side by side (`copies_split`), and every byte still lands where
/// the reference says, at random offsets and lengths that are not multiples of the part. By
/// default an SP without CPUs of its own splits nothing.
#[test]
fn large_copies_are_split_over_the_datapath_threads() {
    let args = [
        "--inline-copy-bytes",
        "0",
        "--datapath-threads",
        "3",
        "--split-copy-bytes",
        "65536",
    ];
    let seed = test_seed();
    let stats = run_random_rounds(1, Layout::Block, seed, &args, 4, 640 << 10);
    let (split, parts) = (sum(&stats, "copies_split"), sum(&stats, "copy_parts"));
    assert!(split > 0, "no copy was split: {stats:?}");
    assert!(
        parts >= 2 * split && parts <= 3 * split,
        "{parts} parts of {split} copies"
    );
    // Without --split-copy-bytes and without CPUs of its own (no --cpus), an SP does not split:
    // it shares the CPUs with the ranks.
    let stats = run_random_rounds(1, Layout::Block, seed, &args[..4], 2, 640 << 10);
    assert!(sum(&stats, "copies_started") > 0);
    assert_eq!(sum(&stats, "copies_split"), 0, "{stats:?}");
}

#[test]
fn alltoallv_block_2sp_and_cyclic_1sp() {
    let seed = test_seed();
    run_random_ops(2, Layout::Block, seed);
    run_random_ops(1, Layout::Cyclic, seed ^ 1);
}

/// Posts without a mailbox slot (a host whose slots are all taken) complete by a message, with
/// the same bytes, many outstanding at once, on two communicators posted in opposite orders
/// by different ranks.
#[test]
fn posts_without_a_slot_complete_by_message() {
    let (mut set, mut hosts) = SpSet::start_job(2, 1, 2, Layout::Block);
    let mut rng = Rng(test_seed());
    let members: Vec<u32> = hosts.iter().map(|h| h.sp).collect();
    let comms = [CommId { leader: 0, id: 1 }, CommId { leader: 0, id: 2 }];
    const PER_COMM: u64 = 40;
    let ops: Vec<Vec<Op>> = comms
        .iter()
        .map(|&c| {
            (0..PER_COMM)
                .map(|seq| make_op(&mut rng, c, seq, vec![0, 1, 2, 3], 64))
                .collect()
        })
        .collect();
    let mut tokens = vec![vec![]; 4];
    for r in 0..4 {
        // Even ranks post communicator 1 first, odd ranks communicator 2 first.
        let order: [usize; 2] = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for c in order {
            for op in &ops[c] {
                let d = op.desc_for(&mut hosts[r], &members, r, 0);
                tokens[r].push(hosts[r].post_slotless(d));
            }
        }
    }
    for r in 0..4 {
        for &t in &tokens[r] {
            assert_eq!(
                hosts[r].wait_message(t),
                Some(STATUS_OK),
                "rank {r} token {t}"
            );
        }
    }
    for op in ops.iter().flatten() {
        op.check();
    }
    for s in set.stats_after_goodbyes(hosts) {
        assert_eq!(s["instances_at_exit"], 0, "{s}");
    }
}

#[test]
fn two_jobs_share_the_sps_and_leave_nothing_behind() {
    // Two jobs at once on the same SPs, with the same communicator ids and sequence numbers:
    // only the job id keeps them apart. After both say goodbye, the SPs hold nothing.
    let seed = test_seed();
    let mut set = SpSet::start(2, 1, 2, Layout::Block);
    let (job_a, job_b) = (new_job(), new_job());
    let mut a = Host::connect_all(&set, job_a, 4);
    let mut b = Host::connect_all(&set, job_b, 4);
    let mut rng = Rng(seed);
    let comm = CommId { leader: 0, id: 1 };
    for seq in 0..10 {
        let op_a = make_op(&mut rng, comm, seq, vec![0, 1, 2, 3], 200);
        let op_b = make_op(&mut rng, comm, seq, vec![3, 2, 1, 0], 200);
        let pa = op_a.post(&mut a, &|w| w as usize, (seq % 4) as u32);
        let pb = op_b.post(&mut b, &|w| w as usize, (seq % 4) as u32);
        for (hosts, posted) in [(&a, pa), (&b, pb)] {
            assert_completed(hosts, &posted, STATUS_OK, &format!("seed {seed}"));
        }
        op_a.check();
        op_b.check();
    }
    for h in a.into_iter().chain(b) {
        h.goodbye();
    }
    std::thread::sleep(Duration::from_millis(200));
    for s in set.stop_and_stats() {
        assert_eq!(s["jobs_at_exit"], 0, "{s}");
        assert_eq!(s["instances_at_exit"], 0, "{s}");
        assert_eq!(s["posts"], 40, "{s}");
    }
}

#[test]
fn alltoallv_with_ucx_grants() {
    // Send and receive buffers granted through UCX (ucp_mem_map + packed rkey); the SPs copy
    // with ucp_get/put on their datapath threads. On this UCX the owner must progress its
    // worker, which the waiting hosts do.
    let seed = test_seed();
    let mut set = SpSet::start_with(2, 1, 2, Layout::Block, &["--ucx"]);
    let job = new_job();
    let ucx = std::rc::Rc::new(std::cell::RefCell::new(
        alias_mkey::host::UcxRegistrar::new().expect("UCX context"),
    ));
    let mut hosts: Vec<Host> = (0..4)
        .map(|r| {
            let mut h = Host::connect(&set, job, r, 4);
            h.ucx = Some(ucx.clone());
            h
        })
        .collect();
    let mut rng = Rng(seed);
    for seq in 0..4 {
        let comm = CommId { leader: 0, id: 3 };
        let op = make_op(&mut rng, comm, seq, vec![0, 1, 2, 3], 5000);
        let posted = op.post(&mut hosts, &|w| w as usize, 0);
        assert_completed(&hosts, &posted, STATUS_OK, &format!("seed {seed}"));
        op.check();
    }
    let stats = set.stats_after_goodbyes(hosts);
    let started = sum(&stats, "copies_started");
    let inline = sum(&stats, "copies_inline");
    assert!(
        started > 0 && inline == 0,
        "ucx copies run on datapath threads: {stats:?}"
    );
}

#[test]
fn stats_command_reads_the_counters_of_running_sps() {
    let (mut set, mut hosts) = SpSet::start_job(2, 1, 2, Layout::Block);
    let op = first_op(21, 4, 64);
    let posted = op.post(&mut hosts, &|w| w as usize, 0);
    assert_completed(&hosts, &posted, STATUS_OK, "one alltoallv");
    let stats = |set: &SpSet| {
        std::process::Command::new(env!("CARGO_BIN_EXE_service-process"))
            .args(["stats", "--json", "--cluster"])
            .arg(&set.cluster_path)
            .output()
            .unwrap()
    };
    let rows = json_lines_ok(stats(&set));
    assert_eq!(rows.len(), 2, "{rows:?}");
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["sp"], i, "{r}");
        assert_eq!(r["posts"], 2, "each SP served two ranks' posts: {r}");
        assert_eq!(r["jobs_at_exit"], 1, "the job is still connected: {r}");
    }
    // An SP that is gone is reported, and the command fails.
    set.kill(1);
    let out = stats(&set);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("SP 1"),
        "{out:?}"
    );
}
