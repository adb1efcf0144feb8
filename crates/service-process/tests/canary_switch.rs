//! `service-process switch` as real processes: a 2-leaf / 2-spine Canary tree of switch
//! daemons on loopback UDP, and four SPs' Canary data paths (`canary_plane::Plane`: a UDP
//! socket and a worker thread running the `algorithms::canary::Host` machine, in this test
//! process) reducing random vectors through it, one contribution each.
//!
//! - Results: integer reductions byte-identical to a reference computed here; floating-point
//!   sums the same bits on every host (one result is broadcast) and within the bound of a
//!   different summation order; the leaves' counters show the data was aggregated in them.
//! - Faults: a spine killed mid-allreduce (every host ends in bounded time, correct or with an
//!   error, never a wrong value); both spines killed (every host fails in bounded time);
//!   forged and malformed datagrams into a leaf's port (counted, dropped, no value changed);
//!   a port's full receive buffer (the kernel's drops counted per port).
//!
//! Each test prints its seed; `TEST_SEED=N` replays one (as in the other tests).

use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use algorithms::allreduce::{reduce_into, Elem, Op, Reduce};
use algorithms::canary::{BlockId, Head, HostConfig, Packet};
use algorithms::sim::rng::Rng;
use service_process::canary_plane::{Plane, PlaneConfig, PlaneEvent};
use service_process::canary_tree::TreePlan;

const HOSTS: usize = 4;
const TAG: u64 = 0x5eed_cafe_f00d_0001;

/// The test's seed: `TEST_SEED` if set (to replay one), else the clock; printed.
fn seed() -> u64 {
    common::test_seed()
}

/// `n` sockets on distinct free ports of `ip`, held together (so no two are the same).
fn reserve(ip: &str, n: usize) -> Vec<UdpSocket> {
    (0..n).map(|_| UdpSocket::bind((ip, 0)).unwrap()).collect()
}

fn addr(s: &UdpSocket) -> SocketAddr {
    s.local_addr().unwrap()
}

struct Switch {
    child: Child,
    stats: PathBuf,
}

impl Switch {
    fn stats(&self) -> serde_json::Value {
        // Rewritten at most every 100 ms: wait for a fresh one.
        std::thread::sleep(Duration::from_millis(250));
        serde_json::from_slice(&std::fs::read(&self.stats).unwrap()).unwrap()
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Tree {
    _dir: TempDir,
    /// Leaves, then spines.
    switches: Vec<Switch>,
    /// Each host's (SP's) address on its leaf link, and its socket until a plane takes it.
    hosts: Vec<SocketAddr>,
    host_socks: Vec<Option<UdpSocket>>,
    /// Each host's leaf port address (where a forged datagram goes).
    host_ports: Vec<SocketAddr>,
}

struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn start_switch(dir: &Path, addr: u32, args: Vec<String>) -> Switch {
    let stats = dir.join(format!("switch-{addr}.json"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_service-process"))
        .arg("switch")
        .args(&args)
        .arg("--stats-file")
        .arg(&stats)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    use std::io::BufRead;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("READY switch"), "switch {addr}: {line:?}");
    Switch { child, stats }
}

/// Two leaves, two spines (`canary_tree::TreePlan::two_level`: hosts 1, 2 under leaf 1001,
/// hosts 3, 4 under leaf 1002, spines 2001, 2002). `ip`: a loopback address of the test's own,
/// so that parallel tests never meet.
fn tree(ip: &str, timeout_us: u64) -> Tree {
    tree_with(ip, timeout_us, &[])
}

/// The same, every switch started with `extra` arguments too.
fn tree_with(ip: &str, timeout_us: u64, extra: &[String]) -> Tree {
    let dir = std::env::temp_dir().join(format!(
        "canary-switch-{}-{}",
        std::process::id(),
        rand_u64()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let host_socks = reserve(ip, HOSTS);
    let hosts: Vec<SocketAddr> = host_socks.iter().map(addr).collect();
    // The switch sockets' addresses, reserved together, released just before the switches
    // bind them.
    let held = reserve(ip, 12);
    let mut next = held.iter().map(addr);
    let plan = TreePlan::two_level(2, 2, &hosts, || next.next().unwrap());
    drop(held);
    let switches = (0..plan.switches.len())
        .map(|i| {
            let mut a = plan.switch_args(i);
            a.extend(extra.iter().cloned());
            a.extend(["--timeout-us".into(), timeout_us.to_string()]);
            start_switch(&dir, plan.switches[i].addr, a)
        })
        .collect();
    let host_ports = plan.members.iter().map(|m| m.leaf).collect();
    Tree {
        _dir: TempDir(dir),
        switches,
        hosts,
        host_socks: host_socks.into_iter().map(Some).collect(),
        host_ports,
    }
}

fn rand_u64() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64
}

fn host_cfg(coll: u32, reduce: Reduce, me: usize, len: usize) -> HostConfig {
    HostConfig {
        coll,
        tag: TAG,
        reduce,
        members: (1..=HOSTS as u32).collect(),
        me,
        len,
        block_bytes: 1024,
        window: 32,
        static_trees: None,
        retx_timeout: 30_000_000,
        max_requests: 8,
        retx_backoff: 0,
        restart_holdoff: 20_000_000,
        max_attempts: 6,
        wait_for_late: false,
    }
}

impl Tree {
    /// A Canary plane per host, on its link to its leaf.
    fn planes(&mut self) -> Vec<Plane> {
        (0..HOSTS)
            .map(|h| {
                let cfg = PlaneConfig {
                    local: self.hosts[h],
                    leaf: self.host_ports[h],
                    linger: Duration::from_secs(2),
                };
                match self.host_socks[h].take() {
                    Some(sock) => Plane::with_socket(sock, cfg),
                    None => Plane::new(cfg),
                }
                .unwrap()
            })
            .collect()
    }
}

type Outcome = (Result<Vec<u8>, String>, Duration);

/// Starts one allreduce on every plane; returns each one's outcome and when it came.
fn allreduce(planes: &[Plane], coll: u32, reduce: Reduce, inputs: &[Vec<u8>]) -> Vec<Outcome> {
    allreduce_then(planes, coll, reduce, inputs, || {})
}

fn allreduce_then(
    planes: &[Plane],
    coll: u32,
    reduce: Reduce,
    inputs: &[Vec<u8>],
    meanwhile: impl FnOnce(),
) -> Vec<Outcome> {
    let t0 = Instant::now();
    for (me, p) in planes.iter().enumerate() {
        p.start(
            host_cfg(coll, reduce, me, inputs[me].len()),
            inputs[me].clone(),
        );
    }
    meanwhile();
    planes
        .iter()
        .map(|p| {
            // Far above the machines' own bounds (8 requests x 30 ms per block, 6 attempts):
            // reaching it is a hang.
            let ev = p
                .wait(Duration::from_secs(60))
                .expect("no end within 60 s: a hang");
            let took = t0.elapsed();
            match ev {
                PlaneEvent::Done { coll: c, result } => {
                    assert_eq!(c, coll);
                    (Ok(result), took)
                }
                PlaneEvent::Failed { coll: c, why } => {
                    assert_eq!(c, coll);
                    (Err(why), took)
                }
            }
        })
        .collect()
}

fn random_input(rng: &mut Rng, elem: Elem, count: usize) -> Vec<u8> {
    match elem {
        Elem::F32 => (0..count)
            .flat_map(|_| ((rng.below(2001) as f32 - 1000.0) / 7.0).to_le_bytes())
            .collect(),
        Elem::F64 => (0..count)
            .flat_map(|_| ((rng.below(2_000_001) as f64 - 1e6) / 3.0).to_le_bytes())
            .collect(),
        _ => (0..count * elem.size())
            .map(|_| rng.next_u64() as u8)
            .collect(),
    }
}

fn reference(reduce: Reduce, inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        reduce_into(reduce, &mut acc, x).unwrap();
    }
    acc
}

/// A float sum in another order: |got - ref| <= (n - 1) * eps * sum |x_i| per element.
fn within_bound(reduce: Reduce, inputs: &[Vec<u8>], got: &[u8]) -> bool {
    let want = reference(reduce, inputs);
    if reduce.op != Op::Sum {
        return want == got;
    }
    let n = inputs.len() as f64;
    let (sz, eps) = match reduce.elem {
        Elem::F32 => (4, f32::EPSILON as f64),
        _ => (8, f64::EPSILON),
    };
    let val = |b: &[u8]| -> f64 {
        if sz == 4 {
            f32::from_le_bytes(b.try_into().unwrap()) as f64
        } else {
            f64::from_le_bytes(b.try_into().unwrap())
        }
    };
    (0..got.len() / sz).all(|i| {
        let r = i * sz..(i + 1) * sz;
        let abs: f64 = inputs.iter().map(|x| val(&x[r.clone()]).abs()).sum();
        (val(&got[r.clone()]) - val(&want[r])).abs() <= (n - 1.0) * eps * abs * 2.0
    })
}

fn random_reduce(rng: &mut Rng) -> Reduce {
    loop {
        let elem = Elem::ALL[rng.below(10) as usize];
        // Float products grow past any useful bound: sums, minima and maxima only.
        let op = if elem.is_float() {
            [Op::Sum, Op::Min, Op::Max][rng.below(3) as usize]
        } else {
            Op::ALL[rng.below(10) as usize]
        };
        let r = Reduce { op, elem };
        if r.is_valid() {
            return r;
        }
    }
}

fn check(reduce: Reduce, inputs: &[Vec<u8>], res: &[Outcome]) {
    let got: Vec<&Vec<u8>> = res
        .iter()
        .enumerate()
        .map(|(h, (r, _))| r.as_ref().unwrap_or_else(|e| panic!("host {h}: {e}")))
        .collect();
    for g in &got[1..] {
        assert_eq!(
            *g, got[0],
            "{reduce:?}: hosts differ (one result is broadcast)"
        );
    }
    if reduce.elem.is_float() {
        assert!(
            within_bound(reduce, inputs, got[0]),
            "{reduce:?}: outside the bound"
        );
    } else {
        assert_eq!(
            *got[0],
            reference(reduce, inputs),
            "{reduce:?}: wrong bytes"
        );
    }
}

#[test]
fn random_allreduces_through_switch_daemons_are_exact_and_aggregated_in_the_leaves() {
    let mut rng = Rng::new(seed());
    let mut t = tree("127.0.27.1", 200);
    let planes = t.planes();
    let mut counts = vec![0usize, 1, 3, 255, 1000];
    counts.extend((0..5).map(|_| rng.below(20_000) as usize));
    for (i, &count) in counts.iter().enumerate() {
        let reduce = random_reduce(&mut rng);
        let inputs: Vec<Vec<u8>> = (0..HOSTS)
            .map(|_| random_input(&mut rng, reduce.elem, count))
            .collect();
        eprintln!("allreduce {i}: {count} x {:?} {:?}", reduce.elem, reduce.op);
        let res = allreduce(&planes, 100 + i as u32, reduce, &inputs);
        check(reduce, &inputs, &res);
    }
    let leaves: Vec<_> = t.switches[..2].iter().map(|s| s.stats()).collect();
    for l in &leaves {
        eprintln!("leaf {l}");
        // Two hosts under each leaf, so every block from the other leaf's hosts meets a
        // partner here: data were reduced in the switch, not only forwarded.
        assert!(l["aggregated"].as_u64().unwrap() > l["flushed"].as_u64().unwrap());
        assert_eq!(l["malformed"].as_u64().unwrap(), 0);
    }
    for s in &t.switches[2..] {
        eprintln!("spine {}", s.stats());
    }
}

#[test]
fn forged_and_malformed_datagrams_into_a_leaf_are_counted_and_change_nothing() {
    let mut rng = Rng::new(seed());
    let mut t = tree("127.0.27.2", 200);
    let reduce = Reduce {
        op: Op::Sum,
        elem: Elem::I64,
    };
    let count = 3000;
    let inputs: Vec<Vec<u8>> = (0..HOSTS)
        .map(|_| random_input(&mut rng, reduce.elem, count))
        .collect();
    let coll = 7;
    // From host 1's own socket (the only source its leaf port receives from): two datagrams
    // that are not Canary packets, and well-formed packets of the job's blocks without its
    // tag: reduce packets with junk data for every block (each takes the block's descriptor
    // slot first, flushed after the window and held for --hold-ms (100), so the job's own
    // packets collide there), and a truncated broadcast.
    let h = t.host_socks[0].take().unwrap();
    h.connect(t.host_ports[0]).unwrap();
    h.send(b"not a canary packet").unwrap();
    h.send(
        &Packet::Bcast {
            head: Head {
                id: BlockId {
                    coll,
                    block: 0,
                    attempt: 0,
                },
                tag: TAG,
                dst: 0,
            },
            data: vec![0; 8],
        }
        .encode()[..20],
    )
    .unwrap();
    let blocks = (count * 8).div_ceil(1024) as u32;
    for block in 0..blocks {
        let head = Head {
            id: BlockId {
                coll,
                block,
                attempt: 0,
            },
            tag: TAG ^ 1,
            dst: (block % HOSTS as u32) + 1,
        };
        h.send(
            &Packet::Reduce {
                head,
                counter: 1,
                hosts: 3,
                reduce,
                tree: None,
                data: vec![0xff; 1024.min(count * 8 - block as usize * 1024)],
            }
            .encode(),
        )
        .unwrap();
    }
    // And from a socket that is not the port's peer: never received.
    let stranger = UdpSocket::bind("127.0.0.1:0").unwrap();
    stranger
        .send_to(b"from a stranger", t.host_ports[0])
        .unwrap();
    // The forged packets sit in the leaf's table (and went on to the leaders, who ignore
    // another tag) before the job's arrive.
    std::thread::sleep(Duration::from_millis(10));
    t.host_socks[0] = Some(h);
    let planes = t.planes();
    let res = allreduce(&planes, coll, reduce, &inputs);
    check(reduce, &inputs, &res);
    let leaf = t.switches[0].stats();
    eprintln!("leaf 1001 {leaf}");
    assert_eq!(leaf["ports"][0]["malformed"].as_u64().unwrap(), 2, "{leaf}");
    assert_eq!(leaf["malformed"].as_u64().unwrap(), 2, "{leaf}");
    assert!(
        leaf["collisions"].as_u64().unwrap() > 0,
        "the forged descriptors were met: {leaf}"
    );
}

#[test]
fn packets_dropped_by_every_switch_still_give_exact_results_on_every_host() {
    let seed = seed();
    let mut rng = Rng::new(seed);
    // 2 % of every switch's sends lost: most blocks cross 3 or 4 lossy hops each way.
    let extra = [
        "--drop-rate".to_string(),
        "0.02".into(),
        "--seed".into(),
        seed.to_string(),
    ];
    let mut t = tree_with("127.0.27.5", 200, &extra);
    let planes = t.planes();
    for i in 0..3 {
        let reduce = random_reduce(&mut rng);
        let count = rng.below(40_000) as usize;
        let inputs: Vec<Vec<u8>> = (0..HOSTS)
            .map(|_| random_input(&mut rng, reduce.elem, count))
            .collect();
        eprintln!("allreduce {i}: {count} x {:?} {:?}", reduce.elem, reduce.op);
        let res = allreduce(&planes, 200 + i, reduce, &inputs);
        check(reduce, &inputs, &res);
    }
    let drops: u64 = t
        .switches
        .iter()
        .map(|s| s.stats()["injected_drops"].as_u64().unwrap())
        .sum();
    eprintln!("packets dropped by the switches: {drops}");
    assert!(drops > 0, "no loss was injected");
}

/// Kills `kill` switches `after` into a 4 MiB allreduce; returns each host's outcome.
fn allreduce_with_kills(ip: &str, kill: &[usize], after: Duration) {
    let mut rng = Rng::new(seed());
    let mut t = tree(ip, 200);
    let reduce = Reduce {
        op: Op::Sum,
        elem: Elem::U32,
    };
    let count = 1 << 20;
    let inputs: Vec<Vec<u8>> = (0..HOSTS)
        .map(|_| random_input(&mut rng, reduce.elem, count))
        .collect();
    let want = reference(reduce, &inputs);
    let planes = t.planes();
    let switches = &mut t.switches;
    let res = allreduce_then(&planes, 9, reduce, &inputs, || {
        std::thread::sleep(after);
        for &k in kill {
            switches[k].child.kill().unwrap();
            eprintln!("killed switch {k} at {after:?}");
        }
    });
    let mut ok = 0;
    for (h, (r, took)) in res.iter().enumerate() {
        match r {
            Ok(v) => {
                assert!(*v == want, "host {h}: a wrong value after a switch died");
                ok += 1;
                eprintln!("host {h}: correct result in {took:?}");
            }
            Err(e) => eprintln!("host {h}: error in {took:?}: {e}"),
        }
    }
    if kill.len() == 2 {
        // No path between the leaves any more: nobody can have every block.
        assert_eq!(ok, 0, "a result without any spine");
    }
}

#[test]
fn a_spine_killed_mid_allreduce_ends_every_host_in_bounded_time_without_a_wrong_value() {
    allreduce_with_kills("127.0.27.3", &[2], Duration::from_millis(30));
}

#[test]
fn both_spines_killed_fail_every_host_in_bounded_time() {
    allreduce_with_kills("127.0.27.4", &[2, 3], Duration::from_millis(30));
}

/// `service-process canary-tree` (quick use): starts a 2+2 tree, writes its plan; members
/// built from the plan reduce through it; at SIGTERM every switch's counters are printed.
#[test]
fn canary_tree_command_starts_a_tree_that_reduces_and_prints_every_switchs_counters() {
    let mut rng = Rng::new(seed());
    let dir = std::env::temp_dir().join(format!("canary-tree-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let _clean = TempDir(dir.clone());
    let plan_path = dir.join("plan.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_service-process"))
        .args(["canary-tree", "--switches", "2+2", "--members", "4"])
        .args(["--ip", "127.0.27.6", "--plan"])
        .arg(&plan_path)
        .args(["--", "--timeout-us", "300"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::{BufRead, Read};
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "READY canary-tree switches=4");
    let plan: TreePlan = serde_json::from_slice(&std::fs::read(&plan_path).unwrap()).unwrap();
    let planes: Vec<Plane> = plan
        .members
        .iter()
        .map(|m| {
            Plane::new(PlaneConfig {
                local: m.local,
                leaf: m.leaf,
                linger: Duration::from_secs(2),
            })
            .unwrap()
        })
        .collect();
    let reduce = random_reduce(&mut rng);
    let count = rng.below(30_000) as usize;
    let inputs: Vec<Vec<u8>> = (0..HOSTS)
        .map(|_| random_input(&mut rng, reduce.elem, count))
        .collect();
    eprintln!("{count} x {:?} {:?}", reduce.elem, reduce.op);
    let res = allreduce(&planes, 1, reduce, &inputs);
    check(reduce, &inputs, &res);
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    assert!(child.wait().unwrap().success());
    let stats: Vec<serde_json::Value> = rest
        .lines()
        .filter_map(|l| l.split_once(" STATS "))
        .map(|(_, j)| serde_json::from_str(j).unwrap())
        .collect();
    assert_eq!(stats.len(), 4, "{rest}");
    let rx: u64 = stats.iter().map(|s| s["rx"].as_u64().unwrap()).sum();
    assert!(count == 0 || rx > 0, "{rest}");
}

/// A port's receive buffer that overflows is counted (`rcvbuf_drops`, the kernel's
/// `SO_RXQ_OVFL`): with the switch stopped (SIGSTOP) and its buffer at the minimum, a burst
/// from the port's peer overflows it; after SIGCONT every datagram sent is either received
/// (here all malformed, so counted as such) or counted as dropped.
#[test]
fn a_full_receive_buffer_is_counted_per_port() {
    let ip = "127.0.27.9";
    let dir = std::env::temp_dir().join(format!(
        "canary-switch-{}-{}",
        std::process::id(),
        rand_u64()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let _dir = TempDir(dir.clone());
    let peer = UdpSocket::bind((ip, 0)).unwrap();
    let port = addr(&reserve(ip, 1).remove(0));
    let sw = start_switch(
        &dir,
        1001,
        vec![
            "--addr=1001".into(),
            format!("--port=0={port},{}", addr(&peer)),
            "--rcvbuf-kib=1".into(),
        ],
    );
    peer.connect(port).unwrap();
    let pid = sw.child.id() as libc::pid_t;
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let burst = 500u64;
    let junk = [0u8; 1000];
    for _ in 0..burst {
        peer.send(&junk).unwrap();
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    std::thread::sleep(Duration::from_millis(100));
    // One more, after the buffer drained: it carries the count of every drop before it.
    peer.send(&junk).unwrap();
    let mut s = sw.stats();
    for _ in 0..20 {
        if s["rx"].as_u64().unwrap() + s["rcvbuf_drops"].as_u64().unwrap() == burst + 1 {
            break;
        }
        s = sw.stats();
    }
    let p = &s["ports"][0];
    let (rx, drops) = (
        p["rx"].as_u64().unwrap(),
        p["rcvbuf_drops"].as_u64().unwrap(),
    );
    eprintln!("{burst} + 1 sent: {rx} received, {drops} dropped by the kernel");
    assert!(drops > 0, "a 1 KiB buffer held {burst} datagrams? {s}");
    assert_eq!(rx + drops, burst + 1, "{s}");
    assert_eq!(p["malformed"].as_u64().unwrap(), rx, "{s}");
    assert_eq!(s["rcvbuf_drops"].as_u64().unwrap(), drops, "{s}");
}
