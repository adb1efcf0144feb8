//! The admin's tools, as a new admin meets them (issue 25): `service-process stats` (its
//! table, a closed pipe, something that is not an SP at the other end), the shipped systemd
//! unit run as it is on every DPU of a cluster (the same instance names everywhere), and
//! `cluster check` of the UCX port range. Real SP processes throughout.

mod tcp;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use tcp::TcpSps;

fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_service-process"))
}

/// SplitMix64 over `TEST_SEED` (or the clock), the seed printed.
struct Rng(u64);

impl Rng {
    fn new() -> Rng {
        let seed = std::env::var("TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
                    % 1_000_000_007
            });
        eprintln!("TEST_SEED={seed}");
        Rng(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn stats_cmd(cluster: &Path) -> Command {
    let mut c = Command::new(exe());
    c.arg("stats")
        .arg("--cluster")
        .arg(cluster)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The words of `line` with the column each ends at (one past its last byte).
fn word_ends(line: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, ch) in line.char_indices().chain([(line.len(), ' ')]) {
        match (ch.is_whitespace(), start) {
            (false, None) => start = Some(i),
            (true, Some(s)) => {
                out.push((line[s..i].to_string(), i));
                start = None;
            }
            _ => {}
        }
    }
    out
}

/// The table's rows stand under its header (every value ends where its column's name ends),
/// and it shows the counters the guide tells the admin to look at: connections per transport
/// and bytes moved, beside posts and completions; its values are the SP's (`--json`).
#[test]
fn stats_table_lines_up_and_shows_connections_and_bytes() {
    let mut rng = Rng::new();
    let mut sps = TcpSps::describe(&exe(), 2, 1, 1);
    sps.start_all(&[]);
    // Counters of different widths: SP 0 asked a random number of times (up to 14).
    let asks = 1 + rng.below(14);
    for _ in 0..asks {
        service_process::stats::query(&sps.cluster.sps[0], &sps.key).unwrap();
    }
    let out = stats_cmd(&sps.cluster_path).output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stats failed: {stderr}");
    eprintln!("{stdout}");
    let lines: Vec<&str> = stdout.lines().collect();
    let header = word_ends(lines[0]);
    let names: Vec<&str> = header.iter().map(|(w, _)| w.as_str()).collect();
    for want in [
        "sp",
        "posts",
        "completions",
        "host_conns_tcp",
        "host_conns_unix",
        "bytes_copied",
        "bytes_inter_node",
        "bytes_intra_node",
        "errors_sent",
    ] {
        assert!(names.contains(&want), "no column {want} in {names:?}");
    }
    let rows: Vec<Vec<(String, usize)>> = lines[1..].iter().map(|l| word_ends(l)).collect();
    assert_eq!(rows.len(), 2, "one row per SP:\n{stdout}");
    for row in &rows {
        assert_eq!(row.len(), header.len(), "row {row:?} under {header:?}");
        for ((name, end), (value, vend)) in header.iter().zip(row) {
            assert_eq!(
                end, vend,
                "{name}: value {value} is not under its name\n{stdout}"
            );
        }
    }
    // The values are the SP's: the JSON taken after it (one more TCP connection each).
    let json = stats_cmd(&sps.cluster_path).arg("--json").output().unwrap();
    assert!(json.status.success());
    let json: Vec<serde_json::Value> = text(&json)
        .0
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for (sp, row) in rows.iter().enumerate() {
        let cell = |name: &str| -> u64 {
            let i = names.iter().position(|n| *n == name).unwrap();
            row[i].0.parse().unwrap()
        };
        assert_eq!(cell("sp"), sp as u64);
        let j = &json[sp];
        assert_eq!(
            cell("host_conns_tcp") + 1,
            j["host_conns_tcp"].as_u64().unwrap(),
            "SP {sp}"
        );
        for f in [
            "posts",
            "host_conns_unix",
            "bytes_copied",
            "bytes_inter_node",
        ] {
            assert_eq!(cell(f), j[f].as_u64().unwrap(), "SP {sp} {f}");
        }
    }
    // SP 0's connections: the asks, the table's request.
    assert_eq!(
        rows[0][names.iter().position(|n| *n == "host_conns_tcp").unwrap()].0,
        (asks + 1).to_string()
    );

    // A request with another key: the SP refused it, and stats says so (not "undecodable").
    let other = sps.run_dir.join("other.key");
    std::fs::write(&other, format!("{}\n", "ab".repeat(32))).unwrap();
    std::fs::set_permissions(&other, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let out = stats_cmd(&sps.cluster_path)
        .arg("--key")
        .arg(&other)
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let at = format!("SP 0 at {} refused the request: ", sps.host_addr(0));
    assert!(
        stderr.contains(&(at + "the admin request is not proven with the cluster key")),
        "{stderr}"
    );
}

/// `stats | head` on a reader that is gone: ends quietly (no panic message), status 0 or the
/// conventional one of a process killed by SIGPIPE.
#[test]
fn stats_into_a_closed_pipe_ends_quietly() {
    let mut sps = TcpSps::describe(&exe(), 2, 1, 1);
    sps.start_all(&[]);
    for json in [false, true] {
        let mut fds = [0; 2];
        // SAFETY: pipe writes two fds into the array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both fds were just made and are owned here only.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        drop(read);
        let mut c = stats_cmd(&sps.cluster_path);
        if json {
            c.arg("--json");
        }
        let out = c.stdout(Stdio::from(write)).output().unwrap();
        let (_, stderr) = text(&out);
        eprintln!("--json {json}: {:?}, stderr {stderr:?}", out.status);
        assert!(
            !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
            "--json {json}: {stderr}"
        );
        use std::os::unix::process::ExitStatusExt;
        assert!(
            out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
            "--json {json}: {:?}",
            out.status
        );
    }
}

/// What a listener that is not an SP does with the stats request.
#[derive(Clone, Copy, Debug)]
enum NotSp {
    /// Answers a line of text (an HTTP, SSH or SMTP server).
    Text(&'static str),
    /// Accepts and says nothing, keeping the connection open.
    Silent,
    /// Accepts and closes at once.
    Closes,
}

fn serve_not_sp(mut s: impl Read + Write + Send + 'static, how: NotSp) {
    std::thread::spawn(move || match how {
        NotSp::Text(t) => {
            let _ = s.write_all(t.as_bytes());
            let mut buf = [0u8; 512];
            let _ = s.read(&mut buf);
        }
        NotSp::Silent => std::thread::sleep(Duration::from_secs(60)),
        NotSp::Closes => drop(s),
    });
}

/// Pointed at things that are not SPs (over TCP and on a Unix socket), `stats` says so, with
/// what it reached and what it got, within its time bound when the other side says nothing.
#[test]
fn stats_pointed_at_something_that_is_not_an_sp_says_so() {
    let mut rng = Rng::new();
    let texts = [
        "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        "SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n",
        "220 mail.example ESMTP Postfix\r\n",
    ];
    let mut kinds = vec![
        NotSp::Text(texts[rng.below(3) as usize]),
        NotSp::Text(texts[rng.below(3) as usize]),
        NotSp::Silent,
        NotSp::Closes,
    ];
    // A random order, and a random one of them on a Unix socket (no host_addr).
    for i in (1..kinds.len()).rev() {
        kinds.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let unix_one = rng.below(kinds.len() as u64) as usize;
    let mut sps = TcpSps::describe(&exe(), 1, kinds.len() as u32, 1);
    sps.release_listeners();
    let mut reached = Vec::new();
    for (i, how) in kinds.iter().enumerate() {
        let how = *how;
        if i == unix_one {
            let path = sps.run_dir.join(format!("not-an-sp-{i}.sock"));
            let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
            std::thread::spawn(move || {
                for s in l.incoming().flatten() {
                    serve_not_sp(s, how);
                }
            });
            sps.cluster.sps[i].host_addr = None;
            sps.cluster.sps[i].host_socket = path.clone();
            reached.push(path.display().to_string());
        } else {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            std::thread::spawn(move || {
                for s in l.incoming().flatten() {
                    serve_not_sp(s, how);
                }
            });
            sps.cluster.sps[i].host_addr = Some(addr);
            reached.push(addr.to_string());
        }
    }
    sps.cluster.save(&sps.cluster_path).unwrap();
    eprintln!("{kinds:?}, SP {unix_one} on a Unix socket");
    let t = Instant::now();
    let out = stats_cmd(&sps.cluster_path).output().unwrap();
    let took = t.elapsed();
    let (stdout, stderr) = text(&out);
    eprintln!("took {took:?}\nstdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(out.status.code(), Some(1));
    assert!(took < Duration::from_secs(12), "took {took:?}");
    assert!(!stderr.contains("exceeds the maximum"), "{stderr}");
    for (i, how) in kinds.iter().enumerate() {
        let line = stderr
            .lines()
            .find(|l| l.contains(&format!("SP {i} at {}: ", reached[i])))
            .unwrap_or_else(|| panic!("no line for SP {i} at {}:\n{stderr}", reached[i]));
        match how {
            NotSp::Text(t) => {
                assert!(line.contains("is not an SP"), "{line}");
                let first = t.split("\r\n").next().unwrap();
                assert!(line.contains(first), "{line} does not show {first:?}");
            }
            NotSp::Silent => {
                assert!(line.contains("no answer within 5 s"), "{line}");
                assert!(line.contains("not an SP"), "{line}");
            }
            NotSp::Closes => {
                assert!(
                    line.contains("closed the connection without answering"),
                    "{line}"
                )
            }
        }
    }
}

/// The shipped unit (deploy/systemd/spoff-sp@.service), its ExecStart run as systemd would on
/// each DPU of a 2-node cluster with 2 SPs per node: instances 0 and 1 on both DPUs. The node
/// comes from the host name (node 1's DPU name is this machine's) or, standing in for another
/// machine, `--node` in SPOFF_SERVE_ARGS (node 0). Every SP serves, with its cluster-wide id.
#[test]
fn the_same_unit_instances_serve_on_every_dpu() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/systemd/spoff-sp@.service");
    let unit = std::fs::read_to_string(unit).unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("the unit has an ExecStart");
    let mut sps = TcpSps::describe(&exe(), 2, 2, 1);
    let host = service_process::deploy::host_name().unwrap();
    let other = format!("not-{host}-dpu");
    sps.cluster.hosts = vec!["h0".into(), "h1".into()];
    sps.cluster.dpus = vec![other.clone(), host.clone()];
    for e in &mut sps.cluster.sps {
        e.host_socket = sps.run_dir.join(format!("run/{}/host.sock", e.id));
    }
    sps.cluster.save(&sps.cluster_path).unwrap();
    sps.release_listeners();
    let key = service_process::launch::key_path(&sps.cluster_path);
    let mut children = Vec::new();
    for node in 0..2u32 {
        for instance in 0..2u32 {
            let serve_args = if node == 0 {
                format!("--node {other}")
            } else {
                String::new()
            };
            let line = exec
                .replace("%i", &instance.to_string())
                .replace("$SPOFF_SERVE_ARGS", &serve_args)
                .replace(
                    "/usr/local/bin/service-process",
                    &exe().display().to_string(),
                )
                .replace(
                    "/etc/spoff/cluster.json",
                    &sps.cluster_path.display().to_string(),
                )
                .replace("/etc/spoff/cluster.key", &key.display().to_string());
            let argv: Vec<&str> = line.split_whitespace().collect();
            let child = Command::new(argv[0])
                .args(&argv[1..])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            children.push((node, instance, child));
        }
    }
    // Each prints READY sp=N once its mesh is up, N = node * 2 + instance.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut outs = Vec::new();
    for (node, instance, mut child) in children {
        let mut stdout = child.stdout.take().unwrap();
        let want = format!("READY sp={}", node * 2 + instance);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut buf = [0u8; 256];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
                let _ = tx.send(String::from_utf8_lossy(&got).into_owned());
            }
        });
        let mut seen = String::new();
        while !seen.contains(&want) {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(s) => seen = s,
                Err(_) => break,
            }
        }
        outs.push((node, instance, want, seen, child));
    }
    let mut failed = Vec::new();
    for (node, instance, want, seen, mut child) in outs {
        // SAFETY: kill with a pid of our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let _ = child.wait();
        if !seen.contains(&want) {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            failed.push(format!(
                "node {node} spoff-sp@{instance}: no {want:?}; stdout {seen:?}; stderr {err}"
            ));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// The local index of `--sp-id local:I` is checked against the description: one line naming
/// what is wrong, at once.
#[test]
fn serve_local_index_beyond_the_sps_of_a_node_is_refused_at_once() {
    let mut sps = TcpSps::describe(&exe(), 2, 2, 1);
    let host = service_process::deploy::host_name().unwrap();
    sps.cluster.hosts = vec!["h0".into(), "h1".into()];
    sps.cluster.dpus = vec![format!("not-{host}"), host];
    sps.cluster.save(&sps.cluster_path).unwrap();
    sps.release_listeners();
    let t = Instant::now();
    let out = sps
        .serve_cmd()
        .args(["--sp-id", "local:2"])
        .output()
        .unwrap();
    let (_, err) = text(&out);
    assert!(!out.status.success());
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(
        err.contains(
            "--sp-id local:2: the cluster description has 2 SPs per node (local:0 to local:1)"
        ),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let out = sps
        .serve_cmd()
        .args(["--sp-id", "local:x"])
        .output()
        .unwrap();
    let (_, err) = text(&out);
    assert!(!out.status.success());
    assert!(err.contains("local:x"), "{err}");
}

/// `cluster check` of the description's UCX port range: a valid one passes and is summarised;
/// a reversed one, one with port 0, one that is not a range and one that holds an SP's own
/// port are refused, each naming the field.
#[test]
fn cluster_check_validates_the_ucx_port_range() {
    let sps = TcpSps::describe(&exe(), 2, 1, 1);
    let text0 = std::fs::read_to_string(&sps.cluster_path).unwrap();
    let peer0 = sps.cluster.sps[0].peer_addr.port();
    let check = |range: serde_json::Value| {
        let mut v: serde_json::Value = serde_json::from_str(&text0).unwrap();
        v["ucx_tcp_port_range"] = range;
        let path = sps.run_dir.join("check.json");
        std::fs::write(&path, v.to_string()).unwrap();
        let out = Command::new(exe())
            .args(["cluster", "check"])
            .arg(&path)
            .output()
            .unwrap();
        let (o, e) = text(&out);
        (out.status.code(), o, e)
    };
    // A range clear of the SPs' own ports (below the kernel's ephemeral ones, where they are).
    let ports: Vec<u16> = sps
        .cluster
        .sps
        .iter()
        .flat_map(|e| [Some(e.peer_addr.port()), e.host_addr.map(|a| a.port())])
        .flatten()
        .collect();
    let first = (20_000u16..)
        .step_by(1000)
        .find(|f| !ports.iter().any(|p| (*f..=f + 999).contains(p)))
        .unwrap();
    let good = format!("{first}-{}", first + 999);
    let (code, out, err) = check(good.clone().into());
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains(&format!("UCX TCP ports {good}")), "{out}");
    for (bad, why) in [
        (
            serde_json::Value::from("5000-4000"),
            "first port above the last",
        ),
        ("0-100".into(), "port 0"),
        ("40000".into(), "not a port range"),
        ("40000-70000".into(), "not a port range"),
        (
            format!("{}-{}", peer0 - 1, peer0 + 1).into(),
            "sps[0].peer_addr",
        ),
    ] {
        let (code, out, err) = check(bad.clone());
        assert_eq!(code, Some(1), "{bad}: {out}{err}");
        let line = err
            .lines()
            .find(|l| l.contains("ucx_tcp_port_range"))
            .unwrap_or_else(|| panic!("{bad}: no line names the field:\n{err}"));
        assert!(line.contains(why), "{bad}: {line}");
    }
}
