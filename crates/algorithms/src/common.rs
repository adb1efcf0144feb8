//! Pieces shared by the collectives' state machines.

use std::collections::BTreeMap;

use crate::SpId;

/// The node of every SP serving a member (`members[r]` serves comm rank `r`
/// on node `nodes[r]`), or the first SP found serving ranks on two nodes.
pub(crate) fn sp_nodes(members: &[SpId], nodes: &[u32]) -> Result<BTreeMap<SpId, u32>, SpId> {
    let mut sp_node: BTreeMap<SpId, u32> = BTreeMap::new();
    for (&sp, &n) in members.iter().zip(nodes) {
        if *sp_node.entry(sp).or_insert(n) != n {
            return Err(sp);
        }
    }
    Ok(sp_node)
}

/// The accessors and trivial inputs every collective's state machine has
/// alike (fields `key`, `me`, `abort`, `stats`, `actions`). With `staged`,
/// also the inputs the staged collectives handle alike (methods `process`,
/// `copy_finished`, `enter_abort`, `pump`; field `now`, `slots`).
macro_rules! common_api {
    ($machine:ident) => {
        impl<K: Clone + fmt::Debug + PartialEq> $machine<K> {
            pub fn key(&self) -> CollKey {
                self.key
            }

            pub fn me(&self) -> SpId {
                self.me
            }

            pub fn abort_status(&self) -> Option<Status> {
                self.abort.status
            }

            pub fn stats(&self) -> Stats {
                self.stats
            }

            /// This algorithm has no timers.
            pub fn handle_timeout(&mut self, _now: Nanos) {}

            pub fn poll_action(&mut self) -> Option<Action<K>> {
                self.actions.pop_front()
            }

            /// This algorithm has no timers: always `None`.
            pub fn poll_timeout(&self) -> Option<Nanos> {
                None
            }
        }
    };
    ($machine:ident, staged, $msg:ty) => {
        common_api!($machine);

        impl<K: Clone + fmt::Debug + PartialEq> $machine<K> {
            /// Staging slots granted, being read, or holding a chunk.
            pub fn slots_in_use(&self) -> usize {
                self.slots.in_use()
            }

            /// A message from SP `from` for this instance.
            pub fn handle_msg(
                &mut self,
                now: Nanos,
                from: SpId,
                msg: $msg,
            ) -> Result<(), MsgError> {
                self.now = now;
                let res = self.process(from, msg);
                self.pump();
                res
            }

            /// The copy `id` finished with `status`.
            pub fn handle_copy_done(&mut self, now: Nanos, id: CopyId, status: Status) {
                self.now = now;
                self.copy_finished(id.0, status);
                self.pump();
            }

            /// Local abort; `Status::Ok` becomes `Status::Aborted`.
            pub fn abort(&mut self, now: Nanos, status: Status) {
                self.now = now;
                self.enter_abort(status);
                self.pump();
            }
        }
    };
}
pub(crate) use common_api;
