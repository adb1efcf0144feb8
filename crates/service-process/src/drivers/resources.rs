//! Resources a family of collectives owns in the SP beyond what every kind shares (the
//! connections, the datapath, the copy limiter): the multicast family's fabric sockets,
//! receive and send workers and their channels; the staged family's staging slots (from the
//! SP's budget), the UCX registrar that grants them to peers, and the regions of its jobs'
//! node segments. The engine holds them in one [`Registry`], hands them a driver's requests
//! ([`super::Act::Resource`]), polls them for what they finished (after every wake of the
//! loop) and feeds it to the instance's driver ([`super::CollDriver::handle_event`]), and
//! releases an instance's share when the instance goes; it never names a family's requests or
//! events (they are `Any`, downcast by the family's own driver and resources).
//!
//! Beyond requests and events, a family's resources may hold memory for its instances, which
//! the engine reaches through the hooks of [`Resources`] whose defaults say "nothing here":
//! taken when an instance is made ([`Resources::admit`], which may refuse it), a post's place
//! ([`Resources::place`]), buffers the drivers name by index ([`Resources::buffer`], filled by
//! peers' data, granted to peers), shared memory ranks copy out of ([`Resources::shared_read`]),
//! and what a peer, a lost peer or a job's end means to them. While a hook runs, the engine
//! lends them a [`Cx`]: who this SP is, its cluster, and a queue of frames to peers it sends
//! right after the hook returns, in order.
//!
//! Adding a family's resources: a type implementing [`Resources`] (in the family's own
//! module, e.g. `crate::mcast::plane`, `crate::staged_resources`), made in `Server::new` and
//! put in the registry.

use super::Inbound;
use algorithms::{CollKey, SpId};
use alias_mkey::{AliasKey, Grant};
use bootstrap::auth::ClusterKey;
use bootstrap::kinds::Family;
use bootstrap::wire::{PostDesc, SpToSp};
use bootstrap::Cluster;
use std::any::Any;
use std::time::Duration;

/// A driver's request to its family's resources, or their answer to it.
pub type Payload = Box<dyn Any + Send>;

/// What the engine lends a family's resources while one of their hooks runs.
pub struct Cx<'a> {
    pub me: SpId,
    pub cluster: &'a Cluster,
    pub key: &'a ClusterKey,
    /// Whether a rank of the job is connected here (the job is known here).
    pub job_here: &'a dyn Fn(u64) -> bool,
    /// Whether peer SP `sp` is lost or said it is leaving.
    pub peer_gone: &'a dyn Fn(SpId) -> bool,
    /// Frames to peer SPs, sent in this order once the hook returns.
    pub to_peers: &'a mut Vec<(SpId, SpToSp)>,
}

/// Where a local post's instance writes on this SP (see [`Resources::place`]).
#[derive(Default)]
pub struct Placement {
    /// A grant of the posting rank (a region of its node's segment) the instance writes, and
    /// its offset in the segment: aliased by the engine as the rank's and handed to the driver
    /// (`LocalPost::region`).
    pub region: Option<(Grant, u64)>,
    /// The instance runs its hierarchical design here (`LocalPost::hier`).
    pub hier: bool,
}

/// One family's resources. Not `Send`: they live on the loop thread (a UCX worker is bound to
/// its thread).
pub trait Resources {
    /// The family they serve.
    fn family(&self) -> Family;
    /// Why the family cannot run on this SP (said to hosts at registration, so that a job
    /// chooses another design everywhere); `None` when it can.
    fn unavailable(&self) -> Option<String>;
    /// Carries out a request of instance `ck`. An error fails the instance (its driver is
    /// aborted with it).
    fn request(&mut self, ck: CollKey, req: Payload) -> Result<(), String>;
    /// What they finished since the last call, per instance.
    fn poll(&mut self, out: &mut Vec<(CollKey, Payload)>);
    /// Instance `ck` is gone: whatever it still holds is released before this returns
    /// (nothing of it touches a rank's memory afterwards).
    fn release(&mut self, ck: CollKey, cx: &mut Cx<'_>);
    /// Counters for `stats` (added to the SP's counters by name).
    fn counters(&self) -> Vec<(&'static str, u64)>;

    /// A new instance `ck` of the family (of a job run by `uid`, when known here): what it
    /// holds for its whole life is taken now; `staged_slots`: the staging slots its machine
    /// was made with (`KindConfig::for_message`). `Err(why)`: refused; the engine aborts the
    /// instance and tells every local rank that posts it why.
    fn admit(&mut self, _ck: CollKey, _uid: Option<u32>, _staged_slots: u32) -> Result<(), String> {
        Ok(())
    }
    /// A checked local post of instance `ck`: where the instance writes it on this SP.
    /// `Err(why)`: the post is refused (`BadDescriptor`).
    fn place(
        &mut self,
        _ck: CollKey,
        _d: &PostDesc,
        _cx: &mut Cx<'_>,
    ) -> Result<Placement, String> {
        Ok(Placement::default())
    }
    /// Buffer `index` of those instance `ck` holds here (a staging slot): its key.
    fn buffer(&self, _ck: CollKey, _index: u32) -> Option<&AliasKey> {
        None
    }
    /// The first `len` bytes of buffer `index` of `ck` (to send to a peer).
    fn buffer_bytes(&self, _ck: CollKey, _index: u32, _len: usize) -> Option<&[u8]> {
        None
    }
    /// A peer's bytes for buffer `index` of `ck` (the driver said they may land there):
    /// written, or false if they do not fit.
    fn fill(&mut self, _ck: CollKey, _index: u32, _bytes: &[u8]) -> bool {
        false
    }
    /// The buffer `index` of peer `to` that `to` granted this SP for `ck` (a UCX key to put
    /// into), taken: each grant is used once.
    fn take_peer_buffer(&mut self, _ck: CollKey, _to: SpId, _index: u32) -> Option<AliasKey> {
        None
    }
    /// The engine is about to send `to` a message of `ck` that lends it the instance's shared
    /// region (`lends_region`) or grants it buffers `grants` (see `Act::Send`): frames `to`
    /// needs first go into `cx.to_peers`.
    fn before_send(
        &mut self,
        _ck: CollKey,
        _to: SpId,
        _lends_region: bool,
        _grants: &[u32],
        _cx: &mut Cx<'_>,
    ) {
    }
    /// A peer's message of `ck` arrived, as its kind describes it, before the instance sees
    /// it; `live`: the instance may still run here (its job is here and it did not finish).
    fn inbound(
        &mut self,
        _ck: CollKey,
        _from: SpId,
        _inbound: &Inbound,
        _live: bool,
        _cx: &mut Cx<'_>,
    ) {
    }
    /// A local rank of `ck` completes with its data in the shared memory of its node
    /// (`Act::Complete { from_segment }`; `source`: the driver's `segment_source`): the
    /// offset and length it copies them from, or why it cannot.
    fn shared_read(
        &mut self,
        _ck: CollKey,
        _source: Option<(SpId, u64, u64)>,
    ) -> Result<(u64, u64), &'static str> {
        Err("no shared memory for this collective")
    }
    /// A rank was handed the copy [`Resources::shared_read`] placed.
    fn read_started(&mut self, _ck: CollKey) {}
    /// That copy ended (done, failed or its rank gone).
    fn read_done(&mut self, _ck: CollKey, _cx: &mut Cx<'_>) {}
    /// A peer's message that belongs to no collective; true if it was for these resources.
    fn peer_msg(&mut self, _from: SpId, _msg: &SpToSp, _cx: &mut Cx<'_>) -> bool {
        false
    }
    /// Peer SP `sp` is lost.
    fn peer_lost(&mut self, _sp: SpId, _cx: &mut Cx<'_>) {}
    /// Nothing of job `job` is left here (no rank connected, no instance).
    fn job_gone(&mut self, _job: u64, _cx: &mut Cx<'_>) {}
    /// Work for the loop thread before it waits for events (`polling`: it will not sleep):
    /// the longest it may wait then, `None` for no bound of theirs.
    fn progress(&mut self, _polling: bool) -> Option<Duration> {
        None
    }
}

/// The resources of every family that has some, at most one per family.
#[derive(Default)]
pub struct Registry {
    parts: Vec<Box<dyn Resources>>,
}

impl Registry {
    pub fn add(&mut self, r: Box<dyn Resources>) {
        self.parts.retain(|p| p.family() != r.family());
        self.parts.push(r);
    }

    pub fn of(&mut self, family: Family) -> Option<&mut (dyn Resources + 'static)> {
        self.parts
            .iter_mut()
            .find(|p| p.family() == family)
            .map(|p| p.as_mut())
    }

    pub fn get(&self, family: Family) -> Option<&(dyn Resources + 'static)> {
        self.parts
            .iter()
            .find(|p| p.family() == family)
            .map(|p| p.as_ref())
    }

    /// A new instance of `family` (see [`Resources::admit`]).
    pub fn admit(
        &mut self,
        family: Family,
        ck: CollKey,
        uid: Option<u32>,
        staged_slots: u32,
    ) -> Result<(), String> {
        self.of(family)
            .map_or(Ok(()), |p| p.admit(ck, uid, staged_slots))
    }

    /// A peer's message outside any collective, to the part it is for; false if none took it.
    pub fn peer_msg(&mut self, from: SpId, msg: &SpToSp, cx: &mut Cx<'_>) -> bool {
        self.parts.iter_mut().any(|p| p.peer_msg(from, msg, cx))
    }

    /// Peer SP `sp` is lost (every part).
    pub fn peer_lost(&mut self, sp: SpId, cx: &mut Cx<'_>) {
        for p in &mut self.parts {
            p.peer_lost(sp, cx);
        }
    }

    /// Job `job` is gone here (every part).
    pub fn job_gone(&mut self, job: u64, cx: &mut Cx<'_>) {
        for p in &mut self.parts {
            p.job_gone(job, cx);
        }
    }

    /// Every part's work before the loop waits: the shortest wait they allow.
    pub fn progress(&mut self, polling: bool) -> Option<Duration> {
        self.parts
            .iter_mut()
            .filter_map(|p| p.progress(polling))
            .min()
    }

    /// Why `family` cannot run here: its resources' reason, or that the SP has none for it.
    pub fn unavailable(&self, family: Family) -> Option<String> {
        match self.parts.iter().find(|p| p.family() == family) {
            Some(p) => p.unavailable(),
            None => Some(format!("this SP runs no {family:?} collectives")),
        }
    }

    /// What every part finished.
    pub fn poll(&mut self) -> Vec<(CollKey, Payload)> {
        let mut out = Vec::new();
        for p in &mut self.parts {
            p.poll(&mut out);
        }
        out
    }

    /// Instance `ck` is gone (every part releases its share; most have none).
    pub fn release(&mut self, ck: CollKey, cx: &mut Cx<'_>) {
        for p in &mut self.parts {
            p.release(ck, cx);
        }
    }

    /// Every part's counters.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        self.parts.iter().flat_map(|p| p.counters()).collect()
    }
}

/// A family whose resources could not be set up here: every request fails with the reason.
pub struct Unavailable {
    pub family: Family,
    pub why: String,
}

impl Resources for Unavailable {
    fn family(&self) -> Family {
        self.family
    }
    fn unavailable(&self) -> Option<String> {
        Some(self.why.clone())
    }
    fn request(&mut self, _ck: CollKey, _req: Payload) -> Result<(), String> {
        Err(self.why.clone())
    }
    fn poll(&mut self, _out: &mut Vec<(CollKey, Payload)>) {}
    fn release(&mut self, _ck: CollKey, _cx: &mut Cx<'_>) {}
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}
