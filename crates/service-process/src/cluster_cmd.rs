//! `service-process cluster check|init`: the cluster description an administrator writes or
//! generates for a real cluster.
//!
//! The description is the JSON every SP and every host shim reads (`bootstrap::Cluster`): per
//! node its host name (what `MPI_Get_processor_name` says there), and per SP its id, node and
//! index, its address for peer SPs (`peer_addr`), its address for the host ranks of its node
//! over the host-DPU network (`host_addr`) and its Unix socket for hosts on its own kernel
//! (`host_socket`). Nothing maps ranks: each rank places itself at `MPI_Init` (see
//! `bootstrap::placement`).
//!
//! `init` writes one from a host file or a Slurm node list, the DPUs' addresses (a name suffix
//! resolved through the resolver, or a map file) and the ports; `check` reads one and lists
//! every problem with its line or field, exiting 1 if there is one.

use anyhow::{bail, Context, Result};
use bootstrap::cluster::{Cluster, Layout, SpEntry};
use std::collections::HashMap;
use std::io::Write;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

#[derive(clap::Subcommand, Debug)]
pub enum ClusterCmd {
    /// Validate a cluster description: JSON syntax (line and column), then every field
    /// (SP ids, nodes and indexes, K, host names, duplicate addresses, ports and sockets).
    /// Prints every problem, or a summary of the cluster. Exit status 0 (valid) or 1.
    Check {
        /// The description (JSON).
        file: PathBuf,
    },
    /// Generate a cluster description for a real cluster: one node per host (in the given
    /// order), K SPs on each node's DPU. SP k of a node listens for peer SPs on
    /// DPU:PEER_PORT+k, for the node's host ranks on DPU:HOST_PORT+k (TCP) and on
    /// SOCKET_DIR/ID/host.sock (Unix, for same-kernel clients; under the systemd unit's runtime
    /// directory /run/spoff). The result is checked as `check` does before it is written.
    #[command(group(clap::ArgGroup::new("hosts_from").required(true)))]
    #[command(group(clap::ArgGroup::new("dpus").required(true)))]
    Init {
        /// The hosts, one per line (an Open MPI host file: the first word of each line counts,
        /// `#` starts a comment; a word may be a Slurm host list).
        #[arg(long, group = "hosts_from")]
        hosts_file: Option<PathBuf>,
        /// The hosts as a Slurm node list, e.g. 'node[01-04],gpu7' (as in SLURM_JOB_NODELIST).
        #[arg(long, group = "hosts_from")]
        slurm_nodelist: Option<String>,
        /// SPs per DPU (K); local rank i of a node is served by its SP i mod K.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
        sps_per_node: u32,
        /// The DPU of host H is named H followed by this suffix (e.g. -dpu: node01-dpu),
        /// resolved to an address now.
        #[arg(long, group = "dpus", allow_hyphen_values = true)]
        dpu_suffix: Option<String>,
        /// A file of lines `HOST DPU_ADDR [PEER_ADDR]`: the DPU address (IP or name) host
        /// ranks of HOST reach, and the one peer SPs reach (default: the same).
        #[arg(long, group = "dpus")]
        dpu_map: Option<PathBuf>,
        /// The peer port of SP 0 of each DPU (SP k: +k).
        #[arg(long, default_value_t = 7100, value_parser = clap::value_parser!(u16).range(1..))]
        peer_port: u16,
        /// The host port of SP 0 of each DPU (SP k: +k).
        #[arg(long, default_value_t = 7200, value_parser = clap::value_parser!(u16).range(1..))]
        host_port: u16,
        /// Directory of the SPs' Unix sockets on each DPU: SP ID's is SOCKET_DIR/ID/host.sock
        /// (the SP makes ID/; /run/spoff is the runtime directory of `spoff-sp@.service`).
        #[arg(long, default_value = "/run/spoff")]
        socket_dir: PathBuf,
        /// The ports UCX's TCP transport may listen on, FIRST-LAST (the description's
        /// `ucx_tcp_port_range`): the ranks and the SPs apply it, so a firewall opens only
        /// these for the `ucx` grants over TCP. Default: none (ports the kernel picks).
        #[arg(long, value_name = "FIRST-LAST")]
        ucx_tcp_port_range: Option<bootstrap::cluster::PortRange>,
        /// Write here instead of standard output.
        #[arg(long, short)]
        output: Option<PathBuf>,
    },
}

/// Runs a `cluster` subcommand; returns the exit status.
pub fn run(cmd: ClusterCmd) -> Result<i32> {
    match cmd {
        ClusterCmd::Check { file } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            match check_text(&text) {
                Ok(c) => {
                    print!("{}", summary(&file, &c));
                    Ok(0)
                }
                Err(problems) => {
                    eprintln!("{}: {} problem(s):", file.display(), problems.len());
                    for p in &problems {
                        eprintln!("  {p}");
                    }
                    Ok(1)
                }
            }
        }
        ClusterCmd::Init {
            hosts_file,
            slurm_nodelist,
            sps_per_node,
            dpu_suffix,
            dpu_map,
            peer_port,
            host_port,
            socket_dir,
            ucx_tcp_port_range,
            output,
        } => {
            let hosts = match (&hosts_file, &slurm_nodelist) {
                (Some(f), _) => read_hosts_file(f)?,
                (None, Some(l)) => crate::hostlist::expand(l).map_err(anyhow::Error::msg)?,
                (None, None) => bail!("give --hosts-file or --slurm-nodelist"),
            };
            let dpus = match (&dpu_suffix, &dpu_map) {
                (Some(s), _) => Dpus::Suffix(s.clone()),
                (None, Some(f)) => Dpus::Map(read_dpu_map(f)?),
                (None, None) => bail!("give --dpu-suffix or --dpu-map"),
            };
            let mut c = init(&Init {
                hosts,
                sps_per_node,
                dpus,
                peer_port,
                host_port,
                socket_dir,
            })?;
            c.ucx_tcp_port_range = ucx_tcp_port_range;
            let text = serde_json::to_string_pretty(&c)? + "\n";
            if let Err(problems) = check_text(&text) {
                bail!(
                    "the generated description is not valid: {}",
                    problems.join("; ")
                );
            }
            match output {
                Some(p) => {
                    std::fs::write(&p, &text)
                        .with_context(|| format!("writing {}", p.display()))?;
                    eprint!("{}", summary(&p, &c));
                }
                None => std::io::stdout().write_all(text.as_bytes())?,
            }
            Ok(0)
        }
    }
}

/// Where the DPUs are.
#[derive(Clone, Debug)]
pub enum Dpus {
    /// The DPU of host H is H + suffix (resolved).
    Suffix(String),
    /// Host -> (address for hosts, address for peers), as written (IP or name).
    Map(HashMap<String, (String, String)>),
}

/// What `init` needs.
#[derive(Clone, Debug)]
pub struct Init {
    pub hosts: Vec<String>,
    pub sps_per_node: u32,
    pub dpus: Dpus,
    pub peer_port: u16,
    pub host_port: u16,
    pub socket_dir: PathBuf,
}

/// Builds the description.
pub fn init(opts: &Init) -> Result<Cluster> {
    let k = opts.sps_per_node;
    if opts.hosts.is_empty() {
        bail!("no hosts given");
    }
    let mut seen = HashMap::new();
    for (n, h) in opts.hosts.iter().enumerate() {
        if let Some(m) = seen.insert(h.as_str(), n) {
            bail!("host {h:?} is given twice (nodes {m} and {n})");
        }
    }
    for (base, what) in [
        (opts.peer_port, "--peer-port"),
        (opts.host_port, "--host-port"),
    ] {
        if base as u32 + k - 1 > u16::MAX as u32 {
            bail!("{what} {base} + {k} SPs per node passes port 65535");
        }
    }
    let (p, h) = (opts.peer_port as u32, opts.host_port as u32);
    if p < h + k && h < p + k {
        bail!(
            "--peer-port {p} and --host-port {h} overlap for {k} SPs per node (ports {p}..{} and \
             {h}..{})",
            p + k - 1,
            h + k - 1
        );
    }
    let mut sps = Vec::new();
    for (n, host) in opts.hosts.iter().enumerate() {
        let (for_hosts, for_peers) = match &opts.dpus {
            Dpus::Suffix(s) => {
                let name = format!("{host}{s}");
                let ip = resolve(&name).with_context(|| {
                    format!("the DPU of {host} ({name}, from --dpu-suffix {s:?})")
                })?;
                (ip, ip)
            }
            Dpus::Map(m) => {
                let (a, b) = m
                    .get(host)
                    .with_context(|| format!("the DPU map has no line for host {host:?}"))?;
                let a = resolve(a).with_context(|| format!("the DPU of {host} in the map"))?;
                let b = resolve(b).with_context(|| format!("the DPU of {host} in the map"))?;
                (a, b)
            }
        };
        for i in 0..k {
            let id = n as u32 * k + i;
            let peer_addr = SocketAddr::new(for_peers, opts.peer_port + i as u16);
            let host_socket = opts.socket_dir.join(id.to_string()).join("host.sock");
            sps.push(SpEntry {
                host_addr: Some(SocketAddr::new(for_hosts, opts.host_port + i as u16)),
                ..SpEntry::numbered(id, k, peer_addr, host_socket)
            });
        }
    }
    let mut c = Cluster::new(opts.hosts.len() as u32, k, None, Layout::Block, sps)?;
    c.hosts = opts.hosts.clone();
    // The DPUs' own names, where they are names (`serve --sp-id auto` finds its node by them).
    c.dpus = match &opts.dpus {
        // An empty suffix: the SPs run on the hosts themselves.
        Dpus::Suffix(s) if s.is_empty() => Vec::new(),
        Dpus::Suffix(s) => opts.hosts.iter().map(|h| format!("{h}{s}")).collect(),
        Dpus::Map(m) => {
            let names: Vec<String> = opts
                .hosts
                .iter()
                .filter_map(|h| m.get(h).map(|(a, _)| a.clone()))
                .filter(|a| a.parse::<IpAddr>().is_err())
                .collect();
            if names.len() == opts.hosts.len() {
                names
            } else {
                Vec::new()
            }
        }
    };
    c.validate()?;
    Ok(c)
}

/// An IP address, or a name resolved now (IPv4 preferred).
fn resolve(name: &str) -> Result<IpAddr> {
    if let Ok(ip) = name.parse::<IpAddr>() {
        return Ok(ip);
    }
    let addrs: Vec<SocketAddr> = (name, 0)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve {name:?}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .map(|a| a.ip())
        .with_context(|| format!("{name:?} resolves to no address"))
}

/// The hosts of an Open MPI style host file (first word of each line; `#` comments; a word may
/// be a Slurm host list).
pub fn read_hosts_file(path: &Path) -> Result<Vec<String>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    parse_hosts(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// See [`read_hosts_file`]; errors carry the line number.
pub fn parse_hosts(text: &str) -> Result<Vec<String>, String> {
    let mut hosts: Vec<String> = Vec::new();
    let mut line_of: HashMap<String, usize> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("");
        let Some(word) = line.split_whitespace().next() else {
            continue;
        };
        let names = crate::hostlist::expand(word).map_err(|e| format!("line {}: {e}", i + 1))?;
        for name in names {
            if let Some(first) = line_of.insert(name.clone(), i + 1) {
                return Err(format!(
                    "line {}: host {name:?} is already on line {first}",
                    i + 1
                ));
            }
            hosts.push(name);
        }
    }
    if hosts.is_empty() {
        return Err("no hosts in the file".into());
    }
    Ok(hosts)
}

/// A DPU map file: lines `HOST DPU_ADDR [PEER_ADDR]`, `#` comments.
pub fn read_dpu_map(path: &Path) -> Result<HashMap<String, (String, String)>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    parse_dpu_map(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// See [`read_dpu_map`].
pub fn parse_dpu_map(text: &str) -> Result<HashMap<String, (String, String)>, String> {
    let mut m = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let words: Vec<&str> = line
            .split('#')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        let (host, a, b) = match words.as_slice() {
            [] => continue,
            [h, a] => (h, a, a),
            [h, a, b] => (h, a, b),
            _ => {
                return Err(format!(
                    "line {}: expected `HOST DPU_ADDR [PEER_ADDR]`, got {} words",
                    i + 1,
                    words.len()
                ))
            }
        };
        if m.insert(host.to_string(), (a.to_string(), b.to_string()))
            .is_some()
        {
            return Err(format!("line {}: host {host:?} is mapped twice", i + 1));
        }
    }
    Ok(m)
}

/// Parses and checks a description; on failure, every problem found (JSON errors with their
/// line and column, field errors with the field's path).
pub fn check_text(text: &str) -> Result<Cluster, Vec<String>> {
    let at = |e: serde_json::Error| {
        let (line, column) = (e.line(), e.column());
        let msg = e.to_string();
        let msg = msg
            .strip_suffix(&format!(" at line {line} column {column}"))
            .unwrap_or(&msg)
            .to_string();
        format!("line {line} column {column}: {msg}")
    };
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| vec![at(e)])?;
    // Unknown fields are refused: a misspelt field would otherwise be ignored silently.
    let mut problems = Vec::new();
    const TOP: [&str; 8] = [
        "nodes",
        "sps_per_node",
        "ranks_per_node",
        "layout",
        "sps",
        "hosts",
        "dpus",
        "ucx_tcp_port_range",
    ];
    const SP: [&str; 6] = [
        "id",
        "node",
        "index",
        "peer_addr",
        "host_socket",
        "host_addr",
    ];
    if let Some(o) = value.as_object() {
        problems.extend(
            o.keys()
                .filter(|k| !TOP.contains(&k.as_str()))
                .map(|k| format!("{k}: unknown field (expected one of {})", TOP.join(", "))),
        );
    }
    if let Some(sps) = value.get("sps").and_then(|s| s.as_array()) {
        for (i, sp) in sps.iter().enumerate() {
            if let Some(o) = sp.as_object() {
                problems.extend(o.keys().filter(|k| !SP.contains(&k.as_str())).map(|k| {
                    format!(
                        "sps[{i}].{k}: unknown field (expected one of {})",
                        SP.join(", ")
                    )
                }));
            }
        }
    }
    // The path of the field a typed error is about (`sps[2].peer_addr`), which serde's own
    // message does not name.
    let typed = serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text));
    let c: Cluster = match typed {
        Ok(c) => c,
        Err(e) => {
            let field = e.path().to_string();
            let msg = at(e.into_inner());
            problems.push(if field == "." {
                msg
            } else {
                format!("{field}: {msg}")
            });
            return Err(problems);
        }
    };
    problems.extend(field_problems(&c));
    if problems.is_empty() {
        Ok(c)
    } else {
        Err(problems)
    }
}

/// Every field problem of a parsed description.
pub fn field_problems(c: &Cluster) -> Vec<String> {
    let mut p = Vec::new();
    let k = c.sps_per_node;
    if c.nodes == 0 {
        p.push("nodes: must be at least 1".to_string());
    }
    if k == 0 {
        p.push("sps_per_node: must be at least 1 (K SPs per DPU)".to_string());
    }
    if c.ranks_per_node == Some(0) {
        p.push("ranks_per_node: must be at least 1 when given".to_string());
    }
    let want = c.nodes as u64 * k as u64;
    if c.sps.len() as u64 != want {
        p.push(format!(
            "sps: {} entries, but nodes x sps_per_node = {} x {k} = {want}",
            c.sps.len(),
            c.nodes
        ));
    }
    let mut peer: HashMap<SocketAddr, usize> = HashMap::new();
    let mut host: HashMap<SocketAddr, usize> = HashMap::new();
    let mut socket: HashMap<(u32, &Path), usize> = HashMap::new();
    for (i, sp) in c.sps.iter().enumerate() {
        let f = |field: &str| format!("sps[{i}].{field}");
        if sp.id as usize != i {
            p.push(format!(
                "{}: {} (ids are the entries' positions: {i})",
                f("id"),
                sp.id
            ));
        }
        if sp.node >= c.nodes {
            p.push(format!(
                "{}: {} outside the {} nodes",
                f("node"),
                sp.node,
                c.nodes
            ));
        }
        if sp.index >= k {
            p.push(format!(
                "{}: {} outside the {k} SPs of a node",
                f("index"),
                sp.index
            ));
        } else if (sp.node as u64 * k as u64 + sp.index as u64) != i as u64 {
            p.push(format!(
                "sps[{i}]: node {} index {} belongs at position node * {k} + index = {}",
                sp.node,
                sp.index,
                sp.node as u64 * k as u64 + sp.index as u64
            ));
        }
        addr_problems(sp.peer_addr, &f("peer_addr"), &peer, &host, &mut p);
        peer.insert(sp.peer_addr, i);
        if let Some(h) = sp.host_addr {
            addr_problems(h, &f("host_addr"), &peer, &host, &mut p);
            host.insert(h, i);
        }
        if !sp.host_socket.is_absolute() {
            p.push(format!(
                "{}: {} is not an absolute path",
                f("host_socket"),
                sp.host_socket.display()
            ));
        }
        if let Some(j) = socket.insert((sp.node, sp.host_socket.as_path()), i) {
            p.push(format!(
                "{}: {} is also sps[{j}].host_socket on the same node",
                f("host_socket"),
                sp.host_socket.display()
            ));
        }
    }
    if c.hosts.is_empty() && !c.dpus.is_empty() {
        // A description of real machines (it names DPUs) without the hosts' names: ranks
        // could only be placed by the emulation's layout, whatever host they run on.
        p.push(format!(
            "hosts: missing, but dpus names {} DPUs: give every node's host name (what \
             MPI_Get_processor_name says there), or ranks cannot find the SPs of their own node",
            c.dpus.len()
        ));
    }
    if let Some(r) = c.ucx_tcp_port_range {
        // UCX takes a random free port of the range, so one of the SPs' own ports inside it
        // could be taken before its SP binds it.
        for (i, sp) in c.sps.iter().enumerate() {
            for (what, a) in [
                ("peer_addr", Some(sp.peer_addr)),
                ("host_addr", sp.host_addr),
            ] {
                if let Some(a) = a.filter(|a| r.contains(a.port())) {
                    p.push(format!(
                        "ucx_tcp_port_range: {r} holds the port of sps[{i}].{what} ({a}): UCX \
                         could take it before the SP binds it; keep the range apart"
                    ));
                }
            }
        }
    }
    let mut names: HashMap<&str, String> = HashMap::new();
    for (list, field) in [(&c.hosts, "hosts"), (&c.dpus, "dpus")] {
        if !list.is_empty() && list.len() as u64 != c.nodes as u64 {
            p.push(format!(
                "{field}: {} names for {} nodes",
                list.len(),
                c.nodes
            ));
        }
        for (n, h) in list.iter().enumerate() {
            if h.is_empty() || h.chars().any(|c| c.is_whitespace() || c.is_control()) {
                p.push(format!("{field}[{n}]: {h:?} is not a host name"));
            }
            if let Some(m) = names.insert(h.as_str(), format!("{field}[{n}]")) {
                p.push(format!("{field}[{n}]: {h:?} is also {m}"));
            }
        }
    }
    if p.is_empty() {
        // Anything the loader refuses that the checks above missed.
        if let Err(e) = c.validate() {
            p.push(e.to_string());
        }
    }
    p
}

/// The problems of address `a` of field `field`, given the addresses seen before.
fn addr_problems(
    a: SocketAddr,
    field: &str,
    peer: &HashMap<SocketAddr, usize>,
    host: &HashMap<SocketAddr, usize>,
    p: &mut Vec<String>,
) {
    if a.port() == 0 {
        p.push(format!("{field}: {a} has port 0"));
    }
    if a.ip().is_unspecified() {
        p.push(format!("{field}: {a} is not an address one can connect to"));
    }
    for (what, seen) in [("peer_addr", peer), ("host_addr", host)] {
        if let Some(j) = seen.get(&a) {
            p.push(format!("{field}: {a} is also sps[{j}].{what}"));
        }
    }
}

/// What `check` prints for a valid description.
pub fn summary(path: &Path, c: &Cluster) -> String {
    let mut s = format!(
        "{}: valid: {} node(s), {} SP(s) per node, {} SP(s)\n",
        path.display(),
        c.nodes,
        c.sps_per_node,
        c.sps.len()
    );
    if c.hosts.is_empty() {
        s += "  no host names: an emulated cluster on one machine (ranks are placed by the \
              SPOFF_NODE hint launch gives, or by its layout)\n";
    }
    if let Some(r) = c.ucx_tcp_port_range {
        s += &format!("  UCX TCP ports {r} (ranks and SPs listen there for the ucx grants)\n");
    }
    for n in 0..c.nodes {
        let host = c.hosts.get(n as usize).map_or("-", String::as_str);
        let dpu = c.dpus.get(n as usize).map_or("-", String::as_str);
        s += &format!("  node {n} host {host} dpu {dpu}\n");
        for sp in c.sps.iter().filter(|sp| sp.node == n) {
            let tcp = sp.host_addr.map_or("-".to_string(), |a| a.to_string());
            s += &format!(
                "    SP {} (index {}): peers {}, hosts tcp {tcp}, unix {}\n",
                sp.id,
                sp.index,
                sp.peer_addr,
                sp.host_socket.display()
            );
        }
    }
    s
}

#[cfg(test)]
mod tests;
