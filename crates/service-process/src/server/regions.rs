//! Staging memory shared with ranks: the regions of a job's node segment that hierarchical
//! instances write, lend to the node's other SPs and release once every reader is done.

use super::*;

impl Server {
    /// The region of `ck` in its job's segment (described by a rank's grant `seg`): the one
    /// the instance has, or a new one of `len` bytes; `None` if the segment has no room.
    pub(super) fn region_for(
        &mut self,
        ck: CollKey,
        seg: &Grant,
        len: u64,
    ) -> Result<Option<(u64, u64)>, String> {
        // The segment holds one equal part per SP of the node; this SP places its regions in
        // its own part.
        let parts = u64::from(self.cluster.sps_per_node.max(1));
        let index = self.cluster.sp(self.me).map_or(0, |e| u64::from(e.index));
        if !seg.len.is_multiple_of(parts) {
            return Err(format!(
                "a segment of {} bytes cannot hold one equal part for each of the node's {parts} \
                 SPs",
                seg.len
            ));
        }
        let part = seg.len / parts;
        let arena = self
            .arenas
            .entry(ck.job)
            .or_insert_with(|| Arena::new(index * part, part));
        if arena.capacity() != part {
            return Err(format!(
                "segment of {} bytes, but the job's ranks on this node used {} (SPOFF_SEGMENT_BYTES \
                 differs between ranks)",
                seg.len,
                arena.capacity() * parts
            ));
        }
        if let Some(r) = self.regions.get(&ck) {
            return Ok(Some((r.off, r.len)));
        }
        let Some(off) = arena.alloc(len) else {
            return Ok(None);
        };
        self.regions.insert(
            ck,
            Region {
                off,
                len,
                readers: 0,
                finished: false,
                owner: None,
                borrowers: HashSet::new(),
            },
        );
        Ok(Some((off, len)))
    }

    /// A rank of a hierarchical staged instance has its data in the segment: it copies them
    /// out itself, and completes when it says it did.
    pub(super) fn finish_from_segment(&mut self, ck: CollKey, p: Posted) {
        // A bcast's ranks copy out of their node leader's region, which may be another SP's
        // (its entry here came with the leader's `Sealed`; the length comes from the view).
        let source = self.instances.get(&ck).and_then(|i| i.sm.segment_source());
        if let Some(r) = self.regions.get_mut(&ck).filter(|r| r.owner.is_some()) {
            match source {
                Some((owner, at, len)) if r.owner == Some(owner) && r.off == at => r.len = len,
                _ => {
                    warn!(
                        sp = self.me,
                        ?ck,
                        "a segment completion out of a region not sealed"
                    );
                    return self.write_completion(p, Status::AccessError);
                }
            }
        }
        let Some((off, len)) = self.regions.get(&ck).map(|r| (r.off, r.len)) else {
            warn!(sp = self.me, ?ck, "a segment completion without a region");
            return self.write_completion(p, Status::AccessError);
        };
        let then = AfterHostCopy::Finish { posted: p };
        if self.send_host_copy(ck, p, then, CopySrc::Segment { offset: off }, 0, len) {
            if let Some(r) = self.regions.get_mut(&ck) {
                r.readers += 1;
            }
        }
        // A host that is gone gets no completion.
    }

    /// One reader of `ck`'s segment region is done; frees the region once the instance
    /// finished and nobody reads it.
    pub(super) fn region_reader_done(&mut self, ck: CollKey) {
        if let Some(r) = self.regions.get_mut(&ck) {
            r.readers = r.readers.saturating_sub(1);
        }
        self.release_region_if_done(ck);
    }

    pub(super) fn release_region_if_done(&mut self, ck: CollKey) {
        let done = self
            .regions
            .get(&ck)
            .is_some_and(|r| r.finished && r.readers == 0 && r.borrowers.is_empty());
        if !done {
            return;
        }
        let Some(r) = self.regions.remove(&ck) else {
            return;
        };
        match r.owner {
            Some(owner) => self.send_peer(owner, &SpToSp::RegionReleased { key: ck }),
            None => {
                if let Some(a) = self.arenas.get_mut(&ck.job) {
                    a.free(r.off);
                }
            }
        }
    }

    /// SP `from`'s ranks finished copying out of this SP's region of `ck`.
    pub(super) fn region_released(&mut self, ck: CollKey, from: SpId) {
        if let Some(r) = self.regions.get_mut(&ck) {
            r.borrowers.remove(&from);
        }
        self.release_region_if_done(ck);
    }
}
