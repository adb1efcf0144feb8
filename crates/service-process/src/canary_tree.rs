//! The plan of a two-level Canary tree of software switches (issue 27 part 4): which switch
//! has which ports, whose socket is at the other end of each, the up-ports and the routes,
//! and each member's link to its leaf. [`TreePlan::two_level`] builds it from the addresses
//! to use; [`TreePlan::switch_args`] gives the `service-process switch` arguments of each
//! switch. The same plan serves a loopback tree (all addresses on 127.x) and, later, a
//! namespace tree (each link's two ends in two namespaces).
//!
//! Canary addresses: members `1..=H` (in the order given), leaves `1001..`, spines `2001..`.
//! Members are spread over the leaves in blocks (member `h` under leaf `h * L / H`). A leaf's
//! ports are its members' first, then one per spine (the up-ports); spine `s`'s port `l` goes
//! to leaf `l`. Each switch routes down to what is below it and to its neighbours (a leaf to
//! each spine, a spine to each leaf: the targets of restorations).

use std::net::SocketAddr;

use algorithms::canary::{Addr, Port};
use serde::{Deserialize, Serialize};

/// Canary address of the first leaf.
pub const LEAF_BASE: Addr = 1001;
/// Canary address of the first spine.
pub const SPINE_BASE: Addr = 2001;

/// One port of a switch: its socket and the socket at the other end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortPlan {
    pub local: SocketAddr,
    pub peer: SocketAddr,
}

/// One switch of the plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchPlan {
    pub addr: Addr,
    /// By port number.
    pub ports: Vec<PortPlan>,
    pub up: Vec<Port>,
    /// (address, port): addresses reached through a fixed port.
    pub routes: Vec<(Addr, Port)>,
}

/// One member's link: its socket and its leaf's port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberLink {
    pub addr: Addr,
    pub local: SocketAddr,
    pub leaf: SocketAddr,
}

/// A whole tree; see the module docs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreePlan {
    /// Leaves first, then spines.
    pub switches: Vec<SwitchPlan>,
    pub leaves: usize,
    pub members: Vec<MemberLink>,
    /// A tree in network namespaces (`crate::canary_netns`): each member's namespace, where
    /// its socket is opened, by member. Empty on loopback.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub member_netns: Vec<String>,
    /// Each switch's namespace, in the order of `switches`. Empty on loopback.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub switch_netns: Vec<String>,
}

impl TreePlan {
    /// `leaves` leaves and `spines` spines over the members whose sockets are `members`;
    /// `next_port` gives a fresh socket address for each switch port, called leaves first
    /// (each leaf's member ports, then its up-ports), then spines.
    pub fn two_level(
        leaves: usize,
        spines: usize,
        members: &[SocketAddr],
        mut next_port: impl FnMut() -> SocketAddr,
    ) -> TreePlan {
        assert!(
            leaves >= 1 && members.len() >= leaves,
            "a leaf without members"
        );
        let h = members.len();
        let leaf_of = |m: usize| m * leaves / h;
        let under: Vec<Vec<usize>> = (0..leaves)
            .map(|l| (0..h).filter(|&m| leaf_of(m) == l).collect())
            .collect();
        // Sockets first (leaf l's up-port to spine s, spine s's port to leaf l).
        let leaf_down: Vec<Vec<SocketAddr>> = under
            .iter()
            .map(|ms| ms.iter().map(|_| next_port()).collect())
            .collect();
        let leaf_up: Vec<Vec<SocketAddr>> = (0..leaves)
            .map(|_| (0..spines).map(|_| next_port()).collect())
            .collect();
        let spine_port: Vec<Vec<SocketAddr>> = (0..spines)
            .map(|_| (0..leaves).map(|_| next_port()).collect())
            .collect();
        let maddr = |m: usize| m as Addr + 1;
        let mut switches = Vec::new();
        for (l, ms) in under.iter().enumerate() {
            let mut ports = Vec::new();
            let mut routes = Vec::new();
            for (p, &m) in ms.iter().enumerate() {
                ports.push(PortPlan {
                    local: leaf_down[l][p],
                    peer: members[m],
                });
                routes.push((maddr(m), p as Port));
            }
            let mut up = Vec::new();
            for s in 0..spines {
                let p = ports.len() as Port;
                ports.push(PortPlan {
                    local: leaf_up[l][s],
                    peer: spine_port[s][l],
                });
                routes.push((SPINE_BASE + s as Addr, p));
                up.push(p);
            }
            switches.push(SwitchPlan {
                addr: LEAF_BASE + l as Addr,
                ports,
                up,
                routes,
            });
        }
        for s in 0..spines {
            let mut ports = Vec::new();
            let mut routes = Vec::new();
            for (l, ms) in under.iter().enumerate() {
                ports.push(PortPlan {
                    local: spine_port[s][l],
                    peer: leaf_up[l][s],
                });
                routes.push((LEAF_BASE + l as Addr, l as Port));
                routes.extend(ms.iter().map(|&m| (maddr(m), l as Port)));
            }
            switches.push(SwitchPlan {
                addr: SPINE_BASE + s as Addr,
                ports,
                up: Vec::new(),
                routes,
            });
        }
        let members = (0..h)
            .map(|m| {
                let l = leaf_of(m);
                let p = under[l].iter().position(|&x| x == m).unwrap();
                MemberLink {
                    addr: maddr(m),
                    local: members[m],
                    leaf: leaf_down[l][p],
                }
            })
            .collect();
        TreePlan {
            switches,
            leaves,
            members,
            member_netns: Vec::new(),
            switch_netns: Vec::new(),
        }
    }

    /// The `--tree` arguments of switch `i` for `k` static trees (the baselines): tree `t`
    /// rooted at spine `t % S`; a leaf sends its members' `m` contributions up its port to that
    /// spine, the root waits for every member's and sends the block to its leader.
    pub fn static_tree_args(&self, i: usize, k: u8) -> Vec<String> {
        let spines = self.switches.len() - self.leaves;
        let members = self.members.len();
        let mut a = Vec::new();
        for t in 0..k {
            let root = t as usize % spines;
            if i < self.leaves {
                let m = self.switches[i].ports.len() - spines;
                a.push("--tree".to_string());
                a.push(format!("{t}={}:{m}", m + root));
            } else if i - self.leaves == root {
                a.push("--tree".to_string());
                a.push(format!("{t}=root:{members}"));
            }
        }
        a
    }

    /// The `service-process switch` arguments of switch `i` (without `--stats-file` and the
    /// tuning options).
    pub fn switch_args(&self, i: usize) -> Vec<String> {
        let s = &self.switches[i];
        let mut a = vec!["--addr".to_string(), s.addr.to_string()];
        for (p, port) in s.ports.iter().enumerate() {
            a.push("--port".into());
            a.push(format!("{p}={},{}", port.local, port.peer));
        }
        for (addr, p) in &s.routes {
            a.push("--route".into());
            a.push(format!("{addr}={p}"));
        }
        if !s.up.is_empty() {
            a.push("--up".into());
            a.push(
                s.up.iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
            );
        }
        a
    }
}

/// A tree shape `L+S`: L leaves, S spines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub leaves: usize,
    pub spines: usize,
}

impl std::str::FromStr for Shape {
    type Err = String;
    fn from_str(s: &str) -> Result<Shape, String> {
        let (l, sp) = s
            .split_once('+')
            .ok_or_else(|| format!("{s:?}: expected LEAVES+SPINES, e.g. 2+2"))?;
        let shape = Shape {
            leaves: l
                .trim()
                .parse()
                .map_err(|e| format!("{s:?}: leaves: {e}"))?,
            spines: sp
                .trim()
                .parse()
                .map_err(|e| format!("{s:?}: spines: {e}"))?,
        };
        if shape.leaves == 0 || shape.spines == 0 {
            return Err(format!("{s:?}: at least one leaf and one spine"));
        }
        Ok(shape)
    }
}

/// Options of `service-process canary-tree`.
#[derive(clap::Args, Clone, Debug)]
pub struct CanaryTreeOpts {
    /// The tree: LEAVES+SPINES.
    #[arg(long, default_value = "2+2")]
    pub switches: Shape,
    /// Members (SPs, or any Canary hosts), spread over the leaves in blocks.
    #[arg(long)]
    pub members: usize,
    /// The loopback address every socket of the tree is on.
    #[arg(long, default_value = "127.0.0.1")]
    pub ip: std::net::IpAddr,
    /// Where to write the plan (JSON: every switch's ports, each member's address, its
    /// socket and its leaf's port).
    #[arg(long)]
    pub plan: std::path::PathBuf,
    /// Build the tree in network namespaces (`canary_netns`: a namespace per switch and per
    /// member, veth links on 10.27.0.0/16 with no route out) instead of on loopback; removed
    /// at the end. Needs root, `ip` and `tc`. The plan names each member's namespace, where
    /// its owner opens its socket.
    #[arg(long)]
    pub netns: bool,
    /// With --netns: shape leaf 0's link to spine 0 to this `tc` rate (e.g. 200mbit), 5 ms of
    /// queue.
    #[arg(long, requires = "netns")]
    pub shape: Option<String>,
    /// With --netns: background traffic over leaf 0's link to spine 0 at this many Mbit/s
    /// for as long as the tree runs.
    #[arg(long, requires = "netns")]
    pub background_mbit: Option<u32>,
    /// Install K static trees in the switches (the paper's baselines: tree t rooted at spine
    /// t mod S, every member in every allreduce); the members must run with static_trees K.
    #[arg(long, value_name = "K")]
    pub static_trees: Option<u8>,
    /// Further arguments of every switch (e.g. `--timeout-us 100 --drop-rate 0.01`), after
    /// `--`.
    #[arg(last = true)]
    pub switch_args: Vec<String>,
}

/// `service-process canary-tree`: starts the switch daemons of a loopback tree, writes the
/// plan, prints `READY canary-tree switches=N`, and on SIGINT/SIGTERM stops them and prints
/// each one's `STATS` line prefixed by its address. The members' sockets are reserved while
/// the plan is made and released before it is written: their owners bind them then.
pub fn run(o: &CanaryTreeOpts) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::BufRead;
    use std::net::UdpSocket;
    use std::process::{Command, Stdio};
    if o.members < o.switches.leaves {
        anyhow::bail!(
            "{} members for {} leaves: every leaf needs one",
            o.members,
            o.switches.leaves
        );
    }
    let mut netns = None;
    let mut member_socks = Vec::new();
    let plan = if o.netns {
        let prefix = format!("spoffcy{}", std::process::id());
        let mut t = crate::canary_netns::NetnsTree::build(
            &prefix,
            o.switches.leaves,
            o.switches.spines,
            o.members,
        )?;
        if let Some(rate) = &o.shape {
            t.shape(rate)?;
        }
        if let Some(mbit) = o.background_mbit {
            t.background(mbit)?;
        }
        let plan = t.plan.clone();
        netns = Some(t);
        plan
    } else {
        let bind = || UdpSocket::bind((o.ip, 0)).with_context(|| format!("binding on {}", o.ip));
        member_socks = (0..o.members)
            .map(|_| bind())
            .collect::<anyhow::Result<Vec<_>>>()?;
        let n_ports = o.members + 2 * o.switches.leaves * o.switches.spines;
        let held = (0..n_ports)
            .map(|_| bind())
            .collect::<anyhow::Result<Vec<_>>>()?;
        let addrs = |v: &[UdpSocket]| -> std::io::Result<Vec<SocketAddr>> {
            v.iter().map(|s| s.local_addr()).collect()
        };
        let members = addrs(&member_socks)?;
        let mut next = addrs(&held)?.into_iter();
        TreePlan::two_level(o.switches.leaves, o.switches.spines, &members, || {
            next.next().expect("enough ports reserved")
        })
    };
    let exe = std::env::current_exe().context("this program's path")?;
    let mut children = Vec::new();
    for (i, sw) in plan.switches.iter().enumerate() {
        let mut cmd = match plan.switch_netns.get(i) {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        cmd.arg("switch")
            .args(plan.switch_args(i))
            .args(plan.static_tree_args(i, o.static_trees.unwrap_or(0)))
            // In namespaces the links have kernel queues: the switches read them.
            .args(o.netns.then_some("--qdisc-load"))
            .args(&o.switch_args)
            .stdout(Stdio::piped());
        // A switch goes with this process, however it ends.
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong);
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting switch {}", sw.addr))?;
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line)?;
        if !line.starts_with("READY switch") {
            let _ = child.kill();
            anyhow::bail!("switch {} did not start: {line:?}", sw.addr);
        }
        children.push((sw.addr, child, out));
    }
    drop(member_socks);
    let tmp = o.plan.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&plan)?)?;
    std::fs::rename(&tmp, &o.plan).with_context(|| format!("writing {}", o.plan.display()))?;
    let mut sig = crate::signals::SignalPipe::install()?;
    println!("READY canary-tree switches={}", children.len());
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let sig_fd = *sig.source().0;
    loop {
        let mut fd = libc::pollfd {
            fd: sig_fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut fd, 1, 200) };
        if fd.revents != 0 && sig.drain() {
            break;
        }
    }
    for (addr, child, out) in &mut children {
        // SAFETY: kill(2) of our own child, still unreaped.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(out, &mut rest);
        let _ = child.wait();
        match rest.lines().find(|l| l.starts_with("STATS ")) {
            Some(l) => println!("switch {addr} {l}"),
            None => println!("switch {addr} ended without its counters (killed?)"),
        }
    }
    if let Some(mut t) = netns {
        let sent = t.stop_background();
        if o.background_mbit.is_some() {
            println!("background datagrams sent: {sent}");
        }
        if o.shape.is_some() {
            for l in t.shaped_stats().lines() {
                println!("shaped link: {}", l.trim());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn plan(leaves: usize, spines: usize, hosts: usize) -> TreePlan {
        let mut next = 20_000u16;
        let members: Vec<SocketAddr> = (0..hosts)
            .map(|i| SocketAddr::from(([127, 0, 0, 1], 10_000 + i as u16)))
            .collect();
        TreePlan::two_level(leaves, spines, &members, || {
            next += 1;
            SocketAddr::from(([127, 0, 0, 1], next))
        })
    }

    /// Every link's two ends name each other; every member reaches every other member and
    /// every switch by the routes and up-ports (a route or an up-port at each hop).
    #[test]
    fn every_link_is_mirrored_and_every_address_is_reachable() {
        for (l, s, h) in [(2, 2, 4), (2, 2, 5), (3, 2, 8), (1, 1, 2), (4, 3, 4)] {
            let t = plan(l, s, h);
            let mut owner: HashMap<SocketAddr, (Option<usize>, usize)> = HashMap::new();
            for (i, sw) in t.switches.iter().enumerate() {
                for (p, port) in sw.ports.iter().enumerate() {
                    assert!(
                        owner.insert(port.local, (Some(i), p)).is_none(),
                        "a socket twice"
                    );
                }
            }
            for (m, link) in t.members.iter().enumerate() {
                owner.insert(link.local, (None, m));
            }
            for sw in &t.switches {
                for port in &sw.ports {
                    let peer_peer = match owner[&port.peer] {
                        (Some(j), q) => t.switches[j].ports[q].peer,
                        (None, m) => t.members[m].leaf,
                    };
                    assert_eq!(peer_peer, port.local, "{l}x{s}x{h}: a link not mirrored");
                }
            }
            // Walk from each member towards every address (up-port 0 where no route).
            let targets: Vec<Addr> = t
                .members
                .iter()
                .map(|m| m.addr)
                .chain(t.switches.iter().map(|s| s.addr))
                .collect();
            for m in &t.members {
                for &dst in &targets {
                    let mut at = m.leaf;
                    let mut hops = 0;
                    loop {
                        let (Some(i), _) = owner[&at] else {
                            panic!("walked into a member")
                        };
                        let sw = &t.switches[i];
                        if sw.addr == dst {
                            break;
                        }
                        let p = sw
                            .routes
                            .iter()
                            .find(|r| r.0 == dst)
                            .map(|r| r.1)
                            .or(sw.up.first().copied())
                            .unwrap_or_else(|| panic!("{dst} unroutable at {}", sw.addr));
                        let peer = sw.ports[p as usize].peer;
                        match owner[&peer] {
                            (None, k) => {
                                assert_eq!(t.members[k].addr, dst, "delivered to the wrong member");
                                break;
                            }
                            _ => at = peer,
                        }
                        hops += 1;
                        assert!(hops <= 4, "{l}x{s}x{h}: a loop towards {dst}");
                    }
                }
            }
        }
    }
}
