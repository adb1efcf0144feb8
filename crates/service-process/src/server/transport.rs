//! Connections: accepting hosts (with their credentials and pidfds), reading frames and
//! dispatching them by role, writing frames, and closing broken connections after the handler
//! that found them is done.

use super::*;

impl Server {
    pub(super) fn accept_hosts(&mut self) {
        loop {
            match self.hosts_listener.accept() {
                Ok((s, _)) => {
                    let (mut hosts, mut pending) = (0, 0);
                    for (_, c) in self.conns.iter() {
                        match c.role {
                            Role::NewHost { .. } => pending += 1,
                            Role::Host(_) => hosts += 1,
                            Role::Peer(_) => {}
                        }
                    }
                    if hosts + pending >= self.limits.max_hosts
                        || pending >= self.limits.max_pending_hellos
                    {
                        self.stats.hosts_refused += 1;
                        let (max_hosts, max_pending) =
                            (self.limits.max_hosts, self.limits.max_pending_hellos);
                        self.client_warn(|| {
                            format!(
                                "refusing a host connection: {hosts} hosts and {pending} without \
                                 a hello already (limits {max_hosts} and {max_pending})"
                            )
                        });
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
                    let since = Instant::now();
                    match self.add_conn(Stream::Unix(s), Role::NewHost { peer, since }) {
                        Ok(key) => self.watch_pidfd(key),
                        Err(e) => warn!("cannot register a host connection: {e}"),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    warn!("accept on the host socket failed: {e}");
                    return;
                }
            }
        }
    }

    /// Registers the pidfd of host connection `key` with the poller: readable once the
    /// connected process has exited, even if another process (a child it forked) still holds
    /// the socket.
    pub(super) fn watch_pidfd(&mut self, key: usize) {
        let fd = match self.conns.get(key).map(|c| &c.role) {
            Some(Role::NewHost { peer, .. }) => peer.pidfd.as_raw_fd(),
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
        let gone = match self.conns.get(key).map(|c| &c.role) {
            Some(Role::NewHost { peer, .. }) => !alias_mkey::process::alive(&peer.pidfd),
            Some(Role::Host(h)) => !alias_mkey::process::alive(&h.peer.pidfd),
            _ => false,
        };
        if gone {
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

    pub(super) fn on_readable(&mut self, key: usize) {
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        let mut frames = Vec::new();
        let end = conn.read_frames(|f| frames.push(f));
        for f in frames {
            self.on_frame(key, f);
            if !self.conns.contains(key) || self.is_doomed(key) {
                return;
            }
        }
        match end {
            Ok(ReadEnd::Open) => {}
            Ok(ReadEnd::Closed) => self.close_conn(key, "closed by the other side"),
            Err(e) => {
                // An oversized or undecodable frame: the stream can no longer be trusted.
                self.send_error(key, None, ErrorCode::BadDescriptor, e.to_string());
                self.close_conn(key, &e.to_string());
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
        match role {
            None => self.on_host_hello(key, &payload),
            Some(true) => match decode::<HostToSp>(&payload) {
                Ok(msg) => self.on_host_msg(key, msg),
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
