//! SPs started by a site's own tools: which SP this process is when a launcher starts one per
//! slot (`serve --sp-id auto`), readiness told to systemd (`sd_notify`), and readiness waited
//! on by a job (`wait-ready`).
//!
//! - **Per job**: `mpirun --map-by ppr:K:node service-process serve --sp-id auto ...` (or
//!   `srun --ntasks-per-node=K ...`) starts K SPs on every node of the allocation. Each finds
//!   its node by its host name in the cluster description's `hosts` (or `--node NAME`) and its
//!   index on the node by the launcher's local rank ([`LOCAL_RANK_VARS`]).
//! - **Daemon**: systemd starts one `serve` per SP of the DPU (`deploy/systemd/spoff-sp@.service`,
//!   `Type=notify`), instance `I` with `--sp-id local:I`: SP `I` of the node its host name
//!   names, so the same instances are enabled on every DPU; the SP sends `READY=1` to `$NOTIFY_SOCKET` itself once its peers are
//!   connected and its host listeners open (a Unix datagram, no libsystemd needed).
//! - **Waiting**: `service-process wait-ready` asks every SP of a description for its counters
//!   until all answer (an SP answers only once it serves), so job scripts never `sleep`.

use algorithms::SpId;
use bootstrap::auth::ClusterKey;
use bootstrap::Cluster;
use std::time::{Duration, Instant};

/// The SP a `serve` should be: a number, `auto` (see [`resolve_sp_id`]) or `local:I` (see
/// [`resolve_local`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpIdArg {
    Id(SpId),
    Auto,
    /// SP `I` of this machine's node (the node found as for `auto`): the same argument, and so
    /// the same systemd instance name (`spoff-sp@I`), on every DPU.
    Local(u32),
}

impl std::str::FromStr for SpIdArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(SpIdArg::Auto);
        }
        if let Some(i) = s.strip_prefix("local:") {
            return i.parse().map(SpIdArg::Local).map_err(|_| {
                format!("{s:?}: expected local:I, I the SP's index on its node (0, 1, ...)")
            });
        }
        s.parse().map(SpIdArg::Id).map_err(|_| {
            format!(
                "expected an SP id (a number), auto or local:I (the index on this node), not {s:?}"
            )
        })
    }
}

/// Environment variables that carry a process's rank on its node, by launcher, in the order
/// they are looked at: Open MPI, MPICH/Hydra (two spellings), Slurm's `srun`.
pub const LOCAL_RANK_VARS: [&str; 4] = [
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
];

/// The SP id of a `serve --sp-id auto`: node from `node_name` (`--node`) or else `host_name`
/// (this machine's) looked up in the description's `hosts` (see [`node_of`]); the index on the
/// node from the launcher's local rank (`env` looks variables up, [`LOCAL_RANK_VARS`]).
pub fn resolve_sp_id(
    cluster: &Cluster,
    node_name: Option<&str>,
    host_name: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Result<SpId, String> {
    let node = node_of(cluster, node_name, host_name, "--sp-id auto")?;
    let (var, value) = LOCAL_RANK_VARS
        .iter()
        .find_map(|v| env(v).map(|x| (*v, x)))
        .ok_or_else(|| {
            format!(
                "--sp-id auto: no launcher local rank in the environment (none of {}); start \
                 the SPs with mpirun or srun, or give --sp-id N",
                LOCAL_RANK_VARS.join(", ")
            )
        })?;
    let local: u32 = value
        .trim()
        .parse()
        .map_err(|_| format!("{var}={value:?} is not a local rank"))?;
    if local >= cluster.sps_per_node {
        return Err(format!(
            "{var}={local}, but the cluster description has {} SPs per node: start exactly {} \
             per node (e.g. mpirun --map-by ppr:{}:node)",
            cluster.sps_per_node, cluster.sps_per_node, cluster.sps_per_node
        ));
    }
    Ok(node * cluster.sps_per_node + local)
}

/// The node of this machine: `node_name` (`--node`) or else `host_name` looked up in the
/// description's `dpus`, then `hosts`. A name matches exactly, or by its first label when only
/// one node's does (`dpu1` for `dpu1.site`). `form` (the `--sp-id` given) is named in errors.
pub fn node_of(
    cluster: &Cluster,
    node_name: Option<&str>,
    host_name: &str,
    form: &str,
) -> Result<u32, String> {
    if cluster.hosts.is_empty() && cluster.dpus.is_empty() {
        return Err(format!(
            "{form} needs the DPU or host name of every node in the cluster description (its \
             \"dpus\" or \"hosts\" list); give --sp-id N instead"
        ));
    }
    let name = node_name.unwrap_or(host_name);
    let short = |s: &str| s.split('.').next().unwrap_or(s).to_string();
    // The DPU names first (the SP runs on the DPU), then the hosts' (SPs started on the hosts,
    // or --node with a host name). Names are distinct across both lists (validated).
    let names: Vec<&String> = cluster.dpus.iter().chain(&cluster.hosts).collect();
    let node_of = |i: usize| {
        if i < cluster.dpus.len() {
            i
        } else {
            i - cluster.dpus.len()
        }
    };
    let node = match names.iter().position(|h| *h == name) {
        Some(i) => node_of(i),
        None => {
            let matches: Vec<usize> = (0..names.len())
                .filter(|&i| short(names[i]) == short(name))
                .map(node_of)
                .collect();
            match matches[..] {
                [n] => n,
                [n, m] if n == m => n,
                [] => {
                    return Err(format!(
                        "host {name:?} is not in the cluster description's dpus or hosts ({}); \
                         give --node NAME or --sp-id N",
                        names
                            .iter()
                            .map(|s| s.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                }
                _ => {
                    return Err(format!(
                        "host {name:?} matches several nodes of the cluster description by its \
                         short name; give --node with the full name"
                    ))
                }
            }
        }
    };
    Ok(node as u32)
}

/// The SP id of a `serve --sp-id local:I`: SP `index` of this machine's node ([`node_of`]).
/// The systemd unit passes its instance name, so `spoff-sp@0` is the first SP of whichever
/// DPU it runs on.
pub fn resolve_local(
    cluster: &Cluster,
    node_name: Option<&str>,
    host_name: &str,
    index: u32,
) -> Result<SpId, String> {
    let k = cluster.sps_per_node;
    if index >= k {
        return Err(format!(
            "--sp-id local:{index}: the cluster description has {k} SPs per node (local:0 to \
             local:{})",
            k - 1
        ));
    }
    let node = node_of(
        cluster,
        node_name,
        host_name,
        &format!("--sp-id local:{index}"),
    )?;
    Ok(node * k + index)
}

/// Creates the directory of the host socket `socket` if it is missing (an SP started by hand,
/// or by a unit without `RuntimeDirectory`), before the SP waits for its peers, so that a
/// directory it cannot make fails at once with its path. A new directory gets mode 0755 when
/// `socket_mode` lets group or others reach the socket, else 0700; an existing one is left as
/// it is.
pub fn prepare_socket_dir(socket: &std::path::Path, socket_mode: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let Some(dir) = socket.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return Ok(());
    };
    if dir.is_dir() {
        return Ok(());
    }
    let mode = if socket_mode & 0o077 != 0 {
        0o755
    } else {
        0o700
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(dir)
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot create {}, the directory of the host socket {}: {e}",
                dir.display(),
                socket.display()
            )
        })
}

/// Why binding SP `sp`'s peer address `addr` failed, in an admin's words: an address this
/// machine does not have most often means the SP id belongs to another node (SP ids are
/// cluster-wide: node n runs n·K … n·K+K−1).
pub fn bind_error(
    cluster: &Cluster,
    sp: SpId,
    addr: std::net::SocketAddr,
    e: &std::io::Error,
) -> String {
    let mut msg = format!("binding {addr}, the peer address of SP {sp}: {e}");
    if e.kind() == std::io::ErrorKind::AddrNotAvailable {
        if let Some(entry) = cluster.sp(sp) {
            let k = cluster.sps_per_node;
            let first = entry.node * k;
            let name = cluster
                .dpus
                .get(entry.node as usize)
                .or_else(|| cluster.hosts.get(entry.node as usize))
                .map(|n| format!(" ({n})"))
                .unwrap_or_default();
            msg.push_str(&format!(
                "; this machine has no such address: SP {sp} belongs to node {}{name}, which \
                 runs SPs {first}..={}. On another node use that node's SP ids, or `--sp-id \
                 local:I` (the unit's form: index I on this machine's node) or `--sp-id auto`",
                entry.node,
                first + k - 1
            ));
        }
    }
    msg
}

/// Lets a TCP listener hold as many finished handshakes as the kernel allows
/// (`net.core.somaxconn`) rather than the 128 the standard library asks for: the ranks of a
/// node connect to its SPs at once, and a connection beyond the backlog waits for its SYN to
/// be sent again (a second or more).
fn deep_backlog(l: &std::net::TcpListener) -> std::io::Result<()> {
    nix::sys::socket::listen(l, nix::sys::socket::Backlog::MAXCONN).map_err(std::io::Error::from)
}

/// SP `sp`'s peer listener: the bound listener a launcher passed as `listen_fd` (checked to
/// be a socket), or its peer address of `cluster` bound here; with a deep backlog either way.
pub fn peer_listener(
    listen_fd: Option<i32>,
    cluster: &Cluster,
    sp: SpId,
) -> anyhow::Result<std::net::TcpListener> {
    use anyhow::Context;
    let listener = match listen_fd {
        Some(fd) => {
            check_listener_fd(fd)?;
            // SAFETY: the launcher passes a bound TCP listener under this number, which
            // nothing else in this process owns (checked to be a socket just above).
            unsafe { <std::net::TcpListener as std::os::fd::FromRawFd>::from_raw_fd(fd) }
        }
        None => {
            let addr = cluster
                .sp(sp)
                .with_context(|| format!("SP id {sp} is not in the cluster description"))?
                .peer_addr;
            std::net::TcpListener::bind(addr)
                .map_err(|e| anyhow::anyhow!(bind_error(cluster, sp, addr, &e)))?
        }
    };
    deep_backlog(&listener).context("setting the peer listener's backlog")?;
    Ok(listener)
}

fn check_listener_fd(fd: i32) -> anyhow::Result<()> {
    // SAFETY: fstat only writes into `st`; an invalid fd is reported as an error.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        anyhow::bail!("--listen-fd {fd} is not an open file descriptor");
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        anyhow::bail!("--listen-fd {fd} is not a socket");
    }
    Ok(())
}

/// SP `sp`'s listener for hosts over TCP at `addr` (its `host_addr`), with a deep backlog.
pub fn host_listener(
    addr: std::net::SocketAddr,
    sp: SpId,
) -> anyhow::Result<std::net::TcpListener> {
    use anyhow::Context;
    let l = std::net::TcpListener::bind(addr)
        .with_context(|| format!("binding the host TCP address {addr} (host_addr of SP {sp})"))?;
    deep_backlog(&l).context("setting the host TCP listener's backlog")?;
    Ok(l)
}

/// This machine's host name.
pub fn host_name() -> std::io::Result<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into the live buffer.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// Tells the service manager `state` (e.g. `READY=1`) through `$NOTIFY_SOCKET` (a Unix
/// datagram socket, `@` for the abstract namespace), as `sd_notify(3)` does. `Ok(false)`:
/// no service manager asked (the variable is unset).
pub fn sd_notify(state: &str) -> std::io::Result<bool> {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET").filter(|p| !p.is_empty()) else {
        return Ok(false);
    };
    notify_to(&path, state)?;
    Ok(true)
}

/// Sends `state` as one datagram to the notify socket at `path`.
pub fn notify_to(path: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let bytes = path.as_bytes();
    let addr = match bytes.strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            SocketAddr::from_abstract_name(name)?
        }
        None => SocketAddr::from_pathname(std::path::Path::new(path))?,
    };
    let s = UnixDatagram::unbound()?;
    let n = s.send_to_addr(state.as_bytes(), &addr)?;
    if n != state.len() {
        return Err(std::io::Error::other("the notification was cut short"));
    }
    Ok(())
}

/// Why an SP did not answer a readiness query, in an admin's words: a query that connected but
/// got no answer in time is an SP that is up but not serving yet (it binds its host address
/// first and serves once every peer SP has joined its mesh), not an I/O error.
fn not_ready_why(e: &anyhow::Error) -> String {
    let silent = e.chain().any(|c| {
        if c.is::<crate::stats::NoAnswer>() {
            return true;
        }
        let io = c
            .downcast_ref::<std::io::Error>()
            .or_else(|| match c.downcast_ref() {
                Some(bootstrap::wire::FrameError::Io(io)) => Some(io),
                _ => None,
            });
        io.is_some_and(|io| {
            matches!(
                io.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            )
        })
    });
    if silent {
        "connected, but not serving yet: an SP serves once all its peer SPs have joined its \
         mesh (is one of them not started, or unreachable?)"
            .to_string()
    } else {
        format!("{e:#}")
    }
}

/// What [`wait_ready`] found: the SPs that never answered, each with its last error.
#[derive(Debug)]
pub struct NotReady(pub Vec<(SpId, String)>);

/// Asks every SP of `cluster` for its counters (`stats::query_within`, over the transport the
/// hosts use) until all have answered once, or `timeout` passed. Retries every `interval`.
pub fn wait_ready(
    cluster: &Cluster,
    key: &ClusterKey,
    timeout: Duration,
    interval: Duration,
) -> Result<(), NotReady> {
    let start = Instant::now();
    let mut waiting: Vec<(SpId, String)> = cluster
        .sps
        .iter()
        .map(|e| (e.id, "not asked yet".to_string()))
        .collect();
    loop {
        let mut still = Vec::new();
        for (id, _) in waiting {
            let entry = &cluster.sps[id as usize];
            let left = timeout.saturating_sub(start.elapsed());
            let per_try = left.clamp(Duration::from_millis(100), Duration::from_secs(2));
            match crate::stats::query_within(entry, key, per_try) {
                Ok(_) => {}
                Err(e) => still.push((id, not_ready_why(&e))),
            }
        }
        if still.is_empty() {
            return Ok(());
        }
        if start.elapsed() + interval >= timeout {
            return Err(NotReady(still));
        }
        waiting = still;
        std::thread::sleep(interval);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bootstrap::Layout;
    use std::collections::HashMap;

    fn cluster(hosts: &[&str], k: u32) -> Cluster {
        bootstrap::testing::cluster(hosts.len() as u32, k, Layout::Block, hosts)
    }

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn sp_id_auto_comes_from_the_host_name_and_the_launchers_local_rank() {
        let c = cluster(&["h0", "h1.site", "h2"], 2);
        // Open MPI, on the second node, second slot.
        let e = env(&[("OMPI_COMM_WORLD_LOCAL_RANK", "1")]);
        assert_eq!(resolve_sp_id(&c, None, "h1.site", &e), Ok(3));
        // By short name, both ways; --node wins over the host name.
        assert_eq!(resolve_sp_id(&c, None, "h1", &e), Ok(3));
        assert_eq!(resolve_sp_id(&c, None, "h2.site", &e), Ok(5));
        assert_eq!(resolve_sp_id(&c, Some("h0"), "h2", &e), Ok(1));
        // Slurm and Hydra.
        let e = env(&[("SLURM_LOCALID", "0")]);
        assert_eq!(resolve_sp_id(&c, None, "h2", &e), Ok(4));
        let e = env(&[("PMI_LOCAL_RANK", "1")]);
        assert_eq!(resolve_sp_id(&c, None, "h0", &e), Ok(1));
        let e = env(&[("MPI_LOCALRANKID", "0")]);
        assert_eq!(resolve_sp_id(&c, None, "h0", &e), Ok(0));
    }

    #[test]
    fn sp_id_auto_on_a_dpu_finds_its_node_by_the_dpu_name() {
        let mut c = cluster(&["h0", "h1"], 2);
        c.dpus = vec!["h0-dpu".into(), "h1-dpu.site".into()];
        c.validate().unwrap();
        let e = env(&[("OMPI_COMM_WORLD_LOCAL_RANK", "1")]);
        assert_eq!(resolve_sp_id(&c, None, "h1-dpu.site", &e), Ok(3));
        assert_eq!(resolve_sp_id(&c, None, "h1-dpu", &e), Ok(3));
        assert_eq!(resolve_sp_id(&c, None, "h0-dpu", &e), Ok(1));
        // A host name still names its node (SPs started on the hosts, or --node).
        assert_eq!(resolve_sp_id(&c, None, "h1", &e), Ok(3));
        assert_eq!(resolve_sp_id(&c, Some("h0"), "h1-dpu", &e), Ok(1));
        let err = resolve_sp_id(&c, None, "h2-dpu", &e).unwrap_err();
        assert!(err.contains("(h0-dpu, h1-dpu.site, h0, h1)"), "{err}");
    }

    #[test]
    fn sp_id_auto_says_clearly_what_is_missing() {
        let c = cluster(&["h0", "h1"], 2);
        let e = env(&[("OMPI_COMM_WORLD_LOCAL_RANK", "0")]);
        let err = resolve_sp_id(&c, None, "elsewhere", &e).unwrap_err();
        assert!(
            err.contains("not in the cluster description's dpus or hosts (h0, h1)"),
            "{err}"
        );
        let err = resolve_sp_id(&c, None, "h0", env(&[])).unwrap_err();
        assert!(err.contains("no launcher local rank"), "{err}");
        assert!(err.contains("SLURM_LOCALID"), "{err}");
        let err = resolve_sp_id(&c, None, "h0", env(&[("SLURM_LOCALID", "2")])).unwrap_err();
        assert!(err.contains("2 SPs per node"), "{err}");
        assert!(err.contains("ppr:2:node"), "{err}");
        let err = resolve_sp_id(&c, None, "h0", env(&[("SLURM_LOCALID", "x")])).unwrap_err();
        assert!(err.contains("not a local rank"), "{err}");
        let mut no_hosts = c.clone();
        no_hosts.hosts.clear();
        let err = resolve_sp_id(&no_hosts, None, "h0", &e).unwrap_err();
        assert!(err.contains("\"hosts\""), "{err}");
        // Two nodes with the same first label: only the full name decides.
        let twins = cluster(&["a.x", "a.y"], 1);
        let err = resolve_sp_id(&twins, None, "a", &e).unwrap_err();
        assert!(err.contains("several nodes"), "{err}");
        assert_eq!(resolve_sp_id(&twins, None, "a.y", &e), Ok(1));
    }

    #[test]
    fn sp_id_argument_parses_numbers_and_auto() {
        assert_eq!("7".parse::<SpIdArg>(), Ok(SpIdArg::Id(7)));
        assert_eq!("auto".parse::<SpIdArg>(), Ok(SpIdArg::Auto));
        assert!("seven".parse::<SpIdArg>().unwrap_err().contains("auto"));
    }
}
