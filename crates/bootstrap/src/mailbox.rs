//! The completion mailbox: a small region each host rank grants its SP for completion flags.
//!
//! It is an array of [`SLOT_BYTES`]-byte slots (one cache line). Slot `i` holds, at offset 0, the
//! `u64` token of the request that owns the slot; at offset 8, a `u32` status ([`STATUS_OK`] or
//! an error); at offset 12, a `u32`, the copies the SP made for the call; at offset 16, the SP's
//! five stamps of the call (`crate::stamps::SpStamps`, `u64` each). The SP writes status, copies
//! and stamps first (one write) and the token second; the host polls
//! the token with an acquire load and reads the status only once the token equals the one it
//! posted. Tokens increase per rank, so a token never repeats in a slot and a torn write of the
//! token can never equal the awaited value before it is whole.

use algorithms::Status;

pub const SLOT_BYTES: u64 = 64;
pub const TOKEN_OFFSET: u64 = 0;
pub const STATUS_OFFSET: u64 = 8;
pub const COPIES_OFFSET: u64 = 12;
pub const STAMPS_OFFSET: u64 = 16;
/// Default number of slots: requests a rank can have outstanding at its SP at once.
pub const DEFAULT_SLOTS: u32 = 1024;
/// Most slots a rank may ask for (`SPOFF_MAILBOX_SLOTS`).
pub const MAX_SLOTS: u32 = 1 << 16;

pub const STATUS_OK: u32 = 0;
pub const STATUS_INTERNAL: u32 = 100;

pub fn slot_offset(slot: u32) -> u64 {
    slot as u64 * SLOT_BYTES
}

/// The code written in the mailbox for a collective's result.
pub fn status_code(s: Status) -> u32 {
    match s {
        Status::Ok => STATUS_OK,
        Status::CountMismatch => 1,
        Status::AccessError => 2,
        Status::PeerFailed => 3,
        Status::RankFailed => 4,
        Status::Aborted => 5,
        Status::InvalidPost => 6,
        Status::NetworkFailed => 7,
    }
}

/// A person-readable name for a mailbox status code.
pub fn status_name(code: u32) -> &'static str {
    match code {
        STATUS_OK => "ok",
        1 => "count mismatch between sender and receiver",
        2 => "memory access refused or failed",
        3 => "a peer service process failed",
        4 => "a rank of the communicator failed",
        5 => "aborted",
        6 => "invalid descriptor",
        7 => "the in-network aggregation failed (switches unreachable or a block given up)",
        STATUS_INTERNAL => "internal service-process error",
        _ => "unknown status",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_named() {
        let all = [
            Status::Ok,
            Status::CountMismatch,
            Status::AccessError,
            Status::PeerFailed,
            Status::RankFailed,
            Status::Aborted,
            Status::InvalidPost,
            Status::NetworkFailed,
        ];
        let mut codes: Vec<u32> = all.iter().map(|s| status_code(*s)).collect();
        codes.sort();
        codes.dedup();
        assert_eq!(codes.len(), all.len());
        assert!(codes.iter().all(|c| status_name(*c) != "unknown status"));
    }
}
