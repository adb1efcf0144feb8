//! SPs started by a site's tools: readiness told to systemd (a real Unix datagram socket
//! stands for it), readiness waited on by `service-process wait-ready` (SPs started late, SPs
//! that never come), `--sp-id auto` under a launcher's environment, and the shipped systemd
//! unit checked by `systemd-analyze verify` where that exists.

mod tcp;

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tcp::TcpSps;

fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_service-process"))
}

fn wait_ready_cmd(sps: &TcpSps, timeout_secs: u64) -> Command {
    let mut c = Command::new(exe());
    c.args(["wait-ready", "--cluster"])
        .arg(&sps.cluster_path)
        .args(["--timeout-secs", &timeout_secs.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// One datagram; a signal arriving meanwhile (the test harness's children exit) is no error.
fn recv(s: &UnixDatagram, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match s.recv(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

#[test]
fn serve_tells_systemd_it_is_ready_and_stopping() {
    let mut sps = TcpSps::describe(&exe(), 1, 1, 1);
    let sock = sps.run_dir.join("notify.sock");
    let systemd = UnixDatagram::bind(&sock).unwrap();
    systemd
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    sps.release_listeners();
    let child = sps
        .serve_cmd()
        .args(["--sp-id", "0"])
        .env("NOTIFY_SOCKET", &sock)
        .spawn()
        .unwrap();
    let mut buf = [0u8; 512];
    let n = recv(&systemd, &mut buf).expect("no READY=1 from the SP");
    let msg = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg:?}");
    assert!(msg.contains("STATUS=serving as SP 0"), "{msg:?}");
    // Ready means serving: a stats request over TCP answers at once.
    let st = service_process::stats::query(&sps.cluster.sps[0], &sps.key).unwrap();
    assert_eq!(st["posts"], 0);
    // SAFETY: kill with a pid of our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let n = recv(&systemd, &mut buf).expect("no STOPPING=1 from the SP");
    assert_eq!(&buf[..n], b"STOPPING=1");
}

#[test]
fn the_notification_reaches_an_abstract_socket_too() {
    use std::os::linux::net::SocketAddrExt;
    let name = format!("spoff-notify-test-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let systemd = UnixDatagram::bind_addr(&addr).unwrap();
    service_process::deploy::notify_to(std::ffi::OsStr::new(&format!("@{name}")), "READY=1")
        .unwrap();
    let mut buf = [0u8; 64];
    let n = systemd.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"READY=1");
    // Nobody listening: an error, not a hang.
    assert!(service_process::deploy::notify_to(
        std::ffi::OsStr::new("/nonexistent/notify.sock"),
        "READY=1"
    )
    .is_err());
}

#[test]
fn wait_ready_waits_for_sps_started_late_and_names_those_that_never_come() {
    let mut sps = TcpSps::describe(&exe(), 2, 1, 1);
    // Nothing runs yet: wait-ready keeps asking.
    let t = Instant::now();
    let waiter = wait_ready_cmd(&sps, 60).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    sps.start(0, &[]);
    std::thread::sleep(Duration::from_millis(500));
    sps.start(1, &[]);
    let out = waiter.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("ready: all 2 SPs answer"), "{stdout}");
    assert!(
        t.elapsed() >= Duration::from_secs(2),
        "ready before the SPs were started"
    );
    // Each SP was really serving when wait-ready returned.
    for e in &sps.cluster.sps {
        service_process::stats::query(e, &sps.key).unwrap();
    }
    drop(sps);

    // SP 1 never starts (so SP 0, which waits for its peer, never serves either): a bounded
    // wait, failure, and both named.
    let mut sps = TcpSps::describe(&exe(), 2, 1, 1);
    sps.start(0, &["--connect-timeout-secs", "30"]);
    let t = Instant::now();
    let out = wait_ready_cmd(&sps, 2).output().unwrap();
    let took = t.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(took < Duration::from_secs(6), "took {took:?}");
    for sp in [0, 1] {
        assert!(
            stderr.contains(&format!("SP {sp} does not answer")),
            "SP {sp} not named:\n{stderr}"
        );
    }
    assert!(
        stderr.contains("2 of 2 SPs not ready after 2 s"),
        "{stderr}"
    );
    // Issue 25: SP 0 is up (its host address accepts) but waits for SP 1: said so, not as an
    // I/O error ("Resource temporarily unavailable").
    let sp0 = stderr
        .lines()
        .find(|l| l.contains("SP 0 does not answer"))
        .unwrap();
    assert!(sp0.contains("connected, but not serving yet"), "{stderr}");
    assert!(
        !stderr.contains("Resource temporarily unavailable"),
        "{stderr}"
    );
}

#[test]
fn serve_sp_id_auto_takes_the_node_and_the_launchers_local_rank() {
    let mut sps = TcpSps::describe(&exe(), 2, 2, 1);
    sps.cluster.hosts = vec!["n0.test".into(), "n1.test".into()];
    sps.cluster.save(&sps.cluster_path).unwrap();
    sps.release_listeners();
    // Two of the four SPs as mpirun would start them on node n1 (local ranks 0 and 1), the
    // other two by number.
    let spawn = |args: &[&str], local: Option<&str>| {
        let mut c = sps.serve_cmd();
        c.args(args);
        for v in service_process::deploy::LOCAL_RANK_VARS {
            c.env_remove(v);
        }
        if let Some(l) = local {
            c.env("OMPI_COMM_WORLD_LOCAL_RANK", l);
        }
        c
    };
    // Wrong settings fail at once with a clear line.
    let out = spawn(&["--sp-id", "auto", "--node", "n1.test"], None)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("no launcher local rank"), "{err}");
    let out = spawn(&["--sp-id", "auto", "--node", "n9"], Some("0"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is not in the cluster description's dpus or hosts"),
        "{err}"
    );

    // The mesh only comes up if every SP took the right id (each proves it to its peers).
    // The SPs bind their peer addresses themselves here (the harness's listeners were
    // released before `spawn` borrowed the harness).
    let mut children = vec![
        spawn(&["--sp-id", "0"], None).spawn().unwrap(),
        spawn(&["--sp-id", "1"], None).spawn().unwrap(),
        spawn(&["--sp-id", "auto", "--node", "n1"], Some("0"))
            .spawn()
            .unwrap(),
        spawn(&["--sp-id", "auto", "--node", "n1.test"], Some("1"))
            .spawn()
            .unwrap(),
    ];
    let ready = service_process::deploy::wait_ready(
        &sps.cluster,
        &sps.key,
        Duration::from_secs(30),
        Duration::from_millis(100),
    );
    for c in &mut children {
        // SAFETY: kill with a pid of our own child.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
    }
    let outs: Vec<String> = children
        .into_iter()
        .map(|c| String::from_utf8_lossy(&c.wait_with_output().unwrap().stdout).into_owned())
        .collect();
    assert!(ready.is_ok(), "{ready:?}");
    assert!(outs[2].contains("READY sp=2"), "{}", outs[2]);
    assert!(outs[3].contains("READY sp=3"), "{}", outs[3]);
}

/// The unit file shipped for the daemon mode.
fn unit() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/systemd/spoff-sp@.service")
}

#[test]
fn the_shipped_systemd_unit_is_type_notify_and_verifies() {
    let text = std::fs::read_to_string(unit()).unwrap();
    for line in [
        "Type=notify",
        "NotifyAccess=main",
        "Restart=on-failure",
        "--sp-id local:%i",
    ] {
        assert!(text.contains(line), "the unit lacks {line:?}");
    }
    // systemd-analyze checks the unit's syntax and that ExecStart's binary exists: point it
    // at the one just built, in a copy.
    let Ok(v) = Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!("systemd-analyze is not installed: syntax not verified");
        return;
    };
    assert!(v.status.success());
    let dir = std::env::temp_dir().join(format!("spoff-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("spoff-sp@0.service");
    std::fs::write(
        &copy,
        text.replace(
            "/usr/local/bin/service-process",
            &exe().display().to_string(),
        ),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let err = String::from_utf8_lossy(&out.stderr);
    // Lines about the unit itself (not about the host's own units, which a container may lack).
    let ours: Vec<&str> = err.lines().filter(|l| l.contains("spoff-sp@")).collect();
    assert!(
        out.status.success() && ours.is_empty(),
        "systemd-analyze verify:\n{err}"
    );
}

/// Issue 25: on a fresh DPU `serve` makes its socket directory itself (mode 0755 for a socket
/// open to others, else 0700) instead of failing with `No such file or directory`.
#[test]
fn serve_creates_the_directory_of_its_host_socket() {
    use std::os::unix::fs::PermissionsExt;
    for (mode, dir_mode) in [("666", 0o755), ("600", 0o700)] {
        let mut sps = TcpSps::describe(&exe(), 1, 1, 1);
        let dir = sps.run_dir.join(format!("fresh-{mode}")).join("0");
        let sock = dir.join("host.sock");
        sps.cluster.sps[0].host_socket = sock.clone();
        sps.cluster.save(&sps.cluster_path).unwrap();
        sps.release_listeners();
        let mut child = sps
            .serve_cmd()
            .args(["--sp-id", "0", "--socket-mode", mode])
            .spawn()
            .unwrap();
        let t = Instant::now();
        while !sock.exists() {
            if let Ok(Some(st)) = child.try_wait() {
                let out = child.wait_with_output().unwrap();
                panic!(
                    "serve exited ({st}): {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "no socket at {sock:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let got = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(got, dir_mode, "socket mode {mode}");
        // SAFETY: kill with a pid of our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        assert!(child.wait().unwrap().success());
    }
}

/// Issue 25: a unit for SP 0 enabled on another node's DPU fails once with what is wrong: the
/// address is SP 0's, on node 0, which runs SPs 0..=K-1.
#[test]
fn serve_of_another_nodes_sp_says_which_node_it_belongs_to() {
    let mut sps = TcpSps::describe(&exe(), 2, 2, 1);
    // SP 2 (node 1) gets an address this machine does not have (TEST-NET-1, never routed).
    sps.cluster.sps[2].peer_addr = "192.0.2.1:7100".parse().unwrap();
    sps.cluster.dpus = vec!["dpu-a".into(), "dpu-b".into()];
    sps.cluster.save(&sps.cluster_path).unwrap();
    sps.release_listeners();
    let out = sps.serve_cmd().args(["--sp-id", "2"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("SP 2 belongs to node 1 (dpu-b), which runs SPs 2..=3"),
        "{err}"
    );
}
