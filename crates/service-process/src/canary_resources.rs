//! The in-network family's resources (issue 27): this SP's Canary data path
//! ([`crate::canary_plane::Plane`], its socket on the link to its leaf switch, named by the
//! cluster description's `canary` fabric) and the Canary allreduces its instances run on it.
//!
//! The Canary allreduce's driver (`drivers::canary_allreduce`) hands each chunk its SP
//! reduced out as a [`Contribute`] request; the chunk becomes one Canary allreduce here:
//! - its id ([`coll_id`]) is a hash of the instance's key and the chunk, the same on every SP
//!   of the instance; an id already running here for another chunk fails the instance
//!   rather than mixing the two;
//! - its tag ([`job_tag`]) is a MAC of the job under the cluster key: a host outside the
//!   cluster cannot forge a packet the members take, and a job's packets never aggregate
//!   into another job's;
//! - its members are the instance's SPs in the driver's order, by their Canary addresses; an
//!   SP of the instance without a link fails the instance with the reason;
//! - one SP alone, or an empty chunk, needs no network: the result is the contribution.
//!
//! The chunk's end (the reduced bytes, or why the Canary machines gave up) comes back as a
//! [`Ended`] event. An instance released while its chunks run has them dropped from the plane
//! (nothing of them is sent after); chunks that ended linger there
//! ([`crate::canary_plane::PlaneConfig::linger`]) to answer the other members' retransmission
//! requests as their blocks' leader.

use std::collections::{HashMap, VecDeque};
use std::net::UdpSocket;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use algorithms::allreduce::Reduce;
use algorithms::canary::HostConfig;
use algorithms::{CollKey, SpId};
use bootstrap::auth::ClusterKey;
use bootstrap::cluster::{CanaryFabric, CanaryParams};
use bootstrap::kinds::Family;
use bootstrap::Cluster;

use crate::canary_plane::{Plane, PlaneConfig, PlaneEvent};
use crate::drivers::resources::{Cx, Payload, Resources};

/// A chunk this SP reduced, to combine with every other SP's of the instance.
pub struct Contribute {
    pub chunk: u32,
    /// The instance's SPs, in the order every SP of it uses (`allreduce::tree_sps`).
    pub sps: Vec<SpId>,
    /// This SP's position in `sps`.
    pub me: usize,
    pub reduce: Reduce,
    pub data: Vec<u8>,
}

/// How a contributed chunk ended: its result, or why it failed.
pub struct Ended {
    pub chunk: u32,
    pub result: Result<Vec<u8>, String>,
}

/// The Canary id of chunk `chunk` of instance `ck` (FNV-1a over the key's fields and the
/// chunk): the same on every SP.
pub fn coll_id(ck: CollKey, chunk: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in ck
        .job
        .to_le_bytes()
        .into_iter()
        .chain(ck.comm.leader.to_le_bytes())
        .chain(ck.comm.id.to_le_bytes())
        .chain(ck.seq.to_le_bytes())
        .chain(chunk.to_le_bytes())
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h ^ (h >> 32)) as u32
}

/// The Canary tag of job `job`'s packets: a MAC of the job under the cluster key.
pub fn job_tag(key: &ClusterKey, job: u64) -> u64 {
    let t = key.mac("spoff canary tag v1", &[&job.to_le_bytes()]);
    u64::from_le_bytes(t[..8].try_into().expect("a MAC is longer than 8 bytes"))
}

/// See the module docs.
pub struct CanaryResources {
    plane: Plane,
    fabric: CanaryFabric,
    key: ClusterKey,
    wake: Arc<mio::Waker>,
    /// Canary ids running here, to their instance and chunk.
    running: HashMap<u32, (CollKey, u32)>,
    /// Ends that needed no network, delivered at the next poll.
    ready: VecDeque<(CollKey, Ended)>,
    started: u64,
    local: u64,
    done: u64,
    failed: u64,
    id_clashes: u64,
}

impl CanaryResources {
    /// Opens SP `me`'s Canary link of `cluster` (`Err`: why this SP runs no Canary
    /// allreduce), waking the SP's loop with `wake`. `opened`: the link's socket, opened
    /// earlier ([`open_early`]: a link in a network namespace), or why it could not be.
    pub fn open(
        me: SpId,
        cluster: &Cluster,
        key: &ClusterKey,
        wake: Arc<mio::Waker>,
        opened: Option<Result<UdpSocket, String>>,
    ) -> Result<CanaryResources, String> {
        let fabric = cluster
            .canary
            .clone()
            .ok_or("the cluster description names no Canary switches")?;
        let link = fabric
            .link(me)
            .ok_or_else(|| format!("the cluster's Canary fabric has no link for SP {me}"))?
            .clone();
        let sock = match (opened, &link.netns) {
            (Some(s), _) => s?,
            (None, Some(ns)) => {
                return Err(format!(
                    "the Canary link of SP {me} is in network namespace {ns}, which this SP \
                     did not enter at start (serve --sp-id N, as root)"
                ))
            }
            (None, None) => UdpSocket::bind(link.local)
                .map_err(|e| format!("cannot bind the Canary socket {}: {e}", link.local))?,
        };
        let cfg = PlaneConfig {
            local: link.local,
            leaf: link.leaf,
            linger: Duration::from_millis(fabric.params.linger_ms),
        };
        let plane = Plane::with_waker(sock, cfg, Some(wake.clone()))
            .map_err(|e| format!("cannot start the Canary data path: {e:#}"))?;
        Ok(CanaryResources {
            plane,
            fabric,
            key: key.clone(),
            wake,
            running: HashMap::new(),
            ready: VecDeque::new(),
            started: 0,
            local: 0,
            done: 0,
            failed: 0,
            id_clashes: 0,
        })
    }

    fn host_config(&self, ck: CollKey, c: &Contribute) -> Result<HostConfig, String> {
        let members = c
            .sps
            .iter()
            .map(|&sp| {
                self.fabric.link(sp).map(|l| l.addr).ok_or_else(|| {
                    format!("SP {sp} of the allreduce has no link to the Canary switches")
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let p: &CanaryParams = &self.fabric.params;
        let elem = c.reduce.elem.size();
        Ok(HostConfig {
            coll: coll_id(ck, c.chunk),
            tag: job_tag(&self.key, ck.job),
            reduce: c.reduce,
            members,
            me: c.me,
            len: c.data.len(),
            block_bytes: (p.block_bytes as usize / elem * elem).max(elem),
            window: p.window as usize,
            static_trees: p.static_trees,
            retx_timeout: p.retx_timeout_us * 1000,
            max_requests: p.max_requests,
            retx_backoff: p.retx_backoff,
            restart_holdoff: p.retx_timeout_us * 1000 * 2 / 3,
            max_attempts: p.max_attempts,
            wait_for_late: true,
        })
    }
}

/// SP `me`'s Canary socket if its link is in a network namespace (`None` otherwise, or
/// without a link): opened at start, before the SP drops the capability that entering a
/// namespace needs, on the calling thread (the SP has no other yet).
pub fn open_early(me: SpId, cluster: &Cluster) -> Option<Result<UdpSocket, String>> {
    let link = cluster.canary.as_ref()?.link(me)?;
    let ns = link.netns.as_ref()?;
    Some(
        crate::canary_netns::bind_in_here(ns, link.local).map_err(|e| {
            format!(
                "cannot open the Canary socket {} in {ns}: {e:#}",
                link.local
            )
        }),
    )
}

impl Resources for CanaryResources {
    fn family(&self) -> Family {
        Family::InNetwork
    }

    fn unavailable(&self) -> Option<String> {
        None
    }

    fn request(&mut self, ck: CollKey, req: Payload) -> Result<(), String> {
        let c = req
            .downcast::<Contribute>()
            .map_err(|_| "not a request of the in-network family".to_string())?;
        if c.me >= c.sps.len() {
            return Err(format!("position {} among {} SPs", c.me, c.sps.len()));
        }
        if c.sps.len() == 1 || c.data.is_empty() {
            self.local += 1;
            self.ready.push_back((
                ck,
                Ended {
                    chunk: c.chunk,
                    result: Ok(c.data),
                },
            ));
            let _ = self.wake.wake();
            return Ok(());
        }
        let cfg = self.host_config(ck, &c)?;
        if let Some(other) = self.running.get(&cfg.coll) {
            self.id_clashes += 1;
            return Err(format!(
                "Canary id {:#x} of chunk {} is in use by another allreduce here ({:?} chunk {})",
                cfg.coll, c.chunk, other.0, other.1
            ));
        }
        self.running.insert(cfg.coll, (ck, c.chunk));
        self.started += 1;
        self.plane.start(cfg, c.data);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<(CollKey, Payload)>) {
        while let Some((ck, e)) = self.ready.pop_front() {
            out.push((ck, Box::new(e)));
        }
        while let Some(ev) = self.plane.poll() {
            let (coll, result) = match ev {
                PlaneEvent::Done { coll, result } => (coll, Ok(result)),
                PlaneEvent::Failed { coll, why } => (coll, Err(why)),
            };
            // An allreduce of a released instance may still end: nobody waits for it.
            let Some((ck, chunk)) = self.running.remove(&coll) else {
                continue;
            };
            if result.is_ok() {
                self.done += 1;
            } else {
                self.failed += 1;
            }
            out.push((ck, Box::new(Ended { chunk, result })));
        }
    }

    fn release(&mut self, ck: CollKey, _cx: &mut Cx<'_>) {
        let gone: Vec<u32> = self
            .running
            .iter()
            .filter(|(_, (k, _))| *k == ck)
            .map(|(&c, _)| c)
            .collect();
        for coll in gone {
            self.running.remove(&coll);
            self.plane.forget(coll);
        }
        self.ready.retain(|(k, _)| *k != ck);
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let s = &self.plane.stats;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        vec![
            ("canary_started", self.started),
            ("canary_local", self.local),
            ("canary_done", self.done),
            ("canary_failed", self.failed),
            ("canary_id_clashes", self.id_clashes),
            ("canary_rx", get(&s.rx)),
            ("canary_tx", get(&s.tx)),
            ("canary_malformed", get(&s.malformed)),
            ("canary_early_kept", get(&s.early_kept)),
            ("canary_early_dropped", get(&s.early_dropped)),
            ("canary_send_errors", get(&s.send_errors)),
            ("canary_waits_sent", get(&s.waits_sent)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use algorithms::CommId;

    /// Ids differ between chunks, sequence numbers, communicators and jobs (no clash among
    /// the first thousands of each), and are the same for the same key and chunk.
    #[test]
    fn ids_differ_between_chunks_calls_and_jobs() {
        let mut seen = std::collections::HashSet::new();
        for job in 0..4u64 {
            for id in 0..4u32 {
                for seq in 0..64u64 {
                    for chunk in 0..64u32 {
                        let ck = CollKey {
                            job,
                            comm: CommId { leader: 0, id },
                            seq,
                        };
                        assert!(seen.insert(coll_id(ck, chunk)), "{ck:?} {chunk}");
                        assert_eq!(coll_id(ck, chunk), coll_id(ck, chunk));
                    }
                }
            }
        }
    }

    /// The tag depends on the job and the cluster key.
    #[test]
    fn tags_differ_between_jobs_and_keys() {
        let (a, b) = (ClusterKey::generate(), ClusterKey::generate());
        assert_eq!(job_tag(&a, 7), job_tag(&a, 7));
        assert_ne!(job_tag(&a, 7), job_tag(&a, 8));
        assert_ne!(job_tag(&a, 7), job_tag(&b, 7));
    }
}
