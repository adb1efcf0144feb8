//! The wire protocol.
//!
//! Every connection (host rank to its SP over a Unix socket, SP to SP over TCP) carries frames:
//! a `u32` little-endian payload length, then the payload. A length above [`MAX_FRAME_BYTES`] is
//! refused *before* anything is allocated ([`FrameError::TooLarge`]).
//!
//! The first frame each way is a hello whose first bytes never change between versions: the
//! magic `SPOF`, the protocol version (`u32` LE) and a role byte. A peer with another version
//! gets a [`Hello::Reject`] saying both versions, readable by any version, and the connection is
//! closed. After the hello, payloads are bincode-encoded [`HostToSp`], [`SpToHost`] or
//! [`SpToSp`] values.

use algorithms::{
    allgatherv, allreduce, alltoallv, bcast, mcast_allgather, mcast_bcast, staged_allgather,
    CollKey, CommId, SpId,
};
use alias_mkey::{AliasKey, Grant};
use bincode::Options;
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::io::{Read, Write};

pub const MAGIC: [u8; 4] = *b"SPOF";
/// 2: descriptors carry the node of every comm rank; allgatherv messages.
/// 3: host-side intra-node copies (`PostDesc::host_copies`, `SpToHost::Copy`,
/// `HostToSp::CopyDone`).
/// 4: the staged broadcast's `Open` carries its tree (SPs grouped by node).
/// 6: posts without a mailbox slot (`SpToHost::Completed`).
/// 7: job credentials in the host hello, the SP-to-SP handshake proves the cluster key,
/// authenticated admin requests.
/// 8: the host hello names the host's pid (hosts over TCP on the SP's kernel).
/// 9: alias keys name the uid and gid their owner's memory is opened with (its client's).
/// 10: `SpToHost::Registered` says which grant backends the SP serves the host ([`Serves`]).
/// 11: the multicast Bcast and Allgather (`CollKind::McastBcast`, `McastAllgather`);
/// `Registered` says whether the SP runs the multicast designs (`mcast_off`).
/// 12: the SP-tree allreduce (`CollKind::Allreduce`, `CollMsg::Allreduce`): a post carries
/// its datatype and operation (`PostDesc::reduce`), which the SPs need to reduce.
/// 13: a post carries the rank's stamps (`PostDesc::stamps`); a mailbox slot is 64 bytes and
/// carries the SP's stamps of the call (`crate::stamps`).
/// 14: the Canary allreduce (`CollKind::CanaryAllreduce`, `CollMsg::CanaryAllreduce`);
/// `Registered` says whether the SP runs it (`canary_off`).
/// 15: the post ring (`Register::post_ring`, a memfd beside the frame) and its arena
/// (`RingShape::arena_chunks`, `rank_base`); `Registered` says whether the SP reads the ring
/// (`post_ring_off`) and takes sides from the arena (`arena_off`).
pub const PROTOCOL_VERSION: u32 = 15;
/// Largest frame accepted: a descriptor for 65536 ranks (four count vectors) fits.
pub const MAX_FRAME_BYTES: u32 = 4 << 20;
/// Largest hello frame accepted (every kind of [`Hello`]; a host hello with its credential is
/// about 150 bytes): what a connection may make its peer hold before it has said who it is.
pub const MAX_HELLO_FRAME_BYTES: u32 = 16 << 10;

const ROLE_HOST: u8 = 1;
const ROLE_SP: u8 = 2;
const ROLE_WELCOME: u8 = 3;
const ROLE_REJECT: u8 = 4;
const ROLE_ADMIN: u8 = 5;
const ROLE_SP_WELCOME: u8 = 6;
const ROLE_SP_PROOF: u8 = 7;

/// Identity of a host rank, sent in its hello.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostHello {
    /// The job's credential (`auth::JobCredential::encode`): the SP takes the job from it,
    /// after checking its MAC and that this process runs under its uid.
    pub credential: String,
    pub world_rank: u32,
    pub world_size: u32,
    pub node: u32,
    pub local_rank: u32,
    /// The process's pid as it sees it. Over a Unix socket the SP takes the pid from the kernel
    /// and ignores this; over TCP it is used only when the SP is told its hosts share its
    /// kernel (`serve --hosts-same-kernel`), and then checked (alive, of the credential's uid).
    pub pid: u32,
}

/// Identity of an SP, sent in its hello to a peer SP, with a fresh nonce for the handshake:
/// the peer answers [`Hello::SpWelcome`] with its own nonce and proof
/// (`auth::sp_proof`), and this side then sends [`Hello::SpProof`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpHello {
    pub sp: SpId,
    pub cluster_fingerprint: u64,
    pub nonce: crate::auth::Nonce,
}

/// An admin request (`service-process stats`): proven with the cluster key over the SP it
/// asks, a nonce and the time (`auth::admin_proof`; the SP accepts a time within a minute of
/// its own, and answers each proof once: `auth::AdminReplays`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdminHello {
    pub nonce: crate::auth::Nonce,
    pub unix_secs: u64,
    pub proof: crate::auth::Tag,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hello {
    Host(HostHello),
    Sp(SpHello),
    /// The SP accepted a host or a peer.
    Welcome {
        sp: SpId,
    },
    /// Refused, with a reason meant for a person.
    Reject {
        reason: String,
    },
    /// A tool asking for the SP's counters: the SP answers with one frame holding its stats as
    /// JSON (a bincode `String`) and closes the connection.
    Admin(AdminHello),
    /// The accepting SP's answer to an [`SpHello`]: its id, its nonce and its proof.
    SpWelcome {
        sp: SpId,
        nonce: crate::auth::Nonce,
        proof: crate::auth::Tag,
    },
    /// The connecting SP's proof, which completes the handshake.
    SpProof {
        proof: crate::auth::Tag,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum HelloError {
    #[error("not a service-process peer (bad magic {0:02x?})")]
    BadMagic([u8; 4]),
    #[error("protocol version mismatch: this side speaks {ours}, the peer speaks {theirs}")]
    Version { ours: u32, theirs: u32 },
    #[error("malformed hello: {0}")]
    Malformed(String),
}

fn options() -> impl Options {
    bincode::DefaultOptions::new()
        .with_little_endian()
        .with_varint_encoding()
        .with_limit(MAX_FRAME_BYTES as u64)
        .reject_trailing_bytes()
}

pub fn encode_hello(hello: &Hello) -> Vec<u8> {
    encode_hello_with_version(hello, PROTOCOL_VERSION)
}

/// Like [`encode_hello`] with another version number: for tests of the mismatch path.
pub fn encode_hello_with_version(hello: &Hello, version: u32) -> Vec<u8> {
    let mut p = MAGIC.to_vec();
    p.extend_from_slice(&version.to_le_bytes());
    let body = match hello {
        Hello::Host(h) => {
            p.push(ROLE_HOST);
            options().serialize(h)
        }
        Hello::Sp(s) => {
            p.push(ROLE_SP);
            options().serialize(s)
        }
        Hello::Welcome { sp } => {
            p.push(ROLE_WELCOME);
            options().serialize(sp)
        }
        Hello::Reject { reason } => {
            p.push(ROLE_REJECT);
            Ok(reason.as_bytes().to_vec())
        }
        Hello::Admin(a) => {
            p.push(ROLE_ADMIN);
            options().serialize(a)
        }
        Hello::SpWelcome { sp, nonce, proof } => {
            p.push(ROLE_SP_WELCOME);
            options().serialize(&(sp, nonce, proof))
        }
        Hello::SpProof { proof } => {
            p.push(ROLE_SP_PROOF);
            options().serialize(proof)
        }
    };
    p.extend_from_slice(&body.expect("hello bodies always serialise"));
    p
}

/// Decodes a hello payload. A reject is decoded whatever its version.
pub fn decode_hello(p: &[u8]) -> Result<Hello, HelloError> {
    if p.len() < 9 {
        return Err(HelloError::Malformed(format!("{} bytes", p.len())));
    }
    let magic: [u8; 4] = p[..4].try_into().unwrap();
    if magic != MAGIC {
        return Err(HelloError::BadMagic(magic));
    }
    let version = u32::from_le_bytes(p[4..8].try_into().unwrap());
    let (role, body) = (p[8], &p[9..]);
    if role == ROLE_REJECT {
        return Ok(Hello::Reject {
            reason: String::from_utf8_lossy(body).into_owned(),
        });
    }
    if version != PROTOCOL_VERSION {
        return Err(HelloError::Version {
            ours: PROTOCOL_VERSION,
            theirs: version,
        });
    }
    let bad = |e: bincode::Error| HelloError::Malformed(e.to_string());
    match role {
        ROLE_HOST => Ok(Hello::Host(options().deserialize(body).map_err(bad)?)),
        ROLE_SP => Ok(Hello::Sp(options().deserialize(body).map_err(bad)?)),
        ROLE_ADMIN => Ok(Hello::Admin(options().deserialize(body).map_err(bad)?)),
        ROLE_SP_WELCOME => {
            let (sp, nonce, proof) = options().deserialize(body).map_err(bad)?;
            Ok(Hello::SpWelcome { sp, nonce, proof })
        }
        ROLE_SP_PROOF => Ok(Hello::SpProof {
            proof: options().deserialize(body).map_err(bad)?,
        }),
        ROLE_WELCOME => Ok(Hello::Welcome {
            sp: options().deserialize(body).map_err(bad)?,
        }),
        other => Err(HelloError::Malformed(format!("unknown role {other}"))),
    }
}

/// Which collective a descriptor is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CollKind {
    Alltoallv,
    /// Allgather(v): `send_counts`/`send_displs` have one entry (this rank's block, at
    /// `send_displs[0]` of the send grant); the receive vectors have one entry per comm rank.
    Allgatherv,
    /// Bcast, staged in SP memory (`PostDesc::staged` names the root and the design): the
    /// root posts its buffer as the send grant (`send_counts == [len]`) and an empty receive
    /// side (`recv_counts == [0]`); every other rank the reverse.
    Bcast,
    /// Iallgather staged in SP memory (`PostDesc::staged` names the design; its `root` is
    /// unused): like `Allgatherv`, with equal blocks in rank order (block `i` at `i * len`).
    StagedAllgather,
    /// Bcast over the SPs' multicast fabric with the fetch ring for what is lost
    /// (`algorithms::mcast_bcast`): laid out as `Bcast` (`PostDesc::staged` names the root;
    /// its design is `Flat`, unused); the receivers' grants are also read (the next SP of the
    /// ring fetches missing chunks out of them).
    McastBcast,
    /// Allgather over the SPs' multicast fabric, each rank's block multicast once by its SP
    /// in the broadcast sequencer's chains (`algorithms::mcast_allgather`): laid out as
    /// `StagedAllgather` (equal blocks in rank order; `PostDesc::staged` design `Flat`, its
    /// root unused); the receive grants are also read (the fetch ring).
    McastAllgather,
    /// Allreduce aggregated by the SPs along a tree (`algorithms::allreduce`): one block each
    /// way (`send_counts == recv_counts == [len]`), `PostDesc::reduce` says how to combine.
    Allreduce,
    /// Allreduce aggregated by Canary switches (`algorithms::canary`): laid out as
    /// `Allreduce`; each SP reduces its local ranks' blocks and sends the partial result
    /// through the switches of the cluster's Canary fabric (`Cluster::canary`).
    CanaryAllreduce,
}

/// The designs of the staged collectives (after BluesMPI): `Flat` writes every rank's buffer
/// from SP staging memory; `Hier` writes a shared segment of the SP's node-local ranks once,
/// and the ranks copy out of it themselves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StagedDesign {
    Flat,
    Hier,
}

/// What a staged collective's post adds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Staged {
    pub root: u32,
    pub design: StagedDesign,
    /// `Hier`: this rank's mapping of the segment it shares with the other ranks of its SP
    /// (read-write, cma).
    pub segment: Option<Grant>,
}

/// What a host rank posts for one collective. Every number in it is untrusted: the SP checks
/// vector lengths, counts and displacements against the grants before anything runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PostDesc {
    pub kind: CollKind,
    pub comm: CommId,
    pub seq: u64,
    pub comm_rank: u32,
    /// SP serving each comm rank.
    pub members: Vec<SpId>,
    /// World rank of each comm rank: the SP checks that the poster is `world_ranks[comm_rank]`
    /// (the rank its connection said hello as), and that every post of an instance agrees.
    pub world_ranks: Vec<u32>,
    /// Node of each comm rank (used by the hierarchical collectives; may be empty otherwise).
    pub nodes: Vec<u32>,
    /// Mailbox slot that receives the completion, and the token written there; `None`: the
    /// completion comes as `SpToHost::Completed` with the token (the host had no free slot,
    /// and a nonblocking post may not wait for one).
    pub slot: Option<u32>,
    pub token: u64,
    pub send: Grant,
    pub recv: Grant,
    /// Bytes, per comm rank.
    pub send_counts: Vec<u64>,
    pub send_displs: Vec<u64>,
    pub recv_counts: Vec<u64>,
    pub recv_displs: Vec<u64>,
    /// The rank waits inside the call (a blocking collective) and copies the segments that
    /// are already on its node itself when the SP asks it to (`SpToHost::Copy`); the SP still
    /// does every copy that crosses nodes. Only the allgatherv uses it.
    pub host_copies: bool,
    /// The staged collectives' root and design (`None` for the others).
    pub staged: Option<Staged>,
    /// The host moves this side through a contiguous staging buffer of its own (a
    /// non-contiguous type packed, or the copy of an `MPI_IN_PLACE` send side): the grants
    /// describe that buffer. For the SP's counters only.
    pub send_packed: bool,
    pub recv_packed: bool,
    /// An allreduce's operation and element type (`None` for every other kind).
    pub reduce: Option<allreduce::Reduce>,
    /// Where the call's time goes (`crate::stamps`): when the rank sent this post, and how long
    /// its previous mailbox completion took from being written to being seen (CLOCK_MONOTONIC
    /// ns on the rank's kernel; 0: not known, or the rank is not on the SP's clock).
    pub stamps: PostStamps,
}

/// The rank's stamps a post carries (see [`PostDesc::stamps`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PostStamps {
    pub sent_ns: u64,
    pub last_notice_ns: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HostToSp {
    /// Resources of the rank: its cores and the mailbox where completions are written.
    Register {
        cores: Vec<u32>,
        mailbox: Grant,
        mailbox_slots: u32,
        /// A post ring of this shape (`crate::post_ring`) travels with this frame as a file
        /// descriptor (`SCM_RIGHTS`, a sealed memfd); `None`: posts come on the socket only.
        post_ring: Option<crate::post_ring::RingShape>,
    },
    Post(Box<PostDesc>),
    /// The rank is finalizing: its state at the SP may go.
    Goodbye,
    /// The answer to `SpToHost::Copy { ticket, .. }`: done (`ok`) or not (the reason is the
    /// host's to report).
    CopyDone {
        ticket: u64,
        ok: bool,
    },
}

/// Why the SP refused something a host sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// A descriptor that does not fit its grants or itself (lengths, overflow, ranges).
    BadDescriptor,
    /// A post before `Register`, or a second `Register`.
    NotRegistered,
    /// The descriptor names a communicator or instance this SP cannot serve for this rank.
    UnknownComm,
    Internal,
}

/// The grant backends an SP serves one host connection, in its answer to the registration:
/// the rank chooses its backend from them at `MPI_Init` (a grant of another backend would be
/// refused at its first collective).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Serves {
    /// `cma`: the SP can attach to this host's memory (a Unix peer, or a TCP host on its
    /// kernel, `serve --hosts-same-kernel`).
    pub cma: bool,
    /// `ucx`: UCX is on in the SP (`serve --ucx`).
    pub ucx: bool,
    /// `ucx-export`: as `ucx` (the import itself may still fail where the SP's UCX cannot).
    pub ucx_export: bool,
}

impl std::fmt::Display for Serves {
    /// `cma, ucx` (the backends served), or `no grant backend`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = [
            (self.cma, "cma"),
            (self.ucx, "ucx"),
            (self.ucx_export, "ucx-export"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        if names.is_empty() {
            f.write_str("no grant backend")
        } else {
            f.write_str(&names.join(", "))
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SpToHost {
    Registered {
        sp: SpId,
        /// The POSIX shared-memory name of this job's segment on this SP's node (the
        /// hierarchical staged designs).
        segment: String,
        /// The grant backends this SP serves this host.
        serves: Serves,
        /// Why this SP cannot run the multicast designs (`serve --mcast=off`, a fabric it
        /// could not open); `None` when it can.
        mcast_off: Option<String>,
        /// Why this SP cannot run the Canary allreduce (the cluster names no Canary link for
        /// it, its socket could not be opened); `None` when it can.
        canary_off: Option<String>,
        /// Why this SP reads no post ring of this host (none offered, an SP that sleeps
        /// until a message arrives, a descriptor it could not take); `None`: it reads it.
        post_ring_off: Option<String>,
        /// Why this SP takes no side from the ring's arena (no ring read, no arena offered,
        /// `serve --inline-copy-bytes` below an arena side); `None`: it does, for the calls
        /// of the communicators it serves alone.
        arena_off: Option<String>,
    },
    /// A refused request. `seq` names the post it concerns, if any; its mailbox slot (if it was
    /// valid) also gets an error status.
    Error {
        comm: Option<CommId>,
        seq: Option<u64>,
        code: ErrorCode,
        message: String,
    },
    /// The SP is alive: sent every `serve --heartbeat-ms` to a host with posts outstanding, so
    /// that its shim can tell a stuck SP from a slow collective.
    Heartbeat,
    /// The post with `token`, posted without a mailbox slot, completed with `status` (a
    /// mailbox status code, `mailbox::status_code`).
    Completed { token: u64, status: u32 },
    /// For the post with `token` (which asked for `host_copies`, or a `Hier` staged post):
    /// copy `len` bytes from `src` to `dst_offset` of the post's receive grant, then answer
    /// with `HostToSp::CopyDone { ticket }`. The post completes only after every such copy.
    Copy {
        token: u64,
        ticket: u64,
        src: CopySrc,
        dst_offset: u64,
        len: u64,
    },
}

/// Where a copy handed to a host reads from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CopySrc {
    /// Address `addr` of process `pid`: a rank of the same node, whose grant the SP checked.
    Process { pid: u32, addr: u64 },
    /// Offset `offset` of the rank's own mapping of its staged-collective segment.
    Segment { offset: u64 },
}

/// Messages of one collective among SPs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CollMsg {
    Alltoallv(alltoallv::Msg<AliasKey>),
    Allgatherv(allgatherv::Msg<AliasKey>),
    Bcast(bcast::Msg),
    StagedAllgather(staged_allgather::Msg<AliasKey>),
    McastBcast(mcast_bcast::Msg<AliasKey>),
    McastAllgather(mcast_allgather::Msg<AliasKey>),
    Allreduce(allreduce::Msg),
    /// Only `Abort` travels between SPs: the data go through the switches.
    CanaryAllreduce(allreduce::Msg),
}

impl CollMsg {
    /// The memory keys the message carries.
    pub fn keys(&self) -> Vec<&AliasKey> {
        match self {
            CollMsg::Alltoallv(m) => m.keys(),
            CollMsg::Allgatherv(m) => m.keys(),
            CollMsg::Bcast(_) => Vec::new(),
            CollMsg::StagedAllgather(m) => m.keys(),
            CollMsg::McastBcast(m) => m.keys(),
            CollMsg::McastAllgather(m) => m.keys(),
            CollMsg::Allreduce(_) | CollMsg::CanaryAllreduce(_) => Vec::new(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SpToSp {
    Coll {
        key: CollKey,
        msg: CollMsg,
    },
    /// A collective message that brings bytes for the receiver's staging (a staged
    /// collective's chunk): the receiver puts `data` into the slot `msg` names, then handles
    /// `msg`.
    Data {
        key: CollKey,
        msg: CollMsg,
        data: Bytes,
    },
    /// The sender's staging slots of instance `key`, granted through UCX, that a `Credit`
    /// following on this connection names: the receiver may put a chunk's bytes straight
    /// into them (SPs with UCX on) instead of sending them in a `Data` frame.
    SlotGrants {
        key: CollKey,
        slots: Vec<(u32, AliasKey)>,
    },
    /// A job ended (or lost a rank) at the sender; receivers abort its instances.
    JobAbort {
        job: u64,
        reason: String,
    },
    /// To the other SPs of the sender's node: none of the job's ranks is connected to the
    /// sender any more and none of its instances is left there. The last SP of a node to have
    /// the job gone (by its own account and these messages) removes the node's segment name.
    /// An SP that does not have the job (never had it, or forgot it) answers with `answer`
    /// set (and never answers an answer): none of its ranks is connected, so none holds a
    /// mapping of the segment that a later rank could fail to share.
    JobGone {
        job: u64,
        answer: bool,
    },
    /// The sender's ranks finished copying out of the receiver's segment region of
    /// hierarchical instance `key` (the receiver, its node's bcast leader or allgather owner,
    /// sent the region's place in `Sealed` or `RegionDone`): the receiver may reuse the
    /// region.
    RegionReleased {
        key: CollKey,
    },
    /// The sender is stopping in an orderly way (its connection closes next). Collectives that
    /// still need it fail as for a lost peer; the receiver just does not report it as a fault.
    Shutdown,
    /// The sender is alive (sent every `serve --heartbeat-ms`): a peer that sends nothing for
    /// `--peer-timeout-ms` is stuck (stopped, deadlocked) and counts as lost.
    Heartbeat,
}

/// Bytes that travel as one block (a length and a copy), not as a sequence of `u8` values:
/// serde's `Vec<u8>` goes element by element, which costs milliseconds per staged chunk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bytes(pub Vec<u8>);

impl Serialize for Bytes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Bytes;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a byte string")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Bytes, E> {
                Ok(Bytes(v.to_vec()))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Bytes, E> {
                Ok(Bytes(v))
            }
        }
        d.deserialize_byte_buf(V)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    TooLarge { len: u32, max: u32 },
    #[error("undecodable frame: {0}")]
    Decode(String),
    #[error("unencodable message: {0}")]
    Encode(String),
    #[error("connection closed")]
    Closed,
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// The encoding of `options()` without its length limit and trailing-byte check, which only
/// concern decoding (with a limit, bincode runs a sizing pass over the message before every
/// serialisation).
fn encoding() -> impl Options {
    bincode::DefaultOptions::new()
        .with_little_endian()
        .with_varint_encoding()
}

/// Encodes `msg` as a whole frame (length prefix included), into a buffer sized for it first:
/// a message carrying a chunk of data is written once, not copied as its vector grows.
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    let len = encoding().serialized_size(msg).unwrap_or(0);
    let mut out = Vec::with_capacity(4 + len.min(MAX_FRAME_BYTES as u64) as usize);
    encode_into(msg, &mut out).expect("protocol messages always serialise");
    out
}

/// [`encode`] into `out` (cleared first, its memory reused): a sender that keeps one buffer
/// frames a message per call without allocating, and without a sizing pass; the frame's
/// length is checked after. `Err` (and `out` empty): the message cannot be serialised, or its
/// payload is longer than [`MAX_FRAME_BYTES`].
pub fn encode_into<T: Serialize>(msg: &T, out: &mut Vec<u8>) -> Result<(), FrameError> {
    out.clear();
    out.extend_from_slice(&[0; 4]);
    encoding().serialize_into(&mut *out, msg).map_err(|e| {
        out.clear();
        FrameError::Encode(e.to_string())
    })?;
    seal_frame(out)
}

/// Writes the length prefix of a frame whose payload follows its 4 placeholder bytes in `out`;
/// `Err` (and `out` emptied) for a payload longer than [`MAX_FRAME_BYTES`].
fn seal_frame(out: &mut Vec<u8>) -> Result<(), FrameError> {
    let len = out.len() - 4;
    if len > MAX_FRAME_BYTES as usize {
        out.clear();
        return Err(FrameError::TooLarge {
            len: len.min(u32::MAX as usize) as u32,
            max: MAX_FRAME_BYTES,
        });
    }
    out[..4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(())
}

/// Prefixes a payload with its length.
pub fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + payload.len());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

pub fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, FrameError> {
    options()
        .deserialize(payload)
        .map_err(|e| FrameError::Decode(e.to_string()))
}

/// Splits a byte stream into frames, for nonblocking readers.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    start: usize,
    max: u32,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new(MAX_FRAME_BYTES)
    }
}

impl FrameDecoder {
    pub fn new(max: u32) -> Self {
        FrameDecoder {
            buf: Vec::new(),
            start: 0,
            max,
        }
    }

    /// Appends bytes read from the stream.
    pub fn extend(&mut self, data: &[u8]) {
        if self.start > 0 && self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        }
        self.buf.extend_from_slice(data);
    }

    /// The next whole frame's payload, if one is buffered. A length above the maximum is an
    /// error as soon as its four bytes are in, before the payload is awaited or stored.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        let avail = &self.buf[self.start..];
        if avail.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes(avail[..4].try_into().unwrap());
        if len > self.max {
            return Err(FrameError::TooLarge { len, max: self.max });
        }
        if avail.len() < 4 + len as usize {
            return Ok(None);
        }
        let payload = avail[4..4 + len as usize].to_vec();
        self.start += 4 + len as usize;
        if self.start > 64 * 1024 && self.start * 2 > self.buf.len() {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        Ok(Some(payload))
    }

    /// Bytes buffered and not yet returned.
    pub fn pending(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Bytes still missing from the next frame (its length first, then its payload); 0 when
    /// a whole frame is buffered. A reader that reads no more than this never buffers past
    /// the frame, nor more than `4 + max` bytes of it.
    pub fn wanted(&self) -> usize {
        let avail = &self.buf[self.start..];
        if avail.len() < 4 {
            return 4 - avail.len();
        }
        let len = u32::from_le_bytes(avail[..4].try_into().unwrap()).min(self.max) as usize;
        (4 + len).saturating_sub(avail.len())
    }

    /// Changes the largest frame accepted from now on (what is buffered is kept).
    pub fn set_max(&mut self, max: u32) {
        self.max = max;
    }
}

/// A blocking channel over any byte stream (a Unix or TCP socket, a pipe): the transport used
/// by the host shim and by tests.
pub struct Channel<S> {
    stream: S,
}

impl<S: Read + Write> Channel<S> {
    pub fn new(stream: S) -> Self {
        Channel { stream }
    }

    pub fn get_ref(&self) -> &S {
        &self.stream
    }

    pub fn send_raw(&mut self, frame: &[u8]) -> Result<(), FrameError> {
        self.stream.write_all(frame)?;
        self.stream.flush()?;
        Ok(())
    }

    pub fn send<T: Serialize>(&mut self, msg: &T) -> Result<(), FrameError> {
        self.send_raw(&encode(msg))
    }

    pub fn send_hello(&mut self, hello: &Hello) -> Result<(), FrameError> {
        self.send_raw(&frame(&encode_hello(hello)))
    }

    /// Reads one frame's payload (checking its length before allocating).
    pub fn recv_raw(&mut self) -> Result<Vec<u8>, FrameError> {
        self.recv_raw_max(MAX_FRAME_BYTES)
    }

    /// [`Self::recv_raw`] of a frame of at most `max` bytes.
    fn recv_raw_max(&mut self, max: u32) -> Result<Vec<u8>, FrameError> {
        let mut len = [0u8; 4];
        if let Err(e) = self.stream.read_exact(&mut len) {
            return Err(if e.kind() == std::io::ErrorKind::UnexpectedEof {
                FrameError::Closed
            } else {
                e.into()
            });
        }
        let len = u32::from_le_bytes(len);
        if len > max {
            return Err(FrameError::TooLarge { len, max });
        }
        let mut payload = vec![0u8; len as usize];
        self.stream.read_exact(&mut payload)?;
        Ok(payload)
    }

    pub fn recv<T: DeserializeOwned>(&mut self) -> Result<T, FrameError> {
        decode(&self.recv_raw()?)
    }

    /// Reads a hello (at most [`MAX_HELLO_FRAME_BYTES`]).
    pub fn recv_hello(&mut self) -> Result<Hello, FrameError> {
        decode_hello(&self.recv_raw_max(MAX_HELLO_FRAME_BYTES)?)
            .map_err(|e| FrameError::Decode(e.to_string()))
    }
}

mod post_view;
pub use post_view::{decode_host, decode_post, encode_post_into, PostView};

#[cfg(test)]
mod tests;
