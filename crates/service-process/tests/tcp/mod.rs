//! Real SPs (`service-process serve`) whose cluster description gives every SP a host TCP
//! address on loopback (`host_addr`), started one by one, as a site's own tools would (not
//! through `launch`). Shared by the SP's TCP tests and the workspace's mpirun test over TCP
//! (included there by path).
#![allow(dead_code)]

use bootstrap::auth::ClusterKey;
use bootstrap::{Cluster, Layout};
use service_process::launch::{self, Sp, SpSetSpec};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

pub struct TcpSps {
    pub exe: PathBuf,
    pub run_dir: PathBuf,
    pub cluster_path: PathBuf,
    pub cluster: Cluster,
    pub key: ClusterKey,
    /// Started SPs, by start order.
    pub sps: Vec<Sp>,
    /// Every stdout line of every SP: (SP id, line).
    pub lines: mpsc::Receiver<(u32, String)>,
    tx: mpsc::Sender<(u32, String)>,
    /// Peer listeners of the SPs not started yet, by SP id.
    listeners: Vec<Option<TcpListener>>,
}

impl TcpSps {
    /// Writes the description of `nodes` x `k` SPs (block layout, `ranks_per_node`), each with
    /// a host TCP address on loopback, and its key; starts nothing.
    pub fn describe(exe: &Path, nodes: u32, k: u32, ranks_per_node: u32) -> TcpSps {
        let run_dir = launch::new_run_dir().unwrap();
        let spec = SpSetSpec {
            nodes,
            sps_per_node: k,
            ranks_per_node,
            layout: Layout::Block,
            sp_cpus: None,
            max_inflight_reads: 4,
            extra_args: vec![],
            sp_args: vec![],
        };
        let (path, listeners) = launch::write_cluster(&spec, &run_dir).unwrap();
        let mut cluster = Cluster::load(&path).unwrap();
        // Held until every SP has its own: a port bound and released at once may come back
        // from the next bind (two SPs given one host address: the second cannot listen).
        let held: Vec<TcpListener> = cluster
            .sps
            .iter()
            .map(|_| launch::loopback_listener().unwrap())
            .collect();
        for (e, l) in cluster.sps.iter_mut().zip(&held) {
            e.host_addr = Some(l.local_addr().unwrap());
        }
        drop(held);
        cluster.save(&path).unwrap();
        let key = ClusterKey::load(&launch::key_path(&path)).unwrap();
        let (tx, lines) = mpsc::channel();
        TcpSps {
            exe: exe.to_path_buf(),
            run_dir,
            cluster_path: path,
            cluster,
            key,
            sps: Vec::new(),
            lines,
            tx,
            listeners: listeners.into_iter().map(Some).collect(),
        }
    }

    /// Starts SP `id` with more `serve` arguments (it prints READY once its peers are up).
    pub fn start(&mut self, id: u32, args: &[&str]) {
        let l = self.listeners[id as usize]
            .take()
            .expect("each SP is started once");
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let sp = launch::spawn_sp(
            &self.exe,
            &self.cluster_path,
            id,
            l,
            &args,
            None,
            self.tx.clone(),
        )
        .unwrap();
        self.sps.push(sp);
    }

    /// Starts every SP not started yet and waits for all of them to print READY.
    pub fn start_all(&mut self, args: &[&str]) {
        for id in 0..self.cluster.sps.len() as u32 {
            if self.listeners[id as usize].is_some() {
                self.start(id, args);
            }
        }
        launch::wait_ready(&mut self.sps, &self.lines, Duration::from_secs(30), None).unwrap();
    }

    /// SIGTERM to every SP; the counters each printed at exit, by SP id.
    pub fn stop_and_stats(&mut self) -> Vec<serde_json::Value> {
        launch::stop_sps(&mut self.sps, Duration::from_secs(5));
        let mut stats = vec![serde_json::Value::Null; self.cluster.sps.len()];
        while let Ok((id, line)) = self.lines.recv_timeout(Duration::from_millis(200)) {
            if let Some(json) = line.strip_prefix("STATS ") {
                stats[id as usize] = serde_json::from_str(json).unwrap();
            }
        }
        stats
    }

    /// Closes the peer listeners held for SPs not started yet, for SPs started without one
    /// (they bind their peer address themselves).
    pub fn release_listeners(&mut self) {
        self.listeners.iter_mut().for_each(|l| *l = None);
    }

    /// `serve` of this cluster (description and key), to which the caller adds `--sp-id`.
    pub fn serve_cmd(&self) -> std::process::Command {
        let mut c = std::process::Command::new(&self.exe);
        c.arg("serve")
            .arg("--cluster")
            .arg(&self.cluster_path)
            .arg("--key")
            .arg(launch::key_path(&self.cluster_path))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        c
    }

    pub fn host_addr(&self, sp: u32) -> SocketAddr {
        self.cluster.sps[sp as usize].host_addr.unwrap()
    }
}

impl Drop for TcpSps {
    fn drop(&mut self) {
        launch::stop_sps(&mut self.sps, Duration::from_secs(3));
        let _ = std::fs::remove_dir_all(&self.run_dir);
    }
}
