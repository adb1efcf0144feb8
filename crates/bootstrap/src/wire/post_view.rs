//! A post as the rank builds and encodes it: [`PostDesc`] with its lists and grants borrowed,
//! encoded by hand into the bytes bincode writes for `HostToSp::Post` of the same fields
//! (which is how the SP decodes it). Building and encoding one allocates nothing: the member
//! lists stay in the communicator's record, the counts in the call's layout, and the frame is
//! the sender's, reused. The rank's time in MPI per call is a few microseconds, and a
//! serde serialisation through `io::Write` (a capacity check per byte) was a quarter of the
//! post.
//!
//! The encoding is bincode's with the protocol's options (`wire::encoding`: little-endian,
//! variable-length integers): an integer of 2 to 8 bytes is one byte below 251, else a marker
//! (251, 252, 253) and the value in 2, 4 or 8 bytes; a `u8` and a `bool` one byte; an
//! `Option` a byte 0 or 1 and the value; an enum its variant's index as such an integer; a
//! sequence its length, then its elements; a struct its fields in order. The test
//! `a_post_view_encodes_as_the_post_message` (`wire/tests.rs`) compares the two encodings on
//! random descriptors; a field added to [`PostDesc`] breaks the build here (every struct is
//! taken apart without `..`).

use super::{CollKind, FrameError, PostDesc, PostStamps, Staged, StagedDesign};
use algorithms::{allreduce, CommId, SpId};
use alias_mkey::{BackendData, Grant};

/// A post as the rank builds it; the fields are [`PostDesc`]'s, in its order.
#[derive(Debug)]
pub struct PostView<'a> {
    pub kind: CollKind,
    pub comm: CommId,
    pub seq: u64,
    pub comm_rank: u32,
    pub members: &'a [SpId],
    pub world_ranks: &'a [u32],
    pub nodes: &'a [u32],
    pub slot: Option<u32>,
    pub token: u64,
    pub send: &'a Grant,
    pub recv: &'a Grant,
    pub send_counts: &'a [u64],
    pub send_displs: &'a [u64],
    pub recv_counts: &'a [u64],
    pub recv_displs: &'a [u64],
    pub host_copies: bool,
    pub staged: Option<&'a Staged>,
    pub send_packed: bool,
    pub recv_packed: bool,
    pub reduce: Option<allreduce::Reduce>,
    pub stamps: PostStamps,
}

impl PostDesc {
    /// This descriptor as a view (what the rank encodes).
    pub fn view(&self) -> PostView<'_> {
        PostView {
            kind: self.kind,
            comm: self.comm,
            seq: self.seq,
            comm_rank: self.comm_rank,
            members: &self.members,
            world_ranks: &self.world_ranks,
            nodes: &self.nodes,
            slot: self.slot,
            token: self.token,
            send: &self.send,
            recv: &self.recv,
            send_counts: &self.send_counts,
            send_displs: &self.send_displs,
            recv_counts: &self.recv_counts,
            recv_displs: &self.recv_displs,
            host_copies: self.host_copies,
            staged: self.staged.as_ref(),
            send_packed: self.send_packed,
            recv_packed: self.recv_packed,
            reduce: self.reduce,
            stamps: self.stamps,
        }
    }
}

impl PostView<'_> {
    /// The descriptor the SP decodes from this view's encoding.
    pub fn to_desc(&self) -> PostDesc {
        PostDesc {
            kind: self.kind,
            comm: self.comm,
            seq: self.seq,
            comm_rank: self.comm_rank,
            members: self.members.to_vec(),
            world_ranks: self.world_ranks.to_vec(),
            nodes: self.nodes.to_vec(),
            slot: self.slot,
            token: self.token,
            send: self.send.clone(),
            recv: self.recv.clone(),
            send_counts: self.send_counts.to_vec(),
            send_displs: self.send_displs.to_vec(),
            recv_counts: self.recv_counts.to_vec(),
            recv_displs: self.recv_displs.to_vec(),
            host_copies: self.host_copies,
            staged: self.staged.cloned(),
            send_packed: self.send_packed,
            recv_packed: self.recv_packed,
            reduce: self.reduce,
            stamps: self.stamps,
        }
    }
}

/// `HostToSp::Post`'s variant index.
const POST_VARIANT: u64 = 1;

/// Bytes of one variable-length integer at most.
const MAX_VARINT: usize = 9;

/// Bytes written at a time into the frame.
const CHUNK: usize = 256;

/// The frame being written: bytes go into a small buffer on the stack, which is appended to
/// the frame when it fills and at the end (pushing each byte onto the `Vec<u8>` would reload
/// its length after every byte, as the byte might alias it; sizing the frame for the longest
/// encoding first would write the whole bound each time).
struct Out<'a> {
    out: &'a mut Vec<u8>,
    buf: [u8; CHUNK],
    at: usize,
}

impl Out<'_> {
    /// Makes room for `n <= CHUNK` bytes in the buffer.
    #[inline]
    fn room(&mut self, n: usize) {
        if self.at + n > CHUNK {
            self.flush();
        }
    }

    fn flush(&mut self) {
        self.out.extend_from_slice(&self.buf[..self.at]);
        self.at = 0;
    }

    #[inline]
    fn byte(&mut self, b: u8) {
        self.room(1);
        self.buf[self.at] = b;
        self.at += 1;
    }

    fn put(&mut self, b: &[u8]) {
        if b.len() > CHUNK {
            self.flush();
            self.out.extend_from_slice(b);
            return;
        }
        self.room(b.len());
        self.buf[self.at..self.at + b.len()].copy_from_slice(b);
        self.at += b.len();
    }

    fn bool(&mut self, b: bool) {
        self.byte(b as u8);
    }

    /// bincode's variable-length integer (inlined: a post writes some 45 of them, and the
    /// call cost about a third of each).
    #[inline]
    fn int(&mut self, v: u64) {
        self.room(MAX_VARINT);
        let b = &mut self.buf[self.at..self.at + MAX_VARINT];
        self.at += if v < 251 {
            b[0] = v as u8;
            1
        } else if v <= u16::MAX as u64 {
            b[0] = 251;
            b[1..3].copy_from_slice(&(v as u16).to_le_bytes());
            3
        } else if v <= u32::MAX as u64 {
            b[0] = 252;
            b[1..5].copy_from_slice(&(v as u32).to_le_bytes());
            5
        } else {
            b[0] = 253;
            b[1..9].copy_from_slice(&v.to_le_bytes());
            9
        };
    }

    fn u32s(&mut self, list: &[u32]) {
        self.int(list.len() as u64);
        for &v in list {
            self.int(v as u64);
        }
    }

    fn u64s(&mut self, list: &[u64]) {
        self.int(list.len() as u64);
        for &v in list {
            self.int(v);
        }
    }

    /// A `Vec<u8>` as serde writes it: its length, then each byte.
    fn bytes(&mut self, b: &[u8]) {
        self.int(b.len() as u64);
        self.put(b);
    }

    fn grant(&mut self, g: &Grant) {
        let Grant {
            region,
            generation,
            addr,
            len,
            rights,
            backend,
        } = g;
        self.int(*region);
        self.int(*generation as u64);
        self.int(*addr);
        self.int(*len);
        self.byte(rights.bits());
        match backend {
            BackendData::Cma => self.int(0),
            BackendData::Ucx {
                worker_address,
                rkey,
            } => {
                self.int(1);
                self.bytes(worker_address);
                self.bytes(rkey);
            }
            BackendData::UcxExport { memh } => {
                self.int(2);
                self.bytes(memh);
            }
        }
    }

    fn staged(&mut self, s: &Staged) {
        let Staged {
            root,
            design,
            segment,
        } = s;
        self.int(*root as u64);
        self.int(match design {
            StagedDesign::Flat => 0,
            StagedDesign::Hier => 1,
        });
        match segment {
            None => self.byte(0),
            Some(g) => {
                self.byte(1);
                self.grant(g);
            }
        }
    }
}

/// Encodes `view` as the whole frame of the message `HostToSp::Post` (length prefix
/// included) into `out`, cleared first, its memory reused: the bytes `encode_into` writes for
/// the same post as a [`PostDesc`]. `Err` (and `out` empty): the payload is longer than
/// [`MAX_FRAME_BYTES`](super::MAX_FRAME_BYTES).
pub fn encode_post_into(view: &PostView<'_>, out: &mut Vec<u8>) -> Result<(), FrameError> {
    let PostView {
        kind,
        comm,
        seq,
        comm_rank,
        members,
        world_ranks,
        nodes,
        slot,
        token,
        send,
        recv,
        send_counts,
        send_displs,
        recv_counts,
        recv_displs,
        host_copies,
        staged,
        send_packed,
        recv_packed,
        reduce,
        stamps,
    } = view;
    out.clear();
    out.extend_from_slice(&[0; 4]);
    let mut o = Out {
        out,
        buf: [0; CHUNK],
        at: 0,
    };
    o.int(POST_VARIANT);
    o.int(*kind as u64);
    let CommId { leader, id } = comm;
    o.int(*leader as u64);
    o.int(*id as u64);
    o.int(*seq);
    o.int(*comm_rank as u64);
    o.u32s(members);
    o.u32s(world_ranks);
    o.u32s(nodes);
    match slot {
        None => o.byte(0),
        Some(s) => {
            o.byte(1);
            o.int(*s as u64);
        }
    }
    o.int(*token);
    o.grant(send);
    o.grant(recv);
    o.u64s(send_counts);
    o.u64s(send_displs);
    o.u64s(recv_counts);
    o.u64s(recv_displs);
    o.bool(*host_copies);
    match staged {
        None => o.byte(0),
        Some(s) => {
            o.byte(1);
            o.staged(s);
        }
    }
    o.bool(*send_packed);
    o.bool(*recv_packed);
    match reduce {
        None => o.byte(0),
        Some(allreduce::Reduce { op, elem }) => {
            o.byte(1);
            o.int(*op as u64);
            o.int(*elem as u64);
        }
    }
    let PostStamps {
        sent_ns,
        last_notice_ns,
    } = stamps;
    o.int(*sent_ns);
    o.int(*last_notice_ns);
    o.flush();
    super::seal_frame(out)
}

/// Decodes a frame's payload from a host (`HostToSp`), a post by hand ([`decode_post`]), any
/// other message with bincode: the result is [`decode`](super::decode)'s in every case, `Ok`
/// or `Err` alike (the test `a_post_decodes_by_hand_as_bincode_decodes_it` compares them on
/// random posts and on their truncations and corruptions).
pub fn decode_host(payload: &[u8]) -> Result<super::HostToSp, FrameError> {
    // A post's variant index, written canonically (bincode takes the other spellings too,
    // and so does this, through bincode).
    if payload.first() == Some(&(POST_VARIANT as u8)) {
        return decode_post(&payload[1..]).map(|d| super::HostToSp::Post(Box::new(d)));
    }
    super::decode(payload)
}

/// The payload being read.
struct In<'a> {
    buf: &'a [u8],
    at: usize,
}

/// Why a post did not decode: a `&'static str` the size of two registers, so that every
/// integer's `Result` comes back in registers (a `FrameError`, with its `String`, is returned
/// through memory; the message is made once, by [`decode_post`]).
#[derive(Clone, Copy, Debug)]
struct Bad(&'static str);

fn bad(what: &'static str) -> Bad {
    Bad(what)
}

impl In<'_> {
    #[inline]
    fn byte(&mut self) -> Result<u8, Bad> {
        let b = *self.buf.get(self.at).ok_or_else(|| bad("ends early"))?;
        self.at += 1;
        Ok(b)
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], Bad> {
        let b = self
            .buf
            .get(self.at..self.at + N)
            .ok_or_else(|| bad("ends early"))?;
        self.at += N;
        Ok(b.try_into().expect("N bytes"))
    }

    /// bincode's variable-length integer (any of its spellings of a value, as bincode reads
    /// them: a marker need not be the shortest).
    #[inline]
    fn u64(&mut self) -> Result<u64, Bad> {
        Ok(match self.byte()? {
            b @ 0..=250 => b as u64,
            251 => u16::from_le_bytes(self.take()?) as u64,
            252 => u32::from_le_bytes(self.take()?) as u64,
            253 => u64::from_le_bytes(self.take()?),
            _ => return Err(bad("an integer of more than 64 bits")),
        })
    }

    fn u32(&mut self) -> Result<u32, Bad> {
        u32::try_from(self.u64()?).map_err(|_| bad("a 32-bit integer out of range"))
    }

    fn bool(&mut self) -> Result<bool, Bad> {
        match self.byte()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(bad("a boolean other than 0 or 1")),
        }
    }

    /// An `Option`'s tag: whether a value follows.
    fn some(&mut self) -> Result<bool, Bad> {
        match self.byte()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(bad("an option tag other than 0 or 1")),
        }
    }

    /// A sequence's length, no more than its elements of at least `min` bytes each could
    /// fill of what is left (so that a hostile length allocates nothing it cannot fill).
    fn len(&mut self, min: usize) -> Result<usize, Bad> {
        let n = self.u64()?;
        let left = (self.buf.len() - self.at) / min;
        if n > left as u64 {
            return Err(bad("a list longer than the message"));
        }
        Ok(n as usize)
    }

    /// A list of integers, each read by `read`, filled by a plain loop: collecting an
    /// iterator of `Result`s costs about a third more per element here.
    fn list<T>(&mut self, read: fn(&mut Self) -> Result<T, Bad>) -> Result<Vec<T>, Bad> {
        let n = self.len(1)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(read(self)?);
        }
        Ok(v)
    }

    fn u32s(&mut self) -> Result<Vec<u32>, Bad> {
        self.list(Self::u32)
    }

    fn u64s(&mut self) -> Result<Vec<u64>, Bad> {
        self.list(Self::u64)
    }

    fn bytes(&mut self) -> Result<Vec<u8>, Bad> {
        let n = self.len(1)?;
        let b = self.buf[self.at..self.at + n].to_vec();
        self.at += n;
        Ok(b)
    }

    /// A fieldless enum's variant index below `n`.
    fn variant(&mut self, n: u32) -> Result<u32, Bad> {
        let v = self.u32()?;
        if v >= n {
            return Err(bad("an unknown variant"));
        }
        Ok(v)
    }

    fn grant(&mut self) -> Result<Grant, Bad> {
        let region = self.u64()?;
        let generation = self.u32()?;
        let addr = self.u64()?;
        let len = self.u64()?;
        let rights = alias_mkey::Rights::from_bits(self.byte()?);
        let backend = match self.variant(3)? {
            0 => BackendData::Cma,
            1 => BackendData::Ucx {
                worker_address: self.bytes()?,
                rkey: self.bytes()?,
            },
            _ => BackendData::UcxExport {
                memh: self.bytes()?,
            },
        };
        Ok(Grant {
            region,
            generation,
            addr,
            len,
            rights,
            backend,
        })
    }
}

/// The variant of index `i` among `all` (a fieldless enum's every variant), by its index.
fn by_index<T: Copy>(all: &[T], index: impl Fn(T) -> u32, i: u32) -> Result<T, Bad> {
    all.iter()
        .copied()
        .find(|&v| index(v) == i)
        .ok_or_else(|| bad("an unknown variant"))
}

/// Decodes a `PostDesc` written by [`encode_post_into`] (or by bincode), the payload after
/// the message's variant index, with nothing after it. Like bincode decoding from a slice
/// (whose `with_limit` does not apply there), it reads a payload of any length: the caller
/// bounds it (the frame reader at `MAX_FRAME_BYTES`, the ring at its entry), and a list is
/// never longer than the bytes left, so what it allocates is bounded by the payload.
pub fn decode_post(payload: &[u8]) -> Result<PostDesc, FrameError> {
    read_post(payload).map_err(|Bad(what)| FrameError::Decode(format!("a post: {what}")))
}

fn read_post(payload: &[u8]) -> Result<PostDesc, Bad> {
    let mut i = In {
        buf: payload,
        at: 0,
    };
    let d = PostDesc {
        kind: by_index(&crate::kinds::KINDS.map(|f| f.kind), |k| k as u32, i.u32()?)?,
        comm: CommId {
            leader: i.u32()?,
            id: i.u32()?,
        },
        seq: i.u64()?,
        comm_rank: i.u32()?,
        members: i.u32s()?,
        world_ranks: i.u32s()?,
        nodes: i.u32s()?,
        slot: if i.some()? { Some(i.u32()?) } else { None },
        token: i.u64()?,
        send: i.grant()?,
        recv: i.grant()?,
        send_counts: i.u64s()?,
        send_displs: i.u64s()?,
        recv_counts: i.u64s()?,
        recv_displs: i.u64s()?,
        host_copies: i.bool()?,
        staged: if i.some()? {
            Some(Staged {
                root: i.u32()?,
                design: match i.variant(2)? {
                    0 => StagedDesign::Flat,
                    _ => StagedDesign::Hier,
                },
                segment: if i.some()? { Some(i.grant()?) } else { None },
            })
        } else {
            None
        },
        send_packed: i.bool()?,
        recv_packed: i.bool()?,
        reduce: if i.some()? {
            Some(allreduce::Reduce {
                op: by_index(&allreduce::Op::ALL, |o| o as u32, i.u32()?)?,
                elem: by_index(&allreduce::Elem::ALL, |e| e as u32, i.u32()?)?,
            })
        } else {
            None
        },
        stamps: PostStamps {
            sent_ns: i.u64()?,
            last_notice_ns: i.u64()?,
        },
    };
    if i.at != payload.len() {
        return Err(bad("bytes after its end"));
    }
    Ok(d)
}
