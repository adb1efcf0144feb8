//! A host's post: checked (`validate::check_post`, limits, the instance's shape), placed by
//! its family's resources (`Resources::place`: the staged family's hierarchical region in the
//! job's segment, or flat for want of room) and fed to its driver.

use super::*;

impl Server {
    /// Checks a descriptor against itself, the cluster and its grants.
    /// Checks a descriptor (see `validate::check_post`); `world_rank` and `world_size`: the
    /// poster's, from its hello; `ck`: the instance.
    pub(super) fn check_post(
        &self,
        d: &PostDesc,
        world_rank: u32,
        world_size: u32,
        ck: CollKey,
    ) -> Result<(), (ErrorCode, String)> {
        let shape = self.instances.get(&ck).and_then(|i| i.shape.as_ref());
        crate::validate::check_post(
            d,
            &crate::validate::Poster {
                sp: self.me,
                world_rank,
                world_size,
            },
            &self.cluster,
            self.ucx,
            shape.map(|(m, w)| (m.as_slice(), w.as_slice())),
        )?;
        // Each world rank has one SP for the whole job: the one its hello or an earlier
        // descriptor named (the ranks place themselves; no layout says it here).
        let job = self.jobs.get(&ck.job);
        if job.is_some_and(|j| learned_already(j, d)) {
            return Ok(());
        }
        let known = job.map(|j| &j.sp_of_rank);
        for (r, (w, &sp)) in d.world_ranks.iter().zip(&d.members).enumerate() {
            match known.and_then(|m| m.get(w)) {
                Some(&was) if was != sp => {
                    return Err((
                        ErrorCode::BadDescriptor,
                        format!(
                            "comm rank {r} (world rank {w}) is said to be served by SP {sp}, \
                             but it is SP {was}'s"
                        ),
                    ))
                }
                _ => {}
            }
        }
        Ok(())
    }

    pub(super) fn on_post(&mut self, key: usize, d: PostDesc) {
        self.stats.posts += 1;
        self.stats.posts_packed += (d.send_packed || d.recv_packed) as u64;
        let (job, slots) = {
            let h = self.host(key);
            match &h.mailbox {
                Some((_, slots)) => (h.job, *slots),
                None => {
                    return self.send_error(
                        key,
                        Some(&d),
                        ErrorCode::NotRegistered,
                        "post before register".into(),
                    )
                }
            }
        };
        if let Some(slot) = d.slot.filter(|&s| s >= slots) {
            return self.send_error(
                key,
                Some(&d),
                ErrorCode::BadDescriptor,
                format!("mailbox slot {slot} outside the {slots} registered"),
            );
        }
        let ck = CollKey {
            job,
            comm: d.comm,
            seq: d.seq,
        };
        // Every post from here on gets exactly one completion.
        let (world_rank, outstanding, conn_id) = {
            let h = self.host(key);
            (h.hello.world_rank, h.outstanding, h.conn_id)
        };
        let (world_size, uid) = self
            .jobs
            .get(&job)
            .map_or((0, u32::MAX), |j| (j.world_size, j.uid));
        if let Role::Host(h) = &mut self.conns[key].role {
            h.outstanding += 1;
        }
        let over = if outstanding >= self.limits.max_posts_per_rank {
            Some(format!(
                "{outstanding} posts of this rank are not complete yet (limit {}, serve \
                 --max-posts-per-rank)",
                self.limits.max_posts_per_rank
            ))
        } else if !self.instances.contains_key(&ck)
            && self.instances.of_job(job) >= self.limits.max_instances_per_job
        {
            Some(format!(
                "the job has {} collectives open on SP {} (limit {}, serve \
                 --max-instances-per-job)",
                self.instances.of_job(job),
                self.me,
                self.limits.max_instances_per_job
            ))
        } else {
            None
        };
        // The SP memory the post will hold (its vectors, the state it creates per member),
        // counted against its connection, job and uid until its instance goes.
        let hold = match over {
            Some(why) => Err(why),
            None => self.held.take(
                conn_id,
                job,
                uid,
                crate::held::post_bytes(&d, self.kind_cfg.staged.chunk_bytes),
            ),
        };
        let hold = match hold {
            Ok(h) => {
                self.stats.held_peak_bytes = self.stats.held_peak_bytes.max(self.held.total());
                h
            }
            Err(why) => {
                self.stats.posts_refused += 1;
                self.send_error(key, Some(&d), ErrorCode::BadDescriptor, why);
                return self
                    .write_completion(self.posted(key, d.slot, d.token), Status::InvalidPost);
            }
        };
        if let Err((code, message)) = self.check_post(&d, world_rank, world_size, ck) {
            let members_ok = code == ErrorCode::BadDescriptor
                && d.members.len() > d.comm_rank as usize
                && d.members[d.comm_rank as usize] == self.me;
            self.send_error(key, Some(&d), code, message);
            self.write_completion(self.posted(key, d.slot, d.token), Status::InvalidPost);
            // Peers may already be waiting for this rank: if we know who they are, abort the
            // instance for every member rather than leave them hanging.
            if members_ok {
                let mut sps: Vec<SpId> = d.members.clone();
                sps.sort_unstable();
                sps.dedup();
                let status = Status::InvalidPost;
                let abort = (drivers::spec(d.kind).abort_msg)(status);
                let frame = encode(&SpToSp::Coll {
                    key: ck,
                    msg: abort,
                });
                let me = self.me;
                for sp in sps.into_iter().filter(|&sp| sp != me) {
                    if let Some(k) = self.peer_conn.get(&sp).copied() {
                        self.send_frame(k, &frame);
                    }
                }
                let now = now_ns(self.start);
                let inst = self.instance(ck, d.kind, None);
                inst.sm.abort(now, Status::InvalidPost);
                // This rank will not post this instance again: without this the instance
                // would wait for it forever.
                inst.sm.handle_rank_lost(now, d.comm_rank);
                self.drive(ck);
            }
            return;
        }
        if let Some(j) = self.jobs.get_mut(&job) {
            if !learned_already(j, &d) {
                for (&w, &sp) in d.world_ranks.iter().zip(&d.members) {
                    j.sp_of_rank.entry(w).or_insert(sp);
                    j.hello_only.remove(&w);
                }
                j.learned.0.clone_from(&d.members);
                j.learned.1.clone_from(&d.world_ranks);
            }
        }
        if self
            .jobs
            .get(&job)
            .is_some_and(|j| j.finished.contains(&ck))
        {
            self.send_error(
                key,
                Some(&d),
                ErrorCode::UnknownComm,
                format!("collective {:?} seq {} already finished", d.comm, d.seq),
            );
            return self.write_completion(self.posted(key, d.slot, d.token), Status::InvalidPost);
        }
        // Where the instance writes the post on this SP, as its family's resources place it
        // (the staged family: a region of the job's node segment for a hierarchical design,
        // or flat for want of room).
        let spec = drivers::spec(d.kind);
        let family = spec.facts().family;
        let placed = self.with_resources(|r, cx| match r.of(family) {
            Some(r) => r.place(ck, &d, cx),
            None => Ok(Default::default()),
        });
        let placed: drivers::resources::Placement = match placed {
            Ok(p) => p,
            Err(why) => {
                self.send_error(key, Some(&d), ErrorCode::BadDescriptor, why);
                return self
                    .write_completion(self.posted(key, d.slot, d.token), Status::InvalidPost);
            }
        };
        let region = placed.region.map(|(g, at)| (self.alias(key, g), at));
        let mut send = self.alias(key, d.send.clone());
        let mut recv = self.alias(key, d.recv.clone());
        // Sides the rank put in its arena, in an instance of this SP's ranks alone: reached
        // through this SP's mapping of the arena (no key leaves this SP).
        let mut arenas = Vec::new();
        if d.kind.takes_arena() && d.members.iter().all(|&sp| sp == self.me) {
            for k in [&mut send, &mut recv] {
                if let Some((key, map)) = self.arena_key(key, k) {
                    *k = key;
                    arenas.push(map);
                }
            }
        }
        let now = now_ns(self.start);
        let failed = self.jobs.get(&job).and_then(|j| j.failed);
        let lost = self.jobs.get(&job).map(|j| &j.lost_sps);
        let dead: Vec<SpId> = if self.dead_peers.is_empty() && lost.is_none_or(|l| l.is_empty()) {
            // No SP is down: no lookup per member.
            Vec::new()
        } else {
            d.members
                .iter()
                .copied()
                .filter(|sp| self.dead_peers.contains(sp) || lost.is_some_and(|l| l.contains(sp)))
                .collect()
        };
        let mut posted = Posted {
            host_copies: d.host_copies && spec.facts().host_copies,
            ..self.posted(key, d.slot, d.token)
        };
        posted.stamps.seen = self.read_at_ns;
        self.stats.breakdown.record_host(self.read_at_ns, &d.stamps);
        let me = self.me;
        // An instance its family's resources refused (the staged family: its job's share of
        // the staging is used up) was aborted: the rank learns why.
        let len = (spec.staged_len)(&d);
        if let Some(why) = self.instance(ck, d.kind, len).refused.clone() {
            self.stats.posts_refused += 1;
            self.send_error(key, Some(&d), ErrorCode::BadDescriptor, why);
        }
        let inst = self.instances.get_mut(&ck).expect("made above");
        inst.local_ranks = Some(d.members.iter().filter(|&&sp| sp == me).count());
        if inst.shape.is_none() {
            inst.shape = Some((d.members.clone(), d.world_ranks.clone()));
        }
        let comm_rank = d.comm_rank;
        let post = LocalPost {
            desc: d,
            send,
            recv,
            region,
            hier: placed.hier,
        };
        match inst.sm.handle_post(now, post) {
            Ok(()) => {
                posted.stamps.ready = bootstrap::stamps::now_ns();
                inst.posted.insert(comm_rank, posted);
                inst.holds.push(hold);
                let sides = arenas.len() as u64;
                inst.arenas.extend(arenas);
                if let Some(status) = failed {
                    inst.sm.abort(now, status);
                }
                for sp in dead {
                    inst.sm.handle_peer_lost(now, sp);
                }
                self.stats.arena_sides += sides;
                self.drive(ck);
            }
            Err(e) => {
                self.send_error(key, None, ErrorCode::UnknownComm, e);
                self.write_completion(posted, Status::InvalidPost);
            }
        }
    }

    /// The key through this SP's mapping of host `conn`'s arena for `k`, a `cma` key of that
    /// host, if the grant lies wholly inside the arena (`bootstrap::post_ring`) and is no
    /// longer than an arena side, and the mapping, which the instance keeps while it lives.
    /// Copies of such a key (at most a side long, both ends `cma`) run on this thread, as
    /// plain copies (`own_copy`) while their instance lives, when `--inline-copy-bytes` is at
    /// least a side (else no such key is made); the engine keeps an instance while its copies
    /// are queued or running, and a copy of own memory whose instance is gone is refused.
    fn arena_key(
        &self,
        conn: usize,
        k: &AliasKey,
    ) -> Option<(AliasKey, std::sync::Arc<crate::post_ring::ArenaMap>)> {
        if self.inline_copy_bytes < bootstrap::post_ring::ARENA_SIDE_BYTES
            || k.grant.backend != BackendData::Cma
            || k.grant.len > bootstrap::post_ring::ARENA_SIDE_BYTES
        {
            return None;
        }
        let ring = self.host(conn).ring.as_ref()?;
        let (addr, map) = ring.arena_addr(k.grant.addr, k.grant.len)?;
        let key = crate::staging::own_key(
            k.owner.job,
            k.grant.region,
            addr,
            k.grant.len,
            k.grant.rights,
        );
        Some((key, map))
    }

    /// Writes a completion into the rank's mailbox: status first, then the token.
    /// Where the completion of a post from host connection `key` goes.
    pub(super) fn posted(&self, key: usize, slot: Option<u32>, token: u64) -> Posted {
        Posted {
            conn: key,
            conn_id: self.host(key).conn_id,
            slot,
            token,
            host_copies: false,
            stamps: Default::default(),
            copies: 0,
        }
    }
}

/// Whether `d` names the same members and world ranks as the last descriptor whose pairs job
/// `j`'s `sp_of_rank` took in (so it has nothing to check or learn there).
fn learned_already(j: &super::Job, d: &PostDesc) -> bool {
    !d.members.is_empty() && j.learned.0 == d.members && j.learned.1 == d.world_ranks
}
