//! What the multicast family's drivers share: their requests to the family's resources
//! ([`crate::mcast::plane`]), and the body of their [`super::CollDriver`] around a machine
//! that registers its receive and multicasts: the machine's actions after a `Register` (its
//! `Ready`) or an `Unregister` (its completions) are held back until the resources said they
//! took it (`McastEvent::Registered`/`Unregistered`), which keeps the machine's driver
//! obligation without the SP's loop ever waiting for a receive worker.

use super::Act;
use crate::mcast::plane::McastReq;

/// A request to the multicast resources.
pub(super) fn resource(req: McastReq) -> Act {
    Act::Resource {
        family: bootstrap::kinds::Family::Multicast,
        req: Box::new(req),
    }
}

/// The [`super::CollDriver`] methods of a multicast driver `Driver(machine, waiting)`, all but
/// `handle_post`: `$m` is the machine's module (`Action`, `CopyId`), `$variant` the kind's
/// `CollMsg` variant, and the file has its `SPEC`.
macro_rules! mcast_driver_body {
    ($m:ident, $variant:path) => {
        fn kind(&self) -> CollKind {
            SPEC.kind
        }
        fn handle_msg(&mut self, now: Nanos, from: SpId, msg: CollMsg) -> Result<(), String> {
            match msg {
                $variant(m) => self.0.handle_msg(now, from, m).map_err(|e| e.to_string()),
                m => Err(format!(
                    "a {:?} message for an instance of {}",
                    m.kind(),
                    SPEC.facts().name
                )),
            }
        }
        fn handle_copy_done(&mut self, now: Nanos, id: u64, status: Status) {
            self.0.handle_copy_done(now, $m::CopyId(id), status)
        }
        fn handle_peer_lost(&mut self, now: Nanos, sp: SpId) {
            self.0.handle_peer_lost(now, sp)
        }
        fn handle_rank_lost(&mut self, now: Nanos, rank: Rank) {
            self.0.handle_rank_lost(now, rank)
        }
        fn abort(&mut self, now: Nanos, status: Status) {
            self.0.abort(now, status)
        }
        fn is_finished(&self) -> bool {
            !self.1 && self.0.is_finished()
        }
        /// A registration the workers have not confirmed counts as in flight: the instance
        /// is not dropped with its job before they did.
        fn copies_in_flight(&self) -> usize {
            self.0.copies_in_flight() + usize::from(self.1)
        }
        fn poll_action(&mut self) -> Option<Act> {
            if self.1 {
                return None;
            }
            let a = self.0.poll_action()?;
            if matches!(a, $m::Action::Register(_) | $m::Action::Unregister) {
                self.1 = true;
            }
            Some(Act::from(a))
        }
        fn deadline(&self) -> Option<Nanos> {
            self.0.poll_timeout()
        }
        fn tick(&mut self, now: Nanos) {
            self.0.handle_timeout(now)
        }
        fn handle_event(&mut self, now: Nanos, event: super::resources::Payload) {
            use crate::mcast::plane::McastEvent;
            let Ok(ev) = event.downcast::<McastEvent>() else {
                return;
            };
            match *ev {
                McastEvent::Registered | McastEvent::Unregistered => self.1 = false,
                McastEvent::Landed(psns) => self.0.handle_landed_many(now, &psns),
                McastEvent::MulticastDone { id, status } => {
                    self.0.handle_copy_done(now, $m::CopyId(id), status)
                }
                // A chunk could not be written where the grant said: the collective fails.
                McastEvent::SinkFailed => self.0.abort(now, Status::AccessError),
            }
        }
    };
}
pub(super) use mcast_driver_body;
