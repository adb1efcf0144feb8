//! Ranks and SPs that die, stop or leave while real SP processes serve a job, with this test
//! process playing the host ranks (see `engine.rs`): the collectives that need them fail on
//! every live rank instead of waiting, and the SPs are left holding nothing.
#![allow(clippy::needless_range_loop)]

mod common;

use bootstrap::mailbox;
use bootstrap::Layout;
use common::alltoallv::first_op;
use common::*;
use std::time::Duration;

#[test]
fn a_rank_that_dies_mid_collective_fails_it_everywhere() {
    let (set, mut hosts) = SpSet::start_job(2, 1, 2, Layout::Block);
    let op = first_op(7, 4, 32);
    // Ranks 0..3 post; rank 3 "dies" (its connection drops) without posting.
    let p = op.members_world.len();
    let members: Vec<u32> = hosts.iter().map(|h| h.sp).collect();
    let posted = op.post_ranks(
        &mut hosts,
        &|w| w as usize,
        &members,
        0,
        &(0..p - 1).collect::<Vec<_>>(),
    );
    drop(hosts.pop());
    let failed = mailbox::status_code(algorithms::Status::RankFailed);
    assert_completed(&hosts, &posted, failed, "must fail");
    // The failed job's state goes once its ranks are gone.
    drop(hosts);
    std::thread::sleep(Duration::from_millis(200));
    let mut set = set;
    assert_nothing_held(&set.stop_and_stats());
}

#[test]
fn a_peer_sp_that_dies_fails_the_collectives_that_need_it() {
    let (mut set, mut hosts) = SpSet::start_job(2, 1, 2, Layout::Block);
    let op = first_op(8, 4, 32);
    let members: Vec<u32> = hosts.iter().map(|h| h.sp).collect();
    let posted = op.post_ranks(&mut hosts, &|w| w as usize, &members, 0, &[0, 1]);
    set.kill(1);
    let failed = mailbox::status_code(algorithms::Status::PeerFailed);
    assert_completed(&hosts, &posted, failed, "must fail");
    assert!(set.alive(0), "the surviving SP keeps running");
}

#[test]
fn posts_after_a_peer_sp_died_fail_instead_of_waiting() {
    let mut set = SpSet::start(2, 1, 2, Layout::Block);
    let job = new_job();
    let mut hosts: Vec<Host> = (0..2).map(|r| Host::connect(&set, job, r, 4)).collect();
    set.kill(1);
    // Give SP 0 time to see the loss first: this is the path where the peer is already known
    // dead when the posts arrive.
    std::thread::sleep(Duration::from_millis(300));
    let op = first_op(9, 4, 32);
    let members = vec![0, 0, 1, 1];
    let posted = op.post_ranks(&mut hosts, &|w| w as usize, &members, 0, &[0, 1]);
    let failed = mailbox::status_code(algorithms::Status::PeerFailed);
    assert_completed(&hosts, &posted, failed, "must fail");
}

#[test]
fn a_post_after_a_rank_died_fails_instead_of_waiting() {
    // Rank 0 dies without posting; its SP forgets the job. Rank 1 posts afterwards: its
    // announcement to rank 0's SP must still be answered, so rank 1 completes with an error.
    let (set, mut hosts) = SpSet::start_job(2, 1, 1, Layout::Block);
    let op = first_op(11, 2, 32);
    let members = vec![hosts[0].sp, hosts[1].sp];
    // Rank 0's connection drops; give the SPs time to forget the job.
    let dead = std::mem::replace(&mut hosts[0], Host::connect(&set, new_job(), 0, 2));
    drop(dead);
    std::thread::sleep(Duration::from_millis(300));
    let posted = op.post_ranks(&mut hosts, &|w| w as usize, &members, 0, &[1]);
    let failed = mailbox::status_code(algorithms::Status::RankFailed);
    assert_completed(&hosts, &posted, failed, "must fail");
}

#[test]
fn a_completion_never_reaches_a_host_that_reused_a_dead_hosts_connection() {
    // Job 1 has ranks 0 and 1 on SP 0 and ranks 2 and 3 on SP 1. Rank 0 posts while SP 1 is
    // stopped, then dies; rank 1 stays, so SP 0 keeps the job and the instance. A rank of job 2
    // connects to SP 0 and may get the dead host's table entry. When SP 1 resumes, the dead
    // rank's instance completes: that completion must not land in job 2's mailbox.
    let (mut set, mut hosts) = SpSet::start_job(2, 1, 2, Layout::Block);
    let op = first_op(12, 4, 32);
    let members: Vec<u32> = hosts.iter().map(|h| h.sp).collect();
    let sp1 = set.sps[1].child.id() as i32;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(sp1, libc::SIGSTOP) };
    let posted = op.post_ranks(&mut hosts, &|w| w as usize, &members, 5, &[0]);
    let dead = std::mem::replace(&mut hosts[0], Host::connect(&set, new_job(), 1, 4));
    drop(dead);
    std::thread::sleep(Duration::from_millis(200));
    let newcomer = Host::connect(&set, new_job(), 0, 4);
    // SAFETY: as above.
    unsafe { libc::kill(sp1, libc::SIGCONT) };
    // The token the dead rank's post carried; the newcomer never posted anything.
    assert_eq!(
        newcomer.wait(5, posted[0].2, Duration::from_millis(1500)),
        None
    );
    drop(newcomer);
    drop(hosts);
    std::thread::sleep(Duration::from_millis(200));
    assert_nothing_held(&set.stop_and_stats());
}

/// The node segment's name outlives no job: here SP 0's rank leaves while SP 1, on the same
/// node, never had a rank of the job connected (its rank never came). SP 0 must not wait for
/// SP 1 to say the job is gone there: SP 1 answers that it does not have the job.
#[test]
fn a_node_segment_name_is_removed_when_the_other_sp_never_had_the_job() {
    let set = SpSet::start(1, 2, 2, Layout::Block);
    let job = new_job();
    let name = service_process::access::segment_name(&set.key, job, 0);
    let path = std::path::Path::new("/dev/shm").join(name.trim_start_matches('/'));
    let c = std::ffi::CString::new(name.clone()).unwrap();
    // SAFETY: a valid C string; the fd is closed at once.
    let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT, 0o600) };
    assert!(fd >= 0, "shm_open {name}");
    // SAFETY: our fd.
    unsafe { libc::close(fd) };
    assert!(path.exists());
    // World rank 0 is SP 0's, rank 1 SP 1's; only rank 0 connects.
    let host = Host::connect(&set, job, 0, 2);
    host.goodbye();
    let t = std::time::Instant::now();
    while path.exists() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left = path.exists();
    // SAFETY: a valid C string (cleanup if the SPs did not).
    unsafe { libc::shm_unlink(c.as_ptr()) };
    assert!(!left, "{name} still there 10 s after the job ended on SP 0");
}
