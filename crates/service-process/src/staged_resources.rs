//! The staged family's resources in the SP ([`Resources`]): the staging slots of its
//! instances (reserved from the SP's [`Budget`] when an instance is made, given back when it
//! goes), the UCX registrar that grants slots to the SP's parents in a broadcast tree (and the
//! slots its children granted this SP), and the regions of its jobs' node segments that the
//! hierarchical designs write, lend to the node's other SPs and release once every reader is
//! done (and, at a job's end, the segment's name, once the node's other SPs are done with it).
//!
//! The engine reaches them only through the hooks of [`Resources`]: `admit` (the staging, or
//! the refusal the posting rank is told), `place` (a region of the segment, or flat for want
//! of room), `buffer`/`buffer_bytes`/`fill`/`take_peer_buffer` (the slots the drivers name by
//! index), `before_send` (a region lent, slots granted over UCX), `inbound` (a region
//! borrowed), `shared_read`/`read_started`/`read_done` (ranks copying out of a region),
//! `peer_msg` (`SlotGrants`, `RegionReleased`, `JobGone`), `peer_lost`, `job_gone`, `release`
//! and `progress` (the UCX worker of the staging).

use crate::drivers::resources::{Cx, Payload, Placement, Resources};
use crate::drivers::{self, Inbound, StagedConfig};
use crate::segment::Arena;
use crate::staging::{Budget, StageSet};
use algorithms::{CollKey, SpId};
use alias_mkey::{AliasKey, Rights};
use bootstrap::kinds::Family;
use bootstrap::wire::{PostDesc, SpToSp, StagedDesign};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};
use tracing::warn;

/// Longest run of progress on the staging UCX worker in one pass of the event loop.
const UCX_PROGRESS_SLICE: Duration = Duration::from_millis(2);

/// The region of its job's node segment a hierarchical staged instance uses on this SP.
struct Region {
    off: u64,
    /// The message length (the region may be larger).
    len: u64,
    /// Ranks still copying out of it.
    readers: usize,
    /// The instance finished (no more writes, no more readers to come).
    finished: bool,
    /// `Some(leader)`: the region is the node leader's, which sealed it for this SP's ranks
    /// (a bcast); it is told once they copied. `None`: this SP's own, in its arena.
    owner: Option<SpId>,
    /// This SP's own region: the node's other SPs it was sealed for that have not said their
    /// ranks finished copying.
    borrowers: HashSet<SpId>,
}

pub struct StagedResources {
    /// With UCX on: the staging buffers are registered with UCX and granted to the parent in
    /// a staged broadcast's tree, which puts chunks straight into them. Declared first so
    /// that it unmaps them before the budget's pool frees them.
    ucx: Option<alias_mkey::host::UcxRegistrar>,
    cfg: StagedConfig,
    budget: Budget,
    /// The staging slots of each instance (given back to the budget with the instance).
    sets: HashMap<CollKey, StageSet>,
    /// Slots children granted through UCX: (instance, child, slot) -> its key.
    peer_slots: HashMap<(CollKey, SpId, u32), AliasKey>,
    /// Segment regions per job, and the region of each instance.
    arenas: HashMap<u64, Arena>,
    regions: HashMap<CollKey, Region>,
    /// Hierarchical instances that found no room in the segment: this SP delivers them flat.
    flat_here: HashSet<CollKey>,
    /// The node's other SPs that said a job is gone there (`SpToSp::JobGone`), for jobs still
    /// here; and, for jobs gone here, those still to say so before the node's segment name is
    /// removed.
    gone_at_siblings: HashMap<u64, HashSet<SpId>>,
    unlink_after: HashMap<u64, HashSet<SpId>>,
    /// The instance whose local post was just placed and is about to be admitted, and the
    /// address of that rank's buffer, near which its slots go ([`StageSet::place_near`]).
    placing: Option<(CollKey, u64)>,
    refused: u64,
    regions_shared: u64,
    hier_delivered_flat: u64,
}

impl StagedResources {
    /// `bytes` of staging for all instances together, shared out by `shares`; `ucx`: the
    /// registrar of the staging (its event fd already registered with the loop), if UCX is on.
    pub fn new(
        cfg: StagedConfig,
        bytes: u64,
        shares: crate::staging::Shares,
        ucx: Option<alias_mkey::host::UcxRegistrar>,
    ) -> StagedResources {
        StagedResources {
            ucx,
            cfg,
            budget: Budget::with_shares(bytes, shares),
            sets: HashMap::new(),
            peer_slots: HashMap::new(),
            arenas: HashMap::new(),
            regions: HashMap::new(),
            flat_here: HashSet::new(),
            gone_at_siblings: HashMap::new(),
            unlink_after: HashMap::new(),
            placing: None,
            refused: 0,
            regions_shared: 0,
            hier_delivered_flat: 0,
        }
    }

    /// The region of `ck` in its job's segment (described by a rank's grant `seg`): the one
    /// the instance has, or a new one of `len` bytes; `None` if the segment has no room.
    fn region_for(
        &mut self,
        ck: CollKey,
        seg_len: u64,
        len: u64,
        cx: &Cx<'_>,
    ) -> Result<Option<(u64, u64)>, String> {
        // The segment holds one equal part per SP of the node; this SP places its regions in
        // its own part.
        let parts = u64::from(cx.cluster.sps_per_node.max(1));
        let index = cx.cluster.sp(cx.me).map_or(0, |e| u64::from(e.index));
        if !seg_len.is_multiple_of(parts) {
            return Err(format!(
                "a segment of {seg_len} bytes cannot hold one equal part for each of the node's \
                 {parts} SPs"
            ));
        }
        let part = seg_len / parts;
        let arena = self
            .arenas
            .entry(ck.job)
            .or_insert_with(|| Arena::new(index * part, part));
        if arena.capacity() != part {
            return Err(format!(
                "segment of {seg_len} bytes, but the job's ranks on this node used {} \
                 (SPOFF_SEGMENT_BYTES differs between ranks)",
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

    fn release_region_if_done(&mut self, ck: CollKey, cx: &mut Cx<'_>) {
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
            Some(owner) => cx
                .to_peers
                .push((owner, SpToSp::RegionReleased { key: ck })),
            None => {
                if let Some(a) = self.arenas.get_mut(&ck.job) {
                    a.free(r.off);
                }
            }
        }
    }

    /// SP `from`'s ranks finished copying out of this SP's region of `ck`.
    fn region_released(&mut self, ck: CollKey, from: SpId, cx: &mut Cx<'_>) {
        if let Some(r) = self.regions.get_mut(&ck) {
            r.borrowers.remove(&from);
        }
        self.release_region_if_done(ck, cx);
    }

    /// The job is gone here: tell the node's other SPs, and remove the node's segment name
    /// once each of them that serves ranks of the job said the same (or is gone). Removing it
    /// earlier would let a rank of another SP that maps it later create a second object under
    /// the same name, and read a region its SP's writer never wrote.
    fn job_gone_here(&mut self, job: u64, cx: &mut Cx<'_>) {
        let Some(node) = cx.cluster.sp(cx.me).map(|e| e.node) else {
            return;
        };
        let siblings: HashSet<SpId> = cx
            .cluster
            .sps
            .iter()
            .filter(|e| e.node == node && e.id != cx.me)
            .map(|e| e.id)
            .collect();
        for &sp in &siblings {
            cx.to_peers
                .push((sp, SpToSp::JobGone { job, answer: false }));
        }
        // Each sibling answers at once if the job was never there (`JobGone { answer }`).
        let told = self.gone_at_siblings.remove(&job).unwrap_or_default();
        let waiting: HashSet<SpId> = siblings
            .into_iter()
            .filter(|sp| !told.contains(sp) && !(cx.peer_gone)(*sp))
            .collect();
        if waiting.is_empty() {
            crate::segment::unlink(cx.key, job, node);
        } else {
            self.unlink_after.insert(job, waiting);
        }
    }

    /// SP `sp` of this node has job `job` gone (or is gone itself, `job` None: every job).
    fn sibling_gone(&mut self, sp: SpId, job: Option<u64>, cx: &Cx<'_>) {
        let Some(node) = cx.cluster.sp(cx.me).map(|e| e.node) else {
            return;
        };
        if cx.cluster.sp(sp).map(|e| e.node) != Some(node) {
            return;
        }
        if let Some(job) = job {
            if !self.unlink_after.contains_key(&job) {
                self.gone_at_siblings.entry(job).or_default().insert(sp);
                return;
            }
        }
        let mut done = Vec::new();
        for (&j, waiting) in self.unlink_after.iter_mut() {
            if job.is_none_or(|g| g == j) {
                waiting.remove(&sp);
                if waiting.is_empty() {
                    done.push(j);
                }
            }
        }
        for j in done {
            self.unlink_after.remove(&j);
            crate::segment::unlink(cx.key, j, node);
        }
    }

    /// With UCX here: registers staging slots `slots` of `ck` for writing and sends their keys
    /// to `to`, which then puts its chunks straight into them (without UCX the chunks come as
    /// frames, which the slots take as well).
    fn grant_slots_over_ucx(&mut self, ck: CollKey, to: SpId, slots: &[u32], cx: &mut Cx<'_>) {
        let (Some(reg), Some(stages)) = (self.ucx.as_mut(), self.sets.get(&ck)) else {
            return;
        };
        let mut granted = Vec::new();
        for &s in slots {
            let Some(stage) = stages.slots.get(s as usize) else {
                continue;
            };
            let k = stage.key();
            // SAFETY: staging buffers are never freed while the registrar lives (they go back
            // to the pool, dropped after this registrar, so unmapped first), and a granted slot
            // is not read here until the chunk's message says its bytes landed.
            match unsafe { reg.register(k.grant.addr, k.grant.len, Rights::WRITE) } {
                Ok(g) => granted.push((
                    s,
                    AliasKey {
                        owner: k.owner,
                        grant: g,
                    },
                )),
                Err(e) => warn!(sp = cx.me, "cannot grant a staging slot: {e}"),
            }
        }
        if !granted.is_empty() {
            cx.to_peers.push((
                to,
                SpToSp::SlotGrants {
                    key: ck,
                    slots: granted,
                },
            ));
        }
    }
}

impl Resources for StagedResources {
    fn family(&self) -> Family {
        Family::Staged
    }

    fn unavailable(&self) -> Option<String> {
        None
    }

    fn request(&mut self, _ck: CollKey, _req: Payload) -> Result<(), String> {
        Err("the staged family's resources take no requests".into())
    }

    fn poll(&mut self, _out: &mut Vec<(CollKey, Payload)>) {}

    fn release(&mut self, ck: CollKey, cx: &mut Cx<'_>) {
        self.sets.remove(&ck);
        if let Some(r) = self.regions.get_mut(&ck) {
            r.finished = true;
        }
        self.release_region_if_done(ck, cx);
        self.flat_here.remove(&ck);
        if !self.peer_slots.is_empty() {
            self.peer_slots.retain(|(k, _, _), _| *k != ck);
        }
    }

    /// Most staging memory reserved at once, instances refused for want of staging,
    /// hierarchical instances this SP delivered flat for want of room in the segment, and node
    /// regions this SP (a bcast's node leader, an allgather's node owner) handed to another SP
    /// of its node (`Sealed`, `RegionDone`), whose ranks copied out of it.
    fn counters(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("staging_peak_bytes", self.budget.peak),
            ("staging_refused", self.refused),
            ("hier_delivered_flat", self.hier_delivered_flat),
            ("regions_shared", self.regions_shared),
        ]
    }

    fn admit(&mut self, ck: CollKey, uid: Option<u32>, slots: u32) -> Result<(), String> {
        // Never more than configured, whatever the caller says, and at least one (as the
        // machine clamps its count).
        let slots = slots.min(self.cfg.slots).max(1);
        match self
            .budget
            .reserve(ck.job, uid, slots, self.cfg.chunk_bytes)
        {
            Ok(mut set) => {
                // Made for a local post (not a peer's message): near that rank's buffer.
                if let Some((_, addr)) = self.placing.take().filter(|(k, _)| *k == ck) {
                    set.place_near(addr);
                }
                self.sets.insert(ck, set);
                Ok(())
            }
            Err(why) => {
                self.refused += 1;
                Err(why)
            }
        }
    }

    // A hierarchical staged instance needs a region of its job's segment on this SP. When none
    // is free, this SP delivers the instance flat: it writes each rank's buffer itself (its
    // ranks granted them for writing), which the ranks cannot tell apart from a copy out of the
    // segment. Waiting for room instead could deadlock: the instance holding the room may need
    // a post that waits elsewhere. Only one SP of a node writes a hierarchical region, which
    // the node's other SPs' ranks copy out of: a bcast's node leader in its tree, a staged
    // allgather's node owner.
    fn place(&mut self, ck: CollKey, d: &PostDesc, cx: &mut Cx<'_>) -> Result<Placement, String> {
        let Some(st) = &d.staged else {
            return Ok(Placement::default());
        };
        // The buffer this rank's copies read (a bcast's root, an allgather's block) or else
        // write, for `admit` to place the instance's slots near, if this post makes it.
        if !self.sets.contains_key(&ck) {
            let side = if d.send.len > 0 { &d.send } else { &d.recv };
            self.placing = Some((ck, side.addr));
        }
        let spec = drivers::spec(d.kind);
        let hier = st.design == StagedDesign::Hier;
        // Only a hierarchical instance asks (a bcast builds its tree to answer).
        let region_writer = hier && (spec.region_writer)(d, cx.me);
        let mut region = None;
        if hier && region_writer && !self.flat_here.contains(&ck) {
            let seg = st.segment.clone().expect("checked by check_post");
            let len = (spec.region_len)(d);
            match self.region_for(ck, seg.len, len, cx)? {
                Some((off, rlen)) => {
                    let g = alias_mkey::Grant {
                        addr: seg.addr + off,
                        len: rlen,
                        ..seg
                    };
                    region = Some((g, off));
                }
                None => {
                    self.hier_delivered_flat += 1;
                    self.flat_here.insert(ck);
                }
            }
        }
        // A node's region writer without room delivers flat (its node's other SPs then get
        // the data); the others are hierarchical as posted.
        let hier = region.is_some() || (!region_writer && hier);
        Ok(Placement { region, hier })
    }

    fn buffer(&self, ck: CollKey, index: u32) -> Option<&AliasKey> {
        self.sets
            .get(&ck)
            .and_then(|s| s.slots.get(index as usize))
            .map(|s| s.key())
    }

    fn buffer_bytes(&self, ck: CollKey, index: u32, len: usize) -> Option<&[u8]> {
        self.sets
            .get(&ck)
            .and_then(|s| s.slots.get(index as usize))
            .map(|s| s.bytes(len))
    }

    fn fill(&mut self, ck: CollKey, index: u32, bytes: &[u8]) -> bool {
        self.sets
            .get_mut(&ck)
            .and_then(|s| s.slots.get_mut(index as usize))
            .is_some_and(|s| s.fill(bytes))
    }

    fn take_peer_buffer(&mut self, ck: CollKey, to: SpId, index: u32) -> Option<AliasKey> {
        self.peer_slots.remove(&(ck, to, index))
    }

    fn before_send(
        &mut self,
        ck: CollKey,
        to: SpId,
        lends_region: bool,
        grants: &[u32],
        cx: &mut Cx<'_>,
    ) {
        if lends_region {
            self.regions_shared += 1;
            if let Some(r) = self.regions.get_mut(&ck) {
                r.borrowers.insert(to);
            }
        }
        if !grants.is_empty() {
            self.grant_slots_over_ucx(ck, to, grants, cx);
        }
    }

    // A node's region writer lent its region to this SP's ranks: it keeps the region until
    // told they are done with it (at once if this SP has no instance to read it).
    fn inbound(&mut self, ck: CollKey, from: SpId, inbound: &Inbound, live: bool, cx: &mut Cx<'_>) {
        let Some(at) = inbound.lends_region_at else {
            return;
        };
        if live {
            self.regions.entry(ck).or_insert_with(|| Region {
                off: at,
                len: 0,
                readers: 0,
                finished: false,
                owner: Some(from),
                borrowers: HashSet::new(),
            });
        } else {
            cx.to_peers.push((from, SpToSp::RegionReleased { key: ck }));
        }
    }

    fn shared_read(
        &mut self,
        ck: CollKey,
        source: Option<(SpId, u64, u64)>,
    ) -> Result<(u64, u64), &'static str> {
        // A bcast's ranks copy out of their node leader's region, which may be another SP's
        // (its entry here came with the leader's `Sealed`; the length comes from the view).
        if let Some(r) = self.regions.get_mut(&ck).filter(|r| r.owner.is_some()) {
            match source {
                Some((owner, at, len)) if r.owner == Some(owner) && r.off == at => r.len = len,
                _ => return Err("a segment completion out of a region not sealed"),
            }
        }
        self.regions
            .get(&ck)
            .map(|r| (r.off, r.len))
            .ok_or("a segment completion without a region")
    }

    fn read_started(&mut self, ck: CollKey) {
        if let Some(r) = self.regions.get_mut(&ck) {
            r.readers += 1;
        }
    }

    /// One reader of `ck`'s segment region is done; frees the region once the instance
    /// finished and nobody reads it.
    fn read_done(&mut self, ck: CollKey, cx: &mut Cx<'_>) {
        if let Some(r) = self.regions.get_mut(&ck) {
            r.readers = r.readers.saturating_sub(1);
        }
        self.release_region_if_done(ck, cx);
    }

    fn peer_msg(&mut self, from: SpId, msg: &SpToSp, cx: &mut Cx<'_>) -> bool {
        match msg {
            SpToSp::SlotGrants { key, slots } => {
                // Without UCX here the datapath cannot put: the chunks go as frames, which the
                // child takes as well.
                if self.ucx.is_some() {
                    for (slot, k) in slots {
                        self.peer_slots.insert((*key, from, *slot), k.clone());
                    }
                }
            }
            &SpToSp::JobGone { job, answer } => {
                // Without the job here (and not waiting to unlink its name), none of its ranks
                // is connected here: say so, so that the sender need not wait for this SP.
                if !answer && !(cx.job_here)(job) && !self.unlink_after.contains_key(&job) {
                    cx.to_peers
                        .push((from, SpToSp::JobGone { job, answer: true }));
                } else {
                    self.sibling_gone(from, Some(job), cx);
                }
            }
            &SpToSp::RegionReleased { key } => self.region_released(key, from, cx),
            _ => return false,
        }
        true
    }

    fn peer_lost(&mut self, sp: SpId, cx: &mut Cx<'_>) {
        self.sibling_gone(sp, None, cx);
        // Its ranks will not copy out of our regions any more.
        let borrowed: Vec<CollKey> = self
            .regions
            .iter()
            .filter(|(_, r)| r.borrowers.contains(&sp))
            .map(|(k, _)| *k)
            .collect();
        for ck in borrowed {
            self.region_released(ck, sp, cx);
        }
    }

    fn job_gone(&mut self, job: u64, cx: &mut Cx<'_>) {
        // The hierarchical designs' segment of this job: nobody is left to read it here;
        // leaders whose regions this SP's ranks were to read may reuse them.
        for (ck, r) in &self.regions {
            if let (true, Some(owner)) = (ck.job == job, r.owner) {
                cx.to_peers
                    .push((owner, SpToSp::RegionReleased { key: *ck }));
            }
        }
        self.regions.retain(|k, _| k.job != job);
        self.flat_here.retain(|k| k.job != job);
        self.peer_slots.retain(|(k, _, _), _| k.job != job);
        self.arenas.remove(&job);
        self.job_gone_here(job, cx);
    }

    // Puts of other SPs into this SP's staging complete only while its UCX worker progresses
    // (UCX 1.13 over tcp/shared memory): progress it until idle, then sleep on its event fd as
    // well as on the sockets. `arm` refuses while events are pending: then look again at once.
    // The bound is a safety net only. A polling SP progresses the worker at every look and
    // never arms it. Progress runs for at most UCX_PROGRESS_SLICE per pass: the transfers of
    // other SPs never keep the loop from its sockets and heartbeats (a worker still busy after
    // the slice is progressed again right after a look at the sockets).
    fn progress(&mut self, polling: bool) -> Option<Duration> {
        let reg = self.ucx.as_ref()?;
        let progress_start = Instant::now();
        let idle = loop {
            if reg.progress() == 0 {
                break true;
            }
            if progress_start.elapsed() >= UCX_PROGRESS_SLICE {
                break false;
            }
        };
        if polling || !idle {
            return Some(Duration::ZERO);
        }
        Some(match reg.arm() {
            Ok(true) => Duration::from_millis(50),
            Ok(false) => Duration::ZERO,
            // Not expected; poll the worker often rather than spin.
            Err(_) => Duration::from_millis(1),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bootstrap::auth::ClusterKey;
    use bootstrap::cluster::{Layout, SpEntry};
    use bootstrap::Cluster;

    fn ck(job: u64, seq: u64) -> CollKey {
        CollKey {
            job,
            comm: algorithms::CommId { leader: 0, id: 1 },
            seq,
        }
    }

    /// One node with SPs 0 and 1; the tests are SP 0.
    fn cluster() -> Cluster {
        let sps = (0..2)
            .map(|i| {
                let addr = format!("127.0.0.1:{}", 40000 + i).parse().unwrap();
                SpEntry::numbered(i, 2, addr, format!("/tmp/sp{i}").into())
            })
            .collect();
        Cluster::new(1, 2, None, Layout::Block, sps).unwrap()
    }

    /// Runs `f` with a context of SP 0 (no job connected, no peer gone); the frames it queued.
    fn with_cx(
        cluster: &Cluster,
        key: &ClusterKey,
        f: impl FnOnce(&mut Cx<'_>),
    ) -> Vec<(SpId, SpToSp)> {
        let mut out = Vec::new();
        let mut cx = Cx {
            me: 0,
            cluster,
            key,
            job_here: &|_| false,
            peer_gone: &|_| false,
            to_peers: &mut out,
        };
        f(&mut cx);
        out
    }

    fn counter(r: &StagedResources, name: &str) -> u64 {
        r.counters()
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v)
            .unwrap()
    }

    #[test]
    fn an_instance_refused_its_share_gets_the_reason_and_a_release_gives_it_back() {
        let (cluster, key) = (cluster(), ClusterKey::generate());
        let shares = crate::staging::Shares {
            job_percent: 50,
            uid_percent: 100,
        };
        let cfg = StagedConfig {
            chunk_bytes: 10,
            slots: 2,
        };
        let mut r = StagedResources::new(cfg, 100, shares, None);
        // 20 bytes an instance: job 1 holds its 50 with two.
        r.admit(ck(1, 0), Some(7), 2).unwrap();
        r.admit(ck(1, 1), Some(7), 2).unwrap();
        let why = r.admit(ck(1, 2), Some(7), 2).unwrap_err();
        assert!(
            why.contains("--staging-job-share") && why.contains("40 of its 50"),
            "{why}"
        );
        assert_eq!(counter(&r, "staging_refused"), 1);
        assert_eq!(counter(&r, "staging_peak_bytes"), 40);
        // The slots are the instance's: a peer's chunk lands in one, the engine reads it back.
        assert!(r.fill(ck(1, 1), 1, &[1, 2, 3]));
        assert_eq!(r.buffer_bytes(ck(1, 1), 1, 3), Some(&[1u8, 2, 3][..]));
        assert!(!r.fill(ck(1, 1), 2, &[1]), "no third slot");
        assert!(
            r.buffer(ck(1, 2), 0).is_none(),
            "a refused instance holds nothing"
        );
        // The instance's end gives its share back: the next instance of the job fits.
        with_cx(&cluster, &key, |cx| r.release(ck(1, 0), cx));
        assert!(r.buffer(ck(1, 0), 0).is_none());
        r.admit(ck(1, 3), Some(7), 2).unwrap();
        assert!(r.buffer(ck(1, 3), 1).is_some());
        assert_eq!(counter(&r, "staging_refused"), 1);
        with_cx(&cluster, &key, |cx| {
            r.release(ck(1, 1), cx);
            r.release(ck(1, 3), cx);
        });
        assert_eq!(r.budget.used(), 0);
    }

    #[test]
    fn an_instance_takes_the_slots_its_machine_was_made_with_never_more_than_configured() {
        let (cluster, key) = (cluster(), ClusterKey::generate());
        let cfg = StagedConfig {
            chunk_bytes: 10,
            slots: 4,
        };
        let mut r = StagedResources::new(cfg, 1000, Default::default(), None);
        for (seq, asked, held) in [(0, 1, 1), (1, 3, 3), (2, 9, 4), (3, 0, 1)] {
            let before = r.budget.used();
            r.admit(ck(1, seq), Some(7), asked).unwrap();
            assert_eq!(r.budget.used() - before, held * 10, "asked for {asked}");
            assert!(r.buffer(ck(1, seq), held as u32 - 1).is_some());
            assert!(
                r.buffer(ck(1, seq), held as u32).is_none(),
                "asked for {asked}"
            );
        }
        with_cx(&cluster, &key, |cx| {
            for seq in 0..4 {
                r.release(ck(1, seq), cx);
            }
        });
        assert_eq!(r.budget.used(), 0);
    }

    #[test]
    fn a_region_is_freed_once_its_borrowers_are_done_and_everything_at_the_job_end() {
        let (cluster, key) = (cluster(), ClusterKey::generate());
        let cfg = StagedConfig {
            chunk_bytes: 10,
            slots: 1,
        };
        let mut r = StagedResources::new(cfg, 100, Default::default(), None);
        // A segment of 2 KiB: SP 0's part is the first 1 KiB, which one region fills.
        let (a, b, c) = (ck(7, 0), ck(7, 1), ck(7, 2));
        let region = |r: &mut StagedResources, k| {
            let mut got = None;
            with_cx(&cluster, &key, |cx| {
                got = Some(r.region_for(k, 2048, 1000, cx))
            });
            got.unwrap().unwrap()
        };
        assert_eq!(region(&mut r, a), Some((0, 1000)));
        assert_eq!(region(&mut r, b), None, "the part is full");
        // Lent to SP 1, whose ranks copy out of it: it outlives its instance until SP 1 says
        // they are done.
        let sent = with_cx(&cluster, &key, |cx| r.before_send(a, 1, true, &[], cx));
        assert!(sent.is_empty());
        assert_eq!(counter(&r, "regions_shared"), 1);
        with_cx(&cluster, &key, |cx| r.release(a, cx));
        assert_eq!(region(&mut r, b), None, "still read by SP 1's ranks");
        let msg = SpToSp::RegionReleased { key: a };
        with_cx(&cluster, &key, |cx| assert!(r.peer_msg(1, &msg, cx)));
        assert_eq!(region(&mut r, b), Some((0, 1000)));
        // SP 1 lends SP 0 its region of `c`; then the job ends here with `b` still open.
        let lent = Inbound {
            lends_region_at: Some(1024),
            ..Inbound::default()
        };
        with_cx(&cluster, &key, |cx| r.inbound(c, 1, &lent, true, cx));
        let sent = with_cx(&cluster, &key, |cx| r.job_gone(7, cx));
        assert_eq!(
            sent,
            vec![
                (1, SpToSp::RegionReleased { key: c }),
                (
                    1,
                    SpToSp::JobGone {
                        job: 7,
                        answer: false
                    }
                ),
            ]
        );
        assert!(
            r.regions.is_empty() && r.arenas.is_empty(),
            "the job's regions are gone"
        );
        // The segment's name goes once SP 1 said the job is gone there too.
        assert!(r.unlink_after.contains_key(&7));
        let gone = SpToSp::JobGone {
            job: 7,
            answer: true,
        };
        with_cx(&cluster, &key, |cx| assert!(r.peer_msg(1, &gone, cx)));
        assert!(r.unlink_after.is_empty());
        // A new job of the same id starts from an empty part.
        assert_eq!(region(&mut r, ck(7, 3)), Some((0, 1000)));
    }
}
