//! Real `mpirun` jobs of unmodified MPI programs (`progs/*.c`, built with `mpicc`) with the
//! shim preloaded, through the real launcher and real SPs on 2 nodes x 2 ranks: alltoall(v)
//! (`a2a_check`, every Wait/Test variant, 1 and 2 SPs per node, fewer mailbox slots than
//! outstanding collectives), the legal mixes of issue 11 (`legal_mix`), the conformance
//! generator (`conform`) and threads on their own communicators (`mt_check`). Each checks the
//! program's own verdict and, from the SPs' counters, that exactly the calls the program
//! counted as eligible were posted and completed, without a failed copy.

mod common;

use common::*;
use integration_tests::Finished;

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
                    && l.contains(&format!(", {slots} mailbox slots, placed by "))),
            "rank {r} did not activate with {slots} slots\n{}",
            run.stderr
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
/// configuration forces designs of the staged collectives; the last two have polling SPs
/// (`serve --poll-us`), which read the ranks' posts from their shared-memory post rings, in
/// order with what the ranks send on their sockets, and (one node, one SP) take the small
/// calls' sides from the ranks' arenas. `make conformance` runs it at scale.
#[test]
fn conformance_generator_matches_native_byte_for_byte() {
    let _serial = serial();
    let prog = prog("conform");
    let seed = integration_tests::seed();
    for (i, (k, layout, bcast, iallgather, polling)) in [
        (1, "block", "flat", "lb", false),
        (2, "cyclic", "hier", "hier", false),
        (1, "cyclic", "hier", "flat", false),
        (2, "block", "flat", "hier", true),
        (1, "block", "flat", "flat", true),
    ]
    .into_iter()
    .enumerate()
    {
        let s = (seed + i as u64).to_string();
        let poll: &[&str] = if polling {
            &["--sp-arg=--poll-us=50"]
        } else {
            &[]
        };
        let run = launch_with(
            k,
            &[&["--layout", layout], poll].concat(),
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
        let calls = assert_conform_offloaded(&run, &s.to_string(), NP, 121);
        let ring = run.sp_total("ring_posts");
        eprintln!(
            "conform seed {s}: {calls} calls offloaded, {} packed, {ring} through post rings",
            run.sp_total("posts_packed")
        );
        let arena = run.sp_total("arena_sides");
        eprintln!("conform seed {s}: {arena} sides through the ranks' arenas");
        if polling {
            assert!(ring > 0, "no post came through a ring\n{}", run.stderr);
        } else {
            assert_eq!(ring, 0, "{}", run.stderr);
            assert_eq!(arena, 0, "{}", run.stderr);
        }
        // One node, one SP: the small calls of the communicators it serves alone went
        // through the arenas (datatypes, zero counts, MPI_IN_PLACE and all).
        if polling && k == 1 {
            assert!(arena > 0, "no side in an arena\n{}", run.stderr);
        }
    }
}

#[test]
fn threads_offload_concurrently_on_their_own_communicators() {
    let _serial = serial();
    let prog = prog("mt_check");
    let run = launch(1, &[&prog], &[]);
    assert_offloaded(&run, "mt_check", 2);
    assert!(shim_lines(&run.stderr).is_empty(), "{}", run.stderr);
    // Polling SPs: the threads' posts share their rank's post ring.
    let run = launch_with(1, &["--sp-arg=--poll-us=50"], &[&prog], &[]);
    assert_offloaded(&run, "mt_check", 2);
    assert!(shim_lines(&run.stderr).is_empty(), "{}", run.stderr);
    assert!(run.sp_total("ring_posts") > 0, "{}", run.stderr);
    assert_eq!(
        run.sp_total("ring_completions"),
        run.sp_total("completions"),
        "{}",
        run.stderr
    );
}
