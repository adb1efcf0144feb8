//! The Canary wire format (paper §4.1, extended): one packet is one block of one allreduce on
//! one hop. [`Packet::encode`] and [`Packet::decode`] are exact inverses; the decoder accepts
//! nothing else (wrong magic or version, unknown kind, truncated or trailing bytes, a payload
//! that is not whole elements or larger than [`MAX_DATA`], a counter of 0 or above the host
//! count, an undefined operation), so a datagram from anywhere can be fed to it.
//!
//! Layout (little-endian): `"CY"`, version, kind, then the [`Head`] (collective, block,
//! attempt, tag, destination), then the kind's fields, the data last (`u16` length first).
//! Against the paper's 19-byte header: the id is split into (allreduce, block, attempt) so a
//! restarted block gets a fresh id (§3.3 "re-issue ... with a different id"), a 64-bit `tag`
//! known only to the job's members keeps packets from outside the job out of its descriptors,
//! and the operation and element type travel in the packet (the switch is not configured per
//! job). The bypass bit is the [`Packet::Collided`] kind and the multicast bit the
//! [`Packet::Bcast`] kind.

use super::{Addr, BlockId, Port};
use crate::allreduce::{Elem, Op, Reduce};

/// Largest payload of one packet (bytes).
pub const MAX_DATA: usize = 8192;
/// Largest port list of a [`Packet::Restore`].
pub const MAX_PORTS: usize = 1024;
const MAGIC: [u8; 2] = *b"CY";
const VERSION: u8 = 1;
/// Bytes of the fixed part every packet starts with.
pub const HEAD_LEN: usize = 4 + 4 + 2 + 8 + 4;

/// Fields every packet carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Head {
    pub id: BlockId,
    /// Secret of the job (agreed at set-up): packets with another tag are never aggregated
    /// with the job's, nor accepted by its hosts.
    pub tag: u64,
    /// Where the packet goes: the block's leader for the reduce direction, a host or a
    /// switch for unicasts; unused by [`Packet::Bcast`] (which follows remembered ports).
    pub dst: Addr,
}

/// One Canary packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Packet {
    /// Reduce phase, towards `head.dst` (the leader): `counter` host contributions already
    /// reduced into `data`, out of `hosts` senders (paper Fig. 3). `tree` names a static
    /// tree (the baselines); `None` is Canary's dynamic routing.
    Reduce {
        head: Head,
        counter: u16,
        hosts: u16,
        reduce: Reduce,
        tree: Option<u8>,
        data: Vec<u8>,
    },
    /// A reduce packet that met a collision at `switch`, received there on `port`; forwarded
    /// to the leader untouched by other switches (paper §3.2.1, the bypass bit).
    Collided {
        head: Head,
        counter: u16,
        hosts: u16,
        reduce: Reduce,
        switch: Addr,
        port: Port,
        data: Vec<u8>,
    },
    /// Broadcast phase: the reduced block, sent down the remembered children ports.
    Bcast { head: Head, data: Vec<u8> },
    /// Tree restoration (§3.2.1): to switch `head.dst`, which sends `data` as a
    /// [`Packet::Bcast`] on `ports`.
    Restore {
        head: Head,
        ports: Vec<Port>,
        data: Vec<u8>,
    },
    /// Retransmission request (§3.3) of host `host` for block `head.id` (its attempt).
    Retx { head: Head, host: Addr },
    /// The reduced block, unicast to one host (answer to a [`Packet::Retx`]).
    Result { head: Head, data: Vec<u8> },
    /// The leader restarts the block: reduce it again under `head.id` (the new attempt).
    Restart { head: Head },
    /// The leader gave the block up: every host fails the allreduce.
    Abort { head: Head },
    /// Not the paper's: the answer to a [`Packet::Retx`] of a leader that will not restart
    /// the block yet, or of a member that has not started the allreduce (an MPI rank may
    /// arrive late): "alive, wait" (the requester's count of unanswered requests starts
    /// again). Sent only by hosts configured with `HostConfig::wait_for_late`, and by the SP's
    /// data path for an allreduce it has not started.
    Wait { head: Head },
}

/// Why bytes are not a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    Short { need: usize, have: usize },
    Magic,
    Version(u8),
    Kind(u8),
    Trailing(usize),
    DataTooLarge { len: usize, max: usize },
    TooManyPorts { len: usize, max: usize },
    NotWholeElements { len: usize, elem: usize },
    BadReduce,
    BadCounter { counter: u16, hosts: u16 },
}

impl core::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        core::fmt::Debug::fmt(self, f)
    }
}

impl Packet {
    pub fn head(&self) -> &Head {
        match self {
            Packet::Reduce { head, .. }
            | Packet::Collided { head, .. }
            | Packet::Bcast { head, .. }
            | Packet::Restore { head, .. }
            | Packet::Retx { head, .. }
            | Packet::Result { head, .. }
            | Packet::Restart { head }
            | Packet::Abort { head }
            | Packet::Wait { head } => head,
        }
    }

    fn kind(&self) -> u8 {
        match self {
            Packet::Reduce { .. } => 1,
            Packet::Collided { .. } => 2,
            Packet::Bcast { .. } => 3,
            Packet::Restore { .. } => 4,
            Packet::Retx { .. } => 5,
            Packet::Result { .. } => 6,
            Packet::Restart { .. } => 7,
            Packet::Abort { .. } => 8,
            Packet::Wait { .. } => 9,
        }
    }

    /// Payload bytes carried (0 for control packets).
    pub fn data_len(&self) -> usize {
        match self {
            Packet::Reduce { data, .. }
            | Packet::Collided { data, .. }
            | Packet::Bcast { data, .. }
            | Packet::Restore { data, .. }
            | Packet::Result { data, .. } => data.len(),
            _ => 0,
        }
    }

    /// Bytes on the wire of [`Packet::encode`].
    pub fn wire_len(&self) -> usize {
        4 + HEAD_LEN
            + match self {
                Packet::Reduce { data, .. } => 2 + 2 + 2 + 2 + 2 + data.len(),
                Packet::Collided { data, .. } => 2 + 2 + 2 + 4 + 2 + 2 + data.len(),
                Packet::Bcast { data, .. } | Packet::Result { data, .. } => 2 + data.len(),
                Packet::Restore { ports, data, .. } => 2 + 2 * ports.len() + 2 + data.len(),
                Packet::Retx { .. } => 4,
                Packet::Restart { .. } | Packet::Abort { .. } | Packet::Wait { .. } => 0,
            }
    }

    /// The packet as bytes. Panics if a length exceeds [`MAX_DATA`] / [`MAX_PORTS`] (the
    /// machines never build such a packet).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.wire_len());
        b.extend_from_slice(&MAGIC);
        b.push(VERSION);
        b.push(self.kind());
        let h = self.head();
        b.extend_from_slice(&h.id.coll.to_le_bytes());
        b.extend_from_slice(&h.id.block.to_le_bytes());
        b.extend_from_slice(&h.id.attempt.to_le_bytes());
        b.extend_from_slice(&h.tag.to_le_bytes());
        b.extend_from_slice(&h.dst.to_le_bytes());
        let data = |b: &mut Vec<u8>, d: &[u8]| {
            assert!(d.len() <= MAX_DATA, "packet data of {} bytes", d.len());
            b.extend_from_slice(&(d.len() as u16).to_le_bytes());
            b.extend_from_slice(d);
        };
        match self {
            Packet::Reduce {
                counter,
                hosts,
                reduce,
                tree,
                data: d,
                ..
            } => {
                b.extend_from_slice(&counter.to_le_bytes());
                b.extend_from_slice(&hosts.to_le_bytes());
                b.extend_from_slice(&reduce_code(*reduce));
                b.push(tree.is_some() as u8);
                b.push(tree.unwrap_or(0));
                data(&mut b, d);
            }
            Packet::Collided {
                counter,
                hosts,
                reduce,
                switch,
                port,
                data: d,
                ..
            } => {
                b.extend_from_slice(&counter.to_le_bytes());
                b.extend_from_slice(&hosts.to_le_bytes());
                b.extend_from_slice(&reduce_code(*reduce));
                b.extend_from_slice(&switch.to_le_bytes());
                b.extend_from_slice(&port.to_le_bytes());
                data(&mut b, d);
            }
            Packet::Bcast { data: d, .. } | Packet::Result { data: d, .. } => data(&mut b, d),
            Packet::Restore { ports, data: d, .. } => {
                assert!(ports.len() <= MAX_PORTS);
                b.extend_from_slice(&(ports.len() as u16).to_le_bytes());
                for p in ports {
                    b.extend_from_slice(&p.to_le_bytes());
                }
                data(&mut b, d);
            }
            Packet::Retx { host, .. } => b.extend_from_slice(&host.to_le_bytes()),
            Packet::Restart { .. } | Packet::Abort { .. } | Packet::Wait { .. } => {}
        }
        debug_assert_eq!(b.len(), self.wire_len());
        b
    }

    /// Parse one packet; see the module docs for what is refused.
    pub fn decode(bytes: &[u8]) -> Result<Packet, DecodeError> {
        let mut r = Reader { b: bytes, at: 0 };
        if r.take(2)? != MAGIC {
            return Err(DecodeError::Magic);
        }
        let version = r.u8()?;
        if version != VERSION {
            return Err(DecodeError::Version(version));
        }
        let kind = r.u8()?;
        if !(1..=9).contains(&kind) {
            return Err(DecodeError::Kind(kind));
        }
        let id = BlockId {
            coll: r.u32()?,
            block: r.u32()?,
            attempt: r.u16()?,
        };
        let head = Head {
            id,
            tag: r.u64()?,
            dst: r.u32()?,
        };
        let p = match kind {
            1 => {
                let (counter, hosts) = counts(&mut r)?;
                let reduce = r.reduce()?;
                let has_tree = r.u8()?;
                let t = r.u8()?;
                let tree = match has_tree {
                    0 if t == 0 => None,
                    1 => Some(t),
                    _ => return Err(DecodeError::BadReduce),
                };
                let data = r.data(Some(reduce.elem))?;
                Packet::Reduce {
                    head,
                    counter,
                    hosts,
                    reduce,
                    tree,
                    data,
                }
            }
            2 => {
                let (counter, hosts) = counts(&mut r)?;
                let reduce = r.reduce()?;
                let switch = r.u32()?;
                let port = r.u16()?;
                let data = r.data(Some(reduce.elem))?;
                Packet::Collided {
                    head,
                    counter,
                    hosts,
                    reduce,
                    switch,
                    port,
                    data,
                }
            }
            3 => Packet::Bcast {
                head,
                data: r.data(None)?,
            },
            4 => {
                let n = r.u16()? as usize;
                if n > MAX_PORTS {
                    return Err(DecodeError::TooManyPorts {
                        len: n,
                        max: MAX_PORTS,
                    });
                }
                let mut ports = Vec::with_capacity(n);
                for _ in 0..n {
                    ports.push(r.u16()?);
                }
                Packet::Restore {
                    head,
                    ports,
                    data: r.data(None)?,
                }
            }
            5 => Packet::Retx {
                head,
                host: r.u32()?,
            },
            6 => Packet::Result {
                head,
                data: r.data(None)?,
            },
            7 => Packet::Restart { head },
            8 => Packet::Abort { head },
            _ => Packet::Wait { head },
        };
        if r.at != bytes.len() {
            return Err(DecodeError::Trailing(bytes.len() - r.at));
        }
        Ok(p)
    }
}

fn counts(r: &mut Reader) -> Result<(u16, u16), DecodeError> {
    let counter = r.u16()?;
    let hosts = r.u16()?;
    if counter == 0 || counter > hosts {
        return Err(DecodeError::BadCounter { counter, hosts });
    }
    Ok((counter, hosts))
}

fn reduce_code(r: Reduce) -> [u8; 2] {
    let op = Op::ALL.iter().position(|&o| o == r.op).unwrap() as u8;
    let elem = Elem::ALL.iter().position(|&e| e == r.elem).unwrap() as u8;
    [op, elem]
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let have = self.b.len() - self.at;
        if have < n {
            return Err(DecodeError::Short {
                need: self.at + n,
                have: self.b.len(),
            });
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn reduce(&mut self) -> Result<Reduce, DecodeError> {
        let op = *Op::ALL
            .get(self.u8()? as usize)
            .ok_or(DecodeError::BadReduce)?;
        let elem = *Elem::ALL
            .get(self.u8()? as usize)
            .ok_or(DecodeError::BadReduce)?;
        let r = Reduce { op, elem };
        if !r.is_valid() {
            return Err(DecodeError::BadReduce);
        }
        Ok(r)
    }
    fn data(&mut self, elem: Option<Elem>) -> Result<Vec<u8>, DecodeError> {
        let len = self.u16()? as usize;
        if len > MAX_DATA {
            return Err(DecodeError::DataTooLarge { len, max: MAX_DATA });
        }
        if let Some(e) = elem {
            if !len.is_multiple_of(e.size()) {
                return Err(DecodeError::NotWholeElements {
                    len,
                    elem: e.size(),
                });
            }
        }
        Ok(self.take(len)?.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::rng::Rng;

    fn head(rng: &mut Rng) -> Head {
        Head {
            id: BlockId {
                coll: rng.next_u64() as u32,
                block: rng.next_u64() as u32,
                attempt: rng.next_u64() as u16,
            },
            tag: rng.next_u64(),
            dst: rng.next_u64() as u32,
        }
    }

    fn data(rng: &mut Rng, elem: usize) -> Vec<u8> {
        let n = rng.below(64) as usize * elem;
        (0..n).map(|_| rng.next_u64() as u8).collect()
    }

    fn every_kind(rng: &mut Rng) -> Vec<Packet> {
        let reduce = Reduce {
            op: Op::Sum,
            elem: Elem::I32,
        };
        let h = head(rng);
        vec![
            Packet::Reduce {
                head: h,
                counter: 3,
                hosts: 7,
                reduce,
                tree: None,
                data: data(rng, 4),
            },
            Packet::Reduce {
                head: h,
                counter: 1,
                hosts: 1,
                reduce,
                tree: Some(3),
                data: data(rng, 4),
            },
            Packet::Collided {
                head: h,
                counter: 2,
                hosts: 9,
                reduce,
                switch: 77,
                port: 31,
                data: data(rng, 4),
            },
            Packet::Bcast {
                head: h,
                data: data(rng, 1),
            },
            Packet::Restore {
                head: h,
                ports: vec![1, 5, 63],
                data: data(rng, 1),
            },
            Packet::Retx { head: h, host: 12 },
            Packet::Result {
                head: h,
                data: data(rng, 1),
            },
            Packet::Restart { head: h },
            Packet::Abort { head: h },
            Packet::Wait { head: h },
        ]
    }

    #[test]
    fn encode_decode_round_trip() {
        let seed = 0xC0FFEE;
        println!("seed {seed}");
        let mut rng = Rng::new(seed);
        for _ in 0..50 {
            for p in every_kind(&mut rng) {
                let b = p.encode();
                assert_eq!(b.len(), p.wire_len());
                assert_eq!(Packet::decode(&b), Ok(p));
            }
        }
    }

    /// Every truncation, every extension and random byte flips either decode to a packet
    /// that encodes back to the same bytes or are refused: never a panic.
    #[test]
    fn decoder_refuses_bad_input_without_panicking() {
        let seed = 0xBAD5EED;
        println!("seed {seed}");
        let mut rng = Rng::new(seed);
        for p in every_kind(&mut rng) {
            let b = p.encode();
            for cut in 0..b.len() {
                assert!(Packet::decode(&b[..cut]).is_err(), "{p:?} cut at {cut}");
            }
            let mut longer = b.clone();
            longer.push(0);
            assert_eq!(Packet::decode(&longer), Err(DecodeError::Trailing(1)));
            for _ in 0..2000 {
                let mut m = b.clone();
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(m.len() as u64) as usize;
                    m[i] = rng.next_u64() as u8;
                }
                if let Ok(q) = Packet::decode(&m) {
                    assert_eq!(q.encode(), m);
                }
            }
        }
        for _ in 0..20000 {
            let n = rng.below(80) as usize;
            let junk: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            let _ = Packet::decode(&junk);
        }
        let bad_counter = Packet::Reduce {
            head: head(&mut rng),
            counter: 5,
            hosts: 4,
            reduce: Reduce {
                op: Op::Sum,
                elem: Elem::I32,
            },
            tree: None,
            data: vec![0; 8],
        };
        assert_eq!(
            Packet::decode(&bad_counter.encode()),
            Err(DecodeError::BadCounter {
                counter: 5,
                hosts: 4
            })
        );
        let odd = Packet::Reduce {
            head: head(&mut rng),
            counter: 1,
            hosts: 4,
            reduce: Reduce {
                op: Op::Sum,
                elem: Elem::I32,
            },
            tree: None,
            data: vec![0; 6],
        };
        assert_eq!(
            Packet::decode(&odd.encode()),
            Err(DecodeError::NotWholeElements { len: 6, elem: 4 })
        );
    }
}
