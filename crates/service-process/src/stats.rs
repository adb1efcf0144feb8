//! Counters of one SP, printed at exit (and as JSON for tools).

use serde::Serialize;

#[derive(Clone, Debug, Default, Serialize)]
pub struct Stats {
    /// The counters of the collective families' own resources (`drivers::resources`), by
    /// name (`mcast_*`; the staged family's `staging_*`, `hier_delivered_flat`, `regions_shared`).
    #[serde(flatten)]
    pub families: std::collections::BTreeMap<&'static str, u64>,
    pub posts: u64,
    /// Of `posts`, those read from a host's post ring (shared memory) rather than its socket.
    pub ring_posts: u64,
    /// Completions written into a mailbox in a host's post ring (plain stores, no
    /// `process_vm_writev`).
    pub ring_completions: u64,
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
    /// Of `copies_inline`, those with both ends in this SP's own memory (its staging, its
    /// mapping of a rank's arena): a plain copy, no system call.
    pub copies_own: u64,
    /// Datapath copies split into parts run side by side on the datapath threads
    /// (`serve --split-copy-bytes`), and the parts they made.
    pub copies_split: u64,
    pub copy_parts: u64,
    /// Keys of a post's sides that this SP reached through its mapping of the rank's arena.
    pub arena_sides: u64,
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
    /// from other SPs.
    pub chunks_moved: u64,
    /// Of `chunks_moved`, those put straight into the child SP's staging through UCX (both SPs
    /// with UCX on); the others travel in the SP-to-SP stream.
    pub chunks_moved_ucx: u64,
    pub bytes_staged_in: u64,
    // The staged family's own counters (`staging_peak_bytes`, `staging_refused`,
    // `hier_delivered_flat`, `regions_shared`) are its resources' (`families`, see
    // `crate::staged_resources`).
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
    /// `Limits::max_pending_hellos` were waiting (the oldest of the source holding the most,
    /// among those accepted before the event loop's current pass).
    pub hellos_evicted: u64,
    pub posts_refused: u64,
    /// Most SP memory the hosts' posts held at once (estimated, see `held::post_bytes`).
    pub held_peak_bytes: u64,
    /// Peer SPs dropped for sending nothing (not even a heartbeat) for `--peer-timeout-ms`.
    pub peers_silent: u64,
    /// Peer SPs that joined after the mesh formed: restarted, or late to start.
    pub peers_joined: u64,
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
    /// Where the offloaded calls' time went (`bootstrap::stamps`): per stage `{n, p50_us,
    /// p99_us}` over the calls completed through a mailbox with status ok. `post` (sent to
    /// seen) and `notice` (written to seen by the rank, told by the rank's next post) only for
    /// ranks on this SP's kernel; `total` is the rank's to measure (the benchmark's table).
    #[serde(rename = "stages")]
    pub breakdown: SpBreakdown,
}

/// The SP's side of [`bootstrap::stamps::Breakdown`].
#[derive(Clone, Debug, Default)]
pub struct SpBreakdown(pub bootstrap::stamps::Breakdown);

impl SpBreakdown {
    /// A post read at `seen` with the rank's stamps: its `post` stage, and the `notice` stage
    /// of the rank's previous call.
    pub fn record_host(&mut self, seen: u64, host: &bootstrap::wire::PostStamps) {
        use bootstrap::stamps::{NOTICE, POST};
        if host.sent_ns != 0 && seen >= host.sent_ns {
            self.0.stages[POST].add(seen - host.sent_ns);
        }
        if host.last_notice_ns != 0 {
            self.0.stages[NOTICE].add(host.last_notice_ns);
        }
    }

    /// A completion written with the SP's stamps `sp`: its `accept`, `issue`, `copy` and
    /// `complete` stages (or one more `disordered`).
    pub fn record_sp(&mut self, sp: &bootstrap::stamps::SpStamps) {
        match sp.sp_stages() {
            Some(s) => {
                for (h, v) in self.0.stages[1..5].iter_mut().zip(s) {
                    h.add(v);
                }
            }
            None => self.0.disordered += 1,
        }
    }
}

impl Serialize for SpBreakdown {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.to_json().serialize(s)
    }
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

impl HostSide {
    fn set_read_timeout(&self, t: std::time::Duration) -> std::io::Result<()> {
        match self {
            HostSide::Unix(s) => s.set_read_timeout(Some(t)),
            HostSide::Tcp(s) => s.set_read_timeout(Some(t)),
        }
    }
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

/// The other side of a stats request said nothing within the time bound: an SP that is not
/// serving yet (it answers once all its peer SPs have joined its mesh), or not an SP at all.
#[derive(Debug, thiserror::Error)]
#[error("no answer within {}: not an SP, or an SP not serving yet (an SP answers once all its peer SPs have joined its mesh)", secs(*.within))]
pub struct NoAnswer {
    pub within: std::time::Duration,
}

/// A duration in seconds as an admin reads it: `5 s`, `0.2 s`.
fn secs(d: std::time::Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// Up to 64 bytes of what answered, as escaped text, `…` when there was more.
fn shown(bytes: &[u8]) -> String {
    let cut = bytes.len().min(64);
    let text: String = String::from_utf8_lossy(&bytes[..cut])
        .escape_debug()
        .collect();
    format!("\"{text}\"{}", if bytes.len() > cut { "…" } else { "" })
}

/// Reads into `buf` until it is full, the other side closes, or `deadline` passes; how many
/// bytes came and, when short, why (`None`: closed).
fn read_until(
    s: &mut HostSide,
    buf: &mut [u8],
    deadline: std::time::Instant,
) -> (usize, Option<std::io::Error>) {
    use std::io::Read;
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return (got, Some(std::io::ErrorKind::TimedOut.into()));
        }
        if let Err(e) = s.set_read_timeout(left) {
            return (got, Some(e));
        }
        match s.read(&mut buf[got..]) {
            Ok(0) => return (got, None),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return (got, None),
            Err(e) => return (got, Some(e)),
        }
    }
    (got, None)
}

/// Whether an I/O error means the other side went away (closed, reset).
fn gone(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof
    )
}

/// [`query`], giving up after `timeout` without an answer (connecting included). Whatever does
/// not answer as an SP does is said in an admin's words, naming what was reached: an SP's
/// refusal (its reason), silence ([`NoAnswer`]), a closed connection, or "this is not an SP"
/// with the first bytes it sent.
pub fn query_within(
    sp: &bootstrap::cluster::SpEntry,
    key: &bootstrap::auth::ClusterKey,
    timeout: std::time::Duration,
) -> anyhow::Result<serde_json::Value> {
    use anyhow::Context;
    use bootstrap::auth;
    use bootstrap::wire::{self, AdminHello, Hello};
    use std::io::Write;
    let deadline = std::time::Instant::now() + timeout;
    let (mut s, at) = match sp.host_addr {
        Some(addr) => {
            let at = format!("SP {} at {addr}", sp.id);
            let s = std::net::TcpStream::connect_timeout(&addr, timeout).context(at.clone())?;
            s.set_write_timeout(Some(timeout))?;
            (HostSide::Tcp(s), at)
        }
        None => {
            let at = format!("SP {} at {}", sp.id, sp.host_socket.display());
            let s = std::os::unix::net::UnixStream::connect(&sp.host_socket).context(at.clone())?;
            s.set_write_timeout(Some(timeout))?;
            (HostSide::Unix(s), at)
        }
    };
    let closed = || {
        anyhow::anyhow!(
            "{at}: closed the connection without answering: not an SP, or an SP that dropped \
             the request"
        )
    };
    let (nonce, unix_secs) = (auth::nonce(), auth::unix_secs());
    let hello = wire::frame(&wire::encode_hello(&Hello::Admin(AdminHello {
        nonce,
        unix_secs,
        proof: auth::admin_proof(key, sp.id, &nonce, unix_secs),
    })));
    if let Err(e) = s.write_all(&hello) {
        return Err(if gone(&e) {
            closed()
        } else {
            anyhow::Error::new(e).context(format!("{at}: sending the stats request"))
        });
    }
    let not_sp =
        |bytes: &[u8]| anyhow::anyhow!("{at}: this is not an SP: it answered {}", shown(bytes));
    // The answer: one frame, a u32 LE length then a JSON string (bincode), or the SP's refusal
    // (a reject hello).
    let mut head = [0u8; 4];
    match read_until(&mut s, &mut head, deadline) {
        (4, _) => {}
        (0, None) => return Err(closed()),
        (0, Some(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            return Err(anyhow::Error::new(NoAnswer { within: timeout }).context(at));
        }
        (0, Some(e)) if gone(&e) => return Err(closed()),
        (0, Some(e)) => return Err(anyhow::Error::new(e).context(at)),
        (n, _) => return Err(not_sp(&head[..n])),
    }
    let len = u32::from_le_bytes(head);
    if len > wire::MAX_FRAME_BYTES {
        // Text (an HTTP or SSH server, ...): show a little more of it, without waiting long.
        let mut more = [0u8; 60];
        let soon = std::time::Instant::now() + std::time::Duration::from_millis(200);
        let (n, _) = read_until(&mut s, &mut more, soon.min(deadline));
        let mut bytes = head.to_vec();
        bytes.extend_from_slice(&more[..n]);
        return Err(not_sp(&bytes));
    }
    let mut payload = vec![0u8; len as usize];
    let (n, _) = read_until(&mut s, &mut payload, deadline);
    let mut bytes = head.to_vec();
    bytes.extend_from_slice(&payload[..n]);
    if n < payload.len() {
        return Err(not_sp(&bytes));
    }
    if payload.starts_with(&wire::MAGIC) {
        return Err(match wire::decode_hello(&payload) {
            Ok(Hello::Reject { reason }) => anyhow::anyhow!("{at} refused the request: {reason}"),
            Ok(other) => anyhow::anyhow!("{at}: answered {other:?} instead of its counters"),
            Err(e) => anyhow::anyhow!("{at}: answered a hello instead of its counters: {e}"),
        });
    }
    let json: String = match wire::decode(&payload) {
        Ok(j) => j,
        Err(_) => return Err(not_sp(&bytes)),
    };
    serde_json::from_str(&json).map_err(|_| not_sp(&bytes))
}

/// The columns of the `stats` table: what is offloaded, the host connections per transport,
/// what is copied and between which nodes, the late arrivals, the errors.
const TABLE: [&str; 14] = [
    "posts",
    "completions",
    "errors_sent",
    "host_conns_tcp",
    "host_conns_unix",
    "copies_started",
    "copies_failed",
    "bytes_copied",
    "bytes_inter_node",
    "bytes_intra_node",
    "no_ready_rank",
    "served_after_pass",
    "parked",
    "parked_wait_ns",
];

/// The `stats` table of `answers` (each SP's counters, by SP id): a header, and one row per SP
/// with every value right-aligned under its column's name; after an SP's row, its jobs' late
/// arrivals.
pub fn table(answers: &[(algorithms::SpId, serde_json::Value)]) -> String {
    let cell = |v: &serde_json::Value, f: &str| match &v[f] {
        serde_json::Value::Null => "-".to_string(),
        other => other.to_string(),
    };
    let mut widths: Vec<usize> = std::iter::once("sp").chain(TABLE).map(str::len).collect();
    for (sp, v) in answers {
        widths[0] = widths[0].max(sp.to_string().len());
        for (i, f) in TABLE.iter().enumerate() {
            widths[i + 1] = widths[i + 1].max(cell(v, f).len());
        }
    }
    let row = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:>w$}"))
            .collect();
        padded.join(" ") + "\n"
    };
    let mut out = row(std::iter::once("sp")
        .chain(TABLE)
        .map(str::to_string)
        .collect());
    for (sp, v) in answers {
        out += &row(std::iter::once(sp.to_string())
            .chain(TABLE.iter().map(|f| cell(v, f)))
            .collect());
        if let Some(line) = stages_line(&v["stages"]) {
            out += &line;
        }
        for j in v["late_arrivals_by_job"].as_array().into_iter().flatten() {
            out += &format!(
                "  job {:#x}: no_ready_rank {} served_after_pass {} parked {} parked_wait_ns {}\n",
                j["job"].as_u64().unwrap_or(0),
                j["no_ready_rank"],
                j["served_after_pass"],
                j["parked"],
                j["parked_wait_ns"]
            );
        }
    }
    out
}

/// The per-stage line under an SP's row of the `stats` table: `p50/p99` in µs of each stage
/// with calls (`None`: no call recorded).
fn stages_line(stages: &serde_json::Value) -> Option<String> {
    let mut parts = Vec::new();
    for name in bootstrap::stamps::STAGES {
        let s = &stages[name];
        if s["n"].as_u64().unwrap_or(0) == 0 {
            continue;
        }
        parts.push(format!("{name} {}/{}", s["p50_us"], s["p99_us"]));
    }
    if parts.is_empty() {
        return None;
    }
    Some(format!(
        "  stages (p50/p99 us): {}; disordered {}\n",
        parts.join(", "),
        stages["disordered"]
    ))
}

/// `service-process stats`: every SP's counters, as a table or JSON lines. An SP that does not
/// answer is reported and makes the exit status 1. A reader that goes away (`stats | head`)
/// ends it quietly, with the status so far.
pub fn print_cluster_stats(
    cluster: &bootstrap::Cluster,
    key: &bootstrap::auth::ClusterKey,
    json: bool,
) -> anyhow::Result<i32> {
    use std::io::Write;
    let mut status = 0;
    let mut answers = Vec::new();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for sp in &cluster.sps {
        match query(sp, key) {
            Ok(mut v) if json => {
                v["sp"] = sp.id.into();
                if let Err(e) = writeln!(out, "{v}").and_then(|()| out.flush()) {
                    return stdout_gone(e, status);
                }
            }
            Ok(v) => answers.push((sp.id, v)),
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
                        if let Err(e) = writeln!(out, "{v}").and_then(|()| out.flush()) {
                            return stdout_gone(e, status);
                        }
                    } else {
                        // In the table with the others (stderr said which rows are kept ones).
                        answers.push((sp.id, v));
                    }
                }
            }
        }
    }
    if !json && !answers.is_empty() {
        if let Err(e) = out
            .write_all(table(&answers).as_bytes())
            .and_then(|()| out.flush())
        {
            return stdout_gone(e, status);
        }
    }
    Ok(status)
}

/// The exit status when writing to stdout failed: a reader that went away (a closed pipe) is
/// the end of the output, not an error; anything else is.
fn stdout_gone(e: std::io::Error, status: i32) -> anyhow::Result<i32> {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        Ok(status)
    } else {
        Err(anyhow::Error::new(e).context("writing to stdout"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drivers::LateArrivals;

    #[test]
    fn the_table_shows_the_stages_of_an_sp_that_recorded_calls() {
        let mut s = Stats::default();
        let sp = bootstrap::stamps::SpStamps {
            seen: 1_000,
            ready: 2_000,
            first_copy: 2_500,
            last_copy: 4_500,
            written: 5_000,
        };
        s.breakdown.record_sp(&sp);
        s.breakdown.record_host(
            1_000,
            &bootstrap::wire::PostStamps {
                sent_ns: 600,
                last_notice_ns: 0,
            },
        );
        s.breakdown
            .record_sp(&bootstrap::stamps::SpStamps { ready: 0, ..sp });
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["stages"]["copy"]["n"], 1);
        assert_eq!(v["stages"]["copy"]["p50_us"], 2.1);
        assert_eq!(v["stages"]["post"]["p50_us"], 0.5);
        assert_eq!(v["stages"]["notice"]["n"], 0, "no notice told yet");
        assert_eq!(v["stages"]["disordered"], 1);
        let t = table(&[(0, v), (1, serde_json::to_value(Stats::default()).unwrap())]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(
            lines[2].starts_with("  stages (p50/p99 us): post 0.5/0.5, accept 1.1/1.1"),
            "{t}"
        );
        assert!(lines[2].ends_with("; disordered 1"), "{t}");
        assert!(!t.contains("total"), "the SP records no total: {t}");
    }

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
