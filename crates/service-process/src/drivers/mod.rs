//! The collective driver interface: what the engine knows of a collective, whichever it is.
//!
//! The state machines of `algorithms` differ in their posts, messages and copies. Each kind of
//! collective has a driver here (one file per kind) that wraps its machine behind
//! [`CollDriver`] and describes the kind to the engine with a [`KindSpec`]: how to make an
//! instance, whether it needs staging slots, which of its messages lend a segment region or
//! carry a staging slot's bytes, how to refuse a message for a job that is gone, and which SP
//! of a node writes a hierarchical region. The engine (`server`) feeds drivers events (a local
//! post, a peer message, a copy or move done, a peer or rank lost, an abort, a timer) with the
//! time passed in, and executes the [`Act`]s they emit; it never names a kind.
//!
//! What a kind is to every side (its name, the layout of its posts, the rights of its grants,
//! staged or direct, host copies) is its `bootstrap::kinds::KindFacts`, read here through
//! [`KindSpec::facts`]; a `KindSpec` holds only what the engine alone needs.
//!
//! Adding a collective kind: a `CollKind` and a `CollMsg` variant in `bootstrap::wire` with
//! its facts in `bootstrap::kinds`, a file here with its driver and `SPEC`, and a line in
//! [`KINDS`].

mod allgatherv;
mod allreduce;
mod alltoallv;
mod bcast;
mod canary_allreduce;
mod mcast;
mod mcast_allgather;
mod mcast_bcast;
pub mod resources;
mod staged_allgather;

use std::convert::Infallible;

use algorithms::{direct, staged, CollKey, Nanos, Rank, SpId, Status};
use alias_mkey::AliasKey;
use bootstrap::kinds::KindFacts;
use bootstrap::wire::{CollKind, CollMsg, PostDesc};

/// Staging of the staged collectives (the same on every SP of a cluster).
#[derive(Clone, Copy, Debug)]
pub struct StagedConfig {
    pub chunk_bytes: u64,
    pub slots: u32,
}

/// The multicast collectives' parameters (the same on every SP of a cluster: the machines
/// check that their views agree): `serve --mcast-mtu`, `--mcast-subgroups`,
/// `--mcast-link-mbps`, `--mcast-alpha-us`.
#[derive(Clone, Copy, Debug)]
pub struct McastParams {
    pub mtu: u64,
    pub subgroups: u16,
    pub link_bytes_per_ns: u64,
    pub alpha_ns: Nanos,
}

impl Default for McastParams {
    fn default() -> Self {
        McastParams {
            mtu: 4096,
            subgroups: 1,
            link_bytes_per_ns: 1,
            alpha_ns: 300_000,
        }
    }
}

/// What a new instance of any kind is configured with.
#[derive(Clone, Copy, Debug)]
pub struct KindConfig {
    pub staged: StagedConfig,
    pub mcast: McastParams,
}

impl KindConfig {
    /// The configuration of an instance whose kind said how long its message is
    /// ([`KindSpec::staged_len`], [`Inbound::message_len`]): a staged one takes no more slots
    /// than its message has chunks (at least one), since no more are ever filled at once.
    pub fn for_message(self, len: Option<u64>) -> KindConfig {
        let Some(len) = len else { return self };
        let chunks = len.div_ceil(self.staged.chunk_bytes.max(1)).max(1);
        KindConfig {
            staged: StagedConfig {
                slots: (self.staged.slots as u64).min(chunks) as u32,
                ..self.staged
            },
            ..self
        }
    }
}

impl StagedConfig {
    /// The configuration of a staged machine (bcast, staged allgather) on SP `me`.
    fn machine(self, me: SpId) -> algorithms::bcast::Config {
        algorithms::bcast::Config {
            me,
            chunk_bytes: self.chunk_bytes,
            staging_slots: self.slots,
        }
    }
}

/// A location of a staged collective's copy: a rank's granted memory or a staging slot of the
/// instance.
pub type Loc = algorithms::bcast::Loc<AliasKey>;

/// What the engine must do next.
pub enum Act {
    Send {
        to: SpId,
        msg: CollMsg,
        /// The message lends `to` the region this SP writes in its node's segment (its ranks
        /// copy out of it): `to` is to say when they are done.
        lends_region: bool,
        /// Staging slots of the instance granted to `to` for its chunks: with UCX the engine
        /// registers them and sends `to` their keys first, so that `to` can put into them.
        grants_slots: Vec<u32>,
    },
    Copy {
        id: u64,
        /// The comm rank written (always served by this SP).
        dst_rank: Rank,
        src_key: AliasKey,
        src_offset: u64,
        dst_key: AliasKey,
        dst_offset: u64,
        len: u64,
    },
    /// A copy of a staged collective: one end may be a staging slot of the instance.
    StageCopy {
        id: u64,
        /// The local rank whose grant is one end.
        rank: Rank,
        src: Loc,
        dst: Loc,
        len: u64,
    },
    /// Move `len` bytes from staging slot `src_slot` to SP `to`, delivering `msg` (which names
    /// the slot there) with them; report with `handle_move_done`.
    Move {
        id: u64,
        to: SpId,
        src_slot: u32,
        dst_slot: u32,
        len: u64,
        msg: CollMsg,
    },
    Complete {
        rank: Rank,
        status: Status,
        /// Hierarchical staged design: the data are in the segment; the host copies them
        /// before the rank may complete.
        from_segment: bool,
    },
    /// A request to the resources of the kind's family ([`resources::Resources`]); what
    /// they finish for it comes back through [`CollDriver::handle_event`].
    Resource {
        family: bootstrap::kinds::Family,
        req: resources::Payload,
    },
}

/// The post of one local rank, checked by `validate::check_post`, with its grants as keys.
pub struct LocalPost {
    pub desc: PostDesc,
    pub send: AliasKey,
    pub recv: AliasKey,
    /// Hierarchical staged designs: the region this SP writes in its node's segment (granted
    /// by the posting rank) and its offset there, if this SP writes one.
    pub region: Option<(AliasKey, u64)>,
    /// The instance runs the hierarchical design here (else flat, as posted or for want of
    /// room in the segment).
    pub hier: bool,
}

impl LocalPost {
    /// The post of a direct collective, `own` taking the kind's own part out of the descriptor.
    fn direct<O>(self, own: impl FnOnce(&mut PostDesc) -> O) -> direct::Post<AliasKey, O> {
        let mut d = self.desc;
        let own = own(&mut d);
        direct::Post {
            rank: d.comm_rank,
            members: d.members,
            send_key: self.send,
            recv_key: self.recv,
            recv_counts: d.recv_counts,
            recv_displs: d.recv_displs,
            own,
        }
    }

    /// The staged collectives' design, region key and offset (`None`, 0 without a region).
    fn staged_parts(&mut self) -> (algorithms::bcast::Design, Option<AliasKey>, u64) {
        let design = if self.hier {
            algorithms::bcast::Design::Hier
        } else {
            algorithms::bcast::Design::Flat
        };
        match self.region.take() {
            Some((k, at)) => (design, Some(k), at),
            None => (design, None, 0),
        }
    }
}

/// Counters of the hierarchical collectives, summed over finished instances.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct LateArrivals {
    /// Announcements that found no ready local rank at the SP they reached.
    pub no_ready_rank: u64,
    /// Of those, served by another SP of the node (the pass path).
    pub served_after_pass: u64,
    /// Announcements parked on the node's pending list.
    pub parked: u64,
    /// Total time announcements waited there (ns).
    pub parked_wait_ns: u64,
}

/// One collective instance on this SP. Every `now` is the engine's clock (ns since the SP
/// started); a driver keeps no clock of its own.
pub trait CollDriver: Send {
    fn kind(&self) -> CollKind;
    fn handle_post(&mut self, now: Nanos, post: LocalPost) -> Result<(), String>;
    fn handle_msg(&mut self, now: Nanos, from: SpId, msg: CollMsg) -> Result<(), String>;
    fn handle_copy_done(&mut self, now: Nanos, id: u64, status: Status);
    /// A [`Act::Move`] ended.
    fn handle_move_done(&mut self, _now: Nanos, _id: u64, _status: Status) {}
    fn handle_peer_lost(&mut self, now: Nanos, sp: SpId);
    fn handle_rank_lost(&mut self, now: Nanos, rank: Rank);
    fn abort(&mut self, now: Nanos, status: Status);
    /// When the driver wants [`CollDriver::tick`] called (cutoff timers, aggregation
    /// timeouts); asked again after every event.
    fn deadline(&self) -> Option<Nanos> {
        None
    }
    /// Its deadline passed.
    fn tick(&mut self, _now: Nanos) {}
    /// Its family's resources finished something for it (see [`Act::Resource`]).
    fn handle_event(&mut self, _now: Nanos, _event: resources::Payload) {}
    fn poll_action(&mut self) -> Option<Act>;
    fn is_finished(&self) -> bool;
    fn copies_in_flight(&self) -> usize;
    /// An incoming chunk may land in staging slot `slot` (granted to `from`, not holding
    /// anything): checked before the bytes are written there.
    fn may_fill(&self, _from: SpId, _slot: u32) -> bool {
        false
    }
    /// A hierarchical design: the SP whose segment region this SP's ranks copy out of, where
    /// it starts and its length.
    fn segment_source(&self) -> Option<(SpId, u64, u64)> {
        None
    }
    /// Late-arrival counters (zero for collectives without a hierarchical landing).
    fn late_arrivals(&self) -> LateArrivals {
        LateArrivals::default()
    }
}

/// What the engine does with an incoming message before its instance sees it.
#[derive(Default)]
pub struct Inbound {
    /// The sender lends this SP's ranks its region at this offset of the node's segment: the
    /// sender keeps it until told they are done (`SpToSp::RegionReleased`).
    pub lends_region_at: Option<u64>,
    /// Counted as an announcement (`announces_received`).
    pub announce: bool,
    /// The message comes with the bytes of a chunk for staging slot `.0`, `.1` bytes long.
    pub fills_slot: Option<(u32, u64)>,
    /// The sender waits for an answer even from an SP where the instance finished (its ranks
    /// may have posted different communicators under one key; or the instance aborted there
    /// and its ranks completed before the message came): refused with `Aborted`.
    pub answer_when_finished: bool,
    /// The length of the collective's message the message states (a staged broadcast's
    /// `Open` and `Credit`): an instance it makes takes no more staging than that needs
    /// ([`KindConfig::for_message`]).
    pub message_len: Option<u64>,
}

/// A collective kind as the engine sees it.
pub struct KindSpec {
    pub kind: CollKind,
    pub new: fn(CollKey, SpId, &KindConfig) -> Box<dyn CollDriver>,
    /// The message that aborts an instance of the kind on a peer.
    pub abort_msg: fn(Status) -> CollMsg,
    /// The replies that let peers finish when `msg` reaches an SP where its job is gone (no
    /// rank of the job will post there): every message that expects exactly one answer gets
    /// it, with `status`, and the instance is aborted. (destination SP, message) pairs; `from`
    /// is the SP the message came from.
    pub refuse: fn(msg: &CollMsg, from: SpId, status: Status) -> Vec<(SpId, CollMsg)>,
    pub inbound: fn(&CollMsg) -> Inbound,
    /// Hierarchical design: SP `me` writes the node's region for this post (one SP per node
    /// does; the node's other SPs' ranks copy out of it).
    pub region_writer: fn(d: &PostDesc, me: SpId) -> bool,
    /// Hierarchical design: the bytes of the node's region (the whole message).
    pub region_len: fn(&PostDesc) -> u64,
    /// A staged kind whose instance never holds more chunks than its message has (the
    /// broadcast): the message's length in a post, so that an instance the post makes takes
    /// only the staging slots it can use ([`KindConfig::for_message`]); `None`: all the
    /// configured slots. Called on posts that may have failed their checks.
    pub staged_len: fn(&PostDesc) -> Option<u64>,
    /// The kind's checks of a descriptor beyond what its facts say (those are
    /// `KindFacts::check_layout`: its blocks and where they start, its staged fields, its
    /// root, its node list), run by `validate::check_post` right after them.
    pub check_desc: fn(&PostDesc) -> Result<(), String>,
    /// Bytes a post of the kind makes the SP hold per member of its communicator, beyond the
    /// descriptor's vectors: an upper estimate, measured with a 4096-rank communicator whose
    /// other ranks never post (`security_budgets.rs`); `crate::held` charges it.
    pub state_bytes_per_member: u64,
    /// Bytes of data buffers a post of the kind makes the SP hold while its instance runs,
    /// given the SP's chunk size (`serve --stage-chunk-bytes`), estimated from above; 0 for
    /// the kinds whose buffers are the staging's (counted in its own budget) or the ranks'.
    /// `crate::held` charges it with the rest.
    pub data_bytes: fn(d: &PostDesc, chunk_bytes: u64) -> u64,
}

/// Every kind the engine serves.
pub static KINDS: [&KindSpec; 8] = [
    &alltoallv::SPEC,
    &allgatherv::SPEC,
    &bcast::SPEC,
    &staged_allgather::SPEC,
    &mcast_bcast::SPEC,
    &mcast_allgather::SPEC,
    &allreduce::SPEC,
    &canary_allreduce::SPEC,
];

impl KindSpec {
    /// What the kind is to every side (`bootstrap::kinds`): whether instances hold staging
    /// slots from the SP's budget (a staged kind), whether it honours `PostDesc::host_copies`,
    /// the rights of its receive grant, its name.
    pub fn facts(&self) -> &'static KindFacts {
        self.kind.facts()
    }
}

/// The kind `kind`.
pub fn spec(kind: CollKind) -> &'static KindSpec {
    KINDS
        .iter()
        .find(|s| s.kind == kind)
        .expect("every CollKind is in KINDS")
}

/// The kind a peer message belongs to (`CollMsg::kind`).
pub fn kind_of(msg: &CollMsg) -> CollKind {
    msg.kind()
}

/// A new instance of `kind`.
pub fn new(kind: CollKind, key: CollKey, me: SpId, cfg: &KindConfig) -> Box<dyn CollDriver> {
    (spec(kind).new)(key, me, cfg)
}

/// The replies of `msg`'s kind (see [`KindSpec::refuse`]).
pub fn refuse(msg: &CollMsg, from: SpId, status: Status) -> Vec<(SpId, CollMsg)> {
    (spec(kind_of(msg)).refuse)(msg, from, status)
}

/// The methods of [`CollDriver`] that a driver (a tuple struct around its machine) passes to
/// the machine as they are, and its `kind` (that of its module's `SPEC`): `$variant` is the
/// kind's `CollMsg` variant, `$copy_id` the machine's copy id type.
macro_rules! delegate {
    ($variant:path, $copy_id:path) => {
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
            self.0.handle_copy_done(now, $copy_id(id), status)
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
            self.0.is_finished()
        }
        fn copies_in_flight(&self) -> usize {
            self.0.copies_in_flight()
        }
        fn poll_action(&mut self) -> Option<Act> {
            self.0.poll_action().map(Act::from)
        }
    };
}
use delegate;

/// What the drivers of the direct collectives (copies between two ranks' grants, no staging,
/// no segment) write alike, each with its own types: the driver (a tuple struct around machine
/// `$m::$machine`), its constructor, its [`Inbound`] (announcements counted), and how its
/// messages (which lend and grant nothing) and copies become [`Act`]s. `$variant` is the
/// kind's `CollMsg` variant; `answer_when_finished` names the messages whose sender waits for
/// an answer even from an SP where the instance finished ([`Inbound::answer_when_finished`]).
macro_rules! direct_driver {
    ($m:ident::$machine:ident, $variant:path $(, answer_when_finished: $answer:pat)?) => {
        struct Driver($m::$machine<AliasKey>);

        impl super::KindMsg for $m::Msg<AliasKey> {
            fn into_coll(self) -> CollMsg {
                $variant(self)
            }
        }

        super::copy_act!($m::Copy<AliasKey> => Copy {
            dst_rank, src_key, src_offset, dst_key, dst_offset, len
        });

        fn new(key: CollKey, me: SpId, _: &super::KindConfig) -> Box<dyn CollDriver> {
            Box::new(Driver($m::$machine::new(key, $m::Config { me })))
        }

        fn inbound(msg: &CollMsg) -> Inbound {
            Inbound {
                announce: matches!(msg, $variant($m::Msg::Announce { .. })),
                answer_when_finished: false $(|| matches!(msg, $variant($answer)))?,
                ..Inbound::default()
            }
        }
    };
}
use direct_driver;

/// A kind's message as the engine sends it (see [`Act::Send`]).
trait KindMsg {
    /// The message on the wire.
    fn into_coll(self) -> CollMsg;
    /// It lends the receiver this SP's region.
    fn lends_region(&self) -> bool {
        false
    }
    /// The staging slots it grants the receiver.
    fn grants_slots(&self) -> Vec<u32> {
        vec![]
    }
}

impl Act {
    fn send(to: SpId, msg: impl KindMsg) -> Act {
        Act::Send {
            to,
            lends_region: msg.lends_region(),
            grants_slots: msg.grants_slots(),
            msg: msg.into_coll(),
        }
    }
}

/// A staged machine's action (its copies and moves convert themselves).
impl<M: KindMsg, C: Into<Act>, V: Into<Act>> From<staged::Action<M, C, V>> for Act {
    fn from(a: staged::Action<M, C, V>) -> Act {
        match a {
            staged::Action::Send { to, msg } => Act::send(to, msg),
            staged::Action::Copy(c) => c.into(),
            staged::Action::Move(m) => m.into(),
            staged::Action::Complete {
                rank,
                status,
                from_segment,
            } => Act::Complete {
                rank,
                status,
                from_segment,
            },
        }
    }
}

/// A direct machine's action: its ranks complete with their data in place.
impl<M: KindMsg, C: Into<Act>> From<direct::Action<M, C>> for Act {
    fn from(a: direct::Action<M, C>) -> Act {
        match a {
            direct::Action::Send { to, msg } => Act::send(to, msg),
            direct::Action::Copy(c) => c.into(),
            direct::Action::Complete { rank, status } => Act::Complete {
                rank,
                status,
                from_segment: false,
            },
        }
    }
}

/// The move of a staged machine without moves.
impl From<Infallible> for Act {
    fn from(never: Infallible) -> Act {
        match never {}
    }
}

/// `From<$copy> for Act`: a machine's copy is the [`Act`] variant `$act`, with the copy's id
/// and the fields `$f` as they are. A direct machine's copy, between two ranks' grants, is an
/// [`Act::Copy`]; a staged machine's (one end may be a staging slot), an [`Act::StageCopy`].
macro_rules! copy_act {
    ($copy:ty => $act:ident { $($f:ident),* }) => {
        impl From<$copy> for Act {
            fn from(c: $copy) -> Act {
                Act::$act {
                    id: c.id.0,
                    $($f: c.$f,)*
                }
            }
        }
    };
}
use copy_act;

/// A kind whose facts say all that its descriptors must satisfy.
fn no_more_checks(_: &PostDesc) -> Result<(), String> {
    Ok(())
}

/// Region defaults of kinds without a hierarchical design.
fn no_region_writer(_: &PostDesc, _: SpId) -> bool {
    true
}
fn no_region_len(_: &PostDesc) -> u64 {
    0
}

fn all_staging_slots(_: &PostDesc) -> Option<u64> {
    None
}

fn no_data_bytes(_: &PostDesc, _: u64) -> u64 {
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_one_spec() {
        for kind in CollKind::all() {
            assert_eq!(
                KINDS.iter().filter(|s| s.kind == kind).count(),
                1,
                "{kind:?}"
            );
            assert_eq!(spec(kind).kind, kind);
            assert_eq!(kind_of(&(spec(kind).abort_msg)(Status::Aborted)), kind);
        }
    }

    #[test]
    fn a_message_of_n_chunks_makes_a_staged_machine_of_at_most_n_slots() {
        let cfg = KindConfig {
            staged: StagedConfig {
                chunk_bytes: 1000,
                slots: 4,
            },
            mcast: McastParams::default(),
        };
        for (len, slots) in [
            (None, 4),
            (Some(0), 1),
            (Some(1), 1),
            (Some(1000), 1),
            (Some(1001), 2),
            (Some(3000), 3),
            (Some(4001), 4),
            (Some(u64::MAX), 4),
        ] {
            let c = cfg.for_message(len);
            assert_eq!(c.staged.slots, slots, "{len:?}");
            assert_eq!(c.staged.chunk_bytes, 1000);
        }
    }
}
