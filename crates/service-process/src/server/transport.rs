//! Connections: accepting hosts (on the Unix socket with their kernel credentials and pidfds;
//! over TCP with nothing but their address until their job credential is checked, see
//! `access::HostPeer`), reading frames and dispatching them by role (a host the SP cannot
//! attach to is kept from asking for cross-memory attach: `remote_gate`), writing frames, and
//! closing broken connections after the handler that found them is done.

use super::*;

/// Who a connection without a hello comes from, as far as the SP can tell before any
/// credential: the uid the kernel names on the Unix socket, the address over TCP.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Source {
    Uid(u32),
    Ip(std::net::IpAddr),
}

fn source(peer: &HostPeer) -> Source {
    match peer {
        HostPeer::Local(p) => Source::Uid(p.uid),
        HostPeer::Tcp { addr, .. } => Source::Ip(addr.ip()),
    }
}

impl Server {
    /// Whether one more host connection fits the limits (counted and logged if not). A
    /// connection without a hello costs little (a hello's bytes, `--hello-timeout-ms`) and a
    /// rank says hello as soon as it connects: when those waiting fill their share, the oldest
    /// of them is closed to make room (from the source holding the most), so that idle
    /// connections can delay no hello. A connection accepted in this pass of the event loop is
    /// never the one closed: its hello, if it came with the connection, is read first (the
    /// pass's reads come before its accepts). Refused: authenticated hosts fill `max_hosts`,
    /// or every connection waiting came in this pass.
    fn host_room(&mut self, via: &str) -> bool {
        let (mut hosts, mut pending) = (0, 0);
        for (_, c) in self.conns.iter() {
            match c.role {
                Role::NewHost { .. } => pending += 1,
                Role::Host(_) => hosts += 1,
                Role::Peer(_) => {}
            }
        }
        let (max_hosts, max_pending) = (self.limits.max_hosts, self.limits.max_pending_hellos);
        let full = hosts + pending >= max_hosts || pending >= max_pending;
        let why = if hosts >= max_hosts || max_pending == 0 {
            ""
        } else if full && !self.evict_oldest_pending(via) {
            ", every one of them accepted in this pass of the event loop"
        } else {
            return true;
        };
        self.stats.hosts_refused += 1;
        self.client_warn(|| {
            format!(
                "refusing a host connection ({via}): {hosts} hosts and {pending} without a \
                 hello already (limits {max_hosts} and {max_pending}){why}"
            )
        });
        false
    }

    /// Closes the connection without a hello that has waited longest, of the source (uid or
    /// address) with the most of them waiting, among those accepted before this pass; false
    /// if there is none.
    fn evict_oldest_pending(&mut self, via: &str) -> bool {
        let mut by_source: HashMap<Source, (usize, Instant, usize)> = HashMap::new();
        for (k, c) in self.conns.iter() {
            if let Role::NewHost {
                peer,
                since,
                accepted_in,
            } = &c.role
            {
                if *accepted_in >= self.pass {
                    continue;
                }
                let e = by_source.entry(source(peer)).or_insert((0, *since, k));
                e.0 += 1;
                if *since < e.1 {
                    (e.1, e.2) = (*since, k);
                }
            }
        }
        let Some(&(n, since, victim)) = by_source.values().max_by_key(|(n, since, _)| {
            // The most connections waiting; among equals, the oldest one.
            (*n, std::cmp::Reverse(*since))
        }) else {
            return false;
        };
        self.stats.hellos_evicted += 1;
        let waited = since.elapsed().as_millis();
        self.client_warn(|| {
            format!(
                "a host connection ({via}) closes the oldest of {n} connections of one source \
                 without a hello (it waited {waited} ms)"
            )
        });
        self.close_conn(
            victim,
            "evicted: no hello, and newer connections need the room",
        );
        true
    }

    /// Hosts on the Unix socket: the kernel names their process (`SO_PEERCRED`, pidfd). At
    /// most [`ACCEPTS_PER_PASS`]; true once none is left waiting.
    pub(super) fn accept_hosts(&mut self) -> bool {
        for _ in 0..ACCEPTS_PER_PASS {
            match self.hosts_listener.accept() {
                Ok((s, _)) => {
                    if !self.host_room("unix socket") {
                        continue;
                    }
                    let peer = match access::peer_cred(&s) {
                        Ok(p) => p,
                        Err(e) => {
                            self.client_warn(|| {
                                format!("cannot identify the process of a host connection: {e}")
                            });
                            continue;
                        }
                    };
                    let (pid, exec_since) = (peer.pid, peer.exec_since);
                    let (peer, since) = (HostPeer::Local(peer), Instant::now());
                    let accepted_in = self.pass;
                    let role = Role::NewHost {
                        peer,
                        since,
                        accepted_in,
                    };
                    match self.add_conn(Stream::Unix(s), role) {
                        Ok(key) => {
                            self.stats.host_conns_unix += 1;
                            self.watch_pidfd(key);
                            if exec_since {
                                self.end_old_images(pid, Some(key));
                            }
                        }
                        Err(e) => warn!("cannot register a host connection: {e}"),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(e) => {
                    warn!("accept on the host socket failed: {e}");
                    return true;
                }
            }
        }
        false
    }

    /// Hosts over TCP: nothing is known of them but their address until their hello's job
    /// credential is checked (`identify_host`). Bounded and timed exactly as Unix hosts. At
    /// most [`ACCEPTS_PER_PASS`]; true once none is left waiting.
    pub(super) fn accept_tcp_hosts(&mut self) -> bool {
        for _ in 0..ACCEPTS_PER_PASS {
            let Some(l) = &self.hosts_tcp else {
                return true;
            };
            match l.accept() {
                Ok((s, addr)) => {
                    if !self.host_room(&format!("tcp from {addr}")) {
                        continue;
                    }
                    if let Err(e) = access::tune_tcp(&s) {
                        warn!(sp = self.me, "cannot set TCP options for host {addr}: {e}");
                    }
                    let peer = HostPeer::Tcp {
                        addr,
                        same_kernel: self.hosts_same_kernel,
                        pinned: None,
                    };
                    let (since, accepted_in) = (Instant::now(), self.pass);
                    let role = Role::NewHost {
                        peer,
                        since,
                        accepted_in,
                    };
                    match self.add_conn(Stream::Tcp(s), role) {
                        Ok(_) => self.stats.host_conns_tcp += 1,
                        Err(e) => warn!("cannot register a host connection: {e}"),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // ECONNABORTED and the like concern one client; EMFILE clears as
                    // connections close. Either way the next readiness event tries again.
                    warn!(sp = self.me, "accept on the host TCP listener failed: {e}");
                    return true;
                }
            }
        }
        false
    }

    /// Checks the hello of new host connection `key` (its credential, and for a TCP host on
    /// this kernel the process it names, which is then pinned and watched); returns the job's
    /// credential or why the host is refused.
    pub(super) fn identify_host(
        &mut self,
        key: usize,
        hello: &HostHello,
    ) -> Result<auth::JobCredential, String> {
        let Some(Role::NewHost { peer, .. }) = self.conns.get_mut(key).map(|c| &mut c.role) else {
            return Err("the connection is gone".into());
        };
        let cred = access::check_hello(hello, &self.key, peer.kernel_uid(), &self.limits)
            .map_err(|e| e.to_string())?;
        if let HostPeer::Tcp {
            same_kernel: true,
            pinned,
            ..
        } = peer
        {
            let p = access::pin_claimed(hello.pid, cred.uid)?;
            let (pid, exec_since) = (p.pid, p.exec_since);
            *pinned = Some(p);
            self.watch_pidfd(key);
            if exec_since {
                self.end_old_images(pid, Some(key));
            }
        }
        Ok(cred)
    }

    /// Ends the connections of every host process that has called `exec` since it connected
    /// (checked once a heartbeat period: one byte read through each pinned image), so that
    /// no connection of a program that no longer runs outlives it by more than that, even
    /// when nothing touches its memory.
    pub(super) fn end_exec_images(&mut self) {
        let mut gone: Vec<u32> = self
            .conns
            .iter()
            .filter_map(|(_, c)| match &c.role {
                Role::Host(h) => h.peer.pinned(),
                Role::NewHost { peer, .. } => peer.pinned(),
                Role::Peer(_) => None,
            })
            .filter(|p| {
                alias_mkey::process::image_alive(p.pid, p.start, p.uid, p.gid) == Some(false)
            })
            .map(|p| p.pid)
            .collect();
        gone.sort_unstable();
        gone.dedup();
        for pid in gone {
            self.end_old_images(pid, None);
        }
    }

    /// Process `pid` has called `exec` since some of its connections were made (a new
    /// connection of it found its old image gone, or an access found no memory): those
    /// connections and their grants belong to a program that no longer runs, whoever holds the
    /// sockets now (a child forked before the `exec`). Ends every host connection pinned to
    /// `pid` but `keep`.
    pub(super) fn end_old_images(&mut self, pid: u32, keep: Option<usize>) {
        let doomed: Vec<usize> = self
            .conns
            .iter()
            .filter(|(k, c)| {
                Some(*k) != keep
                    && match &c.role {
                        Role::NewHost { peer, .. } => peer.pid() == pid,
                        Role::Host(h) => h.peer.pid() == pid,
                        Role::Peer(_) => false,
                    }
            })
            .map(|(k, _)| k)
            .collect();
        for k in doomed {
            self.stats.hosts_exec_ended += 1;
            self.close_conn(k, "the rank's process executed another program");
        }
    }

    /// Stops watching and unpins the process of a host connection that closed.
    pub(super) fn release_peer(&self, peer: &HostPeer) {
        if let Some(p) = peer.pinned() {
            let _ = self
                .poll
                .registry()
                .deregister(&mut mio::unix::SourceFd(&p.pidfd.as_raw_fd()));
            alias_mkey::process::unpin(p.pid, p.start);
        }
    }

    /// A host the SP cannot reach by cross-memory attach (over TCP from another machine) may
    /// not ask for it: no `cma` mailbox (it registers 0 slots and its posts complete by
    /// message), no `cma` grant in a post. `Err`: the error for the host.
    fn remote_gate(&self, key: usize, msg: &HostToSp) -> Result<(), String> {
        let Some(Role::Host(h)) = self.conns.get(key).map(|c| &c.role) else {
            return Ok(());
        };
        if h.peer.serves_cma() {
            return Ok(());
        }
        const WHY: &str = "this SP cannot attach to the memory of a host over TCP (serve \
                           --hosts-same-kernel declares hosts on its kernel)";
        match msg {
            HostToSp::Register { mailbox_slots, .. } if *mailbox_slots > 0 => Err(format!(
                "a mailbox of {mailbox_slots} slots: {WHY}; register 0 slots and take \
                 completions as messages"
            )),
            HostToSp::Post(d) => {
                let cma = |g: &Grant| g.backend == BackendData::Cma;
                if cma(&d.send) || cma(&d.recv) {
                    Err(format!("a cma grant: {WHY}; grant memory through ucx"))
                } else if d.staged.as_ref().is_some_and(|st| st.segment.is_some()) {
                    Err(format!(
                        "a node segment (hierarchical staged design): {WHY}; use a flat design"
                    ))
                } else {
                    Ok(())
                }
            }
            _ => Ok(()),
        }
    }

    /// Registers the pidfd of host connection `key` with the poller: readable once the
    /// connected process has exited, even if another process (a child it forked) still holds
    /// the socket.
    pub(super) fn watch_pidfd(&mut self, key: usize) {
        let fd = match self.conns.get(key).map(|c| &c.role) {
            Some(Role::NewHost { peer, .. }) => match peer.pinned() {
                Some(p) => p.pidfd.as_raw_fd(),
                None => return,
            },
            _ => return,
        };
        let registered = self.poll.registry().register(
            &mut mio::unix::SourceFd(&fd),
            Token(PIDFD_BASE + key),
            Interest::READABLE,
        );
        if let Err(e) = registered {
            warn!(sp = self.me, "cannot watch a host's process: {e}");
        }
    }

    /// The pidfd of host connection `key` became readable: if its process has exited, the
    /// rank is gone, whoever still holds the socket.
    pub(super) fn on_pidfd(&mut self, key: usize) {
        let peer = match self.conns.get(key).map(|c| &c.role) {
            Some(Role::NewHost { peer, .. }) => peer,
            Some(Role::Host(h)) => &h.peer,
            _ => return,
        };
        if peer
            .pinned()
            .is_some_and(|p| !alias_mkey::process::alive(&p.pidfd))
        {
            self.close_conn(key, "the rank's process exited");
        }
    }

    /// A warning a client can cause, within the log's rate limit.
    pub(super) fn client_warn(&mut self, msg: impl FnOnce() -> String) {
        let (log, suppressed) = self.log_limit.admit(Instant::now());
        if let Some(n) = suppressed {
            warn!(sp = self.me, "{n} more client warnings were suppressed");
        }
        if log {
            warn!(sp = self.me, "{}", msg());
        }
    }

    /// Reads what connection `key` has sent. Before its hello, only the hello is read (at most
    /// [`wire::MAX_HELLO_FRAME_BYTES`], not a byte past it); once the hello made it a host,
    /// what follows is read under a host's frame bound. `drain`: read to `WouldBlock` even on
    /// TCP (see `Conn::read_frames`): the event said the other side closed or the socket
    /// failed, or no event says what there is to read.
    pub(super) fn on_readable(&mut self, key: usize, drain: bool) {
        loop {
            let Some(conn) = self.conns.get_mut(key) else {
                return;
            };
            let before_hello = matches!(conn.role, Role::NewHost { .. });
            let mut frames = Vec::new();
            let end = if before_hello {
                conn.read_one_frame(|f| frames.push(f))
            } else {
                conn.read_frames(drain, |f| frames.push(f))
            };
            self.read_at_ns = bootstrap::stamps::now_ns();
            let got_hello = before_hello && !frames.is_empty();
            for f in frames {
                self.on_frame(key, f);
                // Copies a post ran on this thread complete at once, not after the rest of
                // the pass (another read of this socket, the timers).
                if !self.inline_done.is_empty() {
                    self.on_copies_done();
                }
                if !self.conns.contains(key) || self.is_doomed(key) {
                    return;
                }
            }
            match end {
                Ok(ReadEnd::Open) => {}
                Ok(ReadEnd::Closed) => return self.close_conn(key, "closed by the other side"),
                Err(e) => {
                    // An oversized or undecodable frame: the stream can no longer be trusted.
                    self.send_error(key, None, ErrorCode::BadDescriptor, e.to_string());
                    return self.close_conn(key, &e.to_string());
                }
            }
            match self.conns.get_mut(key) {
                Some(c) if got_hello && matches!(c.role, Role::Host(_)) => {
                    c.set_max_frame(wire::MAX_FRAME_BYTES)
                }
                _ => return,
            }
        }
    }

    pub(super) fn flush_conn(&mut self, key: usize) {
        if let Some(c) = self.conns.get_mut(key) {
            if let Err(e) = c.flush() {
                self.close_conn(key, &format!("write failed: {e}"));
            }
        }
    }

    /// Sends `msg` to peer SP `sp` if it is connected (a lost peer needs nothing more).
    pub(super) fn send_peer(&mut self, sp: SpId, msg: &SpToSp) {
        if let Some(k) = self.peer_conn.get(&sp).copied() {
            self.send_frame(k, &encode(msg));
        }
    }

    pub(super) fn send_frame(&mut self, key: usize, frame: &[u8]) {
        if let Some(c) = self.conns.get_mut(key) {
            if let Err(e) = c.send(frame) {
                let serial = c.serial;
                if !self.doomed.iter().any(|d| d.0 == key && d.1 == serial) {
                    self.doomed
                        .push((key, serial, format!("write failed: {e}")));
                }
            }
        }
    }

    /// Whether connection `key` is to be closed (see `doomed`).
    pub(super) fn is_doomed(&self, key: usize) -> bool {
        let serial = self.conns.get(key).map(|c| c.serial);
        self.doomed
            .iter()
            .any(|d| Some(d.1) == serial && d.0 == key)
    }

    /// Closes the connections found broken by the handlers that just ran.
    pub(super) fn close_doomed(&mut self) {
        while let Some((key, serial, why)) = self.doomed.pop() {
            if self.conns.get(key).is_some_and(|c| c.serial == serial) {
                self.close_conn(key, &why);
            }
        }
    }

    pub(super) fn send_error(
        &mut self,
        key: usize,
        post: Option<&PostDesc>,
        code: ErrorCode,
        message: String,
    ) {
        self.stats.errors_sent += 1;
        let msg = SpToHost::Error {
            comm: post.map(|p| p.comm),
            seq: post.map(|p| p.seq),
            code,
            message,
        };
        self.send_frame(key, &encode(&msg));
    }

    pub(super) fn on_frame(&mut self, key: usize, payload: Vec<u8>) {
        if let Some(rec) = &mut self.recorder {
            let c = &self.conns[key];
            let kind = if matches!(c.role, Role::Peer(_)) {
                "peer"
            } else {
                "host"
            };
            rec.record(kind, c.serial, &payload);
        }
        let role = match &self.conns[key].role {
            Role::NewHost { .. } => None,
            Role::Host(_) => Some(true),
            Role::Peer(sp) => {
                self.last_heard.insert(*sp, Instant::now());
                Some(false)
            }
        };
        // A host's ring entries written before this frame go first; the frame counts once
        // the host is registered (the ring's entries say how many went before them).
        let registered = match &self.conns[key].role {
            Role::Host(h) => h.mailbox.is_some(),
            _ => false,
        };
        if registered {
            self.drain_ring(key);
            if !self.conns.contains(key) || self.is_doomed(key) {
                return;
            }
            if let Role::Host(h) = &mut self.conns[key].role {
                h.frames_in += 1;
            }
        }
        match role {
            None => self.on_host_hello(key, &payload),
            Some(true) => match wire::decode_host(&payload) {
                Ok(msg) => match self.remote_gate(key, &msg) {
                    Ok(()) => self.on_host_msg(key, msg),
                    Err(why) => {
                        let post = match &msg {
                            HostToSp::Post(d) => {
                                // Counted as every post is, refused as those beyond a limit.
                                self.stats.posts += 1;
                                self.stats.posts_refused += 1;
                                Some(&**d)
                            }
                            _ => None,
                        };
                        self.client_warn(|| format!("refused from a host over TCP: {why}"));
                        self.send_error(key, post, ErrorCode::BadDescriptor, why);
                    }
                },
                Err(e) => {
                    let rank = self.host(key).hello.world_rank;
                    self.client_warn(|| format!("undecodable message from rank {rank}: {e}"));
                    self.send_error(key, None, ErrorCode::BadDescriptor, e.to_string());
                }
            },
            Some(false) => match decode::<SpToSp>(&payload) {
                Ok(msg) => self.on_peer_msg(key, msg),
                Err(e) => warn!(sp = self.me, "undecodable message from a peer SP: {e}"),
            },
        }
    }
}
