//! Ring `Ialltoallv` progressed by service processes (after NVIDIA's MIMOSA
//! design).
//!
//! One [`Alltoallv`] object exists per collective instance ([`CollKey`]) per
//! SP. Each local rank that posts announces its send blocks to the SPs of
//! the destination ranks, in ring order starting with itself. The SP of a
//! destination rank reads ("RDMA-read") each announced block straight from
//! the source host buffer into the destination host buffer and acknowledges
//! it. A rank completes once all blocks into its receive buffer are done and
//! all blocks out of its send buffer are acknowledged.
//!
//! Failure handling. Every announcement is answered by exactly one `Ack`,
//! also after an abort (then without copying), so a sender always learns
//! when nobody will read its send buffer any more; blocks announced to ranks
//! of a lost SP are settled by [`Alltoallv::handle_peer_lost`]. A rank is
//! never reported complete while a copy reading its send buffer or writing
//! its receive buffer may still be running, not even after an abort. A local
//! abort (or peer loss, or rank loss) is broadcast to every other SP of the
//! communicator with `Msg::Abort`; an aborted instance that does not know the
//! membership yet answers each announcing SP with an `Abort`.
//!
//! Driver obligations: route `Action::Send` messages (tagged with the
//! `CollKey`), execute `Action::Copy` (through a
//! [`CopyLimiter`](crate::sched::CopyLimiter)) and report each with
//! `handle_copy_done`, report every `Action::Complete` to the host. After an
//! abort the driver should remember the `CollKey` for a while after dropping
//! the instance, so late messages do not create a fresh instance that would
//! wait forever.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::abort::{fail_pending, lose_rank, Outcome};
use crate::common::{common_api, take_finished, Core, VRecv};
pub use crate::direct::{Config, CopyId};
use crate::{CollKey, Nanos, Rank, SpId, Status};

mod messages;
mod state;
#[cfg(test)]
mod tests;
mod types;

pub use state::Alltoallv;
use state::*;
pub use types::*;
