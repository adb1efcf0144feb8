//! A Canary tree in network namespaces (issue 27 part 4, short run): a namespace per switch
//! (2 leaves, 2 spines) and per member (4), a veth pair per link with its own /30, no route
//! anywhere but the links themselves (no default route, nothing reaches the machine's
//! interfaces), `tc` rate and queue (tbf) on one leaf-to-spine link, background UDP traffic
//! from the leaf's namespace over that link during the allreduces. The switches are
//! `service-process switch` daemons run with `ip netns exec`; the members are
//! `canary_plane::Plane`s whose sockets this test opens inside each member's namespace (a
//! thread that entered it), so the data crosses the veths and the kernel's queues.
//! Everything is removed at the end, also when the test fails.
//!
//! Needs root and `ip`/`tc`; without them it says so and passes without running.

use std::net::{SocketAddr, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use algorithms::allreduce::{reduce_into, Elem, Op, Reduce};
use algorithms::canary::HostConfig;
use algorithms::sim::rng::Rng;
use service_process::canary_plane::{Plane, PlaneConfig, PlaneEvent};
use service_process::canary_tree::TreePlan;

const H: usize = 4;
const L: usize = 2;
const S: usize = 2;
const PORT: u16 = 7000;

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn must(cmd: &str, args: &[&str]) {
    let st = Command::new(cmd).args(args).status().unwrap();
    assert!(st.success(), "{cmd} {args:?}");
}

/// The namespaces of one run (names carry the pid); removed on drop.
struct Netns {
    names: Vec<String>,
    children: Vec<(u32, Child)>,
}

impl Drop for Netns {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for n in &self.names {
            // Deleting a namespace deletes its veth ends, and so their peers.
            let _ = ip(&["netns", "del", n]);
        }
    }
}

/// Runs `f` on a thread inside namespace `ns` (sockets it opens stay in `ns`).
fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: setns on a valid namespace fd; it changes this thread only.
        let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .unwrap()
}

fn addr(link: usize, end: u8) -> SocketAddr {
    SocketAddr::from(([10, 27, link as u8, end], PORT))
}

#[test]
fn a_namespace_tree_with_a_shaped_congested_link_reduces_exactly() {
    let can = Command::new("ip").args(["netns", "list"]).output().is_ok_and(|o| o.status.success())
        // SAFETY: geteuid has no preconditions.
        && unsafe { libc::geteuid() } == 0
        && Command::new("tc").arg("-V").output().is_ok();
    if !can {
        eprintln!("skipped: needs root, ip netns and tc");
        return;
    }
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("seed {seed}");
    let mut rng = Rng::new(seed);
    let tag = std::process::id();
    let hn = |m: usize| format!("cyh{m}-{tag}");
    let ln = |l: usize| format!("cyl{l}-{tag}");
    let sn = |s: usize| format!("cys{s}-{tag}");
    let mut ns = Netns {
        names: (0..H)
            .map(hn)
            .chain((0..L).map(ln))
            .chain((0..S).map(sn))
            .collect(),
        children: Vec::new(),
    };
    for n in &ns.names {
        must("ip", &["netns", "add", n]);
        must("ip", &["-n", n, "link", "set", "lo", "up"]);
    }
    // Links: member m <-> its leaf on 10.27.m.0/30 (member .1, leaf .2); leaf l <-> spine s
    // on 10.27.(100 + l*S + s).0/30 (leaf .1, spine .2).
    let leaf_of = |m: usize| m * L / H;
    let link =
        |a_ns: &str, a_if: &str, a_ip: SocketAddr, b_ns: &str, b_if: &str, b_ip: SocketAddr| {
            must(
                "ip",
                &[
                    "link", "add", a_if, "netns", a_ns, "type", "veth", "peer", "name", b_if,
                    "netns", b_ns,
                ],
            );
            for (n, i, a) in [(a_ns, a_if, a_ip), (b_ns, b_if, b_ip)] {
                must(
                    "ip",
                    &["-n", n, "addr", "add", &format!("{}/30", a.ip()), "dev", i],
                );
                must("ip", &["-n", n, "link", "set", i, "up"]);
            }
        };
    for m in 0..H {
        link(
            &hn(m),
            "up0",
            addr(m, 1),
            &ln(leaf_of(m)),
            &format!("h{m}"),
            addr(m, 2),
        );
    }
    for l in 0..L {
        for s in 0..S {
            let k = 100 + l * S + s;
            link(
                &ln(l),
                &format!("s{s}"),
                addr(k, 1),
                &sn(s),
                &format!("l{l}"),
                addr(k, 2),
            );
        }
    }
    // The shaped link: leaf 0 towards spine 0, 200 Mbit/s, 5 ms of queue.
    must(
        "tc",
        &[
            "-n",
            &ln(0),
            "qdisc",
            "add",
            "dev",
            "s0",
            "root",
            "tbf",
            "rate",
            "200mbit",
            "burst",
            "32kbit",
            "latency",
            "5ms",
        ],
    );
    // No namespace has a default route; check one.
    let routes = Command::new("ip")
        .args(["-n", &hn(0), "route"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&routes.stdout).contains("default"));

    // The plan, with the addresses in the order two_level asks for them.
    let members: Vec<SocketAddr> = (0..H).map(|m| addr(m, 1)).collect();
    let mut order = Vec::new();
    for l in 0..L {
        order.extend((0..H).filter(|&m| leaf_of(m) == l).map(|m| addr(m, 2)));
    }
    for l in 0..L {
        order.extend((0..S).map(|s| addr(100 + l * S + s, 1)));
    }
    for s in 0..S {
        order.extend((0..L).map(|l| addr(100 + l * S + s, 2)));
    }
    let mut it = order.into_iter();
    let plan = TreePlan::two_level(L, S, &members, || it.next().unwrap());
    for (i, sw) in plan.switches.iter().enumerate() {
        let name = if i < L { ln(i) } else { sn(i - L) };
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &name,
                env!("CARGO_BIN_EXE_service-process"),
                "switch",
            ])
            .args(plan.switch_args(i))
            .args(["--timeout-us", "300", "--queue-kib", "256"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::BufRead;
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.starts_with("READY switch"), "{name}: {line:?}");
        ns.children.push((sw.addr, child));
    }
    let planes: Vec<Plane> = plan
        .members
        .iter()
        .enumerate()
        .map(|(m, link)| {
            let local = link.local;
            let sock = in_ns(&hn(m), move || UdpSocket::bind(local).unwrap());
            Plane::with_socket(
                sock,
                PlaneConfig {
                    local: link.local,
                    leaf: link.leaf,
                    linger: Duration::from_secs(2),
                },
            )
            .unwrap()
        })
        .collect();

    // Background traffic over the shaped link, from leaf 0's namespace to spine 0's side
    // (a port nobody listens on: the spine's kernel drops it), paced at about 150 Mbit/s of
    // the link's 200 (13 datagrams of 1400 bytes a millisecond), during the second half.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut bg = None;
    for i in 0..6u32 {
        if i == 3 {
            let st = stop.clone();
            let bg_ns = ln(0);
            bg = Some(std::thread::spawn(move || {
                in_ns(&bg_ns, move || {
                    let s = UdpSocket::bind("10.27.100.1:0").unwrap();
                    let buf = [0u8; 1400];
                    let mut n = 0u64;
                    while !st.load(std::sync::atomic::Ordering::Relaxed) {
                        for _ in 0..13 {
                            if s.send_to(&buf, "10.27.100.2:9").is_ok() {
                                n += 1;
                            }
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    n
                })
            }));
            std::thread::sleep(Duration::from_millis(100));
        }
        let elem = [Elem::I32, Elem::U64, Elem::F64][i as usize % 3];
        let reduce = Reduce { op: Op::Sum, elem };
        let count = 200_000 + rng.below(50_000) as usize;
        let inputs: Vec<Vec<u8>> = (0..H)
            .map(|_| match elem {
                Elem::F64 => (0..count)
                    .flat_map(|_| ((rng.below(1 << 20) as f64) / 8.0).to_le_bytes())
                    .collect(),
                _ => (0..count * elem.size())
                    .map(|_| rng.next_u64() as u8)
                    .collect(),
            })
            .collect();
        let t0 = Instant::now();
        for (me, p) in planes.iter().enumerate() {
            p.start(
                HostConfig {
                    coll: i,
                    tag: 0xabcdef,
                    reduce,
                    members: (1..=H as u32).collect(),
                    me,
                    len: inputs[me].len(),
                    block_bytes: 1024,
                    window: 32,
                    static_trees: None,
                    retx_timeout: 30_000_000,
                    max_requests: 8,
                    restart_holdoff: 20_000_000,
                    max_attempts: 6,
                    wait_for_late: false,
                },
                inputs[me].clone(),
            );
        }
        let res: Vec<Vec<u8>> = planes
            .iter()
            .enumerate()
            .map(
                |(m, p)| match p.wait(Duration::from_secs(60)).expect("a hang") {
                    PlaneEvent::Done { result, .. } => result,
                    PlaneEvent::Failed { why, .. } => panic!("member {m}: {why}"),
                },
            )
            .collect();
        eprintln!(
            "allreduce {i}: {count} x {elem:?} sum in {:?}{}",
            t0.elapsed(),
            if i >= 3 {
                " (with background traffic)"
            } else {
                ""
            }
        );
        for r in &res[1..] {
            assert!(*r == res[0], "members differ");
        }
        // Sums of f64 values that are multiples of 1/8 below 2^17: exact in any order.
        let mut want = inputs[0].clone();
        for x in &inputs[1..] {
            reduce_into(reduce, &mut want, x).unwrap();
        }
        assert!(res[0] == want, "wrong bytes");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = bg.map(|b| b.join().unwrap()).unwrap_or(0);
    let qd = Command::new("tc")
        .args(["-n", &ln(0), "-s", "qdisc", "show", "dev", "s0"])
        .output()
        .unwrap();
    eprintln!(
        "background datagrams sent: {sent}\n{}",
        String::from_utf8_lossy(&qd.stdout)
    );
    drop(planes);
    for (a, c) in &mut ns.children {
        // SAFETY: kill(2) of our own child (ip netns exec execs the switch in place).
        unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
        let mut out = String::new();
        use std::io::Read;
        c.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        let _ = c.wait();
        let stats = out
            .lines()
            .find(|l| l.starts_with("STATS "))
            .unwrap_or("(none)");
        eprintln!("switch {a} {stats}");
    }
    drop(ns);
    let left = Command::new("ip").args(["netns", "list"]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&left.stdout).contains(&format!("-{tag}")),
        "namespaces left"
    );
}
