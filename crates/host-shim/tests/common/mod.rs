//! Test helpers: building the C check program, running it under `mpirun` with the shim
//! preloaded, and a stand-in SP for the host side of the protocol.
//!
//! The stand-in ([`MockSp`]) is not the service process: it only speaks the host protocol
//! (hello, register, posts, mailbox completions) and performs each alltoallv once every member
//! has posted, with real `process_vm_readv/writev` copies between the real rank processes
//! (through `alias_mkey`'s CMA mover, so every access is checked against the grants the shim
//! sent). Every SP of the cluster is served from this one test process, so "SP to SP" is a
//! shared map. It exists to test the shim's side (descriptors, grants, mailbox tokens, the
//! Wait/Test family, failure handling) before and independently of the real SP.
#![allow(dead_code)]

use alias_mkey::mover::{CmaMover, Mover};
use alias_mkey::{AliasKey, Owner, Rights};
use bootstrap::cluster::{Cluster, Layout, SpEntry};
use bootstrap::mailbox::{self, SLOT_BYTES, STATUS_OFFSET, TOKEN_OFFSET};
use bootstrap::wire::{Channel, Hello, HostToSp, PostDesc, SpToHost};
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Only one `mpirun` at a time (the machine has few cores).
pub static SERIAL: Mutex<()> = Mutex::new(());

pub fn have_mpi() -> bool {
    let ok = |c: &str| {
        Command::new(c)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    ok("mpicc") && ok("mpirun")
}

/// A scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("host-shim-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The preloaded library: cargo builds the cdylib for the test run into `deps/`, next to the
/// test binary (it copies it up to the profile directory only for `cargo build`).
pub fn shim_path() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let so = [
        deps.join("libhost_shim.so"),
        deps.parent().unwrap().join("libhost_shim.so"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .expect("libhost_shim.so was not built next to the test binary");
    so
}

pub fn build_check_prog(dir: &Path) -> PathBuf {
    build_prog(dir, "a2a_check")
}

/// Compiles `tests/progs/<name>.c` with `mpicc` into `dir`.
pub fn build_prog(dir: &Path, name: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/progs/{name}.c"));
    let out = dir.join(name);
    let st = Command::new("mpicc")
        .args(["-O1", "-Wall", "-pthread", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .unwrap();
    assert!(st.success(), "mpicc failed on {}", src.display());
    out
}

/// A cluster of `nodes` nodes with `k` SPs each, sockets in `dir`.
pub fn cluster(dir: &Path, nodes: u32, k: u32) -> (Cluster, PathBuf) {
    let sps = (0..nodes * k)
        .map(|i| SpEntry {
            id: i,
            node: i / k,
            index: i % k,
            peer_addr: format!("127.0.0.1:{}", 1 + i).parse().unwrap(),
            host_socket: dir.join(format!("sp{i}.sock")),
        })
        .collect();
    let c = Cluster::new(nodes, k, None, Layout::Block, sps).unwrap();
    let path = dir.join("cluster.json");
    c.save(&path).unwrap();
    (c, path)
}

/// Runs `prog args` on `np` ranks with the shim preloaded and `env` exported.
pub fn mpirun(
    np: u32,
    prog: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    timeout: Duration,
) -> Output {
    let mut cmd = Command::new("mpirun");
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .args([
            "--oversubscribe",
            "--bind-to",
            "none",
            "-np",
            &np.to_string(),
        ]);
    cmd.arg("-x")
        .arg(format!("LD_PRELOAD={}", shim_path().display()));
    for k in [
        "SPOFF_CLUSTER",
        "SPOFF_OFFLOAD",
        "SPOFF_JOB_ID",
        "SPOFF_VERBOSE",
        "SPOFF_MAILBOX_SLOTS",
    ] {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v).arg("-x").arg(k);
    }
    cmd.arg(prog).args(args);
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let done = Arc::new(AtomicBool::new(false));
    let d2 = done.clone();
    let watchdog = std::thread::spawn(move || {
        let start = Instant::now();
        while !d2.load(Ordering::Acquire) {
            if start.elapsed() > timeout {
                // SAFETY: signalling the mpirun we started.
                unsafe { libc::kill(pid as i32, libc::SIGTERM) };
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    });
    let out = child.wait_with_output().unwrap();
    done.store(true, Ordering::Release);
    let timed_out = watchdog.join().unwrap();
    assert!(
        !timed_out,
        "mpirun did not finish within {timeout:?}\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// What the stand-in SP does.
#[derive(Clone, Copy, Debug)]
pub enum Behaviour {
    Serve,
    /// Closes every host connection once this many posts have arrived (an SP crash).
    DieAfterPosts(usize),
}

struct Instance {
    /// Per comm rank: (owner, mailbox grant of that rank, the post).
    posts: Vec<Option<(Owner, alias_mkey::Grant, PostDesc)>>,
}

#[derive(Default)]
struct Shared {
    instances: HashMap<(u32, u32, u64), Instance>,
    conns: Vec<UnixStream>,
    dead: bool,
}

pub struct MockSp {
    pub posts: Arc<AtomicUsize>,
    pub completed: Arc<AtomicUsize>,
    pub hosts: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Drop for MockSp {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn peer_pid(s: &UnixStream) -> u32 {
    // SAFETY: ucred is plain data; getsockopt writes at most `len` bytes.
    unsafe {
        let mut cred: libc::ucred = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        let rc = libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        );
        assert_eq!(rc, 0);
        cred.pid as u32
    }
}

impl MockSp {
    /// Serves the SPs `serve` of `cluster`.
    pub fn start(cluster: &Cluster, serve: &[u32], behaviour: Behaviour) -> MockSp {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let mut m = MockSp {
            posts: Arc::new(AtomicUsize::new(0)),
            completed: Arc::new(AtomicUsize::new(0)),
            hosts: Arc::new(AtomicUsize::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
        };
        let mut threads = Vec::new();
        for &sp in serve {
            let path = cluster.sp(sp).unwrap().host_socket.clone();
            let _ = std::fs::remove_file(&path);
            let l = UnixListener::bind(&path).unwrap();
            l.set_nonblocking(true).unwrap();
            let (shared, stop) = (shared.clone(), m.stop.clone());
            let (posts, completed, hosts) = (m.posts.clone(), m.completed.clone(), m.hosts.clone());
            threads.push(std::thread::spawn(move || {
                let mut conns = Vec::new();
                while !stop.load(Ordering::Acquire) {
                    match l.accept() {
                        Ok((s, _)) => {
                            s.set_nonblocking(false).unwrap();
                            shared.lock().unwrap().conns.push(s.try_clone().unwrap());
                            let (shared, posts, completed, hosts) = (
                                shared.clone(),
                                posts.clone(),
                                completed.clone(),
                                hosts.clone(),
                            );
                            conns.push(std::thread::spawn(move || {
                                serve_host(sp, s, shared, behaviour, posts, completed, hosts)
                            }));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
                let _ = std::fs::remove_file(&path);
                for s in shared.lock().unwrap().conns.drain(..) {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
                for c in conns {
                    let _ = c.join();
                }
            }));
        }
        m.threads = threads;
        m
    }
}

fn serve_host(
    sp: u32,
    s: UnixStream,
    shared: Arc<Mutex<Shared>>,
    behaviour: Behaviour,
    posts: Arc<AtomicUsize>,
    completed: Arc<AtomicUsize>,
    hosts: Arc<AtomicUsize>,
) {
    let pid = peer_pid(&s);
    let mut ch = Channel::new(s);
    let Ok(Hello::Host(h)) = ch.recv_hello() else {
        return;
    };
    let _ = ch.send_hello(&Hello::Welcome { sp });
    let Ok(HostToSp::Register {
        mailbox,
        mailbox_slots,
        ..
    }) = ch.recv::<HostToSp>()
    else {
        return;
    };
    assert!(mailbox.len >= mailbox_slots as u64 * SLOT_BYTES);
    assert_eq!(mailbox.rights, Rights::READ_WRITE);
    let _ = ch.send(&SpToHost::Registered { sp });
    hosts.fetch_add(1, Ordering::AcqRel);
    let owner = Owner {
        job: h.job,
        world_rank: h.world_rank,
        pid,
    };
    loop {
        match ch.recv::<HostToSp>() {
            Ok(HostToSp::Post(desc)) => {
                let n = posts.fetch_add(1, Ordering::AcqRel) + 1;
                if let Behaviour::DieAfterPosts(k) = behaviour {
                    if n >= k {
                        let mut sh = shared.lock().unwrap();
                        sh.dead = true;
                        for c in sh.conns.drain(..) {
                            let _ = c.shutdown(std::net::Shutdown::Both);
                        }
                        return;
                    }
                }
                let ready = {
                    let mut sh = shared.lock().unwrap();
                    if sh.dead {
                        return;
                    }
                    let key = (desc.comm.leader, desc.comm.id, desc.seq);
                    let size = desc.members.len();
                    let inst = sh.instances.entry(key).or_insert_with(|| Instance {
                        posts: (0..size).map(|_| None).collect(),
                    });
                    assert_eq!(inst.posts.len(), size, "members differ for {key:?}");
                    let r = desc.comm_rank as usize;
                    assert!(inst.posts[r].is_none(), "rank {r} posted {key:?} twice");
                    inst.posts[r] = Some((owner, mailbox.clone(), *desc));
                    if inst.posts.iter().all(Option::is_some) {
                        sh.instances.remove(&key)
                    } else {
                        None
                    }
                };
                if let Some(inst) = ready {
                    run(inst);
                    completed.fetch_add(1, Ordering::AcqRel);
                }
            }
            Ok(HostToSp::Goodbye) | Err(_) => return,
            Ok(HostToSp::Register { .. }) => panic!("second register"),
        }
    }
}

/// Performs one alltoallv and writes every member's completion.
fn run(inst: Instance) {
    let posts: Vec<(Owner, alias_mkey::Grant, PostDesc)> =
        inst.posts.into_iter().map(Option::unwrap).collect();
    let n = posts.len();
    let mut mover = CmaMover::default();
    let key = |o: &Owner, g: &alias_mkey::Grant| AliasKey {
        owner: *o,
        grant: g.clone(),
    };
    let mut status = mailbox::STATUS_OK;
    for (_, _, p) in &posts {
        assert_eq!(
            p.members, posts[0].2.members,
            "members differ between ranks"
        );
        for v in [
            &p.send_counts,
            &p.send_displs,
            &p.recv_counts,
            &p.recv_displs,
        ] {
            assert_eq!(v.len(), n);
        }
    }
    'pairs: for (src, (so, _, sp)) in posts.iter().enumerate() {
        for (dst, (dow, _, dp)) in posts.iter().enumerate() {
            let len = sp.send_counts[dst];
            if len != dp.recv_counts[src] {
                status = mailbox::status_code(algorithms::Status::CountMismatch);
                break 'pairs;
            }
            if len == 0 {
                continue;
            }
            if let Err(e) = mover.copy(
                &key(so, &sp.send),
                sp.send_displs[dst],
                &key(dow, &dp.recv),
                dp.recv_displs[src],
                len,
            ) {
                eprintln!("mock SP: copy {src}->{dst} refused: {e}");
                status = mailbox::status_code(algorithms::Status::AccessError);
                break 'pairs;
            }
        }
    }
    for (o, mb, p) in &posts {
        let k = key(o, mb);
        let at = p.slot as u64 * SLOT_BYTES;
        // Status first, then the token: the host reads the status once it sees its token.
        let _ = mover.write(&k, at + STATUS_OFFSET, &status.to_ne_bytes());
        let _ = mover.write(&k, at + TOKEN_OFFSET, &p.token.to_ne_bytes());
    }
}
