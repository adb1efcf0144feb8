//! Staging memory of the staged collectives (Ibcast): buffers in this SP process that hold
//! chunks between a read from a host and the writes into hosts or the forwards to child SPs.
//!
//! A buffer is described by an [`AliasKey`] owned by this process (pid = this SP), so the
//! datapath workers and the inline mover move bytes between it and host buffers exactly as
//! they copy between hosts (with `cma`, one `process_vm_readv`/`writev` per copy). Staging is
//! bounded per SP ([`Budget`]): an instance reserves its buffers when it starts, and an
//! instance that does not fit is refused with an error, never allocated past the bound. No
//! size here comes from a user count: buffers are the configured chunk size.

use alias_mkey::{AliasKey, BackendData, Grant, Owner, Rights};
use std::cell::{Cell, RefCell};
use std::rc::Rc;

/// One staging buffer.
#[derive(Debug)]
pub struct Stage {
    buf: Box<[u8]>,
    key: AliasKey,
}

/// This process's start time, for the owner of its own keys.
fn my_start_time() -> u64 {
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *START.get_or_init(|| {
        alias_mkey::process::start_time(std::process::id()).expect("/proc/self/stat is readable")
    })
}

/// World rank used in the owner of staging keys (no host rank has it).
pub const STAGE_OWNER_RANK: u32 = u32::MAX;

impl Stage {
    pub fn new(job: u64, region: u64, len: usize) -> Stage {
        let buf = vec![0u8; len].into_boxed_slice();
        let key = AliasKey {
            owner: Owner {
                job,
                world_rank: STAGE_OWNER_RANK,
                pid: std::process::id(),
                start: my_start_time(),
                // SAFETY: geteuid/getegid have no preconditions.
                uid: unsafe { libc::geteuid() },
                gid: unsafe { libc::getegid() },
            },
            grant: Grant {
                region,
                generation: 0,
                addr: buf.as_ptr() as u64,
                len: len as u64,
                rights: Rights::READ_WRITE,
                backend: BackendData::Cma,
            },
        };
        Stage { buf, key }
    }

    pub fn key(&self) -> &AliasKey {
        &self.key
    }

    /// The first `len` bytes (to send to another SP once a read into them finished).
    pub fn bytes(&self, len: usize) -> &[u8] {
        &self.buf[..len.min(self.buf.len())]
    }

    /// Fills the buffer from `data` (a chunk received from another SP); false if it does not
    /// fit.
    pub fn fill(&mut self, data: &[u8]) -> bool {
        match self.buf.get_mut(..data.len()) {
            Some(dst) => {
                dst.copy_from_slice(data);
                true
            }
            None => false,
        }
    }
}

/// The staging of one instance: its slots, reserved from the SP's [`Budget`] and given back
/// when the set is dropped (with the instance): the bytes to the bound, the buffers to the
/// pool the next instance takes them from (a fresh buffer costs a page fault per page).
pub struct StageSet {
    pub slots: Vec<Stage>,
    bytes: u64,
    used: Rc<Cell<u64>>,
    pool: Rc<RefCell<Vec<Stage>>>,
}

impl Drop for StageSet {
    fn drop(&mut self) {
        self.used.set(self.used.get().saturating_sub(self.bytes));
        self.pool.borrow_mut().append(&mut self.slots);
    }
}

/// The bound on an SP's staging memory.
#[derive(Debug)]
pub struct Budget {
    limit: u64,
    used: Rc<Cell<u64>>,
    /// Buffers given back, for reuse (never more than `peak` bytes with those in use).
    pool: Rc<RefCell<Vec<Stage>>>,
    /// Most bytes reserved at once.
    pub peak: u64,
    next_region: u64,
}

impl Budget {
    pub fn new(limit: u64) -> Budget {
        Budget {
            limit,
            used: Rc::new(Cell::new(0)),
            pool: Rc::new(RefCell::new(Vec::new())),
            peak: 0,
            next_region: 1,
        }
    }

    /// `slots` buffers of `chunk` bytes for an instance of `job`, or why not.
    pub fn reserve(&mut self, job: u64, slots: u32, chunk: u64) -> Result<StageSet, String> {
        let bytes = chunk.checked_mul(slots as u64);
        match bytes.and_then(|b| self.used.get().checked_add(b).map(|n| (b, n))) {
            Some((b, n)) if n <= self.limit => {
                self.used.set(n);
                self.peak = self.peak.max(n);
                let mut pool = self.pool.borrow_mut();
                let slots = (0..slots)
                    .map(
                        |_| match pool.iter().position(|s| s.buf.len() as u64 == chunk) {
                            Some(i) => {
                                let mut s = pool.swap_remove(i);
                                s.key.owner.job = job;
                                s
                            }
                            None => {
                                self.next_region += 1;
                                Stage::new(job, self.next_region, chunk as usize)
                            }
                        },
                    )
                    .collect();
                Ok(StageSet {
                    slots,
                    bytes: b,
                    used: self.used.clone(),
                    pool: self.pool.clone(),
                })
            }
            _ => Err(format!(
                "staging memory exhausted: {} of {} bytes in use, {slots} x {chunk} more needed \
                 (raise --staging-mib, or have fewer staged collectives outstanding)",
                self.used.get(),
                self.limit
            )),
        }
    }

    pub fn used(&self) -> u64 {
        self.used.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_refuses_past_the_limit_and_gives_back_on_drop() {
        let mut b = Budget::new(100);
        let a = b.reserve(1, 3, 20).unwrap();
        assert_eq!(a.slots.len(), 3);
        let e = b.reserve(1, 2, 21).err().unwrap();
        assert!(e.contains("60 of 100"), "{e}");
        let c = b.reserve(1, 2, 20).unwrap();
        assert_eq!(b.used(), 100);
        let a_addr = a.slots[0].key().grant.addr;
        drop(a);
        assert_eq!(b.used(), 40);
        assert_eq!(b.peak, 100);
        // The next instance reuses a buffer given back, named for its own job.
        let d = b.reserve(9, 1, 20).unwrap();
        assert_eq!(d.slots[0].key().grant.addr, a_addr);
        assert_eq!(d.slots[0].key().owner.job, 9);
        drop(d);
        assert!(b.reserve(1, u32::MAX, u64::MAX).is_err());
        drop(c);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn a_stage_key_names_this_process_and_its_own_bytes() {
        let mut s = Stage::new(7, 1, 64);
        assert_eq!(s.key().owner.pid, std::process::id());
        assert_eq!(s.key().grant.len, 64);
        assert!(s.fill(&[1, 2, 3]));
        assert_eq!(s.bytes(3), &[1, 2, 3]);
        assert!(!s.fill(&[0; 65]));
    }
}
