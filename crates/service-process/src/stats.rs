//! Counters of one SP, printed at exit (and as JSON for tools).

use serde::Serialize;

#[derive(Clone, Debug, Default, Serialize)]
pub struct Stats {
    pub posts: u64,
    /// Of `posts`, those whose host packed a side through its own staging (a non-contiguous
    /// datatype, or the send side of `MPI_IN_PLACE`).
    pub posts_packed: u64,
    pub completions: u64,
    pub collectives_finished: u64,
    pub announces_received: u64,
    pub messages_sent: u64,
    pub copies_started: u64,
    pub copies_failed: u64,
    /// Copies of a failed job dropped before they started.
    pub copies_purged: u64,
    /// Of `copies_started`, those small enough to run on the event-loop thread.
    pub copies_inline: u64,
    pub bytes_copied: u64,
    /// Of `bytes_copied`, what came from a rank of another node (what a DPU moves over the
    /// network) and what stayed within this node.
    pub bytes_inter_node: u64,
    pub bytes_intra_node: u64,
    /// Intra-node copies handed to the receiving host (blocking allgatherv), their bytes
    /// (not in `bytes_copied`), and how many the host reported failed.
    pub host_copies: u64,
    pub host_copy_bytes: u64,
    pub host_copies_failed: u64,
    /// Staged collectives (bcast): chunks moved to a child SP, bytes received into staging
    /// from other SPs, most staging memory reserved at once, instances refused for want of
    /// staging, and hierarchical instances this SP delivered flat for want of room in the
    /// segment.
    pub chunks_moved: u64,
    /// Of `chunks_moved`, those put straight into the child SP's staging through UCX (both SPs
    /// with UCX on); the others travel in the SP-to-SP stream.
    pub chunks_moved_ucx: u64,
    pub bytes_staged_in: u64,
    pub staging_peak_bytes: u64,
    pub staging_refused: u64,
    pub hier_delivered_flat: u64,
    /// Hierarchical staged collectives: node regions this SP (a bcast's node leader, an
    /// allgather's node owner) handed to another SP of its node (`Sealed`, `RegionDone`),
    /// whose ranks copied out of it.
    pub regions_shared: u64,
    /// Most copies active at once (bounded by `max_inflight_reads`).
    pub max_inflight: u64,
    pub errors_sent: u64,
    /// Clients refused: connections beyond the limits, hellos that failed their checks (a
    /// bad or foreign job credential, a uid that is not the credential's, a taken rank),
    /// connections closed for saying no hello in time, posts beyond a limit.
    pub hosts_refused: u64,
    /// Host connections ended because their process executed another program (its grants
    /// named memory of an image that no longer runs).
    pub hosts_exec_ended: u64,
    /// Host connections accepted on the Unix socket and over TCP (`host_addr`).
    pub host_conns_unix: u64,
    pub host_conns_tcp: u64,
    pub hellos_refused: u64,
    pub hellos_timed_out: u64,
    /// Connections without a hello closed to make room for a newer one, when as many as
    /// `Limits::max_pending_hellos` were waiting (the oldest of the source holding the most).
    pub hellos_evicted: u64,
    pub posts_refused: u64,
    /// Most SP memory the hosts' posts held at once (estimated, see `held::post_bytes`).
    pub held_peak_bytes: u64,
    /// Peer SPs dropped for sending nothing (not even a heartbeat) for `--peer-timeout-ms`.
    pub peers_silent: u64,
    /// The event loop's longest pass (µs): from the end of one wait for events to the start
    /// of the next, everything the loop did in between (its sockets, timers, completions and
    /// the staging UCX worker's progress). Heartbeats go out only between passes.
    pub loop_pass_max_us: u64,
    /// The longest single run of progress on the staging UCX worker (µs), where the puts and
    /// gets of other SPs into this SP's staging are served.
    pub ucx_progress_max_us: u64,
    /// The longest time between two checks of the clock (heartbeats, silent peers) (ms): a
    /// figure well above `--heartbeat-ms` means the loop was held (or the SP descheduled).
    pub timer_gap_max_ms: u64,
    /// Looks of a polling event loop (`serve --poll-us`) that found nothing (0 without it).
    pub empty_polls: u64,
    /// Hierarchical collectives (allgatherv): announcements that found no ready rank where they
    /// arrived, how many another SP of the node then served, how many went to the node's
    /// pending list, and how long they waited there (ns).
    pub no_ready_rank: u64,
    pub served_after_pass: u64,
    pub parked: u64,
    pub parked_wait_ns: u64,
    /// The same four counters per job, for the last [`JOBS_KEPT`] jobs that finished a
    /// hierarchical collective here (oldest first).
    pub late_arrivals_by_job: Vec<JobLateArrivals>,
    /// UCX endpoints of the datapath (to the ranks whose `ucx` grants it copies, and to other
    /// SPs' staging): made, closed (their job ended, their rank's connection closed, their peer
    /// failed, the cache was full), open now (`opened - closed`), and, of the closed, those whose
    /// close had not completed within its bound (left to UCX). `ucx_endpoint_errors`: peer
    /// failures UCX reported to the endpoints' error handler (a rank gone before its endpoint was
    /// closed, an unreachable host), handled without a UCX error line.
    pub ucx_endpoints_opened: u64,
    pub ucx_endpoints_closed: u64,
    pub ucx_endpoints_open: u64,
    pub ucx_endpoint_closes_unfinished: u64,
    pub ucx_endpoint_errors: u64,
    /// Jobs and collective instances held when the counters were taken (at exit: 0 once every
    /// job ended).
    pub jobs_at_exit: u64,
    pub instances_at_exit: u64,
}

/// Jobs whose late-arrival counters an SP keeps apart (an SP may serve jobs for ever).
pub const JOBS_KEPT: usize = 64;

#[derive(Clone, Debug, Default, Serialize)]
pub struct JobLateArrivals {
    pub job: u64,
    #[serde(flatten)]
    pub counters: crate::drivers::LateArrivals,
}

impl Stats {
    /// Adds the counters of a finished instance of `job`, to the totals and to the job's.
    pub fn add_late_arrivals(&mut self, job: u64, l: crate::drivers::LateArrivals) {
        self.no_ready_rank += l.no_ready_rank;
        self.served_after_pass += l.served_after_pass;
        self.parked += l.parked;
        self.parked_wait_ns += l.parked_wait_ns;
        if l.no_ready_rank == 0 && l.parked == 0 && l.served_after_pass == 0 {
            return;
        }
        let i = match self.late_arrivals_by_job.iter().position(|j| j.job == job) {
            Some(i) => i,
            None => {
                if self.late_arrivals_by_job.len() == JOBS_KEPT {
                    self.late_arrivals_by_job.remove(0);
                }
                self.late_arrivals_by_job.push(JobLateArrivals {
                    job,
                    counters: Default::default(),
                });
                self.late_arrivals_by_job.len() - 1
            }
        };
        let c = &mut self.late_arrivals_by_job[i].counters;
        c.no_ready_rank += l.no_ready_rank;
        c.served_after_pass += l.served_after_pass;
        c.parked += l.parked;
        c.parked_wait_ns += l.parked_wait_ns;
    }
}

/// Asks one SP for its counters, proving the request with the cluster key: over TCP at its
/// `host_addr` when it has one (as its hosts reach it), else over its host socket.
pub fn query(
    sp: &bootstrap::cluster::SpEntry,
    key: &bootstrap::auth::ClusterKey,
) -> anyhow::Result<serde_json::Value> {
    query_within(sp, key, std::time::Duration::from_secs(5))
}

/// A connection to an SP's host side, Unix or TCP.
enum HostSide {
    Unix(std::os::unix::net::UnixStream),
    Tcp(std::net::TcpStream),
}

impl std::io::Read for HostSide {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            HostSide::Unix(s) => s.read(buf),
            HostSide::Tcp(s) => s.read(buf),
        }
    }
}

impl std::io::Write for HostSide {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            HostSide::Unix(s) => s.write(buf),
            HostSide::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// [`query`], giving up after `timeout` without an answer (connecting included).
pub fn query_within(
    sp: &bootstrap::cluster::SpEntry,
    key: &bootstrap::auth::ClusterKey,
    timeout: std::time::Duration,
) -> anyhow::Result<serde_json::Value> {
    use anyhow::Context;
    use bootstrap::auth;
    use bootstrap::wire::{AdminHello, Channel, Hello};
    let s = match sp.host_addr {
        Some(addr) => {
            let s = std::net::TcpStream::connect_timeout(&addr, timeout)
                .with_context(|| format!("SP {} at {addr}", sp.id))?;
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))?;
            HostSide::Tcp(s)
        }
        None => {
            let s = std::os::unix::net::UnixStream::connect(&sp.host_socket)
                .with_context(|| format!("SP {} at {}", sp.id, sp.host_socket.display()))?;
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))?;
            HostSide::Unix(s)
        }
    };
    let mut ch = Channel::new(s);
    let (nonce, unix_secs) = (auth::nonce(), auth::unix_secs());
    ch.send_hello(&Hello::Admin(AdminHello {
        nonce,
        unix_secs,
        proof: auth::admin_proof(key, sp.id, &nonce, unix_secs),
    }))?;
    let json: String = ch
        .recv()
        .with_context(|| format!("SP {} did not answer the stats request", sp.id))?;
    Ok(serde_json::from_str(&json)?)
}

/// `service-process stats`: every SP's counters, as a table or JSON lines. An SP that does not
/// answer is reported and makes the exit status 1.
pub fn print_cluster_stats(
    cluster: &bootstrap::Cluster,
    key: &bootstrap::auth::ClusterKey,
    json: bool,
) -> anyhow::Result<i32> {
    const FIELDS: [&str; 9] = [
        "posts",
        "completions",
        "copies_started",
        "bytes_copied",
        "no_ready_rank",
        "served_after_pass",
        "parked",
        "parked_wait_ns",
        "errors_sent",
    ];
    let mut status = 0;
    if !json {
        let header: Vec<String> = FIELDS.iter().map(|f| format!("{f:>17}")).collect();
        println!("{:>4} {}", "sp", header.join(" "));
    }
    for sp in &cluster.sps {
        match query(sp, key) {
            Ok(mut v) => {
                if json {
                    v["sp"] = sp.id.into();
                    println!("{v}");
                } else {
                    let cells: Vec<String> =
                        FIELDS.iter().map(|f| format!("{:>17}", v[*f])).collect();
                    println!("{:>4} {}", sp.id, cells.join(" "));
                    for j in v["late_arrivals_by_job"].as_array().into_iter().flatten() {
                        println!(
                            "     job {:#x}: no_ready_rank {} served_after_pass {} parked {} \
                             parked_wait_ns {}",
                            j["job"].as_u64().unwrap_or(0),
                            j["no_ready_rank"],
                            j["served_after_pass"],
                            j["parked"],
                            j["parked_wait_ns"]
                        );
                    }
                }
            }
            Err(e) => {
                eprintln!("service-process stats: {e:#}");
                status = 1;
                // Gone: the counters it kept when it stopped, if they are on this machine.
                if let Some(mut v) = crate::stopped::read(&sp.host_socket) {
                    let at = crate::stopped::label(&v);
                    eprintln!(
                        "service-process stats: SP {} {at}; its counters then (from {}):",
                        sp.id,
                        crate::stopped::path_for(&sp.host_socket).display()
                    );
                    if json {
                        v["sp"] = sp.id.into();
                        println!("{v}");
                    } else {
                        let cells: Vec<String> =
                            FIELDS.iter().map(|f| format!("{:>17}", v[*f])).collect();
                        println!("{:>4} {}  ({at})", sp.id, cells.join(" "));
                    }
                }
            }
        }
    }
    Ok(status)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drivers::LateArrivals;

    #[test]
    fn late_arrivals_are_kept_per_job_for_the_last_jobs() {
        let mut s = Stats::default();
        let one = LateArrivals {
            no_ready_rank: 2,
            served_after_pass: 1,
            parked: 1,
            parked_wait_ns: 10,
        };
        s.add_late_arrivals(7, one);
        s.add_late_arrivals(7, one);
        s.add_late_arrivals(8, LateArrivals::default());
        assert_eq!(s.no_ready_rank, 4);
        assert_eq!(
            s.late_arrivals_by_job.len(),
            1,
            "a job with nothing late is not listed"
        );
        assert_eq!(s.late_arrivals_by_job[0].counters.parked_wait_ns, 20);
        for job in 100..100 + JOBS_KEPT as u64 {
            s.add_late_arrivals(job, one);
        }
        assert_eq!(s.late_arrivals_by_job.len(), JOBS_KEPT);
        assert_eq!(
            s.late_arrivals_by_job[0].job, 100,
            "the oldest job went first"
        );
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["late_arrivals_by_job"][0]["job"], 100);
        assert_eq!(v["late_arrivals_by_job"][0]["parked"], 1);
    }
}
