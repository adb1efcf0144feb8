use super::*;
use crate::bcast::{set_mutation, Mutation};
use crate::sim::staged_common::clean_by_design;

fn cfg(seed: u64) -> SimConfig {
    let mut c = SimConfig::new(seed);
    c.len_bytes = Some(70);
    c.faults.msg_jitter_ns = 2_000;
    c
}

#[test]
fn a_run_moves_and_copies_real_bytes() {
    let cfg = |design| SimConfig { design, ..cfg(5) };
    for r in clean_by_design(cfg, run) {
        assert_eq!(r.bytes_moved_inter_node, r.min_inter_node_bytes);
        assert!(r.moves > 0 && r.copies > 0);
        assert_eq!(r.stats.chunks_forwarded, r.moves);
        assert!(r.stats.max_slots_in_use >= 2, "{:?}", r.stats);
    }
}

/// Runs `c` under `m` for a few seeds; every seed must fail with a
/// message containing one of `want`. Returns the first failure.
fn caught(m: Mutation, c: SimConfig, want: &[&str]) -> String {
    driver::caught(m, set_mutation, c, run, want)
}

#[test]
fn checkers_catch_a_slot_freed_while_its_move_reads_it() {
    // One rank per SP: the root's SP has no local writes to wait for.
    let mut c = cfg(0);
    c.ranks_per_node = 2;
    caught(Mutation::FreeWhileMoving, c, &["writes staging slot"]);
}

#[test]
fn checkers_catch_ranks_completing_a_chunk_early() {
    caught(
        Mutation::CompleteOneChunkEarly,
        cfg(0),
        &["on the buffer of rank", "is wrong"],
    );
}

#[test]
fn checkers_catch_the_root_completing_before_its_reads_finished() {
    let mut c = cfg(0);
    c.design = Design::Hier;
    caught(
        Mutation::RootCompletesBeforeReads,
        c,
        &["on the buffer of rank"],
    );
}

#[test]
fn checkers_catch_a_late_rank_missing_staged_chunks() {
    let mut c = cfg(0);
    c.late_ranks = 6;
    c.late_delay_ns = 1_000_000;
    caught(
        Mutation::SkipStagedForLateRank,
        c,
        &["never completed", "not finished"],
    );
}

#[test]
fn checkers_catch_ok_completions_after_an_abort() {
    let mut c = cfg(0);
    c.faults.inconsistent_posts = 2;
    c.faults.rank_deaths = 1;
    c.faults.death_window_ns = 10_000;
    caught(
        Mutation::OkAfterAbort,
        c,
        &["learned of a fault", "inconsistent post"],
    );
}
