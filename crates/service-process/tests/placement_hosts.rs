//! What a rank needs to decide at `MPI_Init` (issue 25), below the shim (which the mpirun
//! jobs of `tests/tests/backends_init.rs` cover):
//!
//! - real SPs answer a registration with the grant backends they serve that connection:
//!   `cma` to a Unix peer or a TCP host on their kernel (`--hosts-same-kernel`), `ucx` when
//!   UCX is on (`--ucx`), whatever else;
//! - the placement every rank computes refuses a layout (a description without `hosts`) for
//!   ranks whose host names differ, and only then.

mod common;
mod tcp;

use alias_mkey::host::Registrar;
use alias_mkey::Rights;
use bootstrap::auth::JobCredential;
use bootstrap::cluster::Layout;
use bootstrap::mailbox;
use bootstrap::placement::{host_hash, place_ranks, NodeReport, NodeSource};
use bootstrap::wire::{Channel, Hello, HostHello, Serves, SpToHost};
use common::{new_job, register, test_seed, Rng, SLOTS};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;
use tcp::TcpSps;

fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_service-process"))
}

fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Says hello as world rank `rank` (pid: this process) and registers `slots` slots; what the
/// SP says it serves this connection.
fn serves_to<S: Read + Write>(mut ch: Channel<S>, cred: &str, rank: u32, slots: u32) -> Serves {
    ch.send_hello(&Hello::Host(HostHello {
        credential: cred.to_string(),
        world_rank: rank,
        world_size: 2,
        node: 0,
        local_rank: rank,
        pid: std::process::id(),
    }))
    .unwrap();
    assert_eq!(ch.recv_hello().unwrap(), Hello::Welcome { sp: 0 });
    // Leaked: the SP may write the mailbox until it sees this connection go.
    let mailbox: &'static [u64] =
        Box::leak(vec![0u64; (SLOTS as u64 * mailbox::SLOT_BYTES / 8) as usize].into_boxed_slice());
    let grant = Registrar::new().register(
        mailbox.as_ptr() as u64,
        SLOTS as u64 * mailbox::SLOT_BYTES,
        Rights::READ_WRITE,
    );
    match register(&mut ch, grant, slots) {
        SpToHost::Registered { sp: 0, serves, .. } => serves,
        other => panic!("rank {rank}: register answered with {other:?}"),
    }
}

/// An SP with UCX on or off, its hosts over TCP on its kernel or not (both at random, each
/// combination once in a random order): a Unix peer is served `cma`, a TCP host `cma` only
/// on the SP's kernel, and both `ucx` (and `ucx-export`) exactly when UCX is on.
#[test]
fn the_registration_lists_the_grant_backends_the_sp_serves() {
    let seed = test_seed();
    let mut rng = Rng(seed);
    let mut cases: Vec<(bool, bool)> =
        vec![(true, true), (true, false), (false, true), (false, false)];
    for i in (1..cases.len()).rev() {
        cases.swap(i, rng.below(i as u64 + 1) as usize);
    }
    for (ucx, same_kernel) in cases {
        eprintln!(
            "--ucx={} --hosts-same-kernel: {same_kernel}",
            if ucx { "on" } else { "off" }
        );
        let mut args = vec![if ucx { "--ucx=on" } else { "--ucx=off" }];
        if same_kernel {
            args.push("--hosts-same-kernel");
        }
        let mut sps = TcpSps::describe(&exe(), 1, 1, 2);
        sps.start_all(&args);
        let cred = JobCredential::issue(&sps.key, new_job(), uid(), 2).encode();
        let want = |cma| Serves {
            cma,
            ucx,
            ucx_export: ucx,
        };

        let unix = UnixStream::connect(&sps.cluster.sps[0].host_socket).unwrap();
        unix.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        assert_eq!(serves_to(Channel::new(unix), &cred, 0, SLOTS), want(true));

        let tcp = TcpStream::connect(sps.host_addr(0)).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // A host the SP cannot attach to registers no mailbox.
        let slots = if same_kernel { SLOTS } else { 0 };
        let got = serves_to(Channel::new(tcp), &cred, 1, slots);
        assert_eq!(got, want(same_kernel));
        if !ucx && !same_kernel {
            assert_eq!(got.to_string(), "no grant backend");
        }
        let stats = sps.stop_and_stats();
        assert_eq!(stats[0]["errors_sent"], 0, "{}", stats[0]);
    }
}

fn report(node: u32, source: NodeSource, host: &str) -> NodeReport {
    NodeReport {
        node: Some(node),
        machine: 0,
        source,
        host: if host.is_empty() { 0 } else { host_hash(host) },
    }
}

/// Random jobs (2..=12 ranks on 1..=3 host names) placed by a description's layout: refused
/// exactly when two ranks' host names differ, naming rank 0 and the first rank on another
/// host; placed by host name or by `SPOFF_NODE` hints, the same jobs are accepted. A rank
/// without a host name does not count.
#[test]
fn a_layout_places_the_ranks_of_one_host_only() {
    let seed = test_seed();
    let mut rng = Rng(seed);
    for case in 0..200 {
        let size = 2 + rng.below(11) as u32;
        let names = 1 + rng.below(3);
        let nodes = 1 + rng.below(3) as u32;
        let mut cluster = bootstrap::testing::cluster(nodes, 1, Layout::Block, &[]);
        let hosts: Vec<String> = (0..size)
            .map(|_| format!("h{}", rng.below(names)))
            .collect();
        let placed_by = |source| -> Vec<NodeReport> {
            (0..size)
                .map(|r| {
                    let node = cluster.placement(r, size).unwrap().node;
                    report(node, source, &hosts[r as usize])
                })
                .collect()
        };
        let got = place_ranks(&cluster, &placed_by(NodeSource::Layout));
        match hosts.iter().position(|h| *h != hosts[0]) {
            None => {
                let p = got.unwrap_or_else(|e| panic!("seed {seed} case {case}: {e}"));
                for r in 0..size {
                    assert_eq!(p[r as usize], cluster.placement(r, size).unwrap());
                }
            }
            Some(other) => {
                let e = got.expect_err(&format!("seed {seed} case {case}: {hosts:?}"));
                assert!(
                    e.contains("the cluster description names no hosts")
                        && e.contains(&format!("world ranks 0 and {other} run on two hosts"))
                        && e.contains("list the nodes' host names"),
                    "seed {seed} case {case}: {e}"
                );
            }
        }
        // Hints are the emulation's word: any host names.
        assert!(place_ranks(&cluster, &placed_by(NodeSource::Hint)).is_ok());
        // Host names that name the nodes (one machine each, as MPI would say).
        cluster.hosts = (0..nodes).map(|n| format!("h{n}")).collect();
        let by_name: Vec<NodeReport> = (0..size)
            .map(|_| {
                let n = (rng.below(nodes as u64)) as u32;
                NodeReport {
                    machine: n,
                    ..report(n, NodeSource::HostName, &format!("h{n}"))
                }
            })
            .collect();
        assert!(
            place_ranks(&cluster, &by_name).is_ok(),
            "seed {seed} case {case}"
        );
    }
    // A rank whose host name is unknown is not counted.
    let c = bootstrap::testing::cluster(2, 1, Layout::Block, &[]);
    let reps = [
        report(0, NodeSource::Layout, "a"),
        report(0, NodeSource::Layout, ""),
        report(1, NodeSource::Layout, "a"),
    ];
    assert!(place_ranks(&c, &reps).is_ok());
}
