//! The engine's side of the families' resources (`crate::drivers::resources`): the context
//! their hooks get ([`Server::with_resources`]: this SP, its cluster, the jobs and peers, a
//! queue of frames to peers sent right after), and a rank's copy out of its node's shared
//! memory, which the resources place and count.

use super::*;
use crate::drivers::resources::{Cx, Registry};
use bootstrap::kinds::Family;

impl Server {
    /// Runs `f` on the resources with a [`Cx`], then sends the frames it queued for peers, in
    /// order.
    pub(super) fn with_resources<R>(
        &mut self,
        f: impl FnOnce(&mut Registry, &mut Cx<'_>) -> R,
    ) -> R {
        let mut out = std::mem::take(&mut self.resource_out);
        let r = {
            let jobs = &self.jobs;
            let (dead, leaving) = (&self.dead_peers, &self.leaving_peers);
            let job_here = |j: u64| jobs.contains_key(&j);
            let peer_gone = |sp: SpId| dead.contains(&sp) || leaving.contains(&sp);
            let mut cx = Cx {
                me: self.me,
                cluster: &self.cluster,
                key: &self.key,
                job_here: &job_here,
                peer_gone: &peer_gone,
                to_peers: &mut out,
            };
            f(&mut self.resources, &mut cx)
        };
        for (sp, msg) in out.drain(..) {
            self.send_peer(sp, &msg);
        }
        self.resource_out = out;
        r
    }

    /// The family of instance `ck`'s kind (while the instance exists).
    pub(super) fn family_of(&self, ck: CollKey) -> Option<Family> {
        self.instances.get(&ck).map(|i| i.sm.kind().facts().family)
    }

    /// A rank of `ck` has its data in its node's shared memory (a hierarchical staged design):
    /// it copies them out itself, where the instance's resources say, and completes when it
    /// says it did.
    pub(super) fn finish_from_segment(&mut self, ck: CollKey, p: Posted) {
        let Some(family) = self.family_of(ck) else {
            return;
        };
        let source = self.instances.get(&ck).and_then(|i| i.sm.segment_source());
        let placed = match self.resources.of(family) {
            Some(r) => r.shared_read(ck, source),
            None => Err("a segment completion without resources"),
        };
        let (off, len) = match placed {
            Ok(at) => at,
            Err(why) => {
                warn!(sp = self.me, ?ck, "{why}");
                return self.write_completion(p, Status::AccessError);
            }
        };
        let then = AfterHostCopy::Finish { posted: p, family };
        if self.send_host_copy(ck, p, then, CopySrc::Segment { offset: off }, 0, len) {
            if let Some(r) = self.resources.of(family) {
                r.read_started(ck);
            }
        }
        // A host that is gone gets no completion.
    }

    /// A rank's copy out of shared memory of `family`'s resources ended.
    pub(super) fn shared_read_done(&mut self, ck: CollKey, family: Family) {
        self.with_resources(|r, cx| {
            if let Some(r) = r.of(family) {
                r.read_done(ck, cx);
            }
        });
    }
}
