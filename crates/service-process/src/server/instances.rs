//! The SP's collective instances: held in a slab and found by key through one map, so that a
//! handler that looked an instance up once reaches it again by its slot (`drive` takes a
//! dozen steps of one instance per post; each step used to hash its key again). The map keeps
//! std's keyed SipHash, because hosts choose the keys (communicator and sequence number; see
//! `SpMap`). The instances of each job are counted as they come and go: the per-job limit is
//! checked at every new post and must not scan them all.

use super::Instance;
use algorithms::CollKey;
use slab::Slab;
use std::collections::HashMap;

#[derive(Default)]
pub(super) struct Instances {
    slab: Slab<(CollKey, Instance)>,
    index: HashMap<CollKey, usize>,
    by_job: HashMap<u64, usize>,
}

/// Where an instance was found: good for [`Instances::at`] and [`Instances::at_mut`] while
/// the instance lives (a slot reused by another instance is told apart by its key; an
/// instance of the same key made again after this one went may sit in another slot, which
/// this one does not find: look the key up again after anything that can make instances).
#[derive(Clone, Copy, Debug)]
pub(super) struct Slot(usize);

impl Instances {
    pub(super) fn slot(&self, ck: &CollKey) -> Option<Slot> {
        self.index.get(ck).map(|&i| Slot(i))
    }

    pub(super) fn at(&self, slot: Slot, ck: &CollKey) -> Option<&Instance> {
        match self.slab.get(slot.0) {
            Some((k, inst)) if k == ck => Some(inst),
            _ => None,
        }
    }

    pub(super) fn at_mut(&mut self, slot: Slot, ck: &CollKey) -> Option<&mut Instance> {
        match self.slab.get_mut(slot.0) {
            Some((k, inst)) if k == ck => Some(inst),
            _ => None,
        }
    }

    pub(super) fn get(&self, ck: &CollKey) -> Option<&Instance> {
        self.index.get(ck).map(|&i| &self.slab[i].1)
    }

    pub(super) fn get_mut(&mut self, ck: &CollKey) -> Option<&mut Instance> {
        let i = *self.index.get(ck)?;
        Some(&mut self.slab[i].1)
    }

    pub(super) fn contains_key(&self, ck: &CollKey) -> bool {
        self.index.contains_key(ck)
    }

    /// Adds `inst` under `ck`, which must not be here yet (a second one would replace the
    /// first in the index and leave it unreachable).
    pub(super) fn insert(&mut self, ck: CollKey, inst: Instance) -> Slot {
        debug_assert!(!self.index.contains_key(&ck), "{ck:?} inserted twice");
        let i = self.slab.insert((ck, inst));
        self.index.insert(ck, i);
        *self.by_job.entry(ck.job).or_default() += 1;
        Slot(i)
    }

    pub(super) fn remove(&mut self, ck: &CollKey) -> Option<Instance> {
        let i = self.index.remove(ck)?;
        let (_, inst) = self.slab.remove(i);
        self.gone(ck.job);
        Some(inst)
    }

    /// Keeps the instances `keep` says to keep; returns the keys of the others, dropped.
    pub(super) fn retain(
        &mut self,
        mut keep: impl FnMut(&CollKey, &mut Instance) -> bool,
    ) -> Vec<CollKey> {
        let mut dropped = Vec::new();
        self.slab.retain(|_, (k, inst)| {
            let kept = keep(k, inst);
            if !kept {
                dropped.push(*k);
            }
            kept
        });
        for ck in &dropped {
            self.index.remove(ck);
            self.gone(ck.job);
        }
        dropped
    }

    fn gone(&mut self, job: u64) {
        if let Some(n) = self.by_job.get_mut(&job) {
            *n -= 1;
            if *n == 0 {
                self.by_job.remove(&job);
            }
        } else {
            debug_assert!(false, "an instance of job {job} went, none was counted");
        }
    }

    /// The instances `job` has here.
    pub(super) fn of_job(&self, job: u64) -> usize {
        self.by_job.get(&job).copied().unwrap_or(0)
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = &CollKey> {
        self.slab.iter().map(|(_, (k, _))| k)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&CollKey, &Instance)> {
        self.slab.iter().map(|(_, (k, inst))| (k, inst))
    }

    pub(super) fn len(&self) -> usize {
        self.slab.len()
    }
}
