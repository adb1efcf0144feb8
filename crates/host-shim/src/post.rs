//! Posting one collective: laying out its two sides, agreeing on the communicator, taking a
//! completion slot, packing, granting and sending the descriptor.
//!
//! Each side is granted directly or packed (`layout.rs`): a choice each rank makes alone,
//! which no other rank can see, so it never splits a collective between the offloaded and the
//! native path. The only conditions that send a call to the native function are checked
//! before the communicator agreement and hold alike on every rank of a correct program (see
//! `coll.rs`); once the agreement has run the call is committed: every member offloads it, so
//! a failure from then on (a dead SP connection, a failed `MPI_Pack`) is `MPI_ERR_OTHER` with a
//! line on stderr, raised through the communicator's error handler, never a native call that
//! the other members would not match.
//!
//! Completion slots: a free mailbox slot is taken (harvesting completed requests first if none
//! is free); with none free the post goes without one and the SP completes it with a message
//! (`request.rs`). A nonblocking call never waits for a slot: the slot it waits for may only
//! free up once another rank posts a collective that this rank posts later (two communicators
//! used in opposite orders by different ranks, with more outstanding collectives than slots).

use crate::boundary::{say, Commit};
use crate::comm::{self, CommInfo};
use crate::design::{host_copies_enabled, staged_design};
use crate::layout::{packed_side, region_addr, side_bytes, LayoutError, SideBytes, TypeGeometry};
use crate::pack::{self, Block, Unpack};
use crate::recycle::Recycled;
use crate::request::{OffloadRequest, Staging};
use crate::state::{mailbox_token, topology, with_shim, TRACKED};
use algorithms::allreduce::Reduce;
use alias_mkey::Grant;
use alias_mkey::Rights;
use bootstrap::wire::{CollKind, PostStamps, PostView, Staged, StagedDesign};
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicU32, Ordering};

/// Post failures reported on stderr before going quiet.
const REPORTED_POST_FAILURES: u32 = 3;
static POST_FAILURES: AtomicU32 = AtomicU32::new(0);

/// What became of a call.
pub enum Offload {
    /// Not offloaded: run the native function.
    Native,
    /// Posted: the request object's address.
    Posted(usize),
    /// Offloaded but could not be posted: return this code.
    Failed(c_int),
}

/// One side of the exchange as the program gave it: a block of `counts[p]` elements of `ty`
/// at element displacement `displs[p]` from `buf`, per peer.
pub struct Side {
    pub buf: *const c_void,
    pub counts: Recycled<i64>,
    pub displs: Recycled<i64>,
    pub ty: ffi::MPI_Datatype,
    pub geo: TypeGeometry,
    /// Always through the shim's staging: the send side of an `MPI_IN_PLACE` call, whose data
    /// live in the receive buffer the collective overwrites (copied at the post).
    pub copy: bool,
}

impl Side {
    /// The program's blocks as addresses and counts (for packing).
    fn blocks(&self) -> Vec<Block> {
        self.counts
            .iter()
            .zip(&self.displs)
            .map(|(&count, &displ)| Block {
                addr: (self.buf as isize)
                    .wrapping_add((displ as isize).wrapping_mul(self.geo.extent as isize))
                    as usize,
                count,
            })
            .collect()
    }
}

/// How a side is granted.
pub(crate) struct Laid {
    pub bytes: SideBytes,
    /// Where its region starts in the program's buffer; `None`: packed into staging.
    pub direct: Option<u64>,
}

/// Lays out a side: directly when its blocks are runs (and, for a staged allgather's receive
/// side, equal blocks in rank order, as that collective needs), packed otherwise. `Err` only
/// for arguments MPI calls erroneous (negative counts, lengths past the address space).
pub(crate) fn lay_out(side: &Side, rank_ordered: bool) -> Result<Laid, LayoutError> {
    if !side.copy {
        match side_bytes(&side.counts, &side.displs, &side.geo) {
            Ok(bytes) => {
                let ordered = !rank_ordered || {
                    let len = bytes.counts.first().copied().unwrap_or(0);
                    (0..bytes.counts.len() as u64).all(|i| {
                        bytes.counts[i as usize] == len
                            && (len == 0 || bytes.displs[i as usize] == i * len)
                    })
                };
                if ordered {
                    let addr = region_addr(side.buf as u64, bytes.region_offset, bytes.region_len)
                        .ok_or(LayoutError::Overflow { peer: 0 })?;
                    return Ok(Laid {
                        bytes,
                        direct: Some(addr),
                    });
                }
            }
            Err(LayoutError::NotARun { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Laid {
        bytes: packed_side(&side.counts, side.geo.size)?,
        direct: None,
    })
}

/// Posts one collective of `kind`: each side has the blocks the kind's facts say
/// (`bootstrap::kinds`: a block per comm rank for an alltoallv, the one block of this rank for
/// an allgatherv or a bcast's root). `blocking`: the caller waits for the request inside the
/// call, so in a kind with host copies (the allgatherv) it can copy the segments already on
/// its node itself (unless `SPOFF_HOST_COPIES=0`), sparing the SP that work. `root`: the root
/// of a rooted kind (a bcast).
///
/// # Safety
/// The shim is active; `comm` is a valid intracommunicator; the sides describe the caller's
/// buffers (MPI preconditions of the call).
pub unsafe fn post(
    kind: CollKind,
    comm: ffi::MPI_Comm,
    send: Side,
    recv: Side,
    blocking: bool,
    root: Option<u32>,
    commit: &mut Commit,
) -> Offload {
    // SAFETY: forwarded.
    unsafe { post_reduce(kind, comm, send, recv, blocking, root, None, commit) }
}

/// [`post`] with an allreduce's operation and element type (`reduce`, in the descriptor).
///
/// # Safety
/// As for [`post`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn post_reduce(
    kind: CollKind,
    comm: ffi::MPI_Comm,
    send: Side,
    recv: Side,
    blocking: bool,
    root: Option<u32>,
    reduce: Option<Reduce>,
    commit: &mut Commit,
) -> Offload {
    let facts = kind.facts();
    let (Ok(s), Ok(r)) = (
        lay_out(&send, false),
        lay_out(&recv, facts.recv_rank_ordered),
    ) else {
        // Negative counts and the like: native MPI reports them.
        return Offload::Native;
    };
    // SAFETY: forwarded.
    let info = match unsafe { comm::info(comm) } {
        // SAFETY: the info lives as long as `comm`, which outlives this call.
        Ok(p) => unsafe { &*p },
        Err(_) => return Offload::Native,
    };
    // Every member has now agreed on the communicator and offloads this call.
    commit.mark();
    let rank = topology().world_rank;
    let seq = info.next_seq.fetch_add(1, Ordering::AcqRel);
    let fail = |why: &str| {
        // A dead SP fails every later collective too: report the first few, then stay quiet.
        match POST_FAILURES.fetch_add(1, Ordering::AcqRel) {
            n if n < REPORTED_POST_FAILURES => say!(
                "rank {rank}: cannot post {} #{seq} on communicator {}:{}: {why}",
                facts.name,
                info.id.leader,
                info.id.id
            ),
            REPORTED_POST_FAILURES => say!(
                "rank {rank}: further offloaded collectives fail with MPI_ERR_OTHER (not reported)"
            ),
            _ => {}
        }
        Offload::Failed(consts::ERR_OTHER())
    };
    // The staging of packed sides: the send side packed now, the receive side unpacked at
    // completion.
    let mut staging = Staging::default();
    if s.direct.is_none() {
        // SAFETY: the send side's blocks are readable (MPI precondition); the offsets and the
        // length come from `packed_side` on the same counts.
        match unsafe {
            pack::pack(
                &send.blocks(),
                &s.bytes.displs,
                send.ty,
                send.geo.size,
                send.geo.extent,
                s.bytes.region_len,
            )
        } {
            Ok(buf) => staging.send = Some(buf),
            Err(why) => return fail(&why),
        }
    }
    if r.direct.is_none() {
        // SAFETY: MPI is initialised; the receive type is valid (its geometry was read).
        match unsafe {
            Unpack::new(
                recv.blocks(),
                r.bytes.displs.to_vec(),
                recv.ty,
                recv.geo.size,
                recv.geo.extent,
                r.bytes.region_len,
            )
        } {
            Ok(u) => staging.recv = Some(u),
            Err(why) => return fail(&why),
        }
    }
    // A Vec's heap buffer does not move when the Vec moves into the request.
    let send_addr = s
        .direct
        .or_else(|| staging.send.as_ref().map(|b| b.as_ptr() as u64))
        .expect("a side is direct or packed");
    let recv_addr = r
        .direct
        .or_else(|| staging.recv.as_ref().map(|u| u.staging.as_ptr() as u64))
        .expect("a side is direct or packed");
    let (send_packed, recv_packed) = (s.direct.is_none(), r.direct.is_none());
    let len = s.bytes.region_len.max(r.bytes.region_len);
    let design = facts.posts_staged_fields().then(|| {
        if facts.is_staged() {
            staged_design(kind, info.max_per_node, len, !topology().remote)
        } else {
            StagedDesign::Flat
        }
    });
    // Hier: SPs write the segment this rank shares with the other ranks of its node, and the
    // rank copies from it into its buffer (the root receives nothing).
    let segment = match design {
        Some(StagedDesign::Hier) => {
            let t = topology();
            let node = t.node_of_sp[t.sp_of_world[t.world_rank as usize] as usize];
            let sps = t.node_of_sp.iter().filter(|&&n| n == node).count() as u64;
            match crate::segment::get(&t.segment, sps) {
                Ok(seg) => Some((seg.addr as u64, seg.len)),
                Err(why) => return fail(&why),
            }
        }
        _ => None,
    };
    // A small call that its SP serves alone goes through the arena it shares with its SP:
    // the send side copied in now, the received blocks copied out at completion.
    let (mut send_addr, mut recv_addr) = (send_addr, recv_addr);
    let host_copies = blocking && facts.host_copies && host_copies_enabled();
    let my_sp = topology().sp_of_world[rank as usize];
    if kind.takes_arena()
        && segment.is_none()
        && reduce.is_none()
        && !host_copies
        && crate::arena::fits(s.bytes.region_len, r.bytes.region_len)
        && info.members.iter().all(|&sp| sp == my_sp)
    {
        if let Some(chunk) = crate::arena::Chunk::take() {
            // SAFETY: the send region is readable for its length (MPI precondition, or the
            // shim's staging), the chunk's send half holds `ARENA_SIDE_BYTES` (`fits`).
            unsafe {
                alias_mkey::copy::copy_bytes(
                    send_addr as *const u8,
                    chunk.send(),
                    s.bytes.region_len as usize,
                )
            };
            let mut recv_blocks = Recycled::new();
            for (&n, &at) in r.bytes.counts.iter().zip(&r.bytes.displs) {
                if n > 0 {
                    recv_blocks.extend_from_slice(&[at, n]);
                }
            }
            send_addr = chunk.send() as u64;
            let to = std::mem::replace(&mut recv_addr, chunk.recv() as u64);
            staging.arena = Some(crate::arena::InArena {
                chunk,
                recv_to: to as usize,
                recv_blocks,
            });
        }
    }
    let draft = Draft {
        kind,
        seq,
        send: (s.bytes, send_addr, send_packed),
        recv: (r.bytes, recv_addr, recv_packed),
        blocking,
        host_copies_enabled: host_copies_enabled(),
        root,
        design,
        segment,
        reduce,
    };
    let posted = with_shim(|sh| {
        if let Some(why) = &sh.conn.broken {
            return Err(why.clone());
        }
        let slot = sh.slots.take().or_else(|| {
            sh.harvest();
            sh.slots.take()
        });
        let token = sh.next_token;
        sh.next_token += 1;
        if let Some(slot) = slot {
            mailbox_token(slot).store(0, Ordering::Release);
        }
        let idle = sh.registry.all().all(|a| {
            // SAFETY: every address in the registry is a live request (see `Shim::harvest`).
            unsafe { &*(a as *const OffloadRequest) }.result().is_some()
        });
        sh.registrar.refresh(idle);
        let region_len = draft.recv.0.region_len;
        let grants = draft.grant(info, |addr, len, rights, segment| {
            if segment {
                sh.registrar.cma_buffer(addr, len, rights)
            } else {
                sh.registrar.buffer(addr, len, rights)
            }
        });
        let host_copies = grants.host_copies;
        let sent_ns = bootstrap::stamps::now_ns();
        let stamps = PostStamps {
            sent_ns,
            last_notice_ns: std::mem::take(&mut sh.last_notice_ns),
        };
        match sh
            .conn
            .send_post(&draft.view(info, &grants, slot, token, stamps))
        {
            Ok(()) => {
                let mut req = OffloadRequest::new(kind, slot, token, info.id, seq, comm, staging);
                req.sent_ns = sent_ns;
                if host_copies {
                    req.accept_host_copies((recv_addr as usize, region_len));
                }
                let mut req = Box::new(req);
                // The object's address does not change when it leaves the box.
                req.handle = sh.registry.insert(&*req as *const OffloadRequest as usize);
                let req = Box::into_raw(req);
                TRACKED.fetch_add(1, Ordering::AcqRel);
                Ok(req as usize)
            }
            Err(why) => {
                // The SP may have read part of it: the slot is never reused, the staging is
                // never freed, and nothing outstanding can complete over a broken stream.
                if let Some(slot) = slot {
                    sh.slots.quarantine(slot);
                }
                std::mem::forget(staging);
                sh.fail_matching(|_| true);
                Err(why)
            }
        }
    });
    match posted {
        Some(Ok(addr)) => Offload::Posted(addr),
        Some(Err(why)) => fail(&why),
        None => fail("the shim is shut down"),
    }
}

/// A post of one collective once its sides are laid out: everything its descriptor says
/// besides the slot and the grants. [`Draft::grant`] and [`Draft::view`] read the kind's facts
/// (`bootstrap::kinds`) and nothing else of the shim, so that the kinds' agreement test
/// (`kinds_agree.rs`) builds descriptors exactly as [`post`] does and checks them with the
/// SP's checks.
pub(crate) struct Draft {
    pub kind: CollKind,
    pub seq: u64,
    /// Each side's bytes, where its region starts (the program's buffer or the staging), and
    /// whether it is packed.
    pub send: (SideBytes, u64, bool),
    pub recv: (SideBytes, u64, bool),
    pub blocking: bool,
    /// `SPOFF_HOST_COPIES` is not `0`.
    pub host_copies_enabled: bool,
    /// The root of a rooted kind.
    pub root: Option<u32>,
    /// A staged kind's design.
    pub design: Option<StagedDesign>,
    /// The node segment (address, length) of a hierarchical design.
    pub segment: Option<(u64, u64)>,
    /// An allreduce's operation and element type.
    pub reduce: Option<Reduce>,
}

/// What a post grants: its sides, and a staged kind's segment.
pub(crate) struct Grants {
    pub send: Grant,
    pub recv: Grant,
    /// A staged kind's root, design and segment.
    pub staged: Option<Staged>,
    /// The rank copies segments itself (`PostDesc::host_copies`).
    pub host_copies: bool,
}

impl Draft {
    /// The grants of a post on communicator `info`: `grant(addr, len, rights, segment)`
    /// grants a side (or, `segment`, the node segment through cma), in this order: send,
    /// receive, segment.
    pub(crate) fn grant(
        &self,
        info: &CommInfo,
        mut grant: impl FnMut(u64, u64, Rights, bool) -> Grant,
    ) -> Grants {
        let facts = self.kind.facts();
        let ((s, send_addr, _), (r, recv_addr, _)) = (&self.send, &self.recv);
        // A hierarchical rank receives out of the node segment, and copies from it itself;
        // the root of a rooted kind receives nothing.
        let receives_from_segment =
            self.segment.is_some() && (!facts.rooted || self.root != Some(info.comm_rank));
        let host_copies = (self.blocking && facts.host_copies && self.host_copies_enabled)
            || receives_from_segment;
        let send = grant(*send_addr, s.region_len, Rights::READ, false);
        let recv = grant(*recv_addr, r.region_len, facts.recv_rights, false);
        let staged = self.design.map(|design| Staged {
            root: self.root.unwrap_or(0),
            design,
            segment: self
                .segment
                .map(|(addr, len)| grant(addr, len, Rights::READ_WRITE, true)),
        });
        Grants {
            send,
            recv,
            staged,
            host_copies,
        }
    }

    /// The descriptor on communicator `info` with `grants` (from [`Draft::grant`]),
    /// completion `slot` and `token`, borrowing its lists from the draft and the
    /// communicator's record.
    pub(crate) fn view<'a>(
        &'a self,
        info: &'a CommInfo,
        grants: &'a Grants,
        slot: Option<u32>,
        token: u64,
        stamps: PostStamps,
    ) -> PostView<'a> {
        let facts = self.kind.facts();
        let ((s, _, send_packed), (r, _, recv_packed)) = (&self.send, &self.recv);
        PostView {
            kind: self.kind,
            comm: info.id,
            seq: self.seq,
            comm_rank: info.comm_rank,
            members: &info.members,
            world_ranks: &info.world_ranks,
            nodes: if facts.lists_nodes { &info.nodes } else { &[] },
            slot,
            token,
            send: &grants.send,
            recv: &grants.recv,
            send_counts: &s.counts,
            send_displs: &s.displs,
            recv_counts: &r.counts,
            recv_displs: &r.displs,
            host_copies: grants.host_copies,
            staged: grants.staged.as_ref(),
            send_packed: *send_packed,
            recv_packed: *recv_packed,
            reduce: self.reduce,
            stamps,
        }
    }
}
