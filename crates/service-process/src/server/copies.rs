//! The copy/datapath scheduling: copies queued through the per-SP limiter to the datapath
//! threads (or inline, or handed to a blocked host rank), UCX moves of chunks, and their
//! completions fed back to the instances.

use super::*;

impl Server {
    /// Queues a copy of instance `ck` (its copy `id`) for the datapath.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn queue_copy(
        &mut self,
        ck: CollKey,
        id: u64,
        src: AliasKey,
        src_offset: u64,
        dst: AliasKey,
        dst_offset: u64,
        len: u64,
    ) {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.copies.insert(ticket, (ck, id));
        self.limiter.push(CopyJob {
            ticket,
            src,
            src_offset,
            dst,
            dst_offset,
            len,
        });
        self.start_copies();
    }

    /// A chunk put into a child's slot finished: on success its message follows (the put
    /// was flushed, so the bytes are there first), and either way the move is reported.
    pub(super) fn ucx_move_done(
        &mut self,
        ck: CollKey,
        id: u64,
        to: SpId,
        msg: CollMsg,
        len: u64,
        result: Result<(), alias_mkey::AccessError>,
    ) {
        let status = match (result, self.peer_conn.get(&to).copied()) {
            (Ok(()), Some(k)) => {
                let here = self.cluster.sp(self.me).map(|e| e.node);
                if self.cluster.sp(to).map(|e| e.node) == here {
                    self.stats.bytes_intra_node += len;
                } else {
                    self.stats.bytes_inter_node += len;
                }
                self.stats.messages_sent += 1;
                self.stats.chunks_moved += 1;
                self.send_frame(k, &encode(&SpToSp::Coll { key: ck, msg }));
                Status::Ok
            }
            (Ok(()), None) => Status::PeerFailed,
            (Err(e), _) => {
                warn!(
                    sp = self.me,
                    ?ck,
                    to,
                    "putting a chunk into a child SP failed: {e}"
                );
                self.stats.copies_failed += 1;
                Status::AccessError
            }
        };
        let now = now_ns(self.start);
        if let Some(inst) = self.instances.get_mut(&ck) {
            inst.sm.handle_move_done(now, id, status);
            self.drive(ck);
        }
    }

    /// The node of world rank `world_rank` of `job`, as this SP knows it: the node of the SP
    /// its hello or the job's descriptors named (`None`: never named here).
    pub(super) fn node_of_rank(&self, job: u64, world_rank: u32) -> Option<u32> {
        let sp = *self.jobs.get(&job)?.sp_of_rank.get(&world_rank)?;
        self.cluster.sp(sp).map(|e| e.node)
    }

    /// The owner runs on this SP's node.
    pub(super) fn is_local(&self, owner: &Owner) -> bool {
        let node = self.node_of_rank(owner.job, owner.world_rank);
        node.is_some() && node == self.cluster.sp(self.me).map(|e| e.node)
    }

    /// Asks the host of post `p` to do an intra-node copy into its receive buffer, after
    /// checking both ends against their grants (the host learns only an address of a rank
    /// of its node that the grant covers). Its answer comes as `HostToSp::CopyDone`; a copy
    /// that cannot be handed over finishes at once with an error.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hand_to_host(
        &mut self,
        ck: CollKey,
        id: u64,
        p: Posted,
        src: &AliasKey,
        src_offset: u64,
        dst: &AliasKey,
        dst_offset: u64,
        len: u64,
    ) {
        let checked = src
            .check(src_offset, len, Rights::READ)
            .and_then(|addr| dst.check(dst_offset, len, Rights::WRITE).map(|_| addr));
        let status = match checked {
            Ok(addr) => {
                let src = CopySrc::Process {
                    pid: src.owner.pid,
                    addr,
                };
                let then = AfterHostCopy::Machine { id };
                if self.send_host_copy(ck, p, then, src, dst_offset, len) {
                    return;
                }
                Status::RankFailed
            }
            Err(e) => {
                warn!(sp = self.me, ?ck, "host copy refused: {e}");
                self.stats.copies_failed += 1;
                Status::AccessError
            }
        };
        // Fed back outside the instance's `drive`, like an inline copy.
        self.host_done.push((ck, id, status));
    }

    /// Sends the host of `p` a copy into its receive grant; false (nothing sent) if that host
    /// is gone.
    pub(super) fn send_host_copy(
        &mut self,
        ck: CollKey,
        p: Posted,
        then: AfterHostCopy,
        src: CopySrc,
        dst_offset: u64,
        len: u64,
    ) -> bool {
        let live = matches!(
            self.conns.get(p.conn),
            Some(Conn { role: Role::Host(h), .. }) if h.conn_id == p.conn_id
        );
        if !live {
            return false;
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.stats.host_copies += 1;
        self.stats.host_copy_bytes += len;
        self.host_copies.insert(
            ticket,
            HostCopy {
                ck,
                conn: p.conn,
                conn_id: p.conn_id,
                then,
            },
        );
        let msg = SpToHost::Copy {
            token: p.token,
            ticket,
            src,
            dst_offset,
            len,
        };
        self.send_frame(p.conn, &encode(&msg));
        true
    }

    /// A host answered `SpToHost::Copy`.
    pub(super) fn on_host_copy_done(&mut self, key: usize, ticket: u64, ok: bool) {
        let conn_id = self.host(key).conn_id;
        match self.host_copies.get(&ticket) {
            Some(c) if c.conn == key && c.conn_id == conn_id => {}
            _ => {
                return self.send_error(
                    key,
                    None,
                    ErrorCode::BadDescriptor,
                    format!("copy ticket {ticket} was not handed to this rank"),
                )
            }
        }
        let Some(c) = self.host_copies.remove(&ticket) else {
            return;
        };
        let status = if ok {
            Status::Ok
        } else {
            self.stats.host_copies_failed += 1;
            Status::AccessError
        };
        match c.then {
            AfterHostCopy::Machine { id } => {
                self.host_done.push((c.ck, id, status));
                self.feed_host_copies_done();
            }
            AfterHostCopy::Finish { posted, family } => {
                self.write_completion(posted, status);
                self.shared_read_done(c.ck, family);
            }
        }
    }

    /// Host copies of connection `key` will never be answered: they fail.
    pub(super) fn drop_host_copies(&mut self, key: usize) {
        let gone: Vec<u64> = self
            .host_copies
            .iter()
            .filter(|(_, c)| c.conn == key)
            .map(|(&t, _)| t)
            .collect();
        for t in gone {
            let Some(c) = self.host_copies.remove(&t) else {
                continue;
            };
            match c.then {
                AfterHostCopy::Machine { id } => {
                    self.host_done.push((c.ck, id, Status::RankFailed))
                }
                AfterHostCopy::Finish { family, .. } => self.shared_read_done(c.ck, family),
            }
        }
        self.feed_host_copies_done();
    }

    pub(super) fn feed_host_copies_done(&mut self) {
        let now = now_ns(self.start);
        while !self.host_done.is_empty() {
            for (ck, id, status) in std::mem::take(&mut self.host_done) {
                if let Some(inst) = self.instances.get_mut(&ck) {
                    inst.sm.handle_copy_done(now, id, status);
                    self.drive(ck);
                }
            }
        }
    }

    pub(super) fn start_copies(&mut self) {
        while let Some(job) = self.limiter.pop_startable() {
            self.stats.copies_started += 1;
            self.stats.bytes_copied += job.len;
            // A copy crosses nodes when its two ends live on different nodes (this SP's own
            // staging lives here). A put into a child SP's staging is counted when it is done.
            if !self.ucx_moves.contains_key(&job.ticket) {
                let here = self.cluster.sp(self.me).map(|e| e.node);
                let node_of = |k: &AliasKey| {
                    if k.owner.world_rank == crate::staging::STAGE_OWNER_RANK {
                        return here;
                    }
                    self.node_of_rank(k.owner.job, k.owner.world_rank)
                };
                if node_of(&job.src) != node_of(&job.dst) {
                    self.stats.bytes_inter_node += job.len;
                } else {
                    self.stats.bytes_intra_node += job.len;
                }
            }
            self.stats.max_inflight = self.stats.max_inflight.max(self.limiter.in_flight() as u64);
            if let Some(inst) = self
                .copies
                .get(&job.ticket)
                .and_then(|(ck, _)| self.instances.get_mut(ck))
            {
                if inst.first_copy_ns == 0 {
                    inst.first_copy_ns = bootstrap::stamps::now_ns();
                }
            }
            let both_cma = job.src.grant.backend == BackendData::Cma
                && job.dst.grant.backend == BackendData::Cma;
            if job.len <= self.inline_copy_bytes && both_cma {
                self.stats.copies_inline += 1;
                // Both ends in this process's memory (its staging, its mapping of a rank's
                // arena), held by a live instance: a plain copy. An end in this process's
                // memory whose instance is gone is refused, not handed to the mover: the
                // memory may serve another instance now (a pooled staging buffer, an address
                // a later mapping took). (The engine keeps an instance while its copies are
                // queued or running, so this does not happen today.)
                let held = self
                    .copies
                    .get(&job.ticket)
                    .is_some_and(|(ck, _)| self.instances.contains_key(ck));
                let (src_own, dst_own) = (
                    crate::staging::is_own(&job.src),
                    crate::staging::is_own(&job.dst),
                );
                let result = if held && src_own && dst_own {
                    self.stats.copies_own += 1;
                    own_copy(&job)
                } else if !held && (src_own || dst_own) {
                    Err(alias_mkey::AccessError::Unsupported(
                        "a copy of this SP's own memory for an instance that is gone",
                    ))
                } else {
                    self.mover
                        .copy(&job.src, job.src_offset, &job.dst, job.dst_offset, job.len)
                };
                // Fed back by `on_copies_done`, outside the instance's `drive`.
                self.inline_done.push(crate::datapath::CopyDone {
                    ticket: job.ticket,
                    result,
                });
            } else if self.ucx_moves.contains_key(&job.ticket) {
                // A put into a child SP's staging: one message follows it, left whole.
                self.datapath.submit(job);
            } else {
                let whole = job.ticket;
                let mut next = self.next_ticket;
                let parts = self.splits.split(job, || {
                    let t = next;
                    next += 1;
                    t
                });
                self.next_ticket = next;
                if parts.len() > 1 || parts[0].ticket != whole {
                    self.stats.copies_split += 1;
                    self.stats.copy_parts += parts.len() as u64;
                }
                for p in parts {
                    self.datapath.submit(p);
                }
            }
        }
    }

    /// Feeds finished copies back to their instances, until none is left (an instance may
    /// start more inline copies while it handles one).
    pub(super) fn on_copies_done(&mut self) {
        loop {
            let mut done = std::mem::take(&mut self.inline_done);
            let splits = &mut self.splits;
            done.extend(self.datapath.drain().filter_map(|d| splits.join(d)));
            if done.is_empty() {
                return;
            }
            self.feed_copies_done(done);
        }
    }

    pub(super) fn feed_copies_done(&mut self, done: Vec<crate::datapath::CopyDone>) {
        let now = now_ns(self.start);
        for d in done {
            self.limiter.finished();
            if let Some((ck, id, to, msg, len)) = self.ucx_moves.remove(&d.ticket) {
                self.ucx_move_done(ck, id, to, msg, len, d.result);
                continue;
            }
            let Some((ck, id)) = self.copies.remove(&d.ticket) else {
                continue;
            };
            let status = match &d.result {
                Ok(()) => Status::Ok,
                Err(e) => {
                    warn!(sp = self.me, ?ck, "copy failed: {e}");
                    self.stats.copies_failed += 1;
                    if let alias_mkey::AccessError::ImageChanged { pid } = e {
                        self.end_old_images(*pid, None);
                    }
                    Status::AccessError
                }
            };
            if let Some(inst) = self.instances.get_mut(&ck) {
                inst.last_copy_ns = bootstrap::stamps::now_ns();
                inst.copies_done += 1;
                inst.sm.handle_copy_done(now, id, status);
                self.drive(ck);
            }
        }
        self.start_copies();
    }
}

/// A copy between two keys of this process's own memory ([`crate::staging::own_key`]), after
/// the same checks of range and rights as any copy.
fn own_copy(job: &CopyJob) -> Result<(), alias_mkey::AccessError> {
    let src = job.src.check(job.src_offset, job.len, Rights::READ)?;
    let dst = job.dst.check(job.dst_offset, job.len, Rights::WRITE)?;
    // SAFETY: both ranges were checked against their keys, which this process made for
    // memory it keeps mapped while their instance lives (the caller checked that it does): a
    // staging buffer, or its mapping of a rank's arena (a memfd sealed against shrinking, so
    // it cannot be truncated under the mapping; a page the rank punched out is allocated
    // again by the access, which fails only where the kernel finds no page for this process
    // at all). The rank may write its arena at any time; the bytes are its own.
    // The ranges overlap only if a rank granted overlapping sides of its arena (the shim
    // never does): then a copy that allows it.
    let overlap = src < dst.saturating_add(job.len) && dst < src.saturating_add(job.len);
    unsafe {
        if overlap {
            std::ptr::copy(src as *const u8, dst as *mut u8, job.len as usize);
        } else {
            alias_mkey::copy::copy_bytes(src as *const u8, dst as *mut u8, job.len as usize);
        }
    }
    Ok(())
}
