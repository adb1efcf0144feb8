//! Host ranks: hello (credential, job agreement), registration, their messages, their grants
//! as alias keys, and what happens when one goes.

use super::*;
use bootstrap::post_ring::Next;

impl Server {
    /// The first frame of a host connection: a rank's hello, or an admin request.
    pub(super) fn on_host_hello(&mut self, key: usize, payload: &[u8]) {
        let Some(Role::NewHost { peer, .. }) = self.conns.get(key).map(|c| &c.role) else {
            return;
        };
        let who = peer.describe();
        let reject = |s: &mut Self, reason: String| {
            s.stats.hellos_refused += 1;
            let shown = reason.clone();
            s.client_warn(|| format!("refusing host {who}: {shown}"));
            s.send_frame(key, &frame(&encode_hello(&Hello::Reject { reason })));
            s.close_conn(key, "hello refused");
        };
        let hello = match decode_hello(payload) {
            Ok(Hello::Host(h)) => h,
            Ok(Hello::Admin(a)) => {
                if let Err(why) = self.admin_check(&a) {
                    return reject(self, why);
                }
                // `service-process stats`: the counters now, then goodbye.
                let json = serde_json::to_string(&self.stats_now()).unwrap_or_default();
                self.send_frame(key, &encode(&json));
                self.close_conn(key, "stats sent");
                return;
            }
            Ok(other) => return reject(self, format!("expected a host hello, got {other:?}")),
            Err(e) => return reject(self, e.to_string()),
        };
        let cred = match self.identify_host(key, &hello) {
            Ok(c) => c,
            Err(why) => return reject(self, why),
        };
        // The rank placed itself (its node from MPI, its SP local rank mod K of its node):
        // it must have come to the SP that placement names.
        let (node, index) = self
            .cluster
            .sp(self.me)
            .map_or((u32::MAX, u32::MAX), |e| (e.node, e.index));
        let k = self.cluster.sps_per_node;
        if hello.node != node || hello.local_rank % k != index {
            return reject(
                self,
                format!(
                    "rank {} says it is local rank {} of node {}: that is the SP of index {} of \
                     node {}, not this SP {} (index {index} of node {node})",
                    hello.world_rank,
                    hello.local_rank,
                    hello.node,
                    hello.local_rank % k,
                    hello.node,
                    self.me
                ),
            );
        }
        if self
            .jobs
            .get(&cred.job)
            .is_some_and(|j| j.ranks.contains(&hello.world_rank))
        {
            return reject(
                self,
                format!(
                    "rank {} of this job is already connected to SP {}",
                    hello.world_rank, self.me
                ),
            );
        }
        // Which SP serves a world rank is what the job's collectives here rely on (each
        // descriptor is checked against it; locality comes from it): once a descriptor named
        // it, a hello cannot move it (a job credential replayed over TCP as a rank of
        // another SP).
        if let Some(&was) = self
            .jobs
            .get(&cred.job)
            .and_then(|j| j.sp_of_rank.get(&hello.world_rank))
        {
            if was != self.me {
                return reject(
                    self,
                    format!(
                        "rank {} of this job is served by SP {was} (the job's collectives here \
                         said so), not this SP {}",
                        hello.world_rank, self.me
                    ),
                );
            }
        }
        debug!(
            sp = self.me,
            job = cred.job,
            rank = hello.world_rank,
            who,
            "host connected"
        );
        let dead = &self.dead_peers;
        let job = self.jobs.entry(cred.job).or_insert_with(|| Job {
            lost_sps: dead.clone(),
            ..Job::default()
        });
        job.world_size = cred.world_size;
        job.uid = cred.uid;
        job.hosts.insert(key);
        job.ranks.insert(hello.world_rank);
        if let std::collections::hash_map::Entry::Vacant(e) = job.sp_of_rank.entry(hello.world_rank)
        {
            e.insert(self.me);
            job.hello_only.insert(hello.world_rank);
        }
        self.next_conn_id += 1;
        let conn_id = self.next_conn_id;
        let conn = &mut self.conns[key];
        let Role::NewHost { peer, .. } = std::mem::replace(&mut conn.role, Role::Peer(SpId::MAX))
        else {
            unreachable!("checked above");
        };
        // Its `Register` may pass its post ring's descriptor; nothing else may.
        conn.fds_allowed = true;
        conn.role = Role::Host(HostState {
            conn_id,
            hello,
            job: cred.job,
            peer,
            mailbox: None,
            said_goodbye: false,
            outstanding: 0,
            ring: None,
            frames_in: 0,
        });
        self.send_frame(key, &frame(&encode_hello(&Hello::Welcome { sp: self.me })));
    }

    /// Whether an admin request may be answered: proven with the cluster key for this SP,
    /// made within a minute of this SP's clock, and not answered before (`Err`: why not).
    pub(super) fn admin_check(&mut self, a: &AdminHello) -> Result<(), String> {
        if !auth::admin_proof_ok(&self.key, self.me, &a.nonce, a.unix_secs, &a.proof) {
            return Err(format!(
                "the admin request is not proven with the cluster key for SP {}",
                self.me
            ));
        }
        let off = auth::unix_secs().abs_diff(a.unix_secs);
        if off > auth::ADMIN_WINDOW_SECS {
            return Err(format!(
                "the admin request was made {off} s away from this SP's clock (at most {} s)",
                auth::ADMIN_WINDOW_SECS
            ));
        }
        self.admin_replays.admit(Instant::now(), &a.proof)
    }

    pub(super) fn host(&self, key: usize) -> &HostState {
        match &self.conns[key].role {
            Role::Host(h) => h,
            _ => unreachable!("connection {key} is not a host"),
        }
    }

    pub(super) fn on_host_msg(&mut self, key: usize, msg: HostToSp) {
        match msg {
            HostToSp::Register {
                cores: _,
                mailbox,
                mailbox_slots,
                post_ring,
            } => {
                let h = self.host(key);
                if h.mailbox.is_some() {
                    return self.send_error(
                        key,
                        None,
                        ErrorCode::NotRegistered,
                        "already registered".into(),
                    );
                }
                let need = mailbox::slot_offset(mailbox_slots);
                // A host the SP cannot attach to registers no mailbox (0 slots, see
                // `remote_gate`): its posts complete by message.
                let slotless = mailbox_slots == 0 && !h.peer.serves_cma();
                if !slotless
                    && (mailbox.len < need
                        || !mailbox.rights.contains(Rights::READ_WRITE)
                        || mailbox.backend != BackendData::Cma
                        || mailbox_slots == 0)
                {
                    return self.send_error(
                        key,
                        None,
                        ErrorCode::BadDescriptor,
                        format!(
                            "mailbox grant of {} bytes ({}) cannot hold {mailbox_slots} slots \
                             of {} bytes read-write through cma",
                            mailbox.len,
                            mailbox.rights,
                            mailbox::SLOT_BYTES
                        ),
                    );
                }
                let alias = self.alias(key, mailbox);
                let sp = self.me;
                let node = self.cluster.sp(sp).map_or(0, |e| e.node);
                let segment = access::segment_name(&self.key, alias.owner.job, node);
                let ring = self.take_ring(key, post_ring);
                let post_ring_off = ring.as_ref().err().cloned();
                if let Err(why) = &ring {
                    if post_ring.is_some() {
                        let rank = self.host(key).hello.world_rank;
                        self.client_warn(|| format!("rank {rank}'s post ring not read: {why}"));
                    }
                }
                let arena_off = match &ring {
                    Err(_) => Some("no post ring read".to_string()),
                    Ok(_) if post_ring.is_none_or(|s| s.arena_chunks == 0) => {
                        Some("no arena offered".to_string())
                    }
                    Ok(_) if self.inline_copy_bytes < bootstrap::post_ring::ARENA_SIDE_BYTES => {
                        Some(format!(
                            "serve --inline-copy-bytes {} is below an arena side ({} bytes)",
                            self.inline_copy_bytes,
                            bootstrap::post_ring::ARENA_SIDE_BYTES
                        ))
                    }
                    Ok(_) => None,
                };
                if ring.is_ok() {
                    self.ring_hosts.push(key);
                }
                if let Role::Host(h) = &mut self.conns[key].role {
                    h.mailbox = Some((alias, mailbox_slots));
                    h.ring = ring.ok().map(Box::new);
                }
                let serves = self.serves(key);
                self.send_frame(
                    key,
                    &encode(&SpToHost::Registered {
                        sp,
                        segment,
                        serves,
                        mcast_off: self
                            .resources
                            .unavailable(bootstrap::kinds::Family::Multicast),
                        canary_off: self
                            .resources
                            .unavailable(bootstrap::kinds::Family::InNetwork),
                        post_ring_off,
                        arena_off,
                    }),
                );
            }
            HostToSp::Post(desc) => self.on_post(key, *desc),
            HostToSp::Goodbye => {
                if let Role::Host(h) = &mut self.conns[key].role {
                    h.said_goodbye = true;
                }
            }
            HostToSp::CopyDone { ticket, ok } => self.on_host_copy_done(key, ticket, ok),
        }
    }

    /// The post ring host `key` offered with its `Register`, mapped if this SP reads it. The
    /// descriptor passed with the frame is taken and closed off the loop (`close_later`: it is
    /// the client's, and its close may wait for the client); from now on the connection
    /// keeps no descriptor.
    fn take_ring(
        &mut self,
        key: usize,
        shape: Option<bootstrap::post_ring::RingShape>,
    ) -> Result<crate::post_ring::PostRing, String> {
        let conn = &mut self.conns[key];
        conn.fds_allowed = false;
        let extra = std::mem::take(&mut conn.fds_dropped);
        let fd = conn.fds_in.0.pop();
        let ring = match (shape, &fd) {
            (None, _) => Err("no post ring offered".to_string()),
            (Some(_), None) => Err("a post ring offered without its descriptor".into()),
            (Some(_), Some(_)) if extra => {
                Err("more than one descriptor passed with the registration".into())
            }
            (Some(_), Some(_)) if self.poll_interval.is_none() => Err(
                "this SP sleeps until a message arrives (no --poll-us or --busy-poll): posts \
                 go on the socket"
                    .into(),
            ),
            (Some(_), Some(_)) if !self.host(key).peer.serves_cma() => {
                Err("this host does not share the SP's kernel".into())
            }
            (Some(shape), Some(fd)) => crate::post_ring::PostRing::map(fd, shape),
        };
        if let Some(fd) = fd {
            crate::conn::close_later(fd);
        }
        ring
    }

    /// Takes the posts host `key` wrote in its ring that go before its next socket frame, in
    /// order, as if they had come on the socket, at most one ring's worth per call (a rank
    /// that keeps refilling its ring cannot hold the loop). A ring the host corrupted closes
    /// the connection (its job aborts as for any rank that breaks its connection).
    pub(super) fn drain_ring(&mut self, key: usize) {
        // A socket frame read in the same batch keeps the time it was read at.
        let read_at = self.read_at_ns;
        let mut budget: Option<u32> = None;
        while let Some(Role::Host(h)) = self.conns.get_mut(key).map(|c| &mut c.role) {
            let frames = h.frames_in;
            let Some(ring) = h.ring.as_mut() else { break };
            let left = budget.get_or_insert(ring.slots());
            if *left == 0 {
                break;
            }
            *left -= 1;
            let payload = match ring.next(frames) {
                Next::Empty | Next::AfterFrames(_) => break,
                Next::Entry(p) => p,
                Next::Corrupt(why) => {
                    let rank = h.hello.world_rank;
                    self.client_warn(|| format!("rank {rank}: {why}"));
                    self.send_error(key, None, ErrorCode::BadDescriptor, why.clone());
                    self.close_conn(key, &why);
                    break;
                }
            };
            // The post is seen now (its `seen` stamp), as a socket frame is when read.
            self.read_at_ns = bootstrap::stamps::now_ns();
            self.stats.ring_posts += 1;
            if let Some(rec) = &mut self.recorder {
                rec.record("host", self.conns[key].serial, &payload);
            }
            // The shim writes only posts it encoded: anything else is a corrupt ring.
            let bad = match wire::decode_host(&payload) {
                Ok(HostToSp::Post(d)) => {
                    self.on_post(key, *d);
                    None
                }
                Ok(_) => Some("only posts may go in the post ring".to_string()),
                Err(e) => Some(format!("an undecodable post ring entry: {e}")),
            };
            if let Some(Role::Host(h)) = self.conns.get_mut(key).map(|c| &mut c.role) {
                if let Some(ring) = h.ring.as_mut() {
                    ring.give_back(payload);
                }
            }
            if let Some(why) = bad {
                let rank = self.host(key).hello.world_rank;
                self.client_warn(|| format!("rank {rank}: {why}"));
                self.send_error(key, None, ErrorCode::BadDescriptor, why.clone());
                self.close_conn(key, &why);
                break;
            }
            if !self.inline_done.is_empty() {
                self.on_copies_done();
            }
            if !self.conns.contains(key) || self.is_doomed(key) {
                break;
            }
        }
        self.read_at_ns = read_at;
    }

    /// Every post ring, once (a polling SP's pass).
    pub(super) fn drain_rings(&mut self) {
        let mut i = 0;
        while i < self.ring_hosts.len() {
            let key = self.ring_hosts[i];
            self.drain_ring(key);
            // A host closed meanwhile left the list: the next one is at `i` now.
            if self.ring_hosts.get(i) == Some(&key) {
                i += 1;
            }
        }
    }

    /// The grant backends this SP serves host connection `key` (what `validate` and
    /// `remote_gate` accept from it).
    fn serves(&self, key: usize) -> wire::Serves {
        wire::Serves {
            cma: self.host(key).peer.serves_cma(),
            ucx: self.ucx,
            ucx_export: self.ucx,
        }
    }

    pub(super) fn alias(&self, key: usize, grant: Grant) -> AliasKey {
        let h = self.host(key);
        AliasKey {
            owner: Owner {
                job: h.job,
                world_rank: h.hello.world_rank,
                pid: h.peer.pid(),
                start: h.peer.start(),
                uid: h.peer.pinned().map_or(u32::MAX, |p| p.uid),
                gid: h.peer.pinned().map_or(u32::MAX, |p| p.gid),
            },
            grant,
        }
    }

    pub(super) fn close_conn(&mut self, key: usize, why: &str) {
        if !self.conns.contains(key) {
            return;
        }
        let mut conn = self.conns.remove(key);
        let _ = self.poll.registry().deregister(conn.stream.source());
        self.ring_hosts.retain(|&k| k != key);
        match conn.role {
            Role::NewHost { peer, .. } => self.release_peer(&peer),
            Role::Peer(sp) => {
                if self.leaving_peers.contains(&sp) {
                    debug!(sp = self.me, peer = sp, "peer SP left");
                } else {
                    warn!(sp = self.me, peer = sp, "peer SP lost: {why}");
                }
                self.peer_conn.remove(&sp);
                self.dead_peers.insert(sp);
                for j in self.jobs.values_mut() {
                    j.lost_sps.insert(sp);
                }
                if self.replacing != Some(sp) {
                    let after = if self.leaving_peers.contains(&sp) {
                        crate::mesh::LEAVING_PEER_GRACE
                    } else {
                        Duration::ZERO
                    };
                    self.keeper.rejoin(self.me, sp, after);
                }
                // What its loss means to the families' resources (the staged family: its
                // ranks will not copy out of this SP's regions any more).
                self.with_resources(|r, cx| r.peer_lost(sp, cx));
                let now = now_ns(self.start);
                let keys: Vec<CollKey> = self.instances.keys().copied().collect();
                for ck in keys {
                    if let Some(inst) = self.instances.get_mut(&ck) {
                        inst.sm.handle_peer_lost(now, sp);
                    }
                    self.drive(ck);
                }
            }
            Role::Host(h) => {
                let job = h.job;
                if self.ucx {
                    // Its process is gone or going: no copy of its memory is to come (one
                    // queued still would connect anew); the job's end closes the rest.
                    self.datapath.close(crate::datapath::Closing::Rank {
                        job,
                        world_rank: h.hello.world_rank,
                        pid: h.peer.pid(),
                    });
                }
                self.release_peer(&h.peer);
                if let Some(j) = self.jobs.get_mut(&job) {
                    j.hosts.remove(&key);
                    j.ranks.remove(&h.hello.world_rank);
                    // What only this connection's hello said goes with it; what a descriptor
                    // named stays.
                    if j.hello_only.remove(&h.hello.world_rank) {
                        j.sp_of_rank.remove(&h.hello.world_rank);
                    }
                }
                if h.said_goodbye {
                    debug!(sp = self.me, job, rank = h.hello.world_rank, "host left");
                } else {
                    warn!(
                        sp = self.me,
                        job,
                        rank = h.hello.world_rank,
                        "host rank disconnected without goodbye ({why}); aborting its job"
                    );
                    self.fail_job(job, Status::RankFailed, true);
                }
                self.drop_host_copies(key);
                if self.jobs.get(&job).is_some_and(|j| j.hosts.is_empty()) {
                    self.abort_unposted(job);
                }
                self.forget_job_if_done(job);
                // The job may live on (its other ranks), the memory of this rank's posts is
                // free: once a lot of it is, the allocator is asked to return it.
                if self.held.released_over(GIVE_BACK_BYTES) {
                    crate::held::give_back_memory();
                }
            }
        }
    }
}
