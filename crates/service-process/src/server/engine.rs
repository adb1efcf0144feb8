//! Collective instances: created by the first event that names them, fed peer messages, and
//! driven: every action their driver emits is executed here (sends, copies, moves,
//! completions) without naming the collective.

use super::*;

impl Server {
    /// The instance of `ck`, created (as a `kind`) by the first event that names it: its
    /// message is `len` bytes long if that event says so (a staged instance then takes only
    /// the staging it can use, `KindConfig::for_message`).
    pub(super) fn instance(
        &mut self,
        ck: CollKey,
        kind: CollKind,
        len: Option<u64>,
    ) -> &mut Instance {
        let slot = match self.instances.slot(&ck) {
            Some(slot) => slot,
            None => self.new_instance(ck, kind, len),
        };
        self.instances
            .at_mut(slot, &ck)
            .expect("found or made above")
    }

    /// Makes the instance of `ck` (see [`Self::instance`]).
    fn new_instance(&mut self, ck: CollKey, kind: CollKind, len: Option<u64>) -> Slot {
        let cfg = self.kind_cfg.for_message(len);
        let mut inst = Instance {
            sm: drivers::new(kind, ck, self.me, &cfg),
            posted: HashMap::new(),
            shape: None,
            local_ranks: None,
            refused: None,
            holds: Vec::new(),
            arenas: Vec::new(),
            first_copy_ns: 0,
            last_copy_ns: 0,
            copies_done: 0,
        };
        // What the instance holds of its family's resources for its life (the staged
        // family's staging slots). Instances exist only for jobs with a rank connected
        // here (a peer's message for another job is refused), so the job's uid is known.
        let uid = self.jobs.get(&ck.job).map(|j| j.uid);
        if let Err(why) = self
            .resources
            .admit(kind.facts().family, ck, uid, cfg.staged.slots)
        {
            // Client-caused: one job holding its share must not flood the log.
            let line = format!("{why}; the collective {ck:?} fails");
            self.client_warn(|| line);
            inst.sm.abort(now_ns(self.start), Status::Aborted);
            inst.refused = Some(why);
        }
        self.instances.insert(ck, inst)
    }

    pub(super) fn on_peer_msg(&mut self, key: usize, msg: SpToSp) {
        let Role::Peer(from) = self.conns[key].role else {
            return;
        };
        let (ck, m, data) = match msg {
            SpToSp::Coll { key, msg } => (key, msg, None),
            SpToSp::Data { key, msg, data } => (key, msg, Some(data.0)),
            // The frame itself was the news (`on_frame` noted when it came).
            SpToSp::Heartbeat => return,
            SpToSp::Shutdown => {
                debug!(sp = self.me, from, "peer SP is shutting down");
                self.leaving_peers.insert(from);
                return;
            }
            SpToSp::JobAbort { job, reason } => {
                warn!(sp = self.me, from, job, "job aborted: {reason}");
                self.fail_job(job, Status::RankFailed, false);
                return;
            }
            // A message for the families' resources (the staged family's slot grants, lent
            // regions released, a job gone at another SP of the node).
            other => {
                let taken = self.with_resources(|r, cx| r.peer_msg(from, &other, cx));
                if !taken {
                    debug!(
                        sp = self.me,
                        from, "a peer message for no resources here; dropped"
                    );
                }
                return;
            }
        };
        // Memory keys a peer names must belong to the instance's job: an SP never copies
        // for one job into or out of another job's ranks, whatever a peer says.
        let world = self.jobs.get(&ck.job).map(|j| j.world_size);
        let foreign = m
            .keys()
            .into_iter()
            .find(|k| k.owner.job != ck.job || world.is_some_and(|w| k.owner.world_rank >= w));
        if let Some(k) = foreign {
            warn!(
                sp = self.me,
                from,
                ?ck,
                "a peer named memory of job {} rank {} in this job's collective; aborting it",
                k.owner.job,
                k.owner.world_rank
            );
            let now = now_ns(self.start);
            if let Some(inst) = self.instances.get_mut(&ck) {
                inst.sm.abort(now, Status::PeerFailed);
            }
            self.drive(ck);
            return;
        }
        let inbound = (drivers::spec(drivers::kind_of(&m)).inbound)(&m);
        // What the message means to its family's resources before the instance sees it (the
        // staged family: a node's region writer lent its region to this SP's ranks).
        let family = m.kind().facts().family;
        if inbound.lends_region_at.is_some() {
            let live = self
                .jobs
                .get(&ck.job)
                .is_some_and(|j| !j.finished.contains(&ck));
            self.with_resources(|r, cx| {
                if let Some(r) = r.of(family) {
                    r.inbound(ck, from, &inbound, live, cx);
                }
            });
        }
        {
            {
                let Some(job) = self.jobs.get(&ck.job) else {
                    // No rank of this job is (any longer) connected here, so none will post:
                    // the job ended or failed here. Answer what expects an answer so that its
                    // sender is not left waiting for it.
                    if self.send_refusals(ck, &m, from, Status::RankFailed) {
                        debug!(sp = self.me, ?ck, "message for a job gone here; refused");
                    }
                    return;
                };
                if job.finished.contains(&ck) {
                    debug!(
                        sp = self.me,
                        ?ck,
                        "message for a finished collective; dropped"
                    );
                    if inbound.answer_when_finished {
                        self.send_refusals(ck, &m, from, Status::Aborted);
                    }
                    return;
                }
                if inbound.announce {
                    self.stats.announces_received += 1;
                }
                let now = now_ns(self.start);
                let me = self.me;
                let failed = job.failed;
                let is_new = !self.instances.contains_key(&ck);
                let inst = self.instance(ck, drivers::kind_of(&m), inbound.message_len);
                if let (true, Some(status)) = (is_new, failed) {
                    inst.sm.abort(now, status);
                }
                // A chunk's bytes go into the buffer of the family's resources it names (a
                // staging slot), if that buffer was granted to the sender and is waiting for it;
                // anything else is a peer's bug, and the instance fails rather than wait for
                // bytes that will not come.
                let landed = match (&data, inbound.fills_slot) {
                    (None, _) => true,
                    (Some(bytes), Some((slot, len))) => {
                        let may = inst.sm.may_fill(from, slot) && bytes.len() as u64 == len;
                        may && self
                            .resources
                            .of(family)
                            .is_some_and(|r| r.fill(ck, slot, bytes))
                    }
                    (Some(_), None) => false,
                };
                let inst = self.instances.get_mut(&ck).expect("made above");
                if landed {
                    if let Err(e) = inst.sm.handle_msg(now, from, m) {
                        warn!(sp = self.me, from, ?ck, "protocol error from a peer: {e}");
                    }
                } else {
                    warn!(
                        sp = me,
                        from,
                        ?ck,
                        "data from a peer that fits no granted staging slot; aborting"
                    );
                    inst.sm.abort(now, Status::PeerFailed);
                }
                if let (true, Some(bytes)) = (landed, &data) {
                    self.stats.bytes_staged_in += bytes.len() as u64;
                }
                self.drive(ck);
            }
        }
    }

    /// Executes every action the instance has.
    pub(super) fn drive(&mut self, ck: CollKey) {
        let _span = info_span!("drive", ?ck).entered();
        // Looked up once: every step below reaches the instance by its slot.
        let Some(slot) = self.instances.slot(&ck) else {
            return;
        };
        loop {
            let Some(inst) = self.instances.at_mut(slot, &ck) else {
                return;
            };
            let Some(action) = inst.sm.poll_action() else {
                break;
            };
            match action {
                Act::Send {
                    to,
                    msg,
                    lends_region,
                    grants_slots,
                } => {
                    // What `to` needs of the family's resources first (a region lent, staging
                    // slots granted over UCX: their keys go before the message).
                    if lends_region || !grants_slots.is_empty() {
                        let family = inst.sm.kind().facts().family;
                        self.with_resources(|r, cx| {
                            if let Some(r) = r.of(family) {
                                r.before_send(ck, to, lends_region, &grants_slots, cx);
                            }
                        });
                    }
                    let frame = encode(&SpToSp::Coll { key: ck, msg });
                    match self.peer_conn.get(&to).copied() {
                        Some(k) => {
                            self.stats.messages_sent += 1;
                            self.send_frame(k, &frame)
                        }
                        None => {
                            let now = now_ns(self.start);
                            if let Some(inst) = self.instances.at_mut(slot, &ck) {
                                inst.sm.handle_peer_lost(now, to);
                            }
                        }
                    }
                }
                Act::Copy {
                    id,
                    dst_rank,
                    src_key,
                    src_offset,
                    dst_key,
                    dst_offset,
                    len,
                } => {
                    // A rank waiting in a blocking call copies what is already on its node,
                    // reading the source rank's process by pid: only a process this SP has
                    // pinned (a host over TCP from another machine has none, pid 0: the SP
                    // moves those bytes itself, through the grants).
                    let dst = inst.posted.get(&dst_rank).copied();
                    let by_host = dst.filter(|p| p.host_copies);
                    let src_known = src_key.owner.pid != 0;
                    if let Some(p) = by_host.filter(|_| src_known && self.is_local(&src_key.owner))
                    {
                        self.hand_to_host(
                            ck, id, p, &src_key, src_offset, &dst_key, dst_offset, len,
                        );
                        continue;
                    }
                    self.queue_copy(ck, id, src_key, src_offset, dst_key, dst_offset, len);
                }
                Act::StageCopy {
                    id,
                    rank: _,
                    src,
                    dst,
                    len,
                } => {
                    let res = self.resources.get(inst.sm.kind().facts().family);
                    let resolve = |loc: drivers::Loc| match loc {
                        drivers::Loc::Host { key, offset } => Some((key, offset)),
                        drivers::Loc::Stage { slot, offset } => res
                            .and_then(|r| r.buffer(ck, slot.0))
                            .map(|k| (k.clone(), offset)),
                    };
                    match (resolve(src), resolve(dst)) {
                        (Some((sk, so)), Some((dk, doff))) => {
                            self.queue_copy(ck, id, sk, so, dk, doff, len)
                        }
                        // No staging (refused by the budget): the instance is aborted; its
                        // copies fail.
                        _ => self.host_done.push((ck, id, Status::AccessError)),
                    }
                }
                Act::Move {
                    id,
                    to,
                    src_slot,
                    dst_slot,
                    len,
                    msg,
                } => {
                    // A slot the child granted through UCX: the datapath puts the bytes
                    // there, and the chunk's message follows once they landed.
                    let family = inst.sm.kind().facts().family;
                    let res = self.resources.of(family);
                    let src = res.as_ref().and_then(|r| r.buffer(ck, src_slot)).cloned();
                    let dst = res.and_then(|r| r.take_peer_buffer(ck, to, dst_slot));
                    if let (Some(src), Some(dst)) = (src, dst) {
                        let ticket = self.next_ticket;
                        self.next_ticket += 1;
                        self.ucx_moves.insert(ticket, (ck, id, to, msg, len));
                        self.stats.chunks_moved_ucx += 1;
                        self.limiter.push(CopyJob {
                            ticket,
                            src,
                            src_offset: 0,
                            dst,
                            dst_offset: 0,
                            len,
                        });
                        self.start_copies();
                        continue;
                    }
                    let data = self
                        .resources
                        .get(family)
                        .and_then(|r| r.buffer_bytes(ck, src_slot, len as usize))
                        .map(|b| b.to_vec());
                    let status = match (data, self.peer_conn.get(&to).copied()) {
                        (_, None) => Status::PeerFailed,
                        (Some(data), Some(k)) if data.len() as u64 == len => {
                            self.stats.messages_sent += 1;
                            self.stats.chunks_moved += 1;
                            let here = self.cluster.sp(self.me).map(|e| e.node);
                            if self.cluster.sp(to).map(|e| e.node) == here {
                                self.stats.bytes_intra_node += len;
                            } else {
                                self.stats.bytes_inter_node += len;
                            }
                            let data = wire::Bytes(data);
                            self.send_frame(k, &encode(&SpToSp::Data { key: ck, msg, data }));
                            Status::Ok
                        }
                        _ => Status::AccessError,
                    };
                    let now = now_ns(self.start);
                    if let Some(inst) = self.instances.at_mut(slot, &ck) {
                        inst.sm.handle_move_done(now, id, status);
                    }
                }
                Act::Resource { family, req } => {
                    let done = match self.resources.of(family) {
                        Some(r) => r.request(ck, req),
                        None => Err(format!("this SP has no {family:?} resources")),
                    };
                    if let Err(why) = done {
                        let line = format!("collective {ck:?} fails: {why}");
                        self.client_warn(|| line);
                        let now = now_ns(self.start);
                        if let Some(inst) = self.instances.at_mut(slot, &ck) {
                            inst.sm.abort(now, Status::Aborted);
                        }
                    }
                }
                Act::Complete {
                    rank,
                    status,
                    from_segment,
                } => {
                    // The instance's copies as this rank saw them: those started before it
                    // was ready count from its `ready`.
                    let posted = inst.posted.get(&rank).copied().map(|mut p| {
                        if inst.first_copy_ns != 0 {
                            p.stamps.first_copy = inst.first_copy_ns.max(p.stamps.ready);
                            p.stamps.last_copy = inst.last_copy_ns.max(p.stamps.first_copy);
                        }
                        p.copies = inst.copies_done;
                        p
                    });
                    match posted {
                        Some(p) if from_segment && status.is_ok() => {
                            self.finish_from_segment(ck, p)
                        }
                        Some(p) => self.write_completion(p, status),
                        None => warn!(
                            sp = self.me,
                            ?ck,
                            rank,
                            "completion for a rank never posted"
                        ),
                    }
                }
            }
        }
        // The driver's next deadline (none once it finished).
        let inst = self.instances.at(slot, &ck);
        let finished = inst.is_some_and(|i| i.sm.is_finished());
        let deadline = inst.filter(|_| !finished).and_then(|i| i.sm.deadline());
        self.deadlines.set(ck, deadline);
        if finished {
            if let Some(done) = self.instances.remove(&ck) {
                self.stats
                    .add_late_arrivals(ck.job, done.sm.late_arrivals());
            }
            self.with_resources(|r, cx| r.release(ck, cx));
            self.stats.collectives_finished += 1;
            if let Some(job) = self.jobs.get_mut(&ck.job) {
                job.finished.insert(ck);
                job.finished_order.push_back(ck);
                if job.finished_order.len() > MAX_FINISHED_PER_JOB {
                    if let Some(old) = job.finished_order.pop_front() {
                        job.finished.remove(&old);
                    }
                }
            }
            self.forget_job_if_done(ck.job);
        } else if self.jobs.get(&ck.job).is_some_and(|j| j.hosts.is_empty()) {
            self.forget_job_if_done(ck.job);
        }
    }

    /// Sends the answers [`drivers::refuse`] gives to `msg` of instance `ck` from SP `from`;
    /// true if there were any.
    pub(super) fn send_refusals(
        &mut self,
        ck: CollKey,
        msg: &CollMsg,
        from: SpId,
        status: Status,
    ) -> bool {
        let replies = drivers::refuse(msg, from, status);
        let any = !replies.is_empty();
        for (to, reply) in replies {
            let frame = encode(&SpToSp::Coll {
                key: ck,
                msg: reply,
            });
            if let Some(k) = self.peer_conn.get(&to).copied() {
                self.send_frame(k, &frame);
            }
        }
        any
    }

    pub(super) fn write_completion(&mut self, p: Posted, status: Status) {
        self.stats.completions += 1;
        let Some(Conn {
            role: Role::Host(h),
            ..
        }) = self.conns.get_mut(p.conn)
        else {
            return;
        };
        if h.conn_id != p.conn_id {
            // That host is gone and another took its slot in the table.
            return;
        }
        h.outstanding = h.outstanding.saturating_sub(1);
        let h = &*h;
        let Some((mb, slots)) = &h.mailbox else {
            return;
        };
        let Some(slot) = p.slot else {
            let done = SpToHost::Completed {
                token: p.token,
                status: mailbox::status_code(status),
            };
            return self.send_frame(p.conn, &encode(&done));
        };
        if slot >= *slots {
            return;
        }
        let base = mailbox::slot_offset(slot);
        // Status, copies and the SP's stamps in one write, then the token.
        let mut stamps = p.stamps;
        stamps.written = bootstrap::stamps::now_ns();
        let mut head = [0u8; 8 + bootstrap::stamps::SpStamps::BYTES];
        head[..4].copy_from_slice(&mailbox::status_code(status).to_le_bytes());
        head[4..8].copy_from_slice(&p.copies.to_le_bytes());
        head[8..].copy_from_slice(&stamps.to_bytes());
        // The mailbox in the host's post ring: plain stores into the shared mapping.
        let res = match h.ring.as_ref().filter(|r| r.has_mailbox(*slots)) {
            Some(ring) => {
                ring.write_completion(slot, &head, p.token);
                self.stats.ring_completions += 1;
                Ok(())
            }
            None => {
                let token = p.token.to_le_bytes();
                self.mover.write_then(
                    mb,
                    base + mailbox::STATUS_OFFSET,
                    &head,
                    base + mailbox::TOKEN_OFFSET,
                    &token,
                )
            }
        };
        if status.is_ok() && p.stamps.seen != 0 {
            self.stats.breakdown.record_sp(&stamps);
        }
        if let Err(e) = res {
            warn!(
                sp = self.me,
                rank = h.hello.world_rank,
                "cannot write completion: {e}"
            );
        }
    }
}

impl Server {
    /// Feeds what the families' resources finished to their instances.
    pub(super) fn on_resource_events(&mut self) {
        let events = self.resources.poll();
        if events.is_empty() {
            return;
        }
        let now = now_ns(self.start);
        let mut touched = Vec::new();
        for (ck, ev) in events {
            if let Some(inst) = self.instances.get_mut(&ck) {
                inst.sm.handle_event(now, ev);
                if !touched.contains(&ck) {
                    touched.push(ck);
                }
            }
        }
        for ck in touched {
            self.drive(ck);
        }
    }
}
