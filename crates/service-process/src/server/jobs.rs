//! Job bookkeeping: goodbyes, unposted instances of leaving ranks, failures (aborts sent to
//! peers), and forgetting a job once nothing of it is left here.

use super::*;

impl Server {
    /// Every rank of `job` has left this SP. An open instance that some of them never posted
    /// can never complete: it is aborted (which tells its other SPs) and dropped once no copy
    /// touches it. The others go on: their ranks here posted (a rank may finalize as soon as
    /// its own part is done, while the instance still needs this SP: an inner SP of a
    /// broadcast tree, a node's reader of another node's blocks).
    pub(super) fn abort_unposted(&mut self, job: u64) {
        let now = now_ns(self.start);
        let stuck: Vec<CollKey> = self
            .instances
            .iter()
            .filter(|(k, i)| k.job == job && !i.all_local_posted())
            .map(|(k, _)| *k)
            .collect();
        for ck in stuck {
            if let Some(inst) = self.instances.get_mut(&ck) {
                inst.sm.abort(now, Status::RankFailed);
            }
            self.drive(ck);
        }
    }

    /// Frees a job's state once none of its ranks is connected and none of its instances is
    /// left (those of a failed job finish as their copies drain).
    pub(super) fn forget_job_if_done(&mut self, job: u64) {
        let Some(j) = self.jobs.get(&job) else { return };
        if !j.hosts.is_empty() {
            return;
        }
        // No rank of this job is left here to complete, and a rank that left without posting
        // would keep its instance open forever: drop what no copy still touches and cannot
        // complete (every instance of a failed job; one a local rank never posted).
        let failed = j.failed.is_some();
        let dropped = self.instances.retain(|k, i| {
            k.job != job || i.sm.copies_in_flight() > 0 || (!failed && i.all_local_posted())
        });
        for ck in dropped {
            self.with_resources(|r, cx| r.release(ck, cx));
        }
        if self.instances.of_job(job) == 0 {
            self.jobs.remove(&job);
            // No copy of the job is left: the datapath closes its UCX endpoints to the job's
            // processes (this node's and other nodes' ranks it copied from or to).
            if self.ucx {
                self.datapath.close(crate::datapath::Closing::Job(job));
            }
            // The counters as of this job's end, kept next to the socket: what an SP killed
            // outright leaves (`crate::stopped`).
            crate::stopped::snapshot(&self.host_socket, self.me, &self.stats_now());
            // The pins of the job's processes (remote ranks copied from) go with them.
            alias_mkey::process::sweep();
            // The families' resources of the job (the staged family's segment regions and
            // the segment's name).
            self.with_resources(|r, cx| r.job_gone(job, cx));
            // What the job's posts held is free now: have the allocator return it.
            crate::held::give_back_memory();
        }
    }

    /// Aborts every instance of `job` here (and, if `tell_peers`, on every other SP).
    pub(super) fn fail_job(&mut self, job: u64, status: Status, tell_peers: bool) {
        if let Some(j) = self.jobs.get_mut(&job) {
            if j.failed.is_some() && !tell_peers {
                return;
            }
            j.failed.get_or_insert(status);
        } else {
            return;
        }
        if tell_peers {
            let frame = encode(&SpToSp::JobAbort {
                job,
                reason: format!("a rank left SP {}", self.me),
            });
            let peers: Vec<usize> = self.peer_conn.values().copied().collect();
            for k in peers {
                self.send_frame(k, &frame);
            }
        }
        let now = now_ns(self.start);
        let keys: Vec<CollKey> = self
            .instances
            .keys()
            .filter(|k| k.job == job)
            .copied()
            .collect();
        // Copies of the job that have not started yet will not start: they would touch the
        // memory of ranks that may be gone.
        let queued: Vec<CopyJob> = self.limiter.clear_queued().collect();
        let mut purged = Vec::new();
        for c in queued {
            match self.copies.get(&c.ticket) {
                Some((ck, id)) if ck.job == job => {
                    purged.push((*ck, *id));
                    self.copies.remove(&c.ticket);
                }
                _ => self.limiter.push(c),
            }
        }
        self.stats.copies_purged += purged.len() as u64;
        for (ck, id) in purged {
            if let Some(inst) = self.instances.get_mut(&ck) {
                inst.sm.handle_copy_done(now, id, status);
            }
        }
        for ck in keys {
            if let Some(inst) = self.instances.get_mut(&ck) {
                inst.sm.abort(now, status);
            }
            self.drive(ck);
        }
    }
}
