//! A two-level Canary tree in network namespaces on one machine (issue 27 part 4): a namespace
//! per switch and per member (an SP's "DPU" end of its link), a veth pair per link with its
//! own /30 (member `m` to its leaf on 10.27.m.0/30, leaf `l` to spine `s` on
//! 10.27.(100 + l * S + s).0/30), no route but the links themselves (no default route, no
//! NAT: nothing reaches the machine's interfaces). The data then cross the veths and the
//! kernel's queues; `tc` shapes a link ([`NetnsTree::shape`]) so that congestion and drops
//! come from the kernel, and [`NetnsTree::background`] sends traffic over it.
//!
//! The switches run inside their namespaces (`ip netns exec`); a member's socket is opened by
//! a thread that entered the member's namespace ([`in_netns`]): a socket stays in the
//! namespace it was made in, so an SP outside it (on the machine's loopback, with its peers)
//! still sends and receives on the link. Everything is removed when the [`NetnsTree`] is
//! dropped. Needs root, `ip` and `tc`.

use std::net::{SocketAddr, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::canary_tree::TreePlan;

/// The UDP port of every socket of the tree (each on an address of its own).
pub const PORT: u16 = 7000;

/// Address `end` (1 or 2) of link `link`'s /30.
pub fn link_addr(link: usize, end: u8) -> SocketAddr {
    SocketAddr::from(([10, 27, link as u8, end], PORT))
}

fn run(cmd: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd}"))?;
    if !out.status.success() {
        bail!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Runs `f` on a thread inside network namespace `ns` (`/run/netns/NS`): sockets it opens
/// stay there.
pub fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    use std::os::fd::AsRawFd;
    let path = format!("/run/netns/{ns}");
    let file = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    std::thread::spawn(move || {
        // SAFETY: setns(2) on a valid namespace fd; it changes this thread only.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(anyhow::anyhow!(
                "entering {path}: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(f())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the thread in {ns} panicked"))?
}

/// A UDP socket bound to `local` inside namespace `ns`, made on a thread of its own.
pub fn bind_in(ns: &str, local: SocketAddr) -> Result<UdpSocket> {
    in_netns(ns, move || UdpSocket::bind(local))?
        .with_context(|| format!("binding {local} in {ns}"))
}

/// [`bind_in`] on the calling thread, which enters `ns` and comes back to its own namespace:
/// for a process that must stay single-threaded (the SP before it drops its capabilities:
/// entering a namespace needs `CAP_SYS_ADMIN`, which it does not keep).
pub fn bind_in_here(ns: &str, local: SocketAddr) -> Result<UdpSocket> {
    use std::os::fd::AsRawFd;
    let own = std::fs::File::open("/proc/thread-self/ns/net").context("this thread's netns")?;
    let path = format!("/run/netns/{ns}");
    let target = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    // SAFETY: setns(2) on a valid namespace fd; it changes this thread only.
    if unsafe { libc::setns(target.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("entering {path}: {}", std::io::Error::last_os_error());
    }
    let sock = UdpSocket::bind(local);
    // SAFETY: as above, back to the namespace this thread was in.
    if unsafe { libc::setns(own.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        // A process left in the wrong namespace must not go on.
        panic!(
            "cannot return to this thread's network namespace: {}",
            std::io::Error::last_os_error()
        );
    }
    sock.with_context(|| format!("binding {local} in {ns}"))
}

/// The namespaces and links of one tree; see the module docs.
pub struct NetnsTree {
    /// Members first, then leaves, then spines.
    pub names: Vec<String>,
    pub leaves: usize,
    pub spines: usize,
    pub members: usize,
    pub plan: TreePlan,
    background: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>, Arc<AtomicU64>)>,
}

impl NetnsTree {
    /// Builds the namespaces and links of `leaves` leaves, `spines` spines and `members`
    /// members, named `PREFIX-hM`, `PREFIX-lL`, `PREFIX-sS`, and the plan of the tree on
    /// them (every switch's ports, each member's link; `TreePlan::netns` names the
    /// namespaces).
    pub fn build(prefix: &str, leaves: usize, spines: usize, members: usize) -> Result<NetnsTree> {
        if members < leaves || leaves == 0 || spines == 0 {
            bail!("{members} members for {leaves} leaves and {spines} spines");
        }
        if members > 99 || leaves * spines > 150 {
            bail!("a namespace tree has at most 99 members and 150 leaf-spine links");
        }
        let h = format!("{prefix}-h");
        let names: Vec<String> = (0..members)
            .map(|m| format!("{h}{m}"))
            .chain((0..leaves).map(|l| format!("{prefix}-l{l}")))
            .chain((0..spines).map(|s| format!("{prefix}-s{s}")))
            .collect();
        // The plan, with the addresses in the order `two_level` asks for them.
        let leaf_of = |m: usize| m * leaves / members;
        let member_socks: Vec<SocketAddr> = (0..members).map(|m| link_addr(m, 1)).collect();
        let mut order = Vec::new();
        for l in 0..leaves {
            order.extend(
                (0..members)
                    .filter(|&m| leaf_of(m) == l)
                    .map(|m| link_addr(m, 2)),
            );
        }
        for l in 0..leaves {
            order.extend((0..spines).map(|s| link_addr(100 + l * spines + s, 1)));
        }
        for s in 0..spines {
            order.extend((0..leaves).map(|l| link_addr(100 + l * spines + s, 2)));
        }
        let mut it = order.into_iter();
        let mut plan = TreePlan::two_level(leaves, spines, &member_socks, || {
            it.next().expect("an address per port")
        });
        plan.member_netns = names[..members].to_vec();
        plan.switch_netns = names[members..].to_vec();
        let mut tree = NetnsTree {
            names: Vec::new(),
            leaves,
            spines,
            members,
            plan,
            background: None,
        };
        for n in &names {
            run("ip", &["netns", "add", n])?;
            tree.names.push(n.clone());
            run("ip", &["-n", n, "link", "set", "lo", "up"])?;
        }
        let link =
            |a_ns: &str, a_if: &str, a: SocketAddr, b_ns: &str, b_if: &str, b: SocketAddr| {
                run(
                    "ip",
                    &[
                        "link", "add", a_if, "netns", a_ns, "type", "veth", "peer", "name", b_if,
                        "netns", b_ns,
                    ],
                )?;
                for (n, i, x) in [(a_ns, a_if, a), (b_ns, b_if, b)] {
                    run(
                        "ip",
                        &["-n", n, "addr", "add", &format!("{}/30", x.ip()), "dev", i],
                    )?;
                    run("ip", &["-n", n, "link", "set", i, "up"])?;
                }
                anyhow::Ok(())
            };
        for m in 0..members {
            link(
                &names[m],
                "up0",
                link_addr(m, 1),
                &names[members + leaf_of(m)],
                &format!("h{m}"),
                link_addr(m, 2),
            )?;
        }
        for l in 0..leaves {
            for s in 0..spines {
                let k = 100 + l * spines + s;
                link(
                    &names[members + l],
                    &format!("s{s}"),
                    link_addr(k, 1),
                    &names[members + leaves + s],
                    &format!("l{l}"),
                    link_addr(k, 2),
                )?;
            }
        }
        Ok(tree)
    }

    /// Namespace of leaf `l`.
    pub fn leaf(&self, l: usize) -> &str {
        &self.names[self.members + l]
    }

    /// Shapes leaf 0's link to spine 0 (its device `s0`) with a token bucket of `rate` (a
    /// `tc` rate, e.g. `200mbit`) and 5 ms of queue: beyond it the kernel queues, then drops.
    pub fn shape(&self, rate: &str) -> Result<()> {
        run(
            "tc",
            &[
                "-n",
                self.leaf(0),
                "qdisc",
                "add",
                "dev",
                "s0",
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "32kbit",
                "latency",
                "5ms",
            ],
        )
    }

    /// The shaped link's queue counters (`tc -s qdisc show`).
    pub fn shaped_stats(&self) -> String {
        Command::new("tc")
            .args(["-n", self.leaf(0), "-s", "qdisc", "show", "dev", "s0"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    /// Starts background traffic over leaf 0's link to spine 0: 1400-byte UDP datagrams from
    /// leaf 0's namespace to a port nobody listens on at spine 0's end, paced at `mbit`
    /// Mbit/s, until [`NetnsTree::stop_background`] or the drop.
    pub fn background(&mut self, mbit: u32) -> Result<()> {
        let ns = self.leaf(0).to_string();
        let from = SocketAddr::new(link_addr(100, 1).ip(), 0);
        let to = SocketAddr::new(link_addr(100, 2).ip(), 9);
        let sock = in_netns(&ns, move || UdpSocket::bind(from))?
            .with_context(|| format!("binding {from} in {ns}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let (st, n) = (stop.clone(), sent.clone());
        // Datagrams per millisecond for `mbit`.
        let per_ms = (u64::from(mbit) * 1_000_000 / 8 / 1400 / 1000).max(1);
        let t = std::thread::Builder::new()
            .name("canary-background".into())
            .spawn(move || {
                let buf = [0u8; 1400];
                while !st.load(Ordering::Relaxed) {
                    for _ in 0..per_ms {
                        if sock.send_to(&buf, to).is_ok() {
                            n.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            })?;
        self.background = Some((stop, t, sent));
        Ok(())
    }

    /// Stops the background traffic; the datagrams it sent.
    pub fn stop_background(&mut self) -> u64 {
        match self.background.take() {
            Some((stop, t, sent)) => {
                stop.store(true, Ordering::Relaxed);
                let _ = t.join();
                sent.load(Ordering::Relaxed)
            }
            None => 0,
        }
    }
}

impl Drop for NetnsTree {
    fn drop(&mut self) {
        self.stop_background();
        for n in &self.names {
            // Deleting a namespace deletes its veth ends, and so their peers.
            let _ = run("ip", &["netns", "del", n]);
        }
    }
}
