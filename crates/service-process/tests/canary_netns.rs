//! A Canary tree in network namespaces (issue 27 part 4, short run): a namespace per switch
//! (2 leaves, 2 spines) and per member (4), a veth pair per link with its own /30, no route
//! anywhere but the links themselves (no default route, nothing reaches the machine's
//! interfaces), `tc` rate and queue (tbf) on one leaf-to-spine link, background UDP traffic
//! from the leaf's namespace over that link during the allreduces. The switches are
//! `service-process switch` daemons run with `ip netns exec`; the members are
//! `canary_plane::Plane`s whose sockets this test opens inside each member's namespace (a
//! thread that entered it), so the data crosses the veths and the kernel's queues. The tree is
//! `service_process::canary_netns`'s, as `canary-tree --netns` builds it.
//! Everything is removed at the end, also when the test fails.
//!
//! Needs root and `ip`/`tc`; without them it says so and passes without running.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use algorithms::allreduce::{reduce_into, Elem, Op, Reduce};
use algorithms::canary::HostConfig;
use algorithms::sim::rng::Rng;
use service_process::canary_netns::{bind_in, NetnsTree};
use service_process::canary_plane::{Plane, PlaneConfig, PlaneEvent};

const H: usize = 4;
const L: usize = 2;
const S: usize = 2;

/// The tree's switches (killed on drop, before the namespaces go with the tree).
struct Switches(Vec<(u32, Child)>);

impl Drop for Switches {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Root, `ip netns` and `tc` are here; says so when not (the test then passes without running).
fn can_build_trees() -> bool {
    let can = Command::new("ip").args(["netns", "list"]).output().is_ok_and(|o| o.status.success())
        // SAFETY: geteuid has no preconditions.
        && unsafe { libc::geteuid() } == 0
        && Command::new("tc").arg("-V").output().is_ok();
    if !can {
        eprintln!("skipped: needs root, ip netns and tc");
    }
    can
}

#[test]
fn a_namespace_tree_with_a_shaped_congested_link_reduces_exactly() {
    if !can_build_trees() {
        return;
    }
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("seed {seed}");
    let mut rng = Rng::new(seed);
    let tag = std::process::id();
    let mut tree = NetnsTree::build(&format!("cyt{tag}"), L, S, H).unwrap();
    // The shaped link: leaf 0 towards spine 0, 200 Mbit/s, 5 ms of queue.
    tree.shape("200mbit").unwrap();
    // No namespace has a default route; check one.
    let routes = Command::new("ip")
        .args(["-n", &tree.names[0], "route"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&routes.stdout).contains("default"));
    let plan = tree.plan.clone();
    let mut switches = Switches(Vec::new());
    for (i, sw) in plan.switches.iter().enumerate() {
        let name = &plan.switch_netns[i];
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                name,
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
        switches.0.push((sw.addr, child));
    }
    let planes: Vec<Plane> = plan
        .members
        .iter()
        .enumerate()
        .map(|(m, link)| {
            let sock = bind_in(&plan.member_netns[m], link.local).unwrap();
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
    // (a port nobody listens on: the spine's kernel drops it), at about 150 Mbit/s of the
    // link's 200, during the second half.
    for i in 0..6u32 {
        if i == 3 {
            tree.background(150).unwrap();
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
                    retx_backoff: 0,
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
    let sent = tree.stop_background();
    eprintln!("background datagrams sent: {sent}\n{}", tree.shaped_stats());
    drop(planes);
    for (a, c) in &mut switches.0 {
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
    drop(switches);
    drop(tree);
    let left = Command::new("ip").args(["netns", "list"]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&left.stdout).contains(&format!("-{tag}")),
        "namespaces left"
    );
}

/// `--qdisc-load`'s reader (`service_process::qdisc`) inside the tree's leaf 0: the shaped
/// device `s0` has a root `tbf` with its limit, and background traffic above the link's rate
/// leaves a backlog in it that the reader sees (what a switch adds to the port's load; its
/// own socket's send queue does not hold these packets).
#[test]
fn the_qdisc_reader_sees_the_shaped_links_limit_and_backlog() {
    if !can_build_trees() {
        return;
    }
    let tag = std::process::id();
    let mut tree = NetnsTree::build(&format!("cyq{tag}"), L, S, H).unwrap();
    tree.shape("20mbit").unwrap();
    let leaf = tree.leaf(0).to_string();
    let s0 = service_process::canary_netns::link_addr(100, 1).ip();
    let read = |leaf: &str| {
        service_process::canary_netns::in_netns(leaf, move || {
            let i = service_process::qdisc::ifindex_of(s0).expect("s0's index");
            let mut r = service_process::qdisc::QdiscReader::new().unwrap();
            r.read().unwrap().remove(&i).expect("s0 has a root qdisc")
        })
        .unwrap()
    };
    let idle = read(&leaf);
    assert_eq!(idle.kind, "tbf", "{idle:?}");
    let limit = idle.limit.expect("a tbf's limit");
    // 5 ms at 20 Mbit/s is 12.5 kB, plus the burst: tc's limit is in that range.
    assert!((10_000..100_000).contains(&limit), "{idle:?}");
    assert_eq!(idle.backlog, 0, "{idle:?}");
    // 60 Mbit/s into a 20 Mbit/s link: the tbf queues up to its limit.
    tree.background(60).unwrap();
    let mut most = 0;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(10));
        let q = read(&leaf);
        assert!(q.backlog <= limit + 1500, "{q:?}");
        most = most.max(q.backlog);
    }
    let sent = tree.stop_background();
    eprintln!("limit {limit}, largest backlog read {most}, {sent} datagrams sent");
    assert!(
        most > limit / 2,
        "the reader never saw the queue: {most} of {limit}"
    );
}
