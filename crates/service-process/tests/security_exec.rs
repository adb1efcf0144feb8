//! Issue 24, items 1 and 2: an SP never reaches a process that its client could not reach with
//! `ptrace` at that moment. Real SP processes (running as root, as the shipped site daemon
//! does), a second uid and a group created by the test and removed after it, and real setuid
//! and setgid programs (a small C program built here, installed setuid root or setgid to the
//! new group, holding a secret read from a file only root or only that group may read):
//!
//! - a rank connects, hands its connection to a child, and execs a setuid-root (or setgid)
//!   program: same pid, same start time. The child posts an Alltoallv whose rank-0 grants name
//!   the program's secret (read) and another of its buffers (write). Before the fix the SP read
//!   the secret into the child and wrote into the program; now neither happens, the posts fail
//!   and the connection of the old image is closed. On the Unix socket and over TCP
//!   (`--hosts-same-kernel`).
//! - over TCP with `--hosts-same-kernel` a credential of the user names the user's own setgid
//!   or non-dumpable process in its hello: refused (the kernel would refuse that user's
//!   `ptrace`), and nothing of it is read.
//!
//! Each attacker step runs in a separate process under the second uid: this test binary run
//! again (`exec_attacker`, with `SPOFF_EXEC_ATTACK` naming the step).

mod common;
#[path = "tcp/mod.rs"]
mod tcp;

use algorithms::CommId;
use alias_mkey::host::Registrar;
use alias_mkey::Rights;
use bootstrap::auth::JobCredential;
use bootstrap::mailbox::STATUS_OK;
use bootstrap::wire::{Channel, Hello, HostHello, HostToSp, SpToHost};
use bootstrap::Layout;
use common::{desc, new_job, SpSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const HOLDER_C: &str = r#"
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/prctl.h>
static char secret[64];
static char target[64] = "TARGET-UNTOUCHED-TARGET-UNTOUCHED-TARGET-UNTOUCHED-TARGET-UNTOU";
int main(int argc, char **argv) {
    if (argc > 2 && !strcmp(argv[2], "nodump")) prctl(PR_SET_DUMPABLE, 0);
    int fd = open(argv[1], O_RDONLY);
    if (fd < 0 || read(fd, secret, sizeof secret - 1) <= 0) { perror("holder"); return 1; }
    printf("%lu %lu\n", (unsigned long)secret, (unsigned long)target);
    fflush(stdout);
    sleep(30);
    return 0;
}
"#;
const TARGET: &[u8] = b"TARGET-UNTOUCHED-TARGET-UNTOUCHED-TARGET-UNTOUCHED-TARGET-UNTOU";

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A second user and a group it is not in, created for one test and removed after it, with
/// the programs and secrets the test needs in a directory of their own.
struct World {
    user: String,
    group: String,
    uid: u32,
    gid: u32,
    secret_gid: u32,
    dir: PathBuf,
    /// The secret every holder reads (the same bytes in every secret file).
    secret: Vec<u8>,
}

impl World {
    fn new(tag: &str) -> World {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(
            unsafe { libc::geteuid() },
            0,
            "this test creates a user and setuid programs: run it as root"
        );
        let n = std::process::id();
        let user = format!("spoffx{n}{tag}");
        let group = format!("spoffs{n}{tag}");
        run(Command::new("useradd").args([
            "--system",
            "--no-create-home",
            "--shell",
            "/usr/sbin/nologin",
            "--user-group",
            &user,
        ]));
        run(Command::new("groupadd").args(["--system", &group]));
        let id = |flag: &str, name: &str| -> u32 {
            let out = Command::new("id").args([flag, name]).output().unwrap();
            String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
        };
        let (uid, gid) = (id("-u", &user), id("-g", &user));
        let secret_gid = String::from_utf8_lossy(
            &Command::new("getent")
                .args(["group", &group])
                .output()
                .unwrap()
                .stdout,
        )
        .split(':')
        .nth(2)
        .unwrap()
        .parse()
        .unwrap();
        let dir = std::env::temp_dir().join(format!("spoff-exec-{n}-{tag}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let secret = format!("SECRET-{:032x}", n as u128 * 0x9e37_79b9_7f4a_7c15 + 17).into_bytes();
        let w = World {
            user,
            group,
            uid,
            gid,
            secret_gid,
            dir,
            secret,
        };
        w.chmod(&w.dir, 0o755);
        std::fs::write(w.dir.join("holder.c"), HOLDER_C).unwrap();
        run(Command::new("cc")
            .args(["-O0", "-o"])
            .arg(w.dir.join("holder"))
            .arg(w.dir.join("holder.c")));
        for (name, mode, group) in [
            ("setuid", 0o4755, 0),
            ("setgid", 0o2755, w.secret_gid),
            ("plain", 0o755, 0),
        ] {
            let p = w.path(name);
            std::fs::copy(w.dir.join("holder"), &p).unwrap();
            std::os::unix::fs::chown(&p, Some(0), Some(group)).unwrap();
            w.chmod(&p, mode);
        }
        // Only root may read the first, only the group the second; the user's own the third.
        for (name, owner, group, mode) in [
            ("root-secret", 0, 0, 0o600),
            ("group-secret", 0, w.secret_gid, 0o640),
            ("own-secret", w.uid, w.gid, 0o600),
        ] {
            let p = w.path(name);
            std::fs::write(&p, &w.secret).unwrap();
            std::os::unix::fs::chown(&p, Some(owner), Some(group)).unwrap();
            w.chmod(&p, mode);
        }
        w
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn chmod(&self, p: &Path, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// This test binary as the attacker `step`, under the second user, with `vars`.
    fn attacker(&self, step: &str, vars: &[(&str, String)]) -> Command {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "exec_attacker",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SPOFF_EXEC_ATTACK", step)
        .uid(self.uid)
        .gid(self.gid)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        for (k, v) in vars {
            cmd.env(k, v);
        }
        cmd
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        // By effective and by real uid: a setuid-root holder runs with the user's real uid only.
        for by in ["-u", "-U"] {
            let _ = Command::new("pkill")
                .args(["-KILL", by, &self.user])
                .status();
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        let _ = Command::new("userdel").arg(&self.user).status();
        let _ = Command::new("groupdel").arg(&self.group).status();
    }
}

/// What an attacker said: its `ATTACK: key value` lines, read until `ATTACK: END` or the
/// pipe closes (bounded).
fn report(child: &mut std::process::Child) -> Vec<(String, String)> {
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some((_, a)) = line.split_once("ATTACK: ") {
                let (k, v) = a.split_once(' ').unwrap_or((a, ""));
                let end = k == "END";
                let _ = tx.send((k.to_string(), v.to_string()));
                if end {
                    return;
                }
            }
        }
    });
    let mut lines = vec![];
    let deadline = Instant::now() + Duration::from_secs(40);
    while let Ok(l) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        if l.0 == "END" {
            return lines;
        }
        lines.push(l);
    }
    panic!("the attacker did not finish: {lines:?}");
}

fn said<'a>(lines: &'a [(String, String)], key: &str) -> &'a str {
    lines
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("the attacker said no {key}: {lines:?}"))
}

/// The holder's ids (`Uid:`/`Gid:` lines of its status: real, effective, saved, fs).
fn ids_of(pid: u32) -> (Vec<u32>, Vec<u32>) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        let l = status.lines().find_map(|l| l.strip_prefix(k)).unwrap();
        l.split_whitespace().map(|v| v.parse().unwrap()).collect()
    };
    (ids("Uid:"), ids("Gid:"))
}

/// `len` bytes at `addr` of `pid`, read by this (root) test process.
fn peek(pid: u32, addr: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let mut b = vec![0; len];
    f.read_exact_at(&mut b, addr).unwrap();
    b
}

/// Checks what an attack achieved: nothing. The rank the attacker controls got none of the
/// secret and no OK, the program's buffer is untouched, and its memory really was out of the
/// user's reach (the user's own `process_vm_readv` of it was refused, as `ptrace` would be).
fn assert_nothing_reached(w: &World, lines: &[(String, String)], holder: u32, target: u64) {
    println!("attacker said: {lines:?}");
    let got = said(lines, "RANK1-RECV");
    assert!(
        !got.contains(&String::from_utf8_lossy(&w.secret[..32]).to_string()),
        "the SP read the secret of pid {holder} for uid {}: {got}",
        w.uid
    );
    assert_ne!(
        said(lines, "RANK1-STATUS"),
        format!("completed {STATUS_OK}"),
        "the collective reading pid {holder} completed OK"
    );
    assert_eq!(
        peek(holder, target, TARGET.len()),
        TARGET,
        "the SP wrote into pid {holder} for uid {}",
        w.uid
    );
    assert!(
        said(lines, "OWN-READ").starts_with("refused"),
        "the user could read the program itself: the case proves nothing: {lines:?}"
    );
}

/// An SP pair started as root, its host socket open to every user (the site daemon's setup),
/// or with a TCP host address and `--hosts-same-kernel`.
enum Sps {
    Unix(SpSet),
    Tcp(tcp::TcpSps),
}

impl Sps {
    fn unix() -> Sps {
        let set = SpSet::start_with(1, 1, 2, Layout::Block, &["--socket-mode=666"]);
        let sock = set.cluster.sp(0).unwrap().host_socket.clone();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            sock.parent().unwrap(),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        Sps::Unix(set)
    }

    fn tcp() -> Sps {
        let exe = PathBuf::from(env!("CARGO_BIN_EXE_service-process"));
        let mut sps = tcp::TcpSps::describe(&exe, 1, 1, 2);
        sps.start_all(&["--hosts-same-kernel"]);
        Sps::Tcp(sps)
    }

    /// Where the attacker connects (`SOCK` or `ADDR`) and a credential of a new 2-rank job for
    /// `uid`.
    fn vars(&self, uid: u32) -> Vec<(&'static str, String)> {
        match self {
            Sps::Unix(set) => vec![
                (
                    "SOCK",
                    set.cluster.sp(0).unwrap().host_socket.display().to_string(),
                ),
                (
                    "CRED",
                    JobCredential::issue(&set.key, new_job(), uid, 2).encode(),
                ),
            ],
            Sps::Tcp(sps) => vec![
                ("ADDR", sps.host_addr(0).to_string()),
                (
                    "CRED",
                    JobCredential::issue(&sps.key, new_job(), uid, 2).encode(),
                ),
            ],
        }
    }
}

/// A rank of `w`'s user connects (Unix socket or TCP), hands its connection to a child and
/// execs the holder `program` reading `secret_file`; the child attacks through it.
fn exec_attack(w: &World, sps: &Sps, program: &str, secret_file: &str) -> Vec<(String, String)> {
    let mut vars = sps.vars(w.uid);
    vars.push(("HOLDER", w.path(program).display().to_string()));
    vars.push(("SECRET_FILE", w.path(secret_file).display().to_string()));
    let mut p = w.attacker("exec-parent", &vars).spawn().unwrap();
    let holder = p.id();
    let lines = report(&mut p);
    let target: u64 = said(&lines, "TARGET").parse().unwrap();
    // The program that runs under the rank's pid now is the privileged one.
    let (uids, gids) = ids_of(holder);
    match program {
        "setuid" => assert_eq!(uids[1], 0, "the holder is not setuid root: {uids:?}"),
        "setgid" => assert_eq!(gids[1], w.secret_gid, "the holder is not setgid: {gids:?}"),
        _ => {}
    }
    assert_nothing_reached(w, &lines, holder, target);
    let _ = p.kill();
    let _ = p.wait();
    lines
}

#[test]
fn a_rank_that_execs_a_setuid_root_program_loses_its_grants_and_connection() {
    let w = World::new("u");
    let sps = Sps::unix();
    let lines = exec_attack(&w, &sps, "setuid", "root-secret");
    assert_eq!(said(&lines, "RANK0-CONN"), "closed", "{lines:?}");
    let Sps::Unix(mut set) = sps else {
        unreachable!()
    };
    let stats = set.stop_and_stats();
    assert!(
        stats[0]["hosts_exec_ended"].as_u64() >= Some(1),
        "{stats:?}"
    );
}

#[test]
fn a_rank_that_execs_a_setgid_program_loses_its_grants() {
    let w = World::new("g");
    let sps = Sps::unix();
    exec_attack(&w, &sps, "setgid", "group-secret");
}

#[test]
fn over_tcp_a_rank_that_execs_a_setuid_root_program_loses_its_grants() {
    let w = World::new("t");
    let sps = Sps::tcp();
    exec_attack(&w, &sps, "setuid", "root-secret");
}

/// Item 1, the connection: a rank that execs a setuid-root program while a child keeps its
/// connection, and nobody touches its memory afterwards: the SP's check of every pinned image
/// (once a heartbeat period) ends that connection anyway, within a few heartbeats.
#[test]
fn an_untouched_connection_of_an_execd_rank_is_ended_by_the_heartbeat_check() {
    let w = World::new("i");
    let sps = Sps::unix();
    let mut vars = sps.vars(w.uid);
    vars.push(("HOLDER", w.path("setuid").display().to_string()));
    vars.push(("SECRET_FILE", w.path("root-secret").display().to_string()));
    vars.push(("CHILD_STEP", "exec-child-idle".to_string()));
    let mut p = w.attacker("exec-parent", &vars).spawn().unwrap();
    let lines = report(&mut p);
    println!("attacker said: {lines:?}");
    let conn = said(&lines, "RANK0-CONN");
    let ms: u64 = conn.rsplit(' ').nth(1).unwrap().parse().unwrap();
    assert!(conn.starts_with("closed"), "{conn}");
    // The default heartbeat is 1 s: a few periods, well inside the attacker's 15 s wait.
    assert!(ms < 5000, "{conn}");
    let _ = p.kill();
    let _ = p.wait();
    let Sps::Unix(mut set) = sps else {
        unreachable!()
    };
    let stats = set.stop_and_stats();
    assert!(
        stats[0]["hosts_exec_ended"].as_u64() >= Some(1),
        "{stats:?}"
    );
}

/// A root SP's own rights (SECURITY.md, "A root SP and its capabilities"): `CAP_SYS_PTRACE` is
/// not effective, what `access::KEPT_CAPABILITIES` does not name is gone from its permitted and
/// bounding sets, and a `UCX_TLS` naming a transport that reaches local processes is refused.
#[test]
fn a_root_sp_keeps_only_the_capabilities_it_names_and_no_local_ucx_transport() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "this test needs root");
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_service-process"));
    let mut sps = tcp::TcpSps::describe(&exe, 1, 1, 1);
    sps.start_all(&[]);
    let status =
        std::fs::read_to_string(format!("/proc/{}/status", sps.sps[0].child.id())).unwrap();
    let caps = |k: &str| -> u64 {
        let v = status.lines().find_map(|l| l.strip_prefix(k)).unwrap();
        u64::from_str_radix(v.trim(), 16).unwrap()
    };
    let (eff, prm, bnd) = (caps("CapEff:"), caps("CapPrm:"), caps("CapBnd:"));
    const SYS_PTRACE: u64 = 1 << 19;
    const SYS_ADMIN: u64 = 1 << 21;
    const SETUID: u64 = 1 << 7;
    assert_eq!(eff & SYS_PTRACE, 0, "CAP_SYS_PTRACE effective: {status}");
    assert_eq!((prm | bnd) & SYS_ADMIN, 0, "CAP_SYS_ADMIN kept: {status}");
    let kept: u64 = service_process::access::KEPT_CAPABILITIES
        .iter()
        .map(|(c, _)| 1u64 << c)
        .sum();
    assert_eq!(prm & !kept, 0, "permitted beyond the kept ones: {prm:x}");
    assert_ne!(prm & SETUID, 0, "CAP_SETUID is needed for the client's ids");
    drop(sps);

    let mut sps = tcp::TcpSps::describe(&exe, 1, 1, 1);
    sps.release_listeners();
    let out = sps
        .serve_cmd()
        .args(["--sp-id", "0"])
        .env("UCX_TLS", "posix,tcp")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("UCX_TLS=posix,tcp: an SP running as root"),
        "{err}"
    );
}

/// Item 2: over TCP on the SP's kernel a credential may name only a process its user could
/// trace: not the user's own setgid program, not a process that made itself non-dumpable.
#[test]
fn over_tcp_a_credential_cannot_name_a_setgid_or_non_dumpable_process() {
    let w = World::new("n");
    let sps = Sps::tcp();
    for (program, secret, arg) in [
        ("setgid", "group-secret", ""),
        ("plain", "own-secret", "nodump"),
    ] {
        let mut vars = sps.vars(w.uid);
        vars.push(("HOLDER", w.path(program).display().to_string()));
        vars.push(("SECRET_FILE", w.path(secret).display().to_string()));
        vars.push(("HOLDER_ARG", arg.to_string()));
        let mut a = w.attacker("name-over-tcp", &vars).spawn().unwrap();
        let lines = report(&mut a);
        let holder: u32 = said(&lines, "HOLDER").parse().unwrap();
        let target: u64 = said(&lines, "TARGET").parse().unwrap();
        assert!(
            said(&lines, "RANK0-HELLO").contains("may not be reached as uid"),
            "{program}: {lines:?}"
        );
        assert_nothing_reached(&w, &lines, holder, target);
        // SAFETY: kill(2) of the holder this test's attacker started.
        unsafe { libc::kill(holder as i32, libc::SIGKILL) };
        let _ = a.kill();
        let _ = a.wait();
    }
}

// ---- the attacker ---------------------------------------------------------------------

/// The attacker steps (not a test of their own: the tests above run them).
#[test]
#[ignore = "the attacker steps of the other tests; does nothing on its own"]
fn exec_attacker() {
    let Ok(step) = std::env::var("SPOFF_EXEC_ATTACK") else {
        return;
    };
    match step.as_str() {
        "exec-parent" => exec_parent(),
        "exec-child" => exec_child(),
        "exec-child-idle" => exec_child_idle(),
        "name-over-tcp" => name_over_tcp(),
        other => panic!("no attacker step {other}"),
    }
}

fn var(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("attacker: {k} is not set"))
}

fn say(what: impl std::fmt::Display) {
    println!("ATTACK: {what}");
    let _ = std::io::stdout().flush();
}

/// A host connection over the Unix socket or TCP.
enum Stream {
    Unix(UnixStream),
    Tcp(std::net::TcpStream),
}

impl Read for Stream {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(b),
            Stream::Tcp(s) => s.read(b),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(b),
            Stream::Tcp(s) => s.write(b),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => s.flush(),
            Stream::Tcp(s) => s.flush(),
        }
    }
}

impl Stream {
    fn connect() -> Stream {
        let s = match std::env::var("SOCK") {
            Ok(sock) => Stream::Unix(UnixStream::connect(sock).unwrap()),
            Err(_) => Stream::Tcp(std::net::TcpStream::connect(var("ADDR")).unwrap()),
        };
        s.set_timeout();
        s
    }

    /// The connection with descriptor `fd`, inherited from the process that made it.
    fn inherit(fd: i32) -> Stream {
        // SAFETY: the parent passed this descriptor of its connection and nothing else here
        // owns it.
        let s = match std::env::var("SOCK") {
            Ok(_) => Stream::Unix(unsafe { UnixStream::from_raw_fd(fd) }),
            Err(_) => Stream::Tcp(unsafe { std::net::TcpStream::from_raw_fd(fd) }),
        };
        s.set_timeout();
        s
    }

    fn set_timeout(&self) {
        let t = Some(Duration::from_secs(15));
        match self {
            Stream::Unix(s) => s.set_read_timeout(t).unwrap(),
            Stream::Tcp(s) => s.set_read_timeout(t).unwrap(),
        }
    }

    fn fd(&self) -> i32 {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        }
    }
}

/// Says hello as `rank` of a 2-rank job naming `pid`; the answer in words, and the channel
/// with a 0-slot mailbox registered if welcomed.
fn hello(rank: u32, pid: u32) -> (String, Option<Channel<Stream>>) {
    let mut ch = Channel::new(Stream::connect());
    ch.send_hello(&Hello::Host(HostHello {
        credential: var("CRED"),
        world_rank: rank,
        world_size: 2,
        node: 0,
        local_rank: rank,
        pid,
    }))
    .unwrap();
    match ch.recv_hello() {
        Ok(Hello::Welcome { .. }) => {}
        Ok(Hello::Reject { reason }) => return (format!("REJECT {reason}"), None),
        other => return (format!("OTHER {other:?}"), None),
    }
    let mb = Box::leak(vec![0u8; 4 * bootstrap::mailbox::SLOT_BYTES as usize].into_boxed_slice());
    let grant = Registrar::new().register(
        mb.as_ptr() as u64,
        4 * bootstrap::mailbox::SLOT_BYTES,
        Rights::READ_WRITE,
    );
    match common::register(&mut ch, grant, 4) {
        SpToHost::Registered { .. } => ("WELCOME".into(), Some(ch)),
        other => (format!("REGISTER {other:?}"), None),
    }
}

/// The holder started (or exec'd) by this attacker: `secret target` on its first line.
fn holder_addrs(out: impl Read) -> (u64, u64) {
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).unwrap();
    let mut it = line.split_whitespace().map(|v| v.parse::<u64>().unwrap());
    (it.next().unwrap(), it.next().unwrap())
}

/// Whether this user can read `len` bytes at `addr` of `pid` by itself.
fn own_read(pid: u32, addr: u64) -> String {
    let mut b = [0u8; 8];
    let local = libc::iovec {
        iov_base: b.as_mut_ptr().cast(),
        iov_len: 8,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: 8,
    };
    // SAFETY: one local iovec over `b`, the remote one only interpreted by the kernel.
    let n = unsafe { libc::process_vm_readv(pid as i32, &local, 1, &remote, 1, 0) };
    if n < 0 {
        format!("refused {}", std::io::Error::last_os_error())
    } else {
        format!("read {n}")
    }
}

/// Both ranks post the 2-rank Alltoallv: rank 0's send grant names `secret` (32 bytes to each
/// rank), its receive grant `target`; rank 1 sends 'A's and receives into its own buffer.
/// Reports what each rank's connection answered and what rank 1 received.
fn post_both(
    ch0: Option<&mut Channel<Stream>>,
    ch1: &mut Channel<Stream>,
    secret: u64,
    target: u64,
) {
    let comm = CommId {
        leader: 0,
        id: 4242,
    };
    let counts = (
        vec![32u64, 32],
        vec![0u64, 0],
        vec![32u64, 32],
        vec![0u64, 32],
    );
    let mut reg = Registrar::new();
    let post = |rank: u32, send, recv| {
        let mut d = desc(comm, 0, rank, vec![0, 0], 0, send, recv, counts.clone());
        d.slot = None;
        d.token = 100 + rank as u64;
        HostToSp::Post(Box::new(d))
    };
    let mut sent0 = false;
    if let Some(ch0) = ch0 {
        let s = reg.register(secret, 64, Rights::READ);
        let r = reg.register(target, 64, Rights::WRITE);
        sent0 = ch0.send(&post(0, s, r)).is_ok();
    }
    let own_send: &'static [u8] = Box::leak(vec![b'A'; 64].into_boxed_slice());
    let own_recv: &'static mut [u8] = Box::leak(vec![0u8; 64].into_boxed_slice());
    let s = reg.register(own_send.as_ptr() as u64, 64, Rights::READ);
    let r = reg.register(own_recv.as_ptr() as u64, 64, Rights::WRITE);
    ch1.send(&post(1, s, r)).unwrap();
    say(format!("RANK0-POSTED {sent0}"));
    // Without rank 0 (refused) the post cannot complete: heartbeats come until the deadline.
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        match ch1.recv::<SpToHost>() {
            Ok(SpToHost::Completed { status, .. }) => break format!("completed {status}"),
            Ok(SpToHost::Error { message, .. }) => break format!("error {message}"),
            Ok(SpToHost::Heartbeat) if Instant::now() > deadline => break "pending".into(),
            Ok(SpToHost::Heartbeat) => continue,
            Ok(other) => break format!("other {other:?}"),
            Err(e) => break format!("closed {e}"),
        }
    };
    say(format!("RANK1-STATUS {status}"));
    // SAFETY-free: the SP wrote `own_recv` behind the compiler's back.
    let got: Vec<u8> = own_recv
        .iter()
        .map(|b| unsafe { std::ptr::read_volatile(b) })
        .collect();
    say(format!("RANK1-RECV {}", String::from_utf8_lossy(&got)));
}

/// Rank 0: connects, passes its connection and the read end of a pipe to a child (the next
/// step), then becomes the holder program (same pid) with its output into the pipe.
// The child outlives this image on purpose (the holder program is what runs here next).
#[allow(clippy::zombie_processes)]
fn exec_parent() {
    let (_, ch) = hello(0, std::process::id());
    let ch = ch.expect("rank 0 is welcomed before its exec");
    let fd = ch.get_ref().fd();
    // Kept open (and inherited by the child: no close-on-exec) whatever happens to `ch`.
    std::mem::forget(ch);
    // SAFETY: fcntl on the connection's descriptor, clearing its flags (FD_CLOEXEC).
    unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
    let mut pipe = [0i32; 2];
    // SAFETY: pipe(2) into an array of two descriptors (without close-on-exec: the child and
    // the program inherit one end each).
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    let mut child = Command::new(std::env::current_exe().unwrap());
    child
        .args([
            "exec_attacker",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            "SPOFF_EXEC_ATTACK",
            std::env::var("CHILD_STEP").unwrap_or_else(|_| "exec-child".into()),
        )
        .env("CONN_FD", fd.to_string())
        .env("PIPE_FD", pipe[0].to_string())
        .env("HOLDER_PID", std::process::id().to_string());
    child.spawn().unwrap();
    // SAFETY: the descriptors above; the program's stdout becomes the pipe's write end.
    unsafe {
        libc::close(fd);
        libc::close(pipe[0]);
        libc::dup2(pipe[1], 1);
        libc::close(pipe[1]);
    }
    let err = Command::new(var("HOLDER")).arg(var("SECRET_FILE")).exec();
    panic!("exec of the holder failed: {err}");
}

/// The child that kept rank 0's connection: waits for the program to run, connects as rank 1,
/// and posts through both.
fn exec_child() {
    let fd: i32 = var("CONN_FD").parse().unwrap();
    let pipe: i32 = var("PIPE_FD").parse().unwrap();
    let holder: u32 = var("HOLDER_PID").parse().unwrap();
    // SAFETY: the read end of the pipe the parent made for this process alone.
    let (secret, target) = holder_addrs(unsafe { std::fs::File::from_raw_fd(pipe) });
    say(format!("TARGET {target}"));
    say(format!("OWN-READ {}", own_read(holder, secret)));
    let mut ch0 = Channel::new(Stream::inherit(fd));
    let (answer, ch1) = hello(1, std::process::id());
    let Some(mut ch1) = ch1 else {
        say(format!("RANK1-STATUS hello {answer}"));
        say("RANK1-RECV ");
        say("END");
        return;
    };
    post_both(Some(&mut ch0), &mut ch1, secret, target);
    // Rank 0's connection: closed by the SP once it found the image gone.
    let conn = loop {
        match ch0.recv::<SpToHost>() {
            Ok(SpToHost::Heartbeat) => continue,
            Ok(SpToHost::Completed { status, .. }) => break format!("completed {status}"),
            Ok(SpToHost::Error { .. }) => continue,
            Ok(other) => break format!("other {other:?}"),
            Err(e) if still_open(&e) => break "open".to_string(),
            Err(_) => break "closed".to_string(),
        }
    };
    say(format!("RANK0-CONN {conn}"));
    say("END");
}

/// Whether a failed read only timed out (the socket's read timeout shows as `EAGAIN`): the
/// connection is still open.
fn still_open(e: &bootstrap::wire::FrameError) -> bool {
    matches!(e, bootstrap::wire::FrameError::Io(io) if matches!(
        io.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    ))
}

/// The child that kept rank 0's connection, touching nothing: how long until the SP ends the
/// connection of the image its process left by `exec`.
fn exec_child_idle() {
    let fd: i32 = var("CONN_FD").parse().unwrap();
    let pipe: i32 = var("PIPE_FD").parse().unwrap();
    // SAFETY: the read end of the pipe the parent made for this process alone.
    let (_, target) = holder_addrs(unsafe { std::fs::File::from_raw_fd(pipe) });
    say(format!("TARGET {target}"));
    let t = Instant::now();
    let mut ch0 = Channel::new(Stream::inherit(fd));
    let conn = match ch0.recv::<SpToHost>() {
        Ok(other) => format!("answered {other:?}"),
        Err(e) if still_open(&e) => "open".to_string(),
        Err(_) => "closed".to_string(),
    };
    say(format!(
        "RANK0-CONN {conn} after {} ms",
        t.elapsed().as_millis()
    ));
    say("END");
}

/// Starts the holder (as this user: setgid, or made non-dumpable), then says hello over TCP as
/// rank 0 naming it, and as rank 1 naming itself; posts if let.
// The holder stays after this step for the test to look into; the test kills it.
#[allow(clippy::zombie_processes)]
fn name_over_tcp() {
    let mut cmd = Command::new(var("HOLDER"));
    cmd.arg(var("SECRET_FILE")).stdout(Stdio::piped());
    let arg = var("HOLDER_ARG");
    if !arg.is_empty() {
        cmd.arg(arg);
    }
    let mut holder = cmd.spawn().unwrap();
    let (secret, target) = holder_addrs(holder.stdout.take().unwrap());
    say(format!("HOLDER {}", holder.id()));
    say(format!("TARGET {target}"));
    say(format!("OWN-READ {}", own_read(holder.id(), secret)));
    let (answer, mut ch0) = hello(0, holder.id());
    say(format!("RANK0-HELLO {answer}"));
    let (answer, ch1) = hello(1, std::process::id());
    let Some(mut ch1) = ch1 else {
        say(format!("RANK1-STATUS hello {answer}"));
        say("RANK1-RECV ");
        say("END");
        return;
    };
    post_both(ch0.as_mut(), &mut ch1, secret, target);
    // The holder stays for the test to look into (and to kill).
    say("END");
}
