//! The emulated cluster: `service-process launch` starts N x K SP processes on this machine,
//! waits until each reports ready, runs `mpirun` with the host shim preloaded (or, with
//! `--native`, without it on the same layout and pinning), returns the program's exit status,
//! then stops the SPs. It leaves no process behind: children run in their own process groups
//! with a parent-death signal, Ctrl-C (SIGINT/SIGTERM) is forwarded and then escalated to
//! SIGKILL, and if an SP dies during the run the job gets `fault_grace` to end on its own (the
//! shims fail the affected collectives) before it is killed.

use crate::cpus::{pin_to, CpuList};
use crate::launch_mpi::{self, Mpi};
use anyhow::{bail, Context, Result};
use bootstrap::auth::{ClusterKey, JobCredential};
use bootstrap::cluster::{CanaryFabric, CanaryLink, Cluster, Layout, McastGroups, SpEntry};
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// File descriptor number under which an SP receives its pre-bound peer listener.
pub const LISTEN_FD: RawFd = 3;

/// The options of `service-process launch` (its `--help` is made of these comments).
#[derive(Clone, Debug, clap::Args)]
pub struct LaunchOpts {
    /// Emulated nodes.
    #[arg(long)]
    pub nodes: u32,
    /// MPI ranks per node (mpirun -np is nodes x ranks-per-node).
    #[arg(long)]
    pub ranks_per_node: u32,
    /// SPs per node; local rank i is served by SP i mod K of its node.
    #[arg(long, default_value_t = 1)]
    pub sps_per_node: u32,
    /// Which emulated node each world rank is told it is on: block (rank / R) or cyclic
    /// (rank % N).
    #[arg(long, default_value = "block")]
    pub layout: Layout,
    /// CPUs for the SPs, assigned round-robin (stand-ins for the DPU's cores). With a CPU for
    /// each SP, the SPs busy-poll there as DPU SPs do (`serve --busy-poll`), unless an
    /// --sp-arg says how to poll (e.g. --sp-arg=--poll-us=100); SPs sharing a CPU sleep until
    /// woken (spinning, they would take it from each other).
    #[arg(long)]
    pub sp_cpus: Option<CpuList>,
    /// Run the SPs under SCHED_FIFO (see `serve --realtime`): on a machine with too few cores
    /// to reserve some for the SPs, they then preempt computing ranks as DPU cores would
    /// not need to.
    #[arg(long)]
    pub sp_realtime: bool,
    /// CPUs for the ranks, assigned round-robin by world rank. mpirun (and what it starts
    /// besides the ranks) then runs on the other CPUs, those of neither the ranks nor the SPs
    /// if there are any, else those of the SPs (not with --sp-realtime).
    #[arg(long)]
    pub rank_cpus: Option<CpuList>,
    /// Run without SPs and without the shim, on the same layout and pinning (the baseline).
    #[arg(long)]
    pub native: bool,
    /// The host shim to preload (default: the one built for the program's MPI next to this
    /// binary: libhost_shim.so for Open MPI, libhost_shim_mpich.so for MPICH).
    #[arg(long)]
    pub shim: Option<PathBuf>,
    /// The program's MPI, openmpi or mpich (the MPICH family: MPICH, MVAPICH, Intel MPI);
    /// it picks the launcher and the shim. Default: detected from the libraries the
    /// program links (libmpi.so.40 / libmpich.so.12); Open MPI for a program linking
    /// neither.
    #[arg(long, value_name = "MPI")]
    pub mpi: Option<Mpi>,
    /// Copies active at once on each SP, across all collectives.
    #[arg(long, default_value_t = 4)]
    pub max_inflight_reads: usize,
    /// The launcher to use (default: mpirun for Open MPI, mpiexec.mpich for MPICH).
    #[arg(long)]
    pub mpirun: Option<String>,
    /// Extra arguments for mpirun (repeatable), e.g. --mpirun-arg=--mca --mpirun-arg=pml
    #[arg(long = "mpirun-arg", allow_hyphen_values = true)]
    pub mpirun_args: Vec<String>,
    /// Extra arguments for every SP's `serve` (repeatable), e.g.
    /// --sp-arg=--inline-copy-bytes=0
    #[arg(long = "sp-arg", allow_hyphen_values = true)]
    pub sp_args: Vec<String>,
    /// An extra argument for one SP's `serve` (repeatable), given as SP=ARG with the SP's id
    /// (0 to nodes x sps-per-node - 1), after the --sp-arg ones, e.g.
    /// --sp-arg-for=1=--mcast=off (a cluster whose SP 1 runs no multicast collective)
    #[arg(long = "sp-arg-for", value_name = "SP=ARG", allow_hyphen_values = true, value_parser = parse_sp_arg)]
    pub sp_arg_for: Vec<(usize, String)>,
    /// The multicast groups of the multicast collectives, written into the cluster
    /// description (`mcast_groups`), as RANGE or RANGE:PORT (e.g. 239.254.3.0/24:41000: an
    /// address per communicator slot and subgroup from the range, a port per slot from
    /// PORT, default 47000). Default: the description's default, 239.255.0.0/16 from port
    /// 47000. Jobs on one host given disjoint groups never see each other's datagrams.
    #[arg(long, value_name = "RANGE[:PORT]", value_parser = parse_mcast_groups)]
    pub mcast_groups: Option<McastGroups>,
    /// Start a loopback tree of Canary switches, LEAVES+SPINES (e.g. 2+2; `service-process
    /// canary-tree`), and name each SP's link to it in the cluster description (`canary`):
    /// the SPs then run the Canary allreduce (`SPOFF_ALLREDUCE_DESIGN=canary`, or `auto`).
    /// Each leaf needs an SP. The switches stand for network hardware: with --sp-cpus they run
    /// on the SPs' CPUs, not the ranks'. Their counters are printed at the end.
    #[arg(long, value_name = "LEAVES+SPINES", conflicts_with = "native")]
    pub canary_tree: Option<crate::canary_tree::Shape>,
    /// An extra argument for every switch of --canary-tree (repeatable), e.g.
    /// --canary-switch-arg=--drop-rate=0.01
    #[arg(long = "canary-switch-arg", allow_hyphen_values = true)]
    pub canary_switch_args: Vec<String>,
    /// Build the --canary-tree in network namespaces (`canary-tree --netns`: a namespace per
    /// switch and per SP link, veths with no route out; each SP opens its Canary socket in its
    /// link's namespace) instead of on loopback. Needs root, `ip` and `tc`.
    #[arg(long, requires = "canary_tree")]
    pub canary_netns: bool,
    /// With --canary-netns: shape leaf 0's link to spine 0 to this `tc` rate (e.g. 200mbit).
    #[arg(long, requires = "canary_netns", value_name = "RATE")]
    pub canary_shape: Option<String>,
    /// The SPs' Canary settings written into the description (`canary.params`), as JSON; the
    /// fields not given keep their defaults, e.g. '{"block_bytes":4096,"window":16}'
    /// (block_bytes, window, retx_timeout_us, max_requests, retx_backoff, max_attempts, linger_ms,
    /// static_trees: K installs K static trees in the switches, the paper's baseline). On a
    /// loopback tree (no --canary-netns) blocks of 8192 bytes, 16 in flight, unless given:
    /// loopback does not fragment them, and they are 3.5x faster than the 1 KiB default.
    #[arg(long, requires = "canary_tree", value_name = "JSON", value_parser = parse_canary_params)]
    pub canary_params: Option<CanaryParamsArg>,
    /// With --canary-netns: background traffic over leaf 0's link to spine 0, in Mbit/s.
    #[arg(long, requires = "canary_netns", value_name = "MBIT")]
    pub canary_background_mbit: Option<u32>,
    /// Seconds to wait for the SPs to be ready.
    #[arg(long, default_value_t = 30)]
    pub ready_timeout_secs: u64,
    /// Seconds the job may run on after an SP died before it is killed.
    #[arg(long, default_value_t = 30)]
    pub fault_grace_secs: u64,
    /// An SP that answers no stats request for this many seconds is considered stuck and
    /// killed, so that the job fails instead of hanging (0: no watchdog).
    #[arg(long, default_value_t = 10)]
    pub sp_watchdog_secs: u64,
    /// Keep the run directory (cluster description and key, sockets) for inspection; its
    /// path is printed on stderr at the start.
    #[arg(long)]
    pub keep_run_dir: bool,
    /// The MPI program and its arguments.
    #[arg(last = true, required = true)]
    pub program: Vec<String>,
}

/// `--sp-arg-for`'s SP=ARG.
fn parse_sp_arg(s: &str) -> Result<(usize, String), String> {
    let (sp, arg) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected SP=ARG (e.g. 1=--mcast=off)"))?;
    let sp = sp
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: {sp:?} is not an SP id"))?;
    Ok((sp, arg.to_string()))
}

/// `--canary-params`: the settings, and which of the block size and window were given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CanaryParamsArg {
    pub params: bootstrap::cluster::CanaryParams,
    pub block_given: bool,
    pub window_given: bool,
}

/// `--canary-params`' JSON.
fn parse_canary_params(s: &str) -> Result<CanaryParamsArg, String> {
    let bad = |e: serde_json::Error| format!("{s:?}: not Canary settings: {e}");
    let v: serde_json::Value = serde_json::from_str(s).map_err(bad)?;
    Ok(CanaryParamsArg {
        params: serde_json::from_value(v.clone()).map_err(bad)?,
        block_given: v.get("block_bytes").is_some(),
        window_given: v.get("window").is_some(),
    })
}

/// Loopback's blocks and window (`--canary-params`).
const LOOPBACK_BLOCK_BYTES: u32 = 8192;
const LOOPBACK_WINDOW: u32 = 16;

/// The SPs' Canary settings for the launcher's tree: `--canary-params`, and on loopback (no
/// namespaces, no 1500-byte links: nothing fragments) larger blocks and window where not
/// given. Through a namespace tree 8 KiB blocks are fragmented, and through its shaped link
/// their loss made a static tree's allreduces fail (docs/BENCHMARKS.md, section S); there
/// the defaults stay.
fn canary_params_for(opts: &LaunchOpts) -> bootstrap::cluster::CanaryParams {
    let arg = opts.canary_params;
    let mut p = arg.map(|a| a.params).unwrap_or_default();
    if !opts.canary_netns {
        if !arg.is_some_and(|a| a.block_given) {
            p.block_bytes = LOOPBACK_BLOCK_BYTES;
        }
        if !arg.is_some_and(|a| a.window_given) {
            p.window = LOOPBACK_WINDOW;
        }
    }
    p
}

/// `--mcast-groups`' RANGE[:PORT].
fn parse_mcast_groups(s: &str) -> Result<McastGroups, String> {
    let (range, port) = match s.split_once(':') {
        Some((r, p)) => (
            r,
            p.trim()
                .parse()
                .map_err(|_| format!("{s:?}: {p:?} is not a UDP port"))?,
        ),
        None => (s, 47_000),
    };
    if port > u16::MAX - 255 {
        return Err(format!("{s:?}: the 256 ports from {port} pass 65535"));
    }
    Ok(McastGroups {
        range: range.parse()?,
        port_base: port,
    })
}

/// The variable in which `launch` gives `rank-exec` the emulated node of every world rank
/// (`0,0,1,1`); `rank-exec` turns it into this rank's `SPOFF_NODE` hint.
pub const RANK_NODES_VAR: &str = "SPOFF_RANK_NODES";

/// The emulated node of each world rank of a job of `world` ranks under `cluster`'s layout:
/// what `launch` tells the ranks (`SPOFF_NODE`).
pub fn rank_nodes(cluster: &Cluster, world: u32) -> Result<Vec<u32>> {
    (0..world)
        .map(|r| Ok(cluster.placement(r, world)?.node))
        .collect()
}

/// This rank's `SPOFF_NODE` from the launcher's list of every rank's node.
fn node_hint(list: &str, rank: u32) -> Result<u32> {
    list.split(',')
        .nth(rank as usize)
        .and_then(|n| n.trim().parse().ok())
        .with_context(|| format!("{RANK_NODES_VAR}={list:?} names no node for world rank {rank}"))
}

/// `rank-exec`: pins this MPI rank, tells it its emulated node (`SPOFF_NODE`, from the list
/// `launch` passed), optionally preloads the shim, and execs the program.
pub fn rank_exec(cpus: Option<&[u32]>, preload: Option<&Path>, program: &[String]) -> Result<()> {
    let rank: u32 = ["OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(0);
    if let Some(cpus) = cpus {
        let cpu = cpus[rank as usize % cpus.len()];
        pin_to(&[cpu]).with_context(|| format!("pinning rank {rank} to CPU {cpu}"))?;
    }
    let hint = match std::env::var(RANK_NODES_VAR) {
        Ok(list) => Some(node_hint(&list, rank)?),
        Err(_) => None,
    };
    let mut cmd = Command::new(&program[0]);
    cmd.args(&program[1..]).env_remove(RANK_NODES_VAR);
    if let Some(node) = hint {
        cmd.env("SPOFF_NODE", node.to_string());
    }
    if let Some(lib) = preload {
        let old = std::env::var("LD_PRELOAD").unwrap_or_default();
        let val = if old.is_empty() {
            lib.display().to_string()
        } else {
            format!("{}:{old}", lib.display())
        };
        cmd.env("LD_PRELOAD", val);
    }
    let err = cmd.exec();
    bail!("cannot run {}: {err}", program[0])
}

/// A new private run directory (mode 0700: the host sockets and the cluster key in it are
/// for this user alone).
pub fn new_run_dir() -> Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("spoff-{}-{nanos:x}", std::process::id()));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    // The mode given to mkdir is filtered by the umask: make it exactly 0700.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("setting the mode of {}", dir.display()))?;
    Ok(dir)
}

/// The cluster key of the cluster whose description is `cluster_json` (the launcher writes
/// both into its run directory).
pub fn key_path(cluster_json: &Path) -> PathBuf {
    cluster_json.with_file_name("cluster.key")
}

/// Puts the child in its own process group and has it die with the launcher.
fn supervised(cmd: &mut Command, death_signal: libc::c_int) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setpgid(0, 0);
            libc::prctl(libc::PR_SET_PDEATHSIG, death_signal as libc::c_ulong);
            // The launcher may have died between fork and prctl: then no signal will come.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

fn signal_group(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on a process group we created; harmless if it is gone.
    unsafe {
        libc::kill(-(child.id() as libc::pid_t), sig);
    }
}

/// Sends `sig` to each child's group, waits up to `grace`, then SIGKILLs what is left.
fn stop_all(children: &mut [&mut Child], sig: libc::c_int, grace: Duration) {
    for c in children.iter() {
        signal_group(c, sig);
    }
    let deadline = Instant::now() + grace;
    for c in children.iter_mut() {
        loop {
            match c.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    signal_group(c, libc::SIGKILL);
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        // Whatever the group leader did, leave no member behind.
        signal_group(c, libc::SIGKILL);
    }
}

fn exit_code(s: ExitStatus) -> i32 {
    s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
}

/// Watches the SPs of a running job. An SP that answers no stats request for `limit` is
/// alive but stuck (stopped, deadlocked): nothing else would notice, and its ranks would wait
/// forever. The watchdog marks it in `stuck`; the launcher's loop, which owns the child
/// handles (and so never signals a pid that was reaped and reused), kills it, and the other
/// SPs and the shims then handle it like any SP death.
fn spawn_watchdog(
    cluster: Cluster,
    key: ClusterKey,
    stuck: Arc<Vec<AtomicBool>>,
    limit: Duration,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut last_answer = vec![Instant::now(); stuck.len()];
        let mut killed = vec![false; stuck.len()];
        let period = (limit / 4).clamp(Duration::from_millis(100), Duration::from_secs(1));
        while !stop.load(Ordering::Relaxed) {
            for (i, sp) in cluster.sps.iter().enumerate() {
                if killed[i] || stop.load(Ordering::Relaxed) {
                    continue;
                }
                if crate::stats::query_within(sp, &key, period).is_ok() {
                    last_answer[i] = Instant::now();
                } else if last_answer[i].elapsed() > limit {
                    eprintln!(
                        "service-process launch: SP {i} has not answered for {limit:?}; it is \
                         stuck, killing it"
                    );
                    stuck[i].store(true, Ordering::Relaxed);
                    killed[i] = true;
                }
            }
            // In short steps: the launcher joins this thread when the job ends, and a whole
            // period's sleep kept every job up to a second longer.
            let until = Instant::now() + period;
            while !stop.load(Ordering::Relaxed) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    })
}

/// One SP child process.
pub struct Sp {
    pub id: u32,
    pub child: Child,
}

/// What [`spawn_sps`] starts.
#[derive(Clone, Debug)]
pub struct SpSetSpec {
    pub nodes: u32,
    pub sps_per_node: u32,
    pub ranks_per_node: u32,
    pub layout: Layout,
    pub sp_cpus: Option<Vec<u32>>,
    pub max_inflight_reads: usize,
    /// More `serve` arguments, for every SP.
    pub extra_args: Vec<String>,
    /// More `serve` arguments for single SPs: (SP id, argument), after `extra_args`.
    pub sp_args: Vec<(usize, String)>,
}

/// Writes the cluster description into `run_dir` (and its key, unless `run_dir` already has
/// one) and starts one `serve` process per SP, each with its pre-bound peer listener (so no
/// port can be taken between choosing and binding it). Every stdout line of SP `i` is sent as
/// `(i, line)` on `lines`. Returns the description's path and the children; call
/// [`wait_ready`] next.
pub fn spawn_sps(
    exe: &Path,
    spec: &SpSetSpec,
    run_dir: &Path,
    lines: mpsc::Sender<(u32, String)>,
) -> Result<(PathBuf, Vec<Sp>)> {
    spawn_sps_on(exe, spec, None, None, run_dir, lines)
}

/// [`spawn_sps`] with the multicast groups `mcast_groups` in the description.
fn spawn_sps_on(
    exe: &Path,
    spec: &SpSetSpec,
    mcast_groups: Option<McastGroups>,
    canary: Option<CanaryFabric>,
    run_dir: &Path,
    lines: mpsc::Sender<(u32, String)>,
) -> Result<(PathBuf, Vec<Sp>)> {
    let (path, listeners) = write_cluster_on(spec, mcast_groups, canary, run_dir)?;
    let mut sps = Vec::new();
    for (i, l) in listeners.into_iter().enumerate() {
        let mut args = spec.extra_args.clone();
        args.extend(
            spec.sp_args
                .iter()
                .filter(|(sp, _)| *sp == i)
                .map(|(_, a)| a.clone()),
        );
        if let Some(cpus) = &spec.sp_cpus {
            args.extend(["--cpus".to_string(), cpus[i % cpus.len()].to_string()]);
        }
        args.extend([
            "--max-inflight-reads".to_string(),
            spec.max_inflight_reads.to_string(),
        ]);
        match spawn_sp(exe, &path, i as u32, l, &args, None, lines.clone()) {
            Ok(sp) => sps.push(sp),
            Err(e) => {
                stop_sps(&mut sps, Duration::from_secs(2));
                return Err(e);
            }
        }
    }
    Ok((path, sps))
}

/// A listener on a loopback port below the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`), tried at random in the 16 Ki ports under it (at least
/// 1024), else on a port the kernel picks. An SP's address must stay its own while the SP is
/// down (a restarted SP binds it again, as its peers know it): a port of the ephemeral range
/// can be handed meanwhile to any process's `bind` to port 0 or outgoing connection (the UCX
/// listeners and connections of every job on the machine are such), and then the SP cannot
/// come back. Below the range, only another explicit bind of that port can take it.
pub fn loopback_listener() -> std::io::Result<TcpListener> {
    use std::hash::{BuildHasher, Hasher};
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768)
        .min(65536);
    let first = low.saturating_sub(16384).max(1024);
    if first < low {
        let span = low - first;
        // Random per call (std's hasher keys are), so two launchers rarely try the same ports.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let start = h.finish();
        for i in 0..64u64 {
            let port = first + ((start.wrapping_add(i.wrapping_mul(7919))) % span as u64) as u32;
            if let Ok(l) = TcpListener::bind(("127.0.0.1", port as u16)) {
                return Ok(l);
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")
}

/// Writes the description of the cluster `spec` asks for into `run_dir` (SP sockets in it,
/// peer listeners bound on loopback) and its key (unless `run_dir` already has one); returns
/// the description's path and the SPs' listeners, by SP id.
pub fn write_cluster(spec: &SpSetSpec, run_dir: &Path) -> Result<(PathBuf, Vec<TcpListener>)> {
    write_cluster_on(spec, None, None, run_dir)
}

/// [`write_cluster`] with the multicast groups `mcast_groups` in the description.
fn write_cluster_on(
    spec: &SpSetSpec,
    mcast_groups: Option<McastGroups>,
    canary: Option<CanaryFabric>,
    run_dir: &Path,
) -> Result<(PathBuf, Vec<TcpListener>)> {
    let n_sps = spec.nodes * spec.sps_per_node;
    let listeners: Vec<TcpListener> = (0..n_sps)
        .map(|_| loopback_listener())
        .collect::<Result<_, _>>()
        .context("binding SP peer listeners on loopback")?;
    let entries = listeners
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let host_socket = run_dir.join(format!("sp-{i}.sock"));
            Ok(SpEntry::numbered(
                i as u32,
                spec.sps_per_node,
                l.local_addr()?,
                host_socket,
            ))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut cluster = Cluster::new(
        spec.nodes,
        spec.sps_per_node,
        Some(spec.ranks_per_node),
        spec.layout,
        entries,
    )?;
    cluster.mcast_groups = mcast_groups;
    cluster.canary = canary;
    cluster.validate()?;
    let path = run_dir.join("cluster.json");
    cluster.save(&path)?;
    let key_file = key_path(&path);
    if !key_file.exists() {
        ClusterKey::create(&key_file)?;
    }
    Ok((path, listeners))
}

/// Starts SP `i` of the cluster described at `path` (its key beside it) on the bound peer
/// `listener`, with more `serve` arguments `args`; its stdout lines go to `lines` as `(i,
/// line)`, its stderr to `stderr` (a file) or to this process's stderr.
pub fn spawn_sp(
    exe: &Path,
    path: &Path,
    i: u32,
    listener: TcpListener,
    args: &[String],
    stderr: Option<std::fs::File>,
    lines: mpsc::Sender<(u32, String)>,
) -> Result<Sp> {
    let mut cmd = Command::new(exe);
    cmd.arg("serve")
        .arg("--cluster")
        .arg(path)
        .arg("--sp-id")
        .arg(i.to_string())
        .arg("--key")
        .arg(key_path(path))
        .arg("--listen-fd")
        .arg(LISTEN_FD.to_string())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    if let Some(f) = stderr {
        cmd.stderr(f);
    }
    let fd = listener.as_raw_fd();
    // SAFETY: dup2 is async-signal-safe; the listener stays open in the parent until after
    // spawn, so `fd` is valid in the child.
    unsafe {
        cmd.pre_exec(move || {
            if fd == LISTEN_FD {
                // dup2 onto itself keeps close-on-exec: clear it instead.
                if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(fd, LISTEN_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    supervised(&mut cmd, libc::SIGTERM);
    let mut child = cmd.spawn().with_context(|| format!("starting SP {i}"))?;
    drop(listener);
    let out = child.stdout.take().expect("piped stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if lines.send((i, line)).is_err() {
                return;
            }
        }
    });
    Ok(Sp { id: i, child })
}

/// Waits until every SP printed `READY`. `Ok(false)`: a signal arrived first. An SP that exits
/// or stays silent past `timeout` is an error naming it. Other lines are echoed to stderr.
pub fn wait_ready(
    sps: &mut [Sp],
    lines: &mpsc::Receiver<(u32, String)>,
    timeout: Duration,
    mut signals: Option<&mut crate::signals::SignalPipe>,
) -> Result<bool> {
    let deadline = Instant::now() + timeout;
    let mut ready = vec![false; sps.len()];
    while ready.iter().any(|r| !r) {
        if signals.as_mut().is_some_and(|s| s.drain()) {
            return Ok(false);
        }
        for sp in sps.iter_mut() {
            if let Ok(Some(st)) = sp.child.try_wait() {
                bail!(
                    "SP {} exited before it was ready ({st}); see its messages above",
                    sp.id
                );
            }
        }
        match lines.recv_timeout(Duration::from_millis(20)) {
            Ok((id, line)) if line.starts_with("READY") => ready[id as usize] = true,
            Ok((id, line)) => eprintln!("sp {id}: {line}"),
            Err(_) if Instant::now() > deadline => {
                let missing: Vec<usize> = ready
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| !**r)
                    .map(|(i, _)| i)
                    .collect();
                bail!("SPs {missing:?} were not ready within {timeout:?}");
            }
            Err(_) => {}
        }
    }
    Ok(true)
}

/// SIGTERM to every SP, SIGKILL after `grace`.
pub fn stop_sps(sps: &mut [Sp], grace: Duration) {
    stop_all(
        &mut sps.iter_mut().map(|s| &mut s.child).collect::<Vec<_>>(),
        libc::SIGTERM,
        grace,
    );
}

/// Runs the whole job; returns the exit status to give the user.
pub fn launch(opts: &LaunchOpts) -> Result<i32> {
    if opts.nodes == 0 || opts.ranks_per_node == 0 || opts.sps_per_node == 0 {
        bail!("--nodes, --ranks-per-node and --sps-per-node must be at least 1");
    }
    if opts.program.is_empty() {
        bail!("no program given (usage: service-process launch [OPTIONS] -- PROGRAM [ARGS...])");
    }
    let exe = std::env::current_exe().context("locating the service-process binary")?;
    let mpi = launch_mpi::choose(opts.mpi, &opts.program[0])?;
    let shim = match (&opts.shim, opts.native) {
        (_, true) => None,
        (Some(p), false) => Some(p.clone()),
        (None, false) => Some(launch_mpi::default_shim(&exe, mpi)?),
    };
    if let Some(s) = &shim {
        if !s.exists() {
            bail!("host shim {} not found", s.display());
        }
    }
    let mut signals = crate::signals::SignalPipe::install()?;
    let run_dir = new_run_dir()?;
    if opts.keep_run_dir {
        eprintln!(
            "service-process launch: run directory {} (kept)",
            run_dir.display()
        );
    }
    let result = run_job(opts, mpi, &exe, shim.as_deref(), &run_dir, &mut signals);
    if !opts.keep_run_dir {
        let _ = std::fs::remove_dir_all(&run_dir);
    }
    result
}

fn run_job(
    opts: &LaunchOpts,
    mpi: Mpi,
    exe: &Path,
    shim: Option<&Path>,
    run_dir: &Path,
    signals: &mut crate::signals::SignalPipe,
) -> Result<i32> {
    let mut canary_tree = None;
    let result = run_job_inner(opts, mpi, exe, shim, run_dir, signals, &mut canary_tree);
    if let Some(tree) = canary_tree {
        stop_canary_tree(tree);
    }
    result
}

fn run_job_inner(
    opts: &LaunchOpts,
    mpi: Mpi,
    exe: &Path,
    shim: Option<&Path>,
    run_dir: &Path,
    signals: &mut crate::signals::SignalPipe,
    canary_tree: &mut Option<CanaryTree>,
) -> Result<i32> {
    let world = opts.nodes * opts.ranks_per_node;
    let mut sps: Vec<Sp> = Vec::new();
    let mut cluster_path = None;
    let (tx, rx) = mpsc::channel::<(u32, String)>();
    if !opts.native {
        let spec = SpSetSpec {
            nodes: opts.nodes,
            sps_per_node: opts.sps_per_node,
            ranks_per_node: opts.ranks_per_node,
            layout: opts.layout,
            sp_cpus: opts.sp_cpus.as_ref().map(|c| c.0.clone()),
            max_inflight_reads: opts.max_inflight_reads,
            extra_args: {
                let mut a = opts.sp_args.clone();
                if opts.sp_realtime {
                    a.push("--realtime".into());
                }
                if busy_poll_implied(opts) {
                    a.push("--busy-poll".into());
                }
                a
            },
            sp_args: opts.sp_arg_for.clone(),
        };
        let n_sps = (opts.nodes * opts.sps_per_node) as usize;
        if let Some((sp, _)) = opts.sp_arg_for.iter().find(|(sp, _)| *sp >= n_sps) {
            bail!(
                "--sp-arg-for names SP {sp}, but the cluster has SPs 0 to {}",
                n_sps - 1
            );
        }
        let canary = match opts.canary_tree {
            Some(shape) => {
                let (tree, fabric) = start_canary_tree(exe, opts, shape, n_sps, run_dir)?;
                *canary_tree = Some(tree);
                Some(bootstrap::cluster::CanaryFabric {
                    params: canary_params_for(opts),
                    ..fabric
                })
            }
            None => None,
        };
        let (path, children) =
            spawn_sps_on(exe, &spec, opts.mcast_groups, canary, run_dir, tx.clone())?;
        sps = children;
        match wait_ready(
            &mut sps,
            &rx,
            Duration::from_secs(opts.ready_timeout_secs),
            Some(signals),
        ) {
            Ok(true) => {}
            Ok(false) => {
                stop_sps(&mut sps, Duration::from_secs(2));
                return Ok(130);
            }
            Err(e) => {
                stop_sps(&mut sps, Duration::from_secs(2));
                return Err(e);
            }
        }
        cluster_path = Some(path);
    }
    let key = match &cluster_path {
        Some(p) => Some(ClusterKey::load(&key_path(p))?),
        None => None,
    };

    let launcher = opts
        .mpirun
        .clone()
        .unwrap_or_else(|| mpi.default_launcher().to_string());
    let mut cmd = Command::new(&launcher);
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("SPOFF_NODES", opts.nodes.to_string())
        .env("SPOFF_RANKS_PER_NODE", opts.ranks_per_node.to_string())
        .env(
            "SPOFF_LAYOUT",
            match opts.layout {
                Layout::Block => "block",
                Layout::Cyclic => "cyclic",
            },
        );
    // SPOFF_NODES, SPOFF_RANKS_PER_NODE and SPOFF_LAYOUT are for the benchmark's traffic
    // accounting (coll-bench); the shim places itself from MPI and the SPOFF_NODE hint.
    let mut exported = vec!["SPOFF_NODES", "SPOFF_RANKS_PER_NODE", "SPOFF_LAYOUT"];
    if spin_wait_implied(opts, world) && std::env::var_os("SPOFF_WAIT").is_none() {
        // Each rank has a core no SP shares: a sleeping wait would only notice late.
        cmd.env("SPOFF_WAIT", "spin");
        exported.push("SPOFF_WAIT");
    }
    match (&cluster_path, &key) {
        (Some(p), Some(key)) => {
            // The job's identity at the SPs, for this user only (a process's environment is
            // readable by its own uid alone).
            // SAFETY: geteuid has no preconditions.
            let uid = unsafe { libc::geteuid() };
            let cred = JobCredential::issue_new(key, uid, world);
            let nodes = rank_nodes(&Cluster::load(p)?, world)?;
            let nodes: Vec<String> = nodes.iter().map(u32::to_string).collect();
            cmd.env("SPOFF_CLUSTER", p)
                .env("SPOFF_JOB_CREDENTIAL", cred.encode())
                .env(RANK_NODES_VAR, nodes.join(","))
                .env_remove("SPOFF_NODE");
            exported.extend(["SPOFF_CLUSTER", "SPOFF_JOB_CREDENTIAL", RANK_NODES_VAR]);
        }
        _ => {
            cmd.env_remove("SPOFF_CLUSTER")
                .env_remove("SPOFF_JOB_CREDENTIAL")
                .env_remove(RANK_NODES_VAR);
        }
    }
    cmd.args(mpi.launcher_args(world, &exported))
        .args(&opts.mpirun_args);
    cmd.arg(exe).arg("rank-exec");
    if let Some(cpus) = &opts.rank_cpus {
        let list: Vec<String> = cpus.0.iter().map(u32::to_string).collect();
        cmd.arg("--cpus").arg(list.join(","));
    }
    if let Some(shim) = shim {
        cmd.arg("--preload").arg(shim);
    }
    cmd.arg("--").args(&opts.program).stdin(Stdio::null());
    supervised(&mut cmd, libc::SIGTERM);
    // mpirun and its helpers stay off the ranks' CPUs (each rank pins itself in `rank-exec`),
    // and off the SPs' too where others are left: with an SP spinning on the other CPU, the
    // scheduler put mpirun's wake-ups on the rank's (125 times in a 1.2 s run here, `perf
    // sched`; none since). Not with --sp-realtime: mpirun would get only what the real-time
    // SPs leave of their CPUs.
    let mpirun_cpus = opts
        .rank_cpus
        .as_ref()
        .filter(|_| !opts.sp_realtime)
        .and_then(|r| {
            let allowed = crate::cpus::allowed_cpus();
            let mut busy = r.0.clone();
            busy.extend(opts.sp_cpus.iter().flat_map(|s| s.0.iter().copied()));
            cpus_besides(&allowed, &busy).or_else(|| cpus_besides(&allowed, &r.0))
        });
    if let Some(cpus) = mpirun_cpus {
        // SAFETY: sched_setaffinity(2) only, between fork and exec.
        unsafe {
            cmd.pre_exec(move || pin_to(&cpus));
        }
    }
    let mut mpirun = cmd
        .spawn()
        .with_context(|| format!("starting {launcher}"))?;
    let stop_watchdog = Arc::new(AtomicBool::new(false));
    let stuck: Arc<Vec<AtomicBool>> =
        Arc::new(sps.iter().map(|_| AtomicBool::new(false)).collect());
    let watchdog = match (&cluster_path, &key) {
        (Some(path), Some(key)) if opts.sp_watchdog_secs > 0 => Some(spawn_watchdog(
            Cluster::load(path)?,
            key.clone(),
            stuck.clone(),
            Duration::from_secs(opts.sp_watchdog_secs),
            stop_watchdog.clone(),
        )),
        _ => None,
    };

    let fault_grace = Duration::from_secs(opts.fault_grace_secs);
    let mut fault_at: Option<Instant> = None;
    let status = loop {
        if let Some(st) = mpirun.try_wait()? {
            break exit_code(st);
        }
        if signals.drain() {
            eprintln!("service-process launch: interrupted; stopping the job");
            stop_watchdog.store(true, Ordering::Relaxed);
            let mut all: Vec<&mut Child> = vec![&mut mpirun];
            all.extend(sps.iter_mut().map(|s| &mut s.child));
            stop_all(&mut all, libc::SIGTERM, Duration::from_secs(3));
            return Ok(130);
        }
        for (i, sp) in sps.iter_mut().enumerate() {
            if stuck[i].swap(false, Ordering::Relaxed) && matches!(sp.child.try_wait(), Ok(None)) {
                signal_group(&sp.child, libc::SIGKILL);
                let _ = sp.child.kill();
            }
            if let Ok(Some(st)) = sp.child.try_wait() {
                if fault_at.is_none() {
                    eprintln!(
                        "service-process launch: SP {} exited during the job ({st}); the job has \
                         {:?} to end",
                        sp.id, fault_grace
                    );
                    fault_at = Some(Instant::now());
                }
            }
        }
        if fault_at.is_some_and(|t| t.elapsed() > fault_grace) {
            eprintln!(
                "service-process launch: the job did not end after an SP failure; killing it"
            );
            stop_all(&mut [&mut mpirun], libc::SIGTERM, Duration::from_secs(3));
            break 1;
        }
        while let Ok((id, line)) = rx.try_recv() {
            eprintln!("sp {id}: {line}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    stop_watchdog.store(true, Ordering::Relaxed);
    if let Some(w) = watchdog {
        let _ = w.join();
    }
    stop_sps(&mut sps, Duration::from_secs(5));
    if let Some(key) = &key {
        // Segments an SP killed during the job could not remove.
        crate::access::remove_stale_segments(key);
    }
    while let Ok((id, line)) = rx.recv_timeout(Duration::from_millis(50)) {
        if let Some(stats) = line.strip_prefix("STATS ") {
            eprintln!("sp {id} stats: {stats}");
        } else {
            eprintln!("sp {id}: {line}");
        }
    }
    Ok(status)
}

/// A running `service-process canary-tree` and the lines it printed.
struct CanaryTree {
    child: Child,
    lines: mpsc::Receiver<String>,
}

/// Starts `canary-tree` of `shape` with `members` members (the SPs, by id), as `opts` ask
/// (`--canary-netns`, `--canary-shape`, `--canary-background-mbit`, `--canary-switch-arg`, on
/// `--sp-cpus`), waits for it to be ready, and returns it with the fabric its plan describes.
fn start_canary_tree(
    exe: &Path,
    opts: &LaunchOpts,
    shape: crate::canary_tree::Shape,
    members: usize,
    run_dir: &Path,
) -> Result<(CanaryTree, CanaryFabric)> {
    let cpus = opts.sp_cpus.as_ref().map(|c| c.0.clone());
    let timeout = Duration::from_secs(opts.ready_timeout_secs);
    let mut tree_args = Vec::new();
    if opts.canary_netns {
        tree_args.push("--netns".to_string());
    }
    if let Some(rate) = &opts.canary_shape {
        tree_args.extend(["--shape".to_string(), rate.clone()]);
    }
    if let Some(mbit) = opts.canary_background_mbit {
        tree_args.extend(["--background-mbit".to_string(), mbit.to_string()]);
    }
    if let Some(k) = opts.canary_params.and_then(|p| p.params.static_trees) {
        tree_args.extend(["--static-trees".to_string(), k.to_string()]);
    }
    let plan_path = run_dir.join("canary-plan.json");
    let mut cmd = Command::new(exe);
    cmd.arg("canary-tree")
        .arg("--switches")
        .arg(format!("{}+{}", shape.leaves, shape.spines))
        .arg("--members")
        .arg(members.to_string())
        .arg("--plan")
        .arg(&plan_path)
        .args(&tree_args)
        .arg("--")
        .args(&opts.canary_switch_args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    supervised(&mut cmd, libc::SIGTERM);
    if let Some(cpus) = cpus {
        // SAFETY: sched_setaffinity(2) only, between fork and exec.
        unsafe {
            cmd.pre_exec(move || pin_to(&cpus));
        }
    }
    let mut child = cmd.spawn().context("starting the Canary switches")?;
    let out = child.stdout.take().expect("piped");
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out)
            .lines()
            .map_while(std::result::Result::ok)
        {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut tree = CanaryTree { child, lines };
    let until = Instant::now() + timeout;
    loop {
        match tree.lines.recv_timeout(Duration::from_millis(100)) {
            Ok(l) if l.starts_with("READY canary-tree") => break,
            Ok(l) => eprintln!("canary-tree: {l}"),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let st = tree.child.wait()?;
                bail!("the Canary switches did not start ({st})");
            }
            Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() > until => {
                stop_canary_tree(tree);
                bail!("the Canary switches were not ready within {timeout:?}");
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
    let plan: crate::canary_tree::TreePlan = serde_json::from_slice(
        &std::fs::read(&plan_path).with_context(|| format!("reading {}", plan_path.display()))?,
    )
    .context("the Canary tree's plan")?;
    let links = plan
        .members
        .iter()
        .enumerate()
        .map(|(sp, m)| CanaryLink {
            sp: sp as u32,
            addr: m.addr,
            local: m.local,
            leaf: m.leaf,
            netns: plan.member_netns.get(sp).cloned(),
        })
        .collect();
    Ok((
        tree,
        CanaryFabric {
            links,
            params: Default::default(),
        },
    ))
}

/// Stops the switches and prints their counters (`canary-tree: switch ADDR STATS {...}`).
fn stop_canary_tree(mut tree: CanaryTree) {
    // SAFETY: kill(2) of our own child, not reaped yet.
    unsafe { libc::kill(tree.child.id() as libc::pid_t, libc::SIGTERM) };
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        match tree.lines.recv_timeout(Duration::from_millis(100)) {
            Ok(l) => eprintln!("canary-tree: {l}"),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() > until => {
                signal_group(&tree.child, libc::SIGKILL);
                break;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
    let _ = tree.child.wait();
}

/// The CPUs of `allowed` that are not the ranks', if any are left.
fn cpus_besides(allowed: &[u32], ranks: &[u32]) -> Option<Vec<u32>> {
    let rest: Vec<u32> = allowed
        .iter()
        .copied()
        .filter(|c| !ranks.contains(c))
        .collect();
    (!rest.is_empty()).then_some(rest)
}

/// `--sp-cpus` with a CPU for each SP implies `serve --busy-poll`, unless the SP arguments say
/// how to poll.
fn busy_poll_implied(opts: &LaunchOpts) -> bool {
    let sps = (opts.nodes * opts.sps_per_node) as usize;
    let own_cpu = opts.sp_cpus.as_ref().is_some_and(|c| {
        let mut distinct = c.0.clone();
        distinct.sort_unstable();
        distinct.dedup();
        distinct.len() >= sps
    });
    let says = |a: &String| a.starts_with("--poll-us") || a.starts_with("--busy-poll");
    own_cpu && !opts.sp_args.iter().any(says) && !opts.sp_arg_for.iter().any(|(_, a)| says(a))
}

/// `--rank-cpus` with a CPU for each rank, none of them in `--sp-cpus`, implies
/// `SPOFF_WAIT=spin` for the ranks (unless the environment sets it).
fn spin_wait_implied(opts: &LaunchOpts, world: u32) -> bool {
    let (Some(ranks), Some(sps)) = (&opts.rank_cpus, &opts.sp_cpus) else {
        return false;
    };
    let mut distinct = ranks.0.clone();
    distinct.sort_unstable();
    distinct.dedup();
    distinct.len() >= world as usize && !distinct.iter().any(|c| sps.0.contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mpirun_runs_beside_the_ranks_cpus_when_any_are_left() {
        assert_eq!(cpus_besides(&[0, 1], &[0]), Some(vec![1]));
        assert_eq!(cpus_besides(&[0, 1, 2, 3], &[1, 3]), Some(vec![0, 2]));
        assert_eq!(cpus_besides(&[0, 1], &[0, 1]), None);
        assert_eq!(cpus_besides(&[2], &[0]), Some(vec![2]));
        assert!(!crate::cpus::allowed_cpus().is_empty());
    }

    #[test]
    fn sp_listeners_are_bound_below_the_ephemeral_range() {
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap();
        let low: u16 = range.split_whitespace().next().unwrap().parse().unwrap();
        let held: Vec<TcpListener> = (0..16).map(|_| loopback_listener().unwrap()).collect();
        let ports: std::collections::BTreeSet<u16> = held
            .iter()
            .map(|l| l.local_addr().unwrap().port())
            .collect();
        eprintln!("ephemeral from {low}; bound {ports:?}");
        assert_eq!(ports.len(), held.len(), "two listeners on one port");
        if low > 1024 + 64 {
            for p in &ports {
                assert!(
                    (low.saturating_sub(16384).max(1024)..low).contains(p),
                    "port {p} is not in the 16 Ki ports below the ephemeral range (from {low})"
                );
            }
        }
    }

    fn opts(args: &[&str]) -> LaunchOpts {
        #[derive(clap::Parser)]
        struct T {
            #[command(flatten)]
            o: LaunchOpts,
        }
        let mut argv = vec!["launch"];
        argv.extend_from_slice(args);
        argv.extend(["--", "true"]);
        <T as clap::Parser>::try_parse_from(argv).unwrap().o
    }

    #[test]
    fn a_loopback_tree_takes_larger_blocks_unless_told() {
        let base = [
            "--nodes",
            "2",
            "--ranks-per-node",
            "1",
            "--canary-tree",
            "2+2",
        ];
        let with = |extra: &[&'static str]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            canary_params_for(&opts(&v))
        };
        let d = bootstrap::cluster::CanaryParams::default();
        let p = with(&[]);
        assert_eq!(
            (p.block_bytes, p.window),
            (LOOPBACK_BLOCK_BYTES, LOOPBACK_WINDOW)
        );
        assert_eq!(p.retx_timeout_us, d.retx_timeout_us);
        let p = with(&["--canary-params", r#"{"block_bytes":1024}"#]);
        assert_eq!((p.block_bytes, p.window), (1024, LOOPBACK_WINDOW));
        let p = with(&["--canary-params", r#"{"window":4,"max_requests":3}"#]);
        assert_eq!(
            (p.block_bytes, p.window, p.max_requests),
            (LOOPBACK_BLOCK_BYTES, 4, 3)
        );
        // A namespace tree keeps the defaults (its links are 1500-byte veths).
        let p = with(&["--canary-netns"]);
        assert_eq!((p.block_bytes, p.window), (d.block_bytes, d.window));
        assert!(parse_canary_params(r#"{"blocks":1}"#).is_err());
    }

    #[test]
    fn ranks_spin_in_waits_only_on_cores_of_their_own() {
        let o = |a: &[&str]| opts(a);
        let one = ["--nodes", "1", "--ranks-per-node", "1"];
        let with = |extra: &[&'static str]| {
            let mut v = one.to_vec();
            v.extend_from_slice(extra);
            v
        };
        assert!(spin_wait_implied(
            &o(&with(&["--rank-cpus", "0", "--sp-cpus", "1"])),
            1
        ));
        // No SP CPUs: the SPs may run anywhere, the ranks' cores too.
        assert!(!spin_wait_implied(&o(&with(&["--rank-cpus", "0"])), 1));
        // A rank's CPU is an SP's.
        assert!(!spin_wait_implied(
            &o(&with(&["--rank-cpus", "0", "--sp-cpus", "0,1"])),
            1
        ));
        // Two ranks on one CPU.
        assert!(!spin_wait_implied(
            &o(&with(&["--rank-cpus", "0", "--sp-cpus", "1"])),
            2
        ));
        assert!(spin_wait_implied(
            &o(&with(&["--rank-cpus", "0,2", "--sp-cpus", "1"])),
            2
        ));
    }

    #[test]
    fn rank_nodes_follow_the_layout_and_each_rank_finds_its_own() {
        let spec = SpSetSpec {
            nodes: 2,
            sps_per_node: 1,
            ranks_per_node: 3,
            layout: Layout::Cyclic,
            sp_cpus: None,
            max_inflight_reads: 1,
            extra_args: vec![],
            sp_args: vec![],
        };
        let dir = new_run_dir().unwrap();
        let (path, _listeners) = write_cluster(&spec, &dir).unwrap();
        let cluster = Cluster::load(&path).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(rank_nodes(&cluster, 6).unwrap(), [0, 1, 0, 1, 0, 1]);
        assert_eq!(node_hint("0,1,0,1", 3).unwrap(), 1);
        assert!(node_hint("0,1", 2).is_err());
        assert!(node_hint("0,x", 1).is_err());
    }
}
