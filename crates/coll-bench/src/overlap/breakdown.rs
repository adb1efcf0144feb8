//! Where an offloaded call's time went, as the host shim saw it (`bootstrap::stamps` in the
//! workspace): the benchmark asks the shim through two C functions it finds with `dlsym`, so
//! the same binary runs natively (no shim, no breakdown). Beside it, the cost of one
//! `process_vm_readv` of the same size on this machine, measured here: the limit of the `cma`
//! path, which copies with it.

use std::ffi::CStr;

/// The shim's stages, in its order (`bootstrap::stamps::STAGES`): sent to seen by the SP,
/// seen to ready, ready to the first copy issued, first copy issued to last copy done, last
/// copy done to completion written, written to seen by the rank; the total.
pub const STAGES: [&str; 7] = [
    "post", "accept", "issue", "copy", "complete", "notice", "total",
];

/// Each stage's median and 99th percentile (ns) and count, and the calls whose stamps were
/// missing or out of order.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stages {
    pub p50_ns: [u64; 7],
    pub p99_ns: [u64; 7],
    pub calls: [u64; 7],
    pub disordered: u64,
}

type ReadFn = unsafe extern "C" fn(*mut u64, *mut u64, *mut u64, usize) -> u64;
type ResetFn = extern "C" fn();

fn sym(name: &CStr) -> *mut libc::c_void {
    // SAFETY: dlsym with the default handle and a NUL-terminated name.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
}

/// Forgets what the shim recorded so far (nothing without the shim).
pub fn reset() {
    let f = sym(c"spoff_breakdown_reset");
    if !f.is_null() {
        // SAFETY: the shim exports it with this signature (host-shim `breakdown.rs`).
        let f: ResetFn = unsafe { std::mem::transmute(f) };
        f();
    }
}

/// What the shim recorded since the last [`reset`]; `None` without the shim.
pub fn read() -> Option<Stages> {
    let f = sym(c"spoff_breakdown_read");
    if f.is_null() {
        return None;
    }
    // SAFETY: as in `reset`.
    let f: ReadFn = unsafe { std::mem::transmute(f) };
    let mut s = Stages::default();
    // SAFETY: three arrays of STAGES.len() u64s.
    s.disordered = unsafe {
        f(
            s.p50_ns.as_mut_ptr(),
            s.p99_ns.as_mut_ptr(),
            s.calls.as_mut_ptr(),
            STAGES.len(),
        )
    };
    Some(s)
}

/// The median time (µs) of one `process_vm_readv` of `len` bytes from this process into a
/// buffer of its own (the kernel does what it does for another process: pins the pages and
/// copies once), over `reps` tries after a warmup. Both buffers start on a page: the kernel's
/// copy runs several times slower on some CPUs (this machine's) when the destination lies 1-31
/// bytes past the source within a cache line (`alias_mkey::copy`), and the limit of the path
/// is the copy that is not.
pub fn readv_us(len: usize, reps: usize) -> f64 {
    let page_aligned = |v: &mut Vec<u8>| {
        let at = v.as_ptr().align_offset(4096);
        v[at..at + len.max(1)].as_mut_ptr()
    };
    let (mut src_buf, mut dst_buf) = (vec![0x5au8; len + 4096], vec![0u8; len + 4096]);
    let src = page_aligned(&mut src_buf);
    let dst = page_aligned(&mut dst_buf);
    let pid = std::process::id() as libc::pid_t;
    let mut times = Vec::with_capacity(reps);
    for i in 0..reps + 3 {
        let local = libc::iovec {
            iov_base: dst.cast(),
            iov_len: len,
        };
        let remote = libc::iovec {
            iov_base: src.cast(),
            iov_len: len,
        };
        let t = std::time::Instant::now();
        // SAFETY: both iovecs describe live buffers of `len` bytes of this process.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        let dt = t.elapsed().as_secs_f64() * 1e6;
        if n < 0 || n as usize != len {
            return f64::NAN;
        }
        if i >= 3 {
            times.push(dt);
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    times[times.len() / 2]
}

/// The breakdown table: per size, each stage's p50/p99 in µs, and the readv beside it.
pub fn table(rows: &[(usize, Stages, f64)]) -> String {
    let mut out =
        String::from("# where an offloaded call's time goes (p50/p99 us, rank 0's calls)\n");
    out += &format!("{:>10}", "bytes");
    for s in STAGES {
        out += &format!(" {s:>15}");
    }
    out += &format!(" {:>8} {:>10} {:>10}\n", "calls", "disordered", "readv_us");
    for (bytes, st, readv) in rows {
        out += &format!("{bytes:>10}");
        for i in 0..STAGES.len() {
            let cell = if st.calls[i] == 0 {
                "-".to_string()
            } else {
                format!(
                    "{:.1}/{:.1}",
                    st.p50_ns[i] as f64 / 1e3,
                    st.p99_ns[i] as f64 / 1e3
                )
            };
            out += &format!(" {cell:>15}");
        }
        out += &format!(
            " {:>8} {:>10} {:>10.2}\n",
            st.calls[6], st.disordered, readv
        );
    }
    out
}

/// One size's breakdown as JSON: per stage `{n, p50_us, p99_us}`, and `disordered`.
pub fn json(st: &Stages) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for (i, s) in STAGES.iter().enumerate() {
        m.insert(
            s.to_string(),
            serde_json::json!({
                "n": st.calls[i],
                "p50_us": st.p50_ns[i] as f64 / 1e3,
                "p99_us": st.p99_ns[i] as f64 / 1e3,
            }),
        );
    }
    m.insert("disordered".into(), st.disordered.into());
    serde_json::Value::Object(m)
}
