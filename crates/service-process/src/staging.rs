//! Staging memory of the staged collectives (Ibcast): buffers in this SP process that hold
//! chunks between a read from a host and the writes into hosts or the forwards to child SPs.
//!
//! A buffer is described by an [`AliasKey`] owned by this process (pid = this SP), so the
//! datapath workers and the inline mover move bytes between it and host buffers exactly as
//! they copy between hosts (with `cma`, one `process_vm_readv`/`writev` per copy). Staging is
//! bounded per SP ([`Budget`]): an instance reserves its buffers when it starts, and an
//! instance that does not fit is refused with an error, never allocated past the bound. No
//! size here comes from a user count: buffers are the configured chunk size. One job, and the
//! jobs of one user, may hold only a share of the bound ([`Shares`]): a job that holds
//! collectives open cannot make every other job's staged collectives fail.

use alias_mkey::copy::BounceBuf;
use alias_mkey::{AliasKey, BackendData, Grant, Owner, Rights};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

/// One staging buffer.
#[derive(Debug)]
pub struct Stage {
    /// The slot is `len` bytes from `off` (below 64) of a page-aligned buffer.
    buf: BounceBuf,
    len: usize,
    off: usize,
    key: AliasKey,
}

/// Where a slot starts past its page unless its instance says otherwise
/// ([`StageSet::place_near`]): where glibc's `malloc` puts a large buffer (past its 16-byte
/// header, in pages of its own). A kernel copy between a slot and a rank's buffer is a slow
/// one when their offsets in a cache line differ by 1-31 bytes the wrong way
/// ([`alias_mkey::copy`]; the mover then bounces it); a copy between a slot and memory of this
/// process (a rank's arena) does not care.
const SLOT_OFFSET: usize = 16;

/// This process's pid, start time, effective uid and gid, for the owner of its own keys: read
/// once (none of them changes in an SP; each read is a system call, and keys are made per
/// post).
fn me() -> (u32, u64, u32, u32) {
    static ME: std::sync::OnceLock<(u32, u64, u32, u32)> = std::sync::OnceLock::new();
    *ME.get_or_init(|| {
        let pid = std::process::id();
        let start = alias_mkey::process::start_time(pid).expect("/proc/self/stat is readable");
        // SAFETY: geteuid/getegid have no preconditions.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        (pid, start, uid, gid)
    })
}

/// World rank used in the owner of staging keys (no host rank has it).
pub const STAGE_OWNER_RANK: u32 = u32::MAX;

/// A key of this SP process's own memory `[addr, addr + len)` (owner rank
/// [`STAGE_OWNER_RANK`], this pid): a staging buffer, or its mapping of a rank's arena. The
/// caller keeps the memory mapped while the key is used.
pub fn own_key(job: u64, region: u64, addr: u64, len: u64, rights: Rights) -> AliasKey {
    let (pid, start, uid, gid) = me();
    AliasKey {
        owner: Owner {
            job,
            world_rank: STAGE_OWNER_RANK,
            pid,
            start,
            uid,
            gid,
        },
        grant: Grant {
            region,
            generation: 0,
            addr,
            len,
            rights,
            backend: BackendData::Cma,
        },
    }
}

/// Whether `k` is a key of this process's own memory ([`own_key`]).
pub fn is_own(k: &AliasKey) -> bool {
    let (pid, start, _, _) = me();
    k.owner.world_rank == STAGE_OWNER_RANK && k.owner.pid == pid && k.owner.start == start
}

impl Stage {
    pub fn new(job: u64, region: u64, len: usize) -> Stage {
        let buf = BounceBuf::new(len);
        let key = own_key(job, region, 0, len as u64, Rights::READ_WRITE);
        let mut s = Stage {
            buf,
            len,
            off: usize::MAX,
            key,
        };
        s.place(SLOT_OFFSET);
        s
    }

    /// Starts the slot `off` (below 64) bytes past its page, its key with it.
    fn place(&mut self, off: usize) {
        if off != self.off {
            self.key.grant.addr = self.buf.at(off, self.len).as_ptr() as u64;
            self.off = off;
        }
    }

    pub fn key(&self) -> &AliasKey {
        &self.key
    }

    /// The first `len` bytes (to send to another SP once a read into them finished).
    pub fn bytes(&self, len: usize) -> &[u8] {
        self.buf.get(self.off, len.min(self.len))
    }

    /// Fills the buffer from `data` (a chunk received from another SP); false if it does not
    /// fit.
    pub fn fill(&mut self, data: &[u8]) -> bool {
        if data.len() > self.len {
            return false;
        }
        alias_mkey::copy::copy_slice(data, self.buf.at(self.off, data.len()));
        true
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
    /// Whose share the bytes count against: the job, and its uid when known here.
    owner: (u64, Option<u32>),
    by_owner: Rc<RefCell<ByOwner>>,
}

impl StageSet {
    /// Starts every slot at the same offset in its cache line as `addr` (a buffer of a rank
    /// the instance copies to or from), so that those kernel copies are not slow ones
    /// ([`alias_mkey::copy`]). Only before any slot is used: a slot's key moves with it.
    pub fn place_near(&mut self, addr: u64) {
        for s in &mut self.slots {
            s.place((addr % 64) as usize);
        }
    }
}

impl Drop for StageSet {
    fn drop(&mut self) {
        self.used.set(self.used.get().saturating_sub(self.bytes));
        self.pool.borrow_mut().append(&mut self.slots);
        self.by_owner.borrow_mut().sub(self.owner, self.bytes);
    }
}

/// The shares of one job and of one uid's jobs together, in percent of the bound.
#[derive(Clone, Copy, Debug)]
pub struct Shares {
    pub job_percent: u64,
    pub uid_percent: u64,
}

impl Default for Shares {
    /// Half for a job (two jobs always fit), three quarters for a user's jobs (another user
    /// always finds a quarter).
    fn default() -> Self {
        Shares {
            job_percent: 50,
            uid_percent: 75,
        }
    }
}

/// Staging bytes in use by job and by uid.
#[derive(Debug, Default)]
struct ByOwner {
    job: HashMap<u64, u64>,
    uid: HashMap<u32, u64>,
}

impl ByOwner {
    fn add(&mut self, (job, uid): (u64, Option<u32>), b: u64) {
        *self.job.entry(job).or_default() += b;
        if let Some(u) = uid {
            *self.uid.entry(u).or_default() += b;
        }
    }

    fn sub(&mut self, (job, uid): (u64, Option<u32>), b: u64) {
        fn take<K: std::hash::Hash + Eq>(m: &mut HashMap<K, u64>, k: K, b: u64) {
            if let Some(v) = m.get_mut(&k) {
                *v = v.saturating_sub(b);
                if *v == 0 {
                    m.remove(&k);
                }
            }
        }
        take(&mut self.job, job, b);
        if let Some(u) = uid {
            take(&mut self.uid, u, b);
        }
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
    shares: Shares,
    by_owner: Rc<RefCell<ByOwner>>,
}

impl Budget {
    pub fn new(limit: u64) -> Budget {
        Self::with_shares(limit, Shares::default())
    }

    pub fn with_shares(limit: u64, shares: Shares) -> Budget {
        Budget {
            limit,
            used: Rc::new(Cell::new(0)),
            pool: Rc::new(RefCell::new(Vec::new())),
            peak: 0,
            next_region: 1,
            shares,
            by_owner: Rc::default(),
        }
    }

    /// Whether `b` more bytes for `job` (of `uid`, when known here) stay inside their shares;
    /// if not, why.
    fn share_refusal(&self, job: u64, uid: Option<u32>, b: u64) -> Option<String> {
        let by = self.by_owner.borrow();
        let share = |percent: u64| (self.limit as u128 * percent.min(100) as u128 / 100) as u64;
        let job_held = by.job.get(&job).copied().unwrap_or(0);
        let job_share = share(self.shares.job_percent);
        // A share of 100 % is the bound itself, which `reserve` checks.
        if self.shares.job_percent < 100 && job_held.saturating_add(b) > job_share {
            return Some(format!(
                "this job's share of the staging memory is exhausted: it holds {job_held} of \
                 its {job_share} bytes ({}% of {}, serve --staging-job-share), {b} more \
                 needed (have fewer staged collectives outstanding)",
                self.shares.job_percent, self.limit
            ));
        }
        let uid_held = uid.and_then(|u| by.uid.get(&u).copied()).unwrap_or(0);
        let uid_share = share(self.shares.uid_percent);
        if self.shares.uid_percent < 100 && uid.is_some() && uid_held.saturating_add(b) > uid_share
        {
            return Some(format!(
                "the share of the staging memory of this job's user is exhausted: its jobs \
                 hold {uid_held} of its {uid_share} bytes ({}% of {}, serve \
                 --staging-uid-share), {b} more needed",
                self.shares.uid_percent, self.limit
            ));
        }
        None
    }

    /// `slots` buffers of `chunk` bytes for an instance of `job` (run by `uid`, if a rank of
    /// the job is connected here), or why not.
    pub fn reserve(
        &mut self,
        job: u64,
        uid: Option<u32>,
        slots: u32,
        chunk: u64,
    ) -> Result<StageSet, String> {
        let bytes = chunk.checked_mul(slots as u64);
        if let Some(why) = bytes.and_then(|b| self.share_refusal(job, uid, b)) {
            return Err(why);
        }
        match bytes.and_then(|b| self.used.get().checked_add(b).map(|n| (b, n))) {
            Some((b, n)) if n <= self.limit => {
                self.used.set(n);
                self.peak = self.peak.max(n);
                let mut pool = self.pool.borrow_mut();
                let slots = (0..slots)
                    .map(|_| match pool.iter().position(|s| s.len as u64 == chunk) {
                        Some(i) => {
                            let mut s = pool.swap_remove(i);
                            s.key.owner.job = job;
                            // Where a slot starts unless its instance places it
                            // (`StageSet::place_near`), not where the last one put it.
                            s.place(SLOT_OFFSET);
                            s
                        }
                        None => {
                            self.next_region += 1;
                            Stage::new(job, self.next_region, chunk as usize)
                        }
                    })
                    .collect();
                self.by_owner.borrow_mut().add((job, uid), b);
                Ok(StageSet {
                    slots,
                    bytes: b,
                    used: self.used.clone(),
                    pool: self.pool.clone(),
                    owner: (job, uid),
                    by_owner: self.by_owner.clone(),
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
        let all = Shares {
            job_percent: 100,
            uid_percent: 100,
        };
        let mut b = Budget::with_shares(100, all);
        let a = b.reserve(1, None, 3, 20).unwrap();
        assert_eq!(a.slots.len(), 3);
        let e = b.reserve(1, None, 2, 21).err().unwrap();
        assert!(e.contains("60 of 100"), "{e}");
        let c = b.reserve(1, None, 2, 20).unwrap();
        assert_eq!(b.used(), 100);
        let a_addr = a.slots[0].key().grant.addr;
        drop(a);
        assert_eq!(b.used(), 40);
        assert_eq!(b.peak, 100);
        // The next instance reuses a buffer given back, named for its own job.
        let d = b.reserve(9, None, 1, 20).unwrap();
        assert_eq!(d.slots[0].key().grant.addr, a_addr);
        assert_eq!(d.slots[0].key().owner.job, 9);
        // Placed near a rank's buffer, then given back: the next instance gets it where a slot
        // starts by default, not where this one put it.
        let mut d = d;
        d.place_near(4096 * 5 + 40);
        assert_eq!(d.slots[0].key().grant.addr, (a_addr & !4095) + 40);
        drop(d);
        // Every buffer in the pool (a's three, the placed one among them).
        let f = b.reserve(9, None, 3, 20).unwrap();
        assert!(f.slots.iter().any(|s| s.key().grant.addr == a_addr));
        assert!(f
            .slots
            .iter()
            .all(|s| s.key().grant.addr % 4096 == SLOT_OFFSET as u64));
        drop(f);
        assert!(b.reserve(1, None, u32::MAX, u64::MAX).is_err());
        drop(c);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn a_job_and_a_user_hold_only_their_share() {
        let mut b = Budget::new(100);
        // Job 1 of uid 7: half.
        let a: Vec<StageSet> = (0..5)
            .map(|_| b.reserve(1, Some(7), 1, 10).unwrap())
            .collect();
        let e = b.reserve(1, Some(7), 1, 10).err().unwrap();
        assert!(
            e.contains("--staging-job-share") && e.contains("50 of its 50"),
            "{e}"
        );
        // Job 2 of uid 7: the user's three quarters.
        let c: Vec<StageSet> = (0..2)
            .map(|_| b.reserve(2, Some(7), 1, 10).unwrap())
            .collect();
        let e = b.reserve(2, Some(7), 1, 10).err().unwrap();
        assert!(e.contains("--staging-uid-share"), "{e}");
        // Another user's job still finds room.
        let d = b.reserve(3, Some(8), 2, 10).unwrap();
        drop(a);
        assert!(b.reserve(1, Some(7), 5, 10).is_ok());
        drop((c, d));
        assert_eq!(b.used(), 0);
        assert!(b.by_owner.borrow().job.is_empty() && b.by_owner.borrow().uid.is_empty());
    }

    #[test]
    fn a_stage_key_names_this_process_and_its_own_bytes() {
        let mut s = Stage::new(7, 1, 64);
        assert_eq!(s.key().owner.pid, std::process::id());
        assert_eq!(s.key().grant.len, 64);
        // Where glibc puts a large buffer: 16 bytes past a page.
        assert_eq!(s.key().grant.addr % 4096, SLOT_OFFSET as u64);
        // Placed near another buffer: at its offset in a cache line, same page, same bytes.
        let page = s.key().grant.addr & !4095;
        s.place(45);
        assert_eq!(s.key().grant.addr, page + 45);
        assert!(s.fill(&[1, 2, 3]));
        assert_eq!(s.bytes(3), &[1, 2, 3]);
        // The key's address is where `fill` writes.
        // SAFETY: the key names the slot's 64 bytes, alive with `s`.
        let at = unsafe { std::slice::from_raw_parts(s.key().grant.addr as *const u8, 3) };
        assert_eq!(at, &[1, 2, 3]);
        assert!(!s.fill(&[0; 65]));
    }
}
