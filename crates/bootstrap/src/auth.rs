//! The secrets of a cluster and the identities built on them.
//!
//! - [`ClusterKey`]: 32 random bytes in a file only its owner may read (mode 0600, checked on
//!   load). The SPs of a cluster and whoever issues job credentials (the launcher, or a
//!   resource manager's prologue) hold it; nobody else does.
//! - [`JobCredential`]: what a rank presents in its hello. It names the job, the uid that may
//!   use it and the job's size, with an HMAC-SHA256 of those under the cluster key, so no
//!   client can pick a job id (another job's, say): the SP verifies the MAC and that the
//!   connecting process runs under that uid (`SO_PEERCRED`). Ranks get it in
//!   `SPOFF_JOB_CREDENTIAL`; a process environment is readable by its own uid only.
//! - The SP-to-SP handshake ([`sp_proof`]): each side proves it holds the key over both sides'
//!   fresh nonces, so a process that read the (world-readable) cluster description cannot
//!   pose as an SP, and a recorded handshake cannot be replayed.
//! - [`admin_proof`]: `service-process stats` proves it holds the key too.
//!
//! Every MAC covers a domain string and length-prefixed fields, so no message of one kind can
//! be taken for another. Comparisons are constant-time (`hmac`'s `verify_slice`).

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

type HmacSha256 = Hmac<Sha256>;

pub const KEY_BYTES: usize = 32;
pub const NONCE_BYTES: usize = 16;
pub type Nonce = [u8; NONCE_BYTES];
pub type Tag = [u8; 32];

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{path}: {err}")]
    Io { path: String, err: std::io::Error },
    #[error(
        "{path} is readable or writable by others (mode {mode:o}): a cluster key must be mode 0600"
    )]
    Exposed { path: String, mode: u32 },
    #[error("{path} belongs to uid {owner}, not to this process's uid {me} or root")]
    Owner { path: String, owner: u32, me: u32 },
    #[error("{path} does not hold a key ({why})")]
    Malformed { path: String, why: String },
    #[error("malformed job credential: {0}")]
    Credential(String),
}

/// Random bytes from the kernel.
pub fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    let mut f = std::fs::File::open("/dev/urandom").expect("/dev/urandom is readable");
    f.read_exact(&mut b).expect("/dev/urandom gives bytes");
    b
}

pub fn nonce() -> Nonce {
    random()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// The cluster's secret.
#[derive(Clone)]
pub struct ClusterKey([u8; KEY_BYTES]);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClusterKey(tag {})", self.tag())
    }
}

impl ClusterKey {
    pub fn generate() -> ClusterKey {
        ClusterKey(random())
    }

    pub fn from_bytes(b: [u8; KEY_BYTES]) -> ClusterKey {
        ClusterKey(b)
    }

    /// A new key in a new file of mode 0600 (refused if the file exists).
    pub fn create(path: &Path) -> Result<ClusterKey, AuthError> {
        let io = |err| AuthError::Io {
            path: path.display().to_string(),
            err,
        };
        let key = ClusterKey::generate();
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(io)?;
        // The mode given to open is filtered by the umask; make sure it is exactly 0600.
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(io)?;
        writeln!(f, "{}", hex(&key.0)).map_err(io)?;
        Ok(key)
    }

    /// Reads a key file, refusing one that others may read or write, or that belongs to
    /// another (non-root) user.
    pub fn load(path: &Path) -> Result<ClusterKey, AuthError> {
        let p = path.display().to_string();
        let io = |err| AuthError::Io {
            path: p.clone(),
            err,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(AuthError::Exposed { path: p, mode });
        }
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if meta.uid() != me && meta.uid() != 0 {
            return Err(AuthError::Owner {
                path: p,
                owner: meta.uid(),
                me,
            });
        }
        let text = std::fs::read_to_string(path).map_err(io)?;
        let key = unhex::<KEY_BYTES>(text.trim()).ok_or_else(|| AuthError::Malformed {
            path: p.clone(),
            why: format!("expected {} hex digits", 2 * KEY_BYTES),
        })?;
        Ok(ClusterKey(key))
    }

    fn hmac(&self, domain: &str, fields: &[&[u8]]) -> HmacSha256 {
        let mut m = HmacSha256::new_from_slice(&self.0).expect("HMAC takes any key length");
        for part in std::iter::once(domain.as_bytes()).chain(fields.iter().copied()) {
            m.update(&(part.len() as u64).to_le_bytes());
            m.update(part);
        }
        m
    }

    /// HMAC-SHA256 of `fields` (length-prefixed) in `domain`.
    pub fn mac(&self, domain: &str, fields: &[&[u8]]) -> Tag {
        self.hmac(domain, fields).finalize().into_bytes().into()
    }

    /// Whether `tag` is [`ClusterKey::mac`] of the same input (constant time).
    pub fn verify(&self, domain: &str, fields: &[&[u8]], tag: &[u8]) -> bool {
        self.hmac(domain, fields).verify_slice(tag).is_ok()
    }

    /// A short public name of the key (for names of files and shared memory of the cluster):
    /// derived from the key, reveals nothing of it.
    pub fn tag(&self) -> String {
        hex(&self.mac("spoff cluster tag", &[])[..6])
    }
}

/// A job's identity, issued by a holder of the cluster key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobCredential {
    pub job: u64,
    /// The uid whose processes may present it.
    pub uid: u32,
    pub world_size: u32,
    pub mac: Tag,
}

const CREDENTIAL_DOMAIN: &str = "spoff job credential v1";
const CREDENTIAL_PREFIX: &str = "spoffjob1";

impl JobCredential {
    pub fn issue(key: &ClusterKey, job: u64, uid: u32, world_size: u32) -> JobCredential {
        let mac = key.mac(
            CREDENTIAL_DOMAIN,
            &[
                &job.to_le_bytes(),
                &uid.to_le_bytes(),
                &world_size.to_le_bytes(),
            ],
        );
        JobCredential {
            job,
            uid,
            world_size,
            mac,
        }
    }

    /// A fresh job id for `uid`.
    pub fn issue_new(key: &ClusterKey, uid: u32, world_size: u32) -> JobCredential {
        JobCredential::issue(key, u64::from_le_bytes(random()), uid, world_size)
    }

    pub fn verify(&self, key: &ClusterKey) -> bool {
        key.verify(
            CREDENTIAL_DOMAIN,
            &[
                &self.job.to_le_bytes(),
                &self.uid.to_le_bytes(),
                &self.world_size.to_le_bytes(),
            ],
            &self.mac,
        )
    }

    /// `spoffjob1:<job hex>:<uid>:<world size>:<mac hex>`.
    pub fn encode(&self) -> String {
        format!(
            "{CREDENTIAL_PREFIX}:{:016x}:{}:{}:{}",
            self.job,
            self.uid,
            self.world_size,
            hex(&self.mac)
        )
    }

    pub fn decode(s: &str) -> Result<JobCredential, AuthError> {
        let bad = |why: &str| AuthError::Credential(why.to_string());
        let parts: Vec<&str> = s.trim().split(':').collect();
        let [prefix, job, uid, size, mac] = parts.as_slice() else {
            return Err(bad("expected five fields separated by ':'"));
        };
        if *prefix != CREDENTIAL_PREFIX {
            return Err(bad("not a spoffjob1 credential"));
        }
        Ok(JobCredential {
            job: u64::from_str_radix(job, 16).map_err(|_| bad("job is not hex"))?,
            uid: uid.parse().map_err(|_| bad("uid is not a number"))?,
            world_size: size
                .parse()
                .map_err(|_| bad("world size is not a number"))?,
            mac: unhex(mac).ok_or_else(|| bad("the MAC is not 64 hex digits"))?,
        })
    }
}

/// The proof SP `prover` sends in the handshake between SPs `a` (the connecting side, nonce
/// `na`) and `b` (the accepting side, nonce `nb`).
pub fn sp_proof(key: &ClusterKey, prover: u32, a: u32, b: u32, na: &Nonce, nb: &Nonce) -> Tag {
    key.mac(
        "spoff sp handshake v1",
        &[
            &prover.to_le_bytes(),
            &a.to_le_bytes(),
            &b.to_le_bytes(),
            na,
            nb,
        ],
    )
}

/// The proof of an admin request (`service-process stats`) to SP `sp`, made at `unix_secs`
/// with `nonce`. It names the SP, so a request seen on its way to one SP proves nothing to
/// another; the SP answers it once ([`AdminReplays`]) and only within [`ADMIN_WINDOW_SECS`] of
/// its clock.
pub fn admin_proof(key: &ClusterKey, sp: u32, nonce: &Nonce, unix_secs: u64) -> Tag {
    key.mac(
        "spoff admin v2",
        &[&sp.to_le_bytes(), nonce, &unix_secs.to_le_bytes()],
    )
}

/// Whether `proof` is [`admin_proof`] of `sp`, `nonce` and `unix_secs` (constant time).
pub fn admin_proof_ok(
    key: &ClusterKey,
    sp: u32,
    nonce: &Nonce,
    unix_secs: u64,
    proof: &Tag,
) -> bool {
    key.verify(
        "spoff admin v2",
        &[&sp.to_le_bytes(), nonce, &unix_secs.to_le_bytes()],
        proof,
    )
}

/// How far the time of an admin request may be from the SP's clock, either way.
pub const ADMIN_WINDOW_SECS: u64 = 60;

/// The admin requests an SP answered and that its clock could still accept: each is answered
/// once. A proof stays here for twice the window (by the monotonic clock) after it was
/// answered: by then its time is out of the window. At most `cap` are held, so at most `cap`
/// requests are answered per two minutes (only a holder of the key can make one).
pub struct AdminReplays {
    seen: std::collections::HashSet<Tag>,
    order: std::collections::VecDeque<(std::time::Instant, Tag)>,
    cap: usize,
}

/// How long [`AdminReplays`] keeps a proof.
pub const ADMIN_REPLAY_KEEP: std::time::Duration =
    std::time::Duration::from_secs(2 * ADMIN_WINDOW_SECS + 1);

impl AdminReplays {
    pub fn new(cap: usize) -> AdminReplays {
        AdminReplays {
            seen: Default::default(),
            order: Default::default(),
            cap,
        }
    }

    /// Takes `proof` (already checked) as answered at `now`; `Err`: why it is refused (seen
    /// before, or too many requests in the last two minutes).
    pub fn admit(&mut self, now: std::time::Instant, proof: &Tag) -> Result<(), String> {
        while let Some((at, p)) = self.order.front() {
            if now.saturating_duration_since(*at) < ADMIN_REPLAY_KEEP {
                break;
            }
            self.seen.remove(p);
            self.order.pop_front();
        }
        if self.seen.contains(proof) {
            return Err(
                "this admin request was already answered: a request is answered once (a replay?)"
                    .into(),
            );
        }
        if self.order.len() >= self.cap {
            return Err(format!(
                "{} admin requests were answered in the last {} s, the most an SP answers; \
                 try again later",
                self.order.len(),
                ADMIN_REPLAY_KEEP.as_secs()
            ));
        }
        self.seen.insert(*proof);
        self.order.push_back((now, *proof));
        Ok(())
    }

    /// Proofs held.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

/// Seconds since the epoch.
pub fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("bootstrap-auth-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    #[test]
    fn a_key_file_is_private_and_round_trips() {
        let p = tmp("key");
        let k = ClusterKey::create(&p).unwrap();
        let mode = std::fs::metadata(&p).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let l = ClusterKey::load(&p).unwrap();
        assert_eq!(k.tag(), l.tag());
        assert!(ClusterKey::create(&p).is_err(), "never overwrites a key");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            ClusterKey::load(&p),
            Err(AuthError::Exposed { .. })
        ));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&p, "not hex").unwrap();
        assert!(matches!(
            ClusterKey::load(&p),
            Err(AuthError::Malformed { .. })
        ));
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn credentials_verify_only_under_their_key_and_fields() {
        let k = ClusterKey::generate();
        let c = JobCredential::issue(&k, 0xfeed, 1000, 4);
        assert!(c.verify(&k));
        let d = JobCredential::decode(&c.encode()).unwrap();
        assert_eq!(d, c);
        assert!(d.verify(&k));
        assert!(!c.verify(&ClusterKey::generate()));
        for forged in [
            JobCredential {
                job: 0xfeee,
                ..c.clone()
            },
            JobCredential {
                uid: 0,
                ..c.clone()
            },
            JobCredential {
                world_size: 5,
                ..c.clone()
            },
        ] {
            assert!(!forged.verify(&k), "{forged:?}");
        }
        assert!(JobCredential::decode("spoffjob1:zz:1:2:00").is_err());
        assert!(JobCredential::decode("").is_err());
    }

    #[test]
    fn sp_proofs_bind_the_prover_and_both_nonces() {
        let k = ClusterKey::generate();
        let (na, nb) = (nonce(), nonce());
        let p = sp_proof(&k, 1, 1, 0, &na, &nb);
        assert_eq!(p, sp_proof(&k, 1, 1, 0, &na, &nb));
        assert_ne!(p, sp_proof(&k, 0, 1, 0, &na, &nb));
        assert_ne!(p, sp_proof(&k, 1, 1, 0, &nb, &na));
        assert_ne!(p, sp_proof(&ClusterKey::generate(), 1, 1, 0, &na, &nb));
    }

    #[test]
    fn admin_proofs_bind_the_sp_and_are_answered_once_within_the_window() {
        let k = ClusterKey::generate();
        let (n, t) = (nonce(), unix_secs());
        let p = admin_proof(&k, 1, &n, t);
        assert!(admin_proof_ok(&k, 1, &n, t, &p));
        assert!(!admin_proof_ok(&k, 0, &n, t, &p), "another SP");
        assert!(!admin_proof_ok(&k, 1, &n, t + 1, &p), "another time");
        let mut seen = AdminReplays::new(2);
        let t0 = std::time::Instant::now();
        assert!(seen.admit(t0, &p).is_ok());
        let again = seen.admit(t0 + std::time::Duration::from_secs(30), &p);
        assert!(again.unwrap_err().contains("already answered"));
        let q = admin_proof(&k, 1, &nonce(), t);
        assert!(seen.admit(t0, &q).is_ok());
        let full = seen.admit(t0, &admin_proof(&k, 1, &nonce(), t));
        assert!(full.unwrap_err().contains("the most an SP answers"));
        // Kept for twice the window, then forgotten (its time is out of the window by then).
        let later = t0 + ADMIN_REPLAY_KEEP;
        assert!(seen.admit(later, &admin_proof(&k, 1, &nonce(), t)).is_ok());
        assert_eq!(seen.len(), 1);
    }
}
