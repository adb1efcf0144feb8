//! The segment of the hierarchical staged designs: shared memory that the ranks of one
//! emulated node map (BluesMPI's node-leader segment), which SPs write once per chunk and each
//! rank copies out of into its own buffer (`SpToHost::Copy` with `CopySrc::Segment`).
//!
//! It is a POSIX shared-memory object whose name the rank's SP gives at registration (derived
//! from the job and the node under the cluster key: it discloses no job id and cannot be
//! guessed by another user), created on first use by whichever rank of the node comes first
//! (`O_CREAT`, sized with `ftruncate`) and mapped by each of them. It holds one part of
//! `SPOFF_SEGMENT_BYTES` (default [`DEFAULT_SEGMENT_BYTES`]) per SP of the node: each SP
//! places the regions it writes in its own part, and any rank of the node may be told to copy
//! out of any part. The node's SPs remove the name once the job ended on all of them. Every
//! rank of the node must use the same size: a rank that finds the object with another size
//! refuses it (its hierarchical posts fail with an error, never a wrong copy).

use std::ffi::CString;
use std::sync::OnceLock;

pub const DEFAULT_SEGMENT_BYTES: u64 = 8 << 20;

/// The smallest segment accepted (and the unit sizes are rounded up to).
const SEGMENT_ALIGN: u64 = 4096;

/// This rank's mapping of the segment.
#[derive(Debug)]
pub struct Segment {
    pub addr: usize,
    pub len: u64,
}

impl Segment {
    /// The address of `[offset, offset + len)` of the mapping, if it lies inside.
    pub fn range(&self, offset: u64, len: u64) -> Result<*const u8, String> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok((self.addr as u64 + offset) as *const u8),
            _ => Err(format!(
                "[{offset}, +{len}) lies outside the {}-byte segment",
                self.len
            )),
        }
    }
}

static SEGMENT: OnceLock<Result<Segment, String>> = OnceLock::new();

/// The configured size: `SPOFF_SEGMENT_BYTES` rounded up to a page, else the default.
pub fn configured_len() -> u64 {
    std::env::var("SPOFF_SEGMENT_BYTES")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&n| n > 0)
        .map_or(DEFAULT_SEGMENT_BYTES, |n| {
            n.div_ceil(SEGMENT_ALIGN) * SEGMENT_ALIGN
        })
}

/// The mapping of the segment `name` of this rank's node, which runs `sps` SPs, creating and
/// mapping it at the first call.
pub fn get(name: &str, sps: u64) -> Result<&'static Segment, String> {
    SEGMENT
        .get_or_init(|| {
            let len = configured_len()
                .checked_mul(sps.max(1))
                .ok_or("SPOFF_SEGMENT_BYTES times the SPs of the node overflows")?;
            open(name, len)
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The mapping if an earlier [`get`] made it.
pub fn mapped() -> Option<&'static Segment> {
    SEGMENT.get().and_then(|r| r.as_ref().ok())
}

fn open(name: &str, len: u64) -> Result<Segment, String> {
    let cname = CString::new(name).map_err(|_| format!("bad segment name {name:?}"))?;
    let os = |what: &str| {
        format!(
            "segment {name}: {what}: {}",
            std::io::Error::last_os_error()
        )
    };
    // SAFETY: a valid C string; the flags and mode are plain integers.
    let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR | libc::O_CREAT, 0o600) };
    if fd < 0 {
        return Err(os("shm_open"));
    }
    let result = (|| {
        // SAFETY: `st` is plain old data, written by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: an open fd and a valid out-pointer.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(os("fstat"));
        }
        let have = st.st_size as u64;
        if have == 0 {
            // First here (or racing with another first rank: both set the same size).
            // SAFETY: an open fd.
            if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
                return Err(os("ftruncate"));
            }
        } else if have != len {
            return Err(format!(
                "segment {name} has {have} bytes, this rank is configured for {len} \
                 (SPOFF_SEGMENT_BYTES differs between ranks)"
            ));
        }
        // SAFETY: mapping `len` bytes of an open shared-memory object read-write.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os("mmap"));
        }
        Ok(Segment {
            addr: p as usize,
            len,
        })
    })();
    // SAFETY: our fd; the mapping stays valid after close.
    unsafe { libc::close(fd) };
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_share_bytes_and_a_size_mismatch_is_refused() {
        let name = format!("/spoff-test-{}", std::process::id());
        let a = open(&name, 8192).unwrap();
        let b = open(&name, 8192).unwrap();
        // SAFETY: both mappings are 8192 bytes long.
        unsafe {
            *((a.addr + 100) as *mut u8) = 0xAB;
            assert_eq!(*((b.addr + 100) as *const u8), 0xAB);
        }
        let err = open(&name, 4096).unwrap_err();
        assert!(err.contains("differs between ranks"), "{err}");
        assert!(a.range(8000, 192).is_ok());
        assert!(a.range(8000, 193).is_err());
        assert!(a.range(u64::MAX, 2).is_err());
        let c = CString::new(name).unwrap();
        // SAFETY: a valid C string.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}
