//! Resources a family of collectives owns in the SP beyond what every kind shares (the
//! connections, the datapath, the copy limiter): the multicast family's fabric sockets,
//! receive and send workers and their channels today. The engine holds them in one
//! [`Registry`], hands them a driver's requests ([`super::Act::Resource`]), polls them for
//! what they finished (after every wake of the loop) and feeds it to the instance's driver
//! ([`super::CollDriver::handle_event`]), and releases an instance's share when the instance
//! goes; it never names a family's requests or events (they are `Any`, downcast by the
//! family's own driver and resources).
//!
//! Adding a family's resources: a type implementing [`Resources`] (in the family's own
//! module, e.g. `crate::mcast::plane`), made in `Server::new` and put in the registry.

use algorithms::CollKey;
use bootstrap::kinds::Family;
use std::any::Any;

/// A driver's request to its family's resources, or their answer to it.
pub type Payload = Box<dyn Any + Send>;

/// One family's resources.
pub trait Resources: Send {
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
    fn release(&mut self, ck: CollKey);
    /// Counters for `stats` (added to the SP's counters by name).
    fn counters(&self) -> Vec<(&'static str, u64)>;
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
    pub fn release(&mut self, ck: CollKey) {
        for p in &mut self.parts {
            p.release(ck);
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
    fn release(&mut self, _ck: CollKey) {}
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}
