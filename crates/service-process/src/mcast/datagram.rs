//! The multicast datagram: a fixed header and one chunk of a collective's buffer.
//!
//! The emulation of the paper's UD multicast fast path (`multicast-bcast-allgather-dpa.txt`,
//! §III "Multicast fast path"; on InfiniBand the PSN travels in the CQE's immediate data, here
//! in the header). Every field is checked before anything else looks at the datagram: a
//! datagram that is short, of another protocol or version, or whose numbers disagree with its
//! own length is [`DatagramError`], never written anywhere.
//!
//! ```text
//!  0      4     5     6        8              16             24      28       32       36   40
//!  | SPMC | ver | kind| subgrp |   coll (u64)  |   tag (u64)  |  psn  | chunks |  len   | 0 |
//! ```
//! All integers little-endian. `coll` names the collective on the fabric (its instance),
//! `tag` is the collective's secret (handed out over the SPs' authenticated channel, like an
//! IB Q_Key: it keeps a datagram of another collective, or a guess from outside, out of this
//! one's buffers), `psn` the chunk's number, `chunks` how many the collective has, `len` the
//! payload's length (the last chunk may be shorter than the MTU).

/// The first four bytes of every datagram.
pub const MAGIC: [u8; 4] = *b"SPMC";
/// The version this build speaks.
pub const VERSION: u8 = 1;
/// A chunk of a collective's data.
pub const KIND_DATA: u8 = 1;
/// Bytes before the payload.
pub const HEADER_BYTES: usize = 40;
/// The largest payload any configuration may use (an IB UD MTU is at most 4 KiB; a UDP
/// datagram on loopback carries up to 64 KiB).
pub const MAX_PAYLOAD: usize = 65_507 - HEADER_BYTES;

/// The header of a data datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub subgroup: u16,
    pub coll: u64,
    pub tag: u64,
    pub psn: u32,
    pub chunks: u32,
}

/// Why a datagram was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DatagramError {
    #[error("{0} bytes: shorter than a header")]
    Short(usize),
    #[error("not a spoff multicast datagram")]
    Magic,
    #[error("version {0}, this build speaks {VERSION}")]
    Version(u8),
    #[error("kind {0} is not a data chunk")]
    Kind(u8),
    #[error("payload length {said} but {got} bytes follow the header")]
    Length { said: u32, got: usize },
    #[error("psn {psn} of a collective of {chunks} chunks")]
    Psn { psn: u32, chunks: u32 },
}

/// Writes the datagram of chunk `h.psn` with `payload` into `out` (cleared first).
pub fn encode(h: &Header, payload: &[u8], out: &mut Vec<u8>) {
    assert!(payload.len() <= MAX_PAYLOAD, "payload beyond MAX_PAYLOAD");
    out.clear();
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(KIND_DATA);
    out.extend_from_slice(&h.subgroup.to_le_bytes());
    out.extend_from_slice(&h.coll.to_le_bytes());
    out.extend_from_slice(&h.tag.to_le_bytes());
    out.extend_from_slice(&h.psn.to_le_bytes());
    out.extend_from_slice(&h.chunks.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(payload);
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The header and payload of `dgram`, every field checked.
pub fn decode(dgram: &[u8]) -> Result<(Header, &[u8]), DatagramError> {
    if dgram.len() < HEADER_BYTES {
        return Err(DatagramError::Short(dgram.len()));
    }
    if dgram[..4] != MAGIC {
        return Err(DatagramError::Magic);
    }
    if dgram[4] != VERSION {
        return Err(DatagramError::Version(dgram[4]));
    }
    if dgram[5] != KIND_DATA {
        return Err(DatagramError::Kind(dgram[5]));
    }
    let h = Header {
        subgroup: u16_at(dgram, 6),
        coll: u64_at(dgram, 8),
        tag: u64_at(dgram, 16),
        psn: u32_at(dgram, 24),
        chunks: u32_at(dgram, 28),
    };
    let said = u32_at(dgram, 32);
    let payload = &dgram[HEADER_BYTES..];
    if said as usize != payload.len() {
        return Err(DatagramError::Length {
            said,
            got: payload.len(),
        });
    }
    if h.psn >= h.chunks {
        return Err(DatagramError::Psn {
            psn: h.psn,
            chunks: h.chunks,
        });
    }
    Ok((h, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            subgroup: 3,
            coll: 0x0102_0304_0506_0708,
            tag: 0xdead_beef_f00d_cafe,
            psn: 7,
            chunks: 9,
        }
    }

    #[test]
    fn a_datagram_decodes_to_what_was_encoded() {
        let mut out = Vec::new();
        for len in [0usize, 1, 4095, 4096] {
            let payload: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
            encode(&header(), &payload, &mut out);
            assert_eq!(out.len(), HEADER_BYTES + len);
            let (h, p) = decode(&out).unwrap();
            assert_eq!(h, header());
            assert_eq!(p, &payload[..]);
        }
    }

    #[test]
    fn every_malformed_datagram_is_refused_with_its_reason() {
        let mut good = Vec::new();
        encode(&header(), b"abcd", &mut good);
        assert_eq!(decode(&good[..39]), Err(DatagramError::Short(39)));
        let mut b = good.clone();
        b[0] = b'X';
        assert_eq!(decode(&b), Err(DatagramError::Magic));
        let mut b = good.clone();
        b[4] = 2;
        assert_eq!(decode(&b), Err(DatagramError::Version(2)));
        let mut b = good.clone();
        b[5] = 9;
        assert_eq!(decode(&b), Err(DatagramError::Kind(9)));
        assert_eq!(
            decode(&good[..good.len() - 1]),
            Err(DatagramError::Length { said: 4, got: 3 })
        );
        let mut b = Vec::new();
        encode(&Header { psn: 9, ..header() }, b"", &mut b);
        assert_eq!(decode(&b), Err(DatagramError::Psn { psn: 9, chunks: 9 }));
    }

    #[test]
    fn random_bytes_never_panic_the_decoder() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut buf = Vec::new();
        encode(&header(), &[1; 64], &mut buf);
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut b = buf.clone();
            b.truncate((x % (buf.len() as u64 + 1)) as usize);
            if !b.is_empty() {
                let i = (x >> 20) as usize % b.len();
                b[i] ^= (x >> 40) as u8;
            }
            let _ = decode(&b);
        }
    }
}
