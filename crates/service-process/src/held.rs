//! The SP memory the posts of a rank, a job and a user hold (issue 24, item 4): a post's
//! descriptor and the instance state it creates grow with its communicator (per member: the
//! block vectors, the per-rank states, an announcement to each rank), so a bound on the number
//! of posts alone lets one connection make the SP hold gigabytes. Each accepted post takes a
//! [`Hold`] of its estimated bytes ([`post_bytes`]) from a [`Ledger`], counted against its
//! connection, its job and its uid; the hold lives with the instance and gives its bytes back
//! when the instance is dropped. A post whose hold would pass a limit is refused.

use bootstrap::wire::PostDesc;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// Bytes a post is charged whatever its size (the instance, its maps, the post's grants).
pub const POST_BASE_BYTES: u64 = 4096;
/// The bytes `d` makes the SP hold, estimated from above: its vectors (kept by the instance)
/// and the state per member it creates (its kind's `KindSpec::state_bytes_per_member`: an
/// alltoallv's is 512, about 450 bytes per member in all were measured).
/// `chunk_bytes` is the SP's chunk (`serve --stage-chunk-bytes`), for the kinds that hold data
/// buffers of their own (`KindSpec::data_bytes`: the allreduces' windows of chunks).
pub fn post_bytes(d: &PostDesc, chunk_bytes: u64) -> u64 {
    let p = d.members.len() as u64;
    let words = [
        &d.send_counts,
        &d.send_displs,
        &d.recv_counts,
        &d.recv_displs,
    ]
    .iter()
    .map(|v| v.len() as u64)
    .sum::<u64>();
    let small = (d.members.len() + d.world_ranks.len() + d.nodes.len()) as u64;
    let spec = crate::drivers::spec(d.kind);
    POST_BASE_BYTES
        + 8 * words
        + 4 * small
        + spec.state_bytes_per_member * p
        + (spec.data_bytes)(d, chunk_bytes)
}

/// The limits, in bytes.
#[derive(Clone, Copy, Debug)]
pub struct HeldLimits {
    pub per_rank: u64,
    pub per_job: u64,
    pub per_uid: u64,
}

impl Default for HeldLimits {
    fn default() -> Self {
        HeldLimits {
            per_rank: 128 << 20,
            per_job: 1 << 30,
            per_uid: 2 << 30,
        }
    }
}

#[derive(Default, Debug)]
struct Counts {
    /// Connection serials and uids are the SP's and the kernel's: foldhash (the job ids a
    /// launcher picks keep SipHash; see `server::SpMap`).
    by_conn: foldhash::HashMap<u64, u64>,
    by_job: HashMap<u64, u64>,
    by_uid: foldhash::HashMap<u32, u64>,
    total: u64,
    /// Bytes given back since the allocator was last asked to return free memory.
    released: u64,
}

impl Counts {
    fn add(&mut self, conn: u64, job: u64, uid: u32, bytes: u64) {
        *self.by_conn.entry(conn).or_default() += bytes;
        *self.by_job.entry(job).or_default() += bytes;
        *self.by_uid.entry(uid).or_default() += bytes;
        self.total += bytes;
    }

    fn remove(&mut self, conn: u64, job: u64, uid: u32, bytes: u64) {
        fn take<K: std::hash::Hash + Eq, S: std::hash::BuildHasher>(
            m: &mut HashMap<K, u64, S>,
            k: K,
            bytes: u64,
        ) {
            if let Some(v) = m.get_mut(&k) {
                *v = v.saturating_sub(bytes);
                if *v == 0 {
                    m.remove(&k);
                }
            }
        }
        take(&mut self.by_conn, conn, bytes);
        take(&mut self.by_job, job, bytes);
        take(&mut self.by_uid, uid, bytes);
        self.total = self.total.saturating_sub(bytes);
        self.released += bytes;
    }
}

/// The bytes held, by connection, job and uid.
#[derive(Debug)]
pub struct Ledger {
    limits: HeldLimits,
    counts: Rc<RefCell<Counts>>,
}

/// Bytes one post holds; given back when dropped (with its instance).
#[derive(Debug)]
pub struct Hold {
    conn: u64,
    job: u64,
    uid: u32,
    bytes: u64,
    counts: Rc<RefCell<Counts>>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.counts
            .borrow_mut()
            .remove(self.conn, self.job, self.uid, self.bytes);
    }
}

impl Ledger {
    pub fn new(limits: HeldLimits) -> Ledger {
        Ledger {
            limits,
            counts: Rc::default(),
        }
    }

    /// `bytes` more for connection `conn` (its serial) of `job`, run by `uid`; or why not (a
    /// line for the client).
    pub fn take(&self, conn: u64, job: u64, uid: u32, bytes: u64) -> Result<Hold, String> {
        let mut c = self.counts.borrow_mut();
        let l = &self.limits;
        let checks = [
            (
                c.by_conn.get(&conn).copied().unwrap_or(0),
                l.per_rank,
                "this rank's posts",
                "--max-held-mib-per-rank",
            ),
            (
                c.by_job.get(&job).copied().unwrap_or(0),
                l.per_job,
                "this job's posts",
                "--max-held-mib-per-job",
            ),
            (
                c.by_uid.get(&uid).copied().unwrap_or(0),
                l.per_uid,
                "the posts of this job's user",
                "--max-held-mib-per-uid",
            ),
        ];
        for (held, limit, whose, flag) in checks {
            if held.saturating_add(bytes) > limit {
                return Err(format!(
                    "{whose} hold {held} bytes of this SP's memory and this post needs {bytes} \
                     more (a communicator of many ranks takes more): limit {limit} (serve \
                     {flag}); wait for earlier collectives to complete"
                ));
            }
        }
        c.add(conn, job, uid, bytes);
        Ok(Hold {
            conn,
            job,
            uid,
            bytes,
            counts: self.counts.clone(),
        })
    }

    /// Bytes held by every post.
    pub fn total(&self) -> u64 {
        self.counts.borrow().total
    }

    /// Whether `threshold` bytes or more were given back since this last said so.
    pub fn released_over(&self, threshold: u64) -> bool {
        let mut c = self.counts.borrow_mut();
        let over = c.released >= threshold;
        if over {
            c.released = 0;
        }
        over
    }
}

/// Asks the allocator to return the free memory it keeps to the system (glibc's malloc keeps
/// freed memory in its arenas; without this an SP's resident size stays at its peak after the
/// posts that made it are gone).
pub fn give_back_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions; it only walks the allocator's own state.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_are_bounded_per_connection_job_and_uid_and_given_back() {
        let l = Ledger::new(HeldLimits {
            per_rank: 100,
            per_job: 150,
            per_uid: 200,
        });
        let a = l.take(1, 10, 7, 60).unwrap();
        let e = l.take(1, 10, 7, 41).unwrap_err();
        assert!(e.contains("--max-held-mib-per-rank"), "{e}");
        // Another connection of the job: the job's limit.
        let b = l.take(2, 10, 7, 80).unwrap();
        let e = l.take(3, 10, 7, 20).unwrap_err();
        assert!(e.contains("--max-held-mib-per-job"), "{e}");
        // Another job of the user: the user's limit.
        let e = l.take(4, 11, 7, 61).unwrap_err();
        assert!(e.contains("--max-held-mib-per-uid"), "{e}");
        // Another user is not affected.
        let c = l.take(5, 12, 8, 100).unwrap();
        assert_eq!(l.total(), 240);
        drop(a);
        assert!(l.take(1, 10, 7, 41).is_ok());
        drop((b, c));
        assert_eq!(l.total(), 0);
        assert!(!l.released_over(240 + 42));
        assert!(l.released_over(240 + 41));
        assert!(!l.released_over(1));
        assert!(l.counts.borrow().by_conn.is_empty());
    }

    #[test]
    fn a_post_is_charged_by_its_communicator() {
        let g = alias_mkey::Grant {
            region: 1,
            generation: 0,
            addr: 0x1000,
            len: 16,
            rights: alias_mkey::Rights::READ_WRITE,
            backend: alias_mkey::BackendData::Cma,
        };
        let post = |p: usize| PostDesc {
            kind: bootstrap::wire::CollKind::Alltoallv,
            comm: algorithms::CommId { leader: 0, id: 1 },
            seq: 0,
            comm_rank: 0,
            world_ranks: (0..p as u32).collect(),
            members: vec![0; p],
            nodes: vec![],
            slot: None,
            token: 0,
            send: g.clone(),
            recv: g.clone(),
            send_counts: vec![0; p],
            send_displs: vec![0; p],
            recv_counts: vec![0; p],
            recv_displs: vec![0; p],
            host_copies: false,
            send_packed: false,
            recv_packed: false,
            reduce: None,
            stamps: Default::default(),
            staged: None,
        };
        assert!(post_bytes(&post(2), 1 << 20) < 8192);
        assert_eq!(post_bytes(&post(4096), 1 << 20), 4096 + 4096 * (512 + 40));

        // The allreduces hold a window of chunks of data: charged by their length, their
        // chunk and (the SP tree) the children an SP can have among the members' SPs.
        let reduce = |kind, len: u64, sps: u32| {
            let mut d = post(1);
            d.kind = kind;
            d.send_counts = vec![len];
            d.recv_counts = vec![len];
            d.members = (0..8).map(|r| r % sps).collect();
            d
        };
        let tree = bootstrap::wire::CollKind::Allreduce;
        let canary = bootstrap::wire::CollKind::CanaryAllreduce;
        let small = post_bytes(&reduce(tree, 64, 4), 1 << 20);
        assert!(small < 8192, "{small}");
        let mib = 1u64 << 20;
        // 4 MiB in 1 MiB chunks: the whole window of 4, each a read, a result and 2 children
        // (4 SPs).
        let big = post_bytes(&reduce(tree, 4 * mib, 4), mib);
        assert!(big >= 4 * mib * 4 && big < 4 * mib * 4 + 65536, "{big}");
        // 1 GiB: still the window only; 256 KiB chunks hold a quarter.
        let huge = post_bytes(&reduce(tree, 1 << 30, 4), mib);
        assert!(huge < big + 65536, "{huge}");
        let quarter = post_bytes(&reduce(tree, 1 << 30, 4), mib / 4);
        assert!(quarter >= 4 * mib && quarter < 4 * mib + 65536, "{quarter}");
        // One SP: no children.
        let alone = post_bytes(&reduce(tree, 4 * mib, 1), mib);
        assert!(alone >= 8 * mib && alone < 8 * mib + 65536, "{alone}");
        let c = post_bytes(&reduce(canary, 4 * mib, 4), mib);
        assert!(c >= 20 * mib && c < 20 * mib + 65536, "{c}");
        // An unchecked descriptor without a length counts as the largest.
        let mut none = reduce(tree, 0, 4);
        none.send_counts.clear();
        assert!(post_bytes(&none, mib) >= 16 * mib);
    }
}
