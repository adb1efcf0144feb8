//! `service-process`: the SP daemon (`serve`), the emulated-cluster launcher (`launch`), and the
//! per-rank wrapper the launcher runs under mpirun (`rank-exec`).

use anyhow::{Context, Result};
use bootstrap::rendezvous::Backoff;
use bootstrap::Cluster;
use clap::{Parser, Subcommand};
use service_process::access::Limits;
use service_process::cpus::{make_realtime, pin_to, CpuList};
use service_process::launch::{self, LaunchOpts};
use service_process::mesh::connect_mesh;
use service_process::server::{ServeConfig, Server, UcxMode};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(
    version,
    about = "Service processes for DPU-offloaded MPI collectives, emulated on one machine"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run one SP of a cluster: connect to its peers, then serve host ranks until SIGTERM.
    ///
    /// Hosts connect to its Unix socket (`host_socket` of its entry in the description) and,
    /// when the entry has a `host_addr`, over TCP there (hosts on other machines: identified by
    /// their job credential only; see --hosts-same-kernel). Prints `READY sp=N` on stdout once
    /// every peer is connected and the host listeners are open, and tells systemd the same
    /// (`READY=1` to $NOTIFY_SOCKET, for a `Type=notify` unit). On SIGTERM/SIGINT it first
    /// prints `STATS {json}` (its counters) and keeps them in HOST_SOCKET.stopped.json (where
    /// `stats` finds them once it is gone), then removes its socket and stops within a fraction
    /// of a second. Logs go to stderr (SPOFF_LOG).
    ///
    /// Started by a launcher, one per slot: `mpirun --map-by ppr:K:node service-process serve
    /// --sp-id auto ...` or `srun --ntasks-per-node=K ...`; `service-process wait-ready` tells
    /// when all serve. As a daemon, by systemd (`spoff-sp@I`, `--sp-id local:I`): the same K
    /// instances on every DPU.
    Serve {
        /// Cluster description (JSON, as written by `launch` or an admin).
        #[arg(long)]
        cluster: PathBuf,
        /// This SP's id in the description (cluster-wide: node n runs n*K ... n*K+K-1), or
        /// `local:I`: SP I (0 ... K-1) of this machine's node, the node found from its host
        /// name (or --node) in the description's `dpus` or `hosts`; the same argument on every
        /// DPU (the systemd unit's `--sp-id local:%i`). Or `auto`: the node so found, the index
        /// from the launcher's local rank (OMPI_COMM_WORLD_LOCAL_RANK, PMI_LOCAL_RANK,
        /// MPI_LOCALRANKID or SLURM_LOCALID).
        #[arg(long, value_name = "N|local:I|auto")]
        sp_id: service_process::deploy::SpIdArg,
        /// With --sp-id auto or local:I: this node's name in the description's `dpus` or `hosts`
        /// (default: this machine's host name).
        #[arg(long)]
        node: Option<String>,
        /// The hosts reaching this SP over TCP share its kernel (network namespaces of one
        /// machine, as in the deployment test): their hellos name their pid, which the SP
        /// checks (alive, running as the job credential's uid) and pins, and their `cma`
        /// grants are served. Without it a TCP host is on another machine: only `ucx` grants,
        /// no mailbox (completions come as messages), no node segment.
        #[arg(long)]
        hosts_same_kernel: bool,
        /// The cluster key (a file of mode 0600; `launch` writes one per cluster): peer SPs,
        /// job credentials and admin requests are checked with it.
        #[arg(long)]
        key: PathBuf,
        /// Mode of the host socket, in octal. 600: only this SP's user may connect (the
        /// default, right for `launch`); a daemon shared by the users of a node opens it (e.g.
        /// 666) and the job credentials decide who is served.
        #[arg(long, default_value = "600", value_parser = parse_mode)]
        socket_mode: u32,
        /// Largest world size of a job.
        #[arg(long, default_value_t = 1 << 20)]
        max_world_size: u32,
        /// Host connections at once, all jobs together.
        #[arg(long, default_value_t = 4096)]
        max_hosts: usize,
        /// Milliseconds a host connection may take to say hello.
        #[arg(long, default_value_t = 5000)]
        hello_timeout_ms: u64,
        /// Posts of one rank not completed yet; beyond it a post is refused with an error.
        #[arg(long, default_value_t = 8192)]
        max_posts_per_rank: usize,
        /// Open collective instances of one job on this SP; beyond it a post is refused.
        #[arg(long, default_value_t = 1 << 16)]
        max_instances_per_job: usize,
        /// SP memory the posts of one rank may hold (MiB, estimated from their communicator
        /// sizes: about 0.5 KiB per member); a post beyond it is refused with an error.
        #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
        max_held_mib_per_rank: u64,
        /// SP memory the posts of one job may hold, all its ranks here together (MiB).
        #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
        max_held_mib_per_job: u64,
        /// SP memory the posts of one user's jobs may hold together (MiB; the user is the uid
        /// the job credentials name).
        #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
        max_held_mib_per_uid: u64,
        /// Milliseconds between heartbeats to peer SPs and to hosts waiting for this SP.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..=60_000))]
        heartbeat_ms: u64,
        /// A peer SP that sends nothing (not even a heartbeat) for this many milliseconds is
        /// stuck (stopped, deadlocked): it counts as lost and the collectives that need it
        /// fail. Must exceed the peers' --heartbeat-ms.
        #[arg(long, default_value_t = 10_000)]
        peer_timeout_ms: u64,
        /// Use this inherited, already bound TCP listener instead of binding the address from
        /// the description.
        #[arg(long)]
        listen_fd: Option<i32>,
        /// Copies active at once on this SP, across all collectives.
        #[arg(long, default_value_t = 4)]
        max_inflight_reads: usize,
        /// Datapath worker threads (default: --max-inflight-reads).
        #[arg(long)]
        datapath_threads: Option<usize>,
        /// A copy that goes to the datapath threads and is at least twice this many bytes is
        /// split into parts copied side by side, none shorter than this (rounded up to a
        /// multiple of 65536; 0: never split), one per datapath thread at most and, with
        /// --cpus, one per CPU the datapath threads have. Default: 262144 when the datapath
        /// threads have at least two CPUs of the SP's own (--cpus of 2 or more; with
        /// --busy-poll 3 or more, the first being the loop's), else 0: an SP that shares its
        /// CPUs with the ranks would take more of them at once.
        #[arg(long)]
        split_copy_bytes: Option<u64>,
        /// Staging buffer per datapath thread, in bytes.
        #[arg(long, default_value_t = 1 << 20)]
        chunk_bytes: usize,
        /// Copies up to this many bytes run on the event-loop thread (0: all on datapath
        /// threads).
        #[arg(long, default_value_t = 64 * 1024)]
        inline_copy_bytes: u64,
        /// UCX (auto, on, off; a bare --ucx means on): serve grants of the `ucx` backend (each
        /// datapath thread owns a UCX worker; UCX_TLS applies) and move the staged
        /// collectives' chunks between SPs as UCX puts. auto (the default): on if UCX
        /// initialises, else off with a warning. off: `ucx` grants are refused (ranks learn it
        /// at MPI_Init: they grant through cma where the SP serves it, else their job runs
        /// natively) and chunks travel as frames on the SPs' TCP connections. The `cma`
        /// backend is always served to hosts it can attach to.
        #[arg(long, default_value = "auto", num_args = 0..=1, default_missing_value = "on")]
        ucx: UcxMode,
        /// Staged collectives (Ibcast, staged Iallgather): bytes per chunk and per staging
        /// buffer (at most 2 MiB; must be the same on every SP of the cluster).
        #[arg(long, default_value_t = 256 * 1024, value_parser = clap::value_parser!(u64).range(1..=2 * 1024 * 1024))]
        stage_chunk_bytes: u64,
        /// Staged collectives: staging buffers per collective instance on this SP (the
        /// pipeline depth; an Ibcast takes no more than its message has chunks).
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
        stage_slots: u32,
        /// Staging memory of this SP, all staged collectives together (MiB); a staged
        /// collective that would exceed it fails with an error.
        #[arg(long, default_value_t = 256)]
        staging_mib: u64,
        /// The share of --staging-mib one job may hold, in percent; its staged collectives
        /// beyond it fail with an error (other jobs' go on).
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=100))]
        staging_job_share: u64,
        /// The share of --staging-mib the jobs of one user (the credentials' uid) may hold
        /// together, in percent.
        #[arg(long, default_value_t = 75, value_parser = clap::value_parser!(u64).range(1..=100))]
        staging_uid_share: u64,
        /// Pin the SP to these CPUs (e.g. `1` or `0,2-3`).
        #[arg(long)]
        cpus: Option<CpuList>,
        /// Run under SCHED_FIFO so the SP preempts computing ranks at once (a stand-in for
        /// dedicated DPU cores on a machine with too few cores to reserve one; needs root or
        /// CAP_SYS_NICE). Its CPU time then comes out of the ranks' time.
        #[arg(long)]
        realtime: bool,
        /// Look at the host and peer connections every US microseconds, napping in between,
        /// instead of sleeping until a message arrives (0: sleep until woken). For an SP that
        /// shares its CPU with others (a nap leaves it to them); a message waits up to US (plus
        /// the kernel's wake-up) for the SP to notice it. On cores of its own, --busy-poll.
        #[arg(long, value_name = "US", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=100_000))]
        poll_us: u64,
        /// Busy-poll, as DPU service processes do on cores of their own: the event loop looks
        /// at the host and peer connections without ever sleeping (a post is seen within a
        /// look, the SP is never woken), and the copies never wait behind it. With --cpus of
        /// one CPU, every cma copy runs on the polling thread (--inline-copy-bytes is then
        /// unlimited: a mover thread on the same CPU would wait for the loop's time slice);
        /// with K >= 2 CPUs, the loop has the first to itself and the datapath (and multicast)
        /// threads share the other K-1. Without --cpus, the threads go where the kernel puts
        /// them. Only on reserved cores: spinning SPs that share a CPU take it from each other
        /// for whole scheduler slices (use --poll-us there). `launch --sp-cpus` with a CPU per
        /// SP passes it.
        #[arg(long, conflicts_with = "poll_us")]
        busy_poll: bool,
        /// Seconds to wait for the peer SPs at start-up.
        #[arg(long, default_value_t = 30)]
        connect_timeout_secs: u64,
        /// The multicast collectives (SPOFF_BCAST_DESIGN=mcast, SPOFF_IALLGATHER_DESIGN=mcast):
        /// on, or off (this SP's ranks learn it at MPI_Init, and their jobs keep the other
        /// designs, saying so once). On, an SP that cannot join its probe group and hear its
        /// own datagram at start runs none either, and says why.
        /// The groups are the description's `mcast_groups` (default 239.255.0.0/16 from port
        /// 47000), sent out of the interface of this SP's peer address (TTL 0 on loopback,
        /// else 1: the DPUs' network, never a router).
        #[arg(long, default_value = "on", value_parser = ["on", "off"])]
        mcast: String,
        /// Multicast: bytes of data per datagram (the chunk; an IB UD MTU is 4096). The same on
        /// every SP of the cluster.
        #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(64..=65_000))]
        mcast_mtu: u64,
        /// Multicast: subgroups (group addresses) a collective's chunks are spread over, as
        /// contiguous runs. The same on every SP of the cluster.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
        mcast_subgroups: u16,
        /// Multicast: receive workers (threads landing chunks; the DPA receive threads'
        /// stand-ins). Each owns some of the subgroup sockets.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
        mcast_recv_workers: u64,
        /// Multicast: send workers (threads multicasting the root's chunks).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
        mcast_send_workers: u64,
        /// Multicast: the cutoff timer's link rate B_link, in bytes per nanosecond (a leaf
        /// scans its bitmap N / B_link + alpha after it said it is ready).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1000))]
        mcast_link_bytes_per_ns: u64,
        /// Multicast: the cutoff timer's alpha, in microseconds (synchronisation and the
        /// network's noise; also how long after the root's SP said every chunk is sent a leaf
        /// waits before it fetches what is missing: docs/BENCHMARKS.md M measured 300 against
        /// 2000 and 100).
        #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(0..=10_000_000))]
        mcast_alpha_us: u64,
        /// Multicast: each subgroup socket's receive buffer, in KiB (the kernel caps it at
        /// net.core.rmem_max; an overflow is a receiver-not-ready drop, counted and recovered).
        #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(16..=1 << 20))]
        mcast_rcvbuf_kib: u64,
        /// Multicast, for tests and benchmarks: drop this percentage of the datagrams received,
        /// on the receive side before the bitmap (seeded by --mcast-seed).
        #[arg(long, default_value_t = 0.0, value_parser = parse_percent)]
        mcast_drop_rate: f64,
        /// Multicast, for tests and benchmarks: hold back this percentage of the datagrams
        /// received behind the next one (reordering).
        #[arg(long, default_value_t = 0.0, value_parser = parse_percent)]
        mcast_reorder: f64,
        /// Multicast: the seed of --mcast-drop-rate and --mcast-reorder (default: the SP id).
        #[arg(long)]
        mcast_seed: Option<u64>,
    },
    /// Start an emulated cluster (N nodes x K SPs), run PROGRAM under mpirun with the host shim
    /// preloaded (an MPICH program under mpiexec.mpich with the MPICH-ABI shim; see --mpi), and
    /// stop everything when it exits. Exit status: the program's.
    ///
    /// The ranks get SPOFF_CLUSTER (the cluster description), SPOFF_JOB_CREDENTIAL and
    /// SPOFF_NODE (the emulated node --layout puts them on; the shim places itself from it and
    /// MPI), and for the benchmarks SPOFF_NODES, SPOFF_RANKS_PER_NODE and SPOFF_LAYOUT; the
    /// shim also reads SPOFF_OFFLOAD=0 (run natively) and SPOFF_VERBOSE=1 from the launcher's
    /// environment. At exit every SP's counters are printed
    /// on stderr as `sp N stats: {json}`. SP logs: SPOFF_LOG (e.g. info, debug).
    Launch(LaunchOpts),
    /// Issue a job credential: what a job's ranks present to the SPs (in SPOFF_JOB_CREDENTIAL)
    /// to be served. Printed on stdout. Whoever can read the cluster key can issue one, for any
    /// uid: on a shared cluster that is the resource manager (e.g. a prologue running as
    /// root), which gives it to the job's processes only. `launch` issues one per job itself.
    Credential {
        /// The cluster key (mode 0600).
        #[arg(long)]
        key: PathBuf,
        /// The job's number of ranks (MPI_COMM_WORLD's size).
        #[arg(long)]
        world_size: u32,
        /// The uid whose processes may use it (default: this process's).
        #[arg(long)]
        uid: Option<u32>,
    },
    /// Print the counters of every SP of a running cluster (the launcher prints them too when
    /// the SPs stop). The cluster description is in the launcher's run directory (or wherever
    /// the admin keeps it); an SP with a `host_addr` is asked over TCP there, else on its Unix
    /// socket. Exit status 1 if an SP does not answer; for such an SP, the counters it kept
    /// next to its socket when it stopped (or when its last job ended) are printed, labelled
    /// "stopped at ..." (read on the SP's machine only).
    Stats {
        /// Cluster description (JSON, as written by `launch`).
        #[arg(long)]
        cluster: PathBuf,
        /// The cluster key that proves the request (default: cluster.key beside the
        /// description, where `launch` writes it).
        #[arg(long)]
        key: Option<PathBuf>,
        /// One JSON object per SP (with an "sp" field) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Wait until every SP of a cluster description serves: asks each for its counters (as
    /// `stats` does, over TCP where the description gives a host address) until all answer.
    /// Exit status 0 then; at the timeout, names the SPs that did not answer and why, exit
    /// status 1. For job scripts that start SPs with their launcher: wait, never sleep.
    WaitReady {
        /// Cluster description (JSON).
        #[arg(long)]
        cluster: PathBuf,
        /// The cluster key that proves the requests (default: cluster.key beside the
        /// description).
        #[arg(long)]
        key: Option<PathBuf>,
        /// Seconds to wait for all of them.
        #[arg(long, default_value_t = 60)]
        timeout_secs: u64,
    },
    /// Run the deterministic simulator of the allgather or the bcast at scale, or the allgather's
    /// tail after a late arrival against a host ring (virtual time under
    /// the simulator's cost model, not a measurement) and print completion time and inter-node
    /// bytes per SPs per node and layout (and per design for the bcast).
    ///
    /// --coll allgather (the default): the hierarchical, load-balanced allgather, every rank
    /// contributing --block-bytes; columns: mean completion time, inter-node bytes and their
    /// minimum (summed over the seeds), and the late-arrival counters (no_ready / passed /
    /// parked, summed over the seeds).
    ///
    /// --coll bcast: the staged bcast, one broadcast of --bcast-bytes from --root cut into
    /// --chunk-bytes chunks with --slots staging buffers per SP, for both designs (flat: every
    /// rank's buffer written by its SP; hier: one node segment per SP, ranks copy out of it);
    /// columns: design, completion_us (mean over the seeds of the last rank to hold the message
    /// in its own buffer, for hier after its copy out of the segment), sp_completion_us (the
    /// last completion an SP emitted), inter_node_B and min_inter_B (per run: bytes that crossed
    /// between nodes, and bcast-bytes x (nodes - 1)), hier/flat (ratio of completion_us, on the
    /// hier row). JSON rows carry "coll": "bcast" and a "design" field.
    ///
    /// --coll tail: the late-arrival tail (issue 28). Per seed, the hierarchical allgather and
    /// a host-based ring allgatherv (`algorithms::host_ring`: P - 1 send-receive steps between
    /// neighbouring world ranks, run by the ranks inside the call, a transfer moving once both
    /// halves are posted) on the same blocks and arrival times, under --cost (and --ring-cost
    /// for the ring on top of it); columns: last_arrival_us (mean over the seeds of the last
    /// rank's call), offload_tail_us and ring_tail_us (the last completion minus the last
    /// arrival), tail_ratio (offload / ring), no_ready and parked (the allgather's late-arrival
    /// counters, summed). --block-bytes stays small (real buffers); the cost field byte_weight
    /// prices each byte as that many.
    ///
    /// Ranks post within the simulator's default arrival skew (20 us); --late-ranks of them
    /// come later still (--late-delay-us). A simulator failure prints its seed and exits with
    /// status 1.
    Simulate(service_process::simulate::SimulateOpts),
    /// Measure the multicast receive workers of one SP (issue 26): chunks per second landed
    /// and CPU ns per chunk against receive workers and chunk size, over loopback multicast
    /// (239.255.0.0/16, TTL 0: nothing leaves this host). Drops for want of socket buffer are
    /// counted. On fewer cores than workers + 1 the sender and workers share them.
    McastBench(service_process::mcast::bench::McastBenchOpts),
    /// Run one software Canary switch (issue 27): the `algorithms::canary` switch machine on
    /// UDP sockets, one per port (`--port N=LOCAL,PEER`: bound to LOCAL, connected to PEER, so
    /// only PEER's datagrams reach it). Datagrams that are not Canary packets are dropped and
    /// counted. A port's queue occupancy, which picks the up-port, is its socket's kernel send
    /// queue (SIOCOUTQ) plus a software queue of what the socket refused (--queue-kib, tail
    /// drop beyond). A port whose peer answers ICMP unreachable is down for --down-ms. Prints
    /// `READY switch addr=A ports=P` once bound; `STATS {json}` at SIGINT/SIGTERM, and keeps
    /// the same JSON in --stats-file while running. Logs: SPOFF_LOG.
    ///
    /// Example, a leaf with two hosts (addresses 1, 2) and two spines (101, 102):
    /// `service-process switch --addr 11 --port 0=127.0.0.1:7000,127.0.0.1:6001 --port
    /// 1=127.0.0.1:7001,127.0.0.1:6002 --port 2=127.0.0.1:7002,127.0.0.1:7100 --port
    /// 3=127.0.0.1:7003,127.0.0.1:7200 --up 2,3 --route 1=0 --route 2=1 --route 101=2
    /// --route 102=3`
    Switch(service_process::canary_switch::SwitchOpts),
    /// Start a tree of Canary switches for quick use: `--switches L+S` (default 2+2) switch
    /// daemons on loopback, or with --netns in network namespaces (veth links, no route out,
    /// optionally a shaped link with background traffic), the members' sockets spread over
    /// the leaves, the plan (every port and member link, JSON) written to --plan; `READY
    /// canary-tree switches=N` once they run; on SIGINT/SIGTERM they stop and each one's
    /// counters are printed (`switch A STATS {json}`). `launch --canary-tree` runs it and
    /// gives each SP its member link (`SPOFF_ALLREDUCE_DESIGN=canary`).
    CanaryTree(service_process::canary_tree::CanaryTreeOpts),
    /// Write (`init`) or validate (`check`) the cluster description of a real cluster: each
    /// node's host name, its DPU's addresses for hosts and for peer SPs, K SPs per DPU, ports.
    Cluster {
        #[command(subcommand)]
        cmd: service_process::cluster_cmd::ClusterCmd,
    },
    /// (internal) Run by mpirun for each rank: pin, preload the shim, exec the program.
    #[command(hide = true)]
    RankExec {
        #[arg(long)]
        cpus: Option<CpuList>,
        #[arg(long)]
        preload: Option<PathBuf>,
        #[arg(last = true, required = true)]
        program: Vec<String>,
    },
}

/// Refuses an inherited fd that is not an open socket, rather than adopting it blindly.
/// A file mode in octal (`600`, `0660`).
/// A percentage, 0 to 100.
fn parse_percent(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))?;
    if !(0.0..=100.0).contains(&v) {
        return Err(format!("{s}: a percentage is 0 to 100"));
    }
    Ok(v)
}

fn parse_mode(s: &str) -> Result<u32, String> {
    match u32::from_str_radix(s.trim_start_matches("0o"), 8) {
        Ok(m) if m <= 0o777 => Ok(m),
        _ => Err(format!("{s:?} is not an octal file mode (e.g. 600 or 666)")),
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SPOFF_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Colours only for a terminal: a journal or a log file gets plain text.
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

fn main() {
    let cli = Cli::parse();
    let code = match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("service-process: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

fn run(cli: Cli) -> Result<i32> {
    match cli.cmd {
        Cmd::Switch(o) => {
            init_tracing();
            service_process::canary_switch::run(&o)?;
            Ok(0)
        }
        Cmd::CanaryTree(o) => {
            init_tracing();
            service_process::canary_tree::run(&o)?;
            Ok(0)
        }
        Cmd::Serve {
            cluster,
            sp_id,
            node,
            hosts_same_kernel,
            key,
            socket_mode,
            max_world_size,
            max_hosts,
            hello_timeout_ms,
            max_posts_per_rank,
            max_instances_per_job,
            max_held_mib_per_rank,
            max_held_mib_per_job,
            max_held_mib_per_uid,
            heartbeat_ms,
            peer_timeout_ms,
            listen_fd,
            max_inflight_reads,
            datapath_threads,
            split_copy_bytes,
            chunk_bytes,
            inline_copy_bytes,
            ucx,
            stage_chunk_bytes,
            stage_slots,
            staging_mib,
            staging_job_share,
            staging_uid_share,
            cpus,
            realtime,
            poll_us,
            busy_poll,
            connect_timeout_secs,
            mcast,
            mcast_mtu,
            mcast_subgroups,
            mcast_recv_workers,
            mcast_send_workers,
            mcast_link_bytes_per_ns,
            mcast_alpha_us,
            mcast_rcvbuf_kib,
            mcast_drop_rate,
            mcast_reorder,
            mcast_seed,
        } => {
            init_tracing();
            // A Canary link in a network namespace (an emulation on one machine): its socket
            // is opened there now, while this process may still enter a namespace.
            let canary_socket = match (&sp_id, Cluster::load(&cluster)) {
                (service_process::deploy::SpIdArg::Id(id), Ok(c)) => {
                    service_process::canary_resources::open_early(*id, &c)
                }
                _ => None,
            };
            // First, while this process has one thread (every later thread inherits it).
            service_process::access::drop_capabilities().context("dropping capabilities")?;
            if ucx != UcxMode::Off {
                service_process::access::confine_ucx_transports()?;
            }
            if let Some(cpus) = &cpus {
                pin_to(&cpus.0).context("pinning the SP")?;
            }
            let reserved: Vec<u32> = cpus.as_ref().map_or(Vec::new(), |c| c.0.clone());
            let movers_cpus = service_process::cpus::movers_cpus(&reserved, busy_poll);
            if realtime {
                make_realtime().context("--realtime: cannot switch to SCHED_FIFO")?;
            }
            let cluster = Cluster::load(&cluster)?;
            let sp_id = match sp_id {
                service_process::deploy::SpIdArg::Id(id) => id,
                service_process::deploy::SpIdArg::Auto => {
                    let host = service_process::deploy::host_name()
                        .context("--sp-id auto: cannot read the host name")?;
                    service_process::deploy::resolve_sp_id(&cluster, node.as_deref(), &host, |v| {
                        std::env::var(v).ok()
                    })
                    .map_err(anyhow::Error::msg)?
                }
                service_process::deploy::SpIdArg::Local(index) => {
                    let host = service_process::deploy::host_name()
                        .context("--sp-id local: cannot read the host name")?;
                    service_process::deploy::resolve_local(&cluster, node.as_deref(), &host, index)
                        .map_err(anyhow::Error::msg)?
                }
            };
            let entry = cluster
                .sp(sp_id)
                .with_context(|| format!("SP id {sp_id} is not in the cluster description"))?
                .clone();
            // UCX listens on every network device it may use: keep it to the SP-to-SP network
            // (the device of this SP's peer address) unless the user chose the devices. Set
            // while this process has one thread, before UCX starts.
            if std::env::var_os("UCX_NET_DEVICES").is_none() {
                if let Some(dev) = service_process::access::interface_of(entry.peer_addr.ip()) {
                    std::env::set_var("UCX_NET_DEVICES", dev);
                }
            }
            // The ports UCX's TCP transport listens on, where the description confines them
            // (what the firewall opens), unless the user chose them.
            if std::env::var_os("UCX_TCP_PORT_RANGE").is_none() {
                if let Some(r) = cluster.ucx_tcp_port_range {
                    std::env::set_var("UCX_TCP_PORT_RANGE", r.to_string());
                }
            }
            let listener = service_process::deploy::peer_listener(listen_fd, &cluster, sp_id)?;
            let backoff = Backoff {
                deadline: Duration::from_secs(connect_timeout_secs),
                ..Backoff::default()
            };
            let key = bootstrap::auth::ClusterKey::load(&key)?;
            service_process::deploy::prepare_socket_dir(&entry.host_socket, socket_mode)?;
            // Bound before the mesh so that a taken address fails at once; served once ready.
            let host_listener = match entry.host_addr {
                Some(addr) => Some(service_process::deploy::host_listener(addr, sp_id)?),
                None => None,
            };
            let mesh = connect_mesh(
                sp_id,
                &cluster,
                &listener,
                backoff,
                &key,
                Duration::from_millis(heartbeat_ms),
            )?;
            let mcast_plane = if mcast == "off" {
                Err("this SP was started with --mcast=off".to_string())
            } else {
                match entry.peer_addr.ip() {
                    std::net::IpAddr::V4(interface) => {
                        let groups = cluster.mcast_groups;
                        let ppm = |pct: f64| (pct * 10_000.0).round() as u32;
                        Ok(service_process::mcast::plane::PlaneConfig {
                            fabric: service_process::mcast::fabric::FabricConfig {
                                base: groups.map_or(std::net::Ipv4Addr::new(239, 255, 0, 0), |g| {
                                    g.range.base
                                }),
                                prefix: groups.map_or(16, |g| g.range.prefix),
                                port_base: groups.map_or(47_000, |g| g.port_base),
                                interface,
                                ttl: if interface.is_loopback() { 0 } else { 1 },
                            },
                            subgroups: mcast_subgroups,
                            recv_workers: mcast_recv_workers as usize,
                            send_workers: mcast_send_workers as usize,
                            inject: service_process::mcast::worker::Injection {
                                drop_ppm: ppm(mcast_drop_rate),
                                reorder_ppm: ppm(mcast_reorder),
                                seed: mcast_seed.unwrap_or(u64::from(sp_id)),
                            },
                            rcvbuf: (mcast_rcvbuf_kib as usize) << 10,
                            movers: Default::default(),
                        })
                    }
                    std::net::IpAddr::V6(a) => Err(format!(
                        "the multicast fabric is IPv4; this SP's peer address {a} is IPv6"
                    )),
                }
            };
            let cfg = ServeConfig {
                mcast: service_process::drivers::McastParams {
                    mtu: mcast_mtu,
                    subgroups: mcast_subgroups,
                    link_bytes_per_ns: mcast_link_bytes_per_ns,
                    alpha_ns: mcast_alpha_us * 1000,
                },
                mcast_plane,
                canary_socket,
                sp: sp_id,
                cluster,
                peer_listener: listener,
                host_socket: entry.host_socket.clone(),
                host_listener,
                hosts_same_kernel,
                max_inflight_reads: max_inflight_reads.max(1),
                datapath_threads: datapath_threads.unwrap_or(max_inflight_reads).max(1),
                split_copy_bytes: split_copy_bytes.unwrap_or(if movers_cpus >= 2 {
                    256 * 1024
                } else {
                    0
                }),
                split_parts: match movers_cpus {
                    0 => usize::MAX,
                    n => n,
                },
                chunk_bytes,
                inline_copy_bytes: if busy_poll && reserved.len() == 1 {
                    u64::MAX
                } else {
                    inline_copy_bytes
                },
                ucx,
                connect_backoff: backoff,
                staged: service_process::drivers::StagedConfig {
                    chunk_bytes: stage_chunk_bytes,
                    slots: stage_slots,
                },
                staging_bytes: staging_mib.saturating_mul(1 << 20),
                poll_interval: if busy_poll {
                    Some(Duration::ZERO)
                } else {
                    (poll_us > 0).then(|| Duration::from_micros(poll_us))
                },
                key,
                socket_mode,
                heartbeat: Duration::from_millis(heartbeat_ms),
                peer_timeout: Duration::from_millis(peer_timeout_ms.max(2 * heartbeat_ms)),
                limits: Limits {
                    max_world_size,
                    max_hosts,
                    hello_timeout: Duration::from_millis(hello_timeout_ms),
                    max_posts_per_rank,
                    max_instances_per_job,
                    held: service_process::held::HeldLimits {
                        per_rank: max_held_mib_per_rank << 20,
                        per_job: max_held_mib_per_job << 20,
                        per_uid: max_held_mib_per_uid << 20,
                    },
                    staging_shares: service_process::staging::Shares {
                        job_percent: staging_job_share,
                        uid_percent: staging_uid_share,
                    },
                    ..Limits::default()
                },
            };
            // Busy-polling on K >= 2 CPUs: the threads the server starts (datapath, multicast
            // workers) go to the last K-1, then the loop's thread takes the first alone.
            let split = busy_poll && reserved.len() >= 2;
            if split {
                pin_to(&reserved[1..]).context("pinning the SP's movers")?;
            }
            let server = Server::new(cfg, mesh)?;
            if split {
                pin_to(&reserved[..1]).context("pinning the SP's polling thread")?;
            }
            println!("READY sp={sp_id}");
            if let Err(e) = service_process::deploy::sd_notify(&format!(
                "READY=1\nSTATUS=serving as SP {sp_id}"
            )) {
                eprintln!("service-process: cannot notify the service manager: {e}");
            }
            let socket = entry.host_socket.clone();
            server.run(|stats| {
                // First thing on the signal, before any teardown (see `Server::run`): the
                // counters on stdout (the journal, the launcher's output) and next to the
                // socket, where `stats` reads them once this SP is gone.
                // One write of the whole line: the SPs of one launcher stop at the same moment,
                // and a line written in pieces (as `println!` does with a line longer than the
                // stdout buffer) interleaves with theirs in the launcher's output.
                let line = format!(
                    "STATS {}\n",
                    serde_json::to_string(stats).unwrap_or_else(|e| format!("null ({e})"))
                );
                {
                    use std::io::Write;
                    let mut out = std::io::stdout().lock();
                    let _ = out.flush();
                    let _ = out.write_all(line.as_bytes());
                    let _ = out.flush();
                }
                if let Err(e) = service_process::stopped::write(&socket, sp_id, stats, true) {
                    eprintln!(
                        "service-process: cannot keep the counters in {}: {e}",
                        service_process::stopped::path_for(&socket).display()
                    );
                }
                let _ = service_process::deploy::sd_notify("STOPPING=1");
            })?;
            Ok(0)
        }
        Cmd::Launch(opts) => {
            init_tracing();
            launch::launch(&opts)
        }
        Cmd::Credential {
            key,
            world_size,
            uid,
        } => {
            anyhow::ensure!(world_size > 0, "--world-size must be at least 1");
            let key = bootstrap::auth::ClusterKey::load(&key)?;
            // SAFETY: geteuid has no preconditions.
            let uid = uid.unwrap_or_else(|| unsafe { libc::geteuid() });
            let cred = bootstrap::auth::JobCredential::issue_new(&key, uid, world_size);
            println!("{}", cred.encode());
            Ok(0)
        }
        Cmd::Stats { cluster, key, json } => {
            let key = key.unwrap_or_else(|| launch::key_path(&cluster));
            let key = bootstrap::auth::ClusterKey::load(&key)?;
            let cluster = Cluster::load(&cluster)?;
            service_process::stats::print_cluster_stats(&cluster, &key, json)
        }
        Cmd::WaitReady {
            cluster,
            key,
            timeout_secs,
        } => {
            let key = key.unwrap_or_else(|| launch::key_path(&cluster));
            let key = bootstrap::auth::ClusterKey::load(&key)?;
            let cluster = Cluster::load(&cluster)?;
            let t = std::time::Instant::now();
            match service_process::deploy::wait_ready(
                &cluster,
                &key,
                Duration::from_secs(timeout_secs),
                Duration::from_millis(200),
            ) {
                Ok(()) => {
                    println!(
                        "ready: all {} SPs answer ({:.1} s)",
                        cluster.sps.len(),
                        t.elapsed().as_secs_f64()
                    );
                    Ok(0)
                }
                Err(service_process::deploy::NotReady(missing)) => {
                    for (sp, why) in &missing {
                        eprintln!("service-process wait-ready: SP {sp} does not answer: {why}");
                    }
                    eprintln!(
                        "service-process wait-ready: {} of {} SPs not ready after {timeout_secs} s",
                        missing.len(),
                        cluster.sps.len()
                    );
                    Ok(1)
                }
            }
        }
        Cmd::Simulate(opts) => {
            service_process::simulate::simulate(&opts)?;
            Ok(0)
        }
        Cmd::McastBench(opts) => {
            service_process::mcast::bench::run(&opts)?;
            Ok(0)
        }
        Cmd::Cluster { cmd } => service_process::cluster_cmd::run(cmd),
        Cmd::RankExec {
            cpus,
            preload,
            program,
        } => {
            launch::rank_exec(
                cpus.as_ref().map(|c| c.0.as_slice()),
                preload.as_deref(),
                &program,
            )?;
            Ok(0)
        }
    }
}
