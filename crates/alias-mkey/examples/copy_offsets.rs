//! How fast a copy runs against where its destination lies in a cache line relative to its
//! source (`alias_mkey::copy`): glibc's `memcpy`, [`alias_mkey::copy::copy_bytes`] and one
//! `process_vm_readv` of this process into itself, for each offset `(dst - src) mod 64` given,
//! the source on a page boundary. Median of the repetitions, ns. Pin it to a core
//! (`taskset -c 1`) for steady figures.
//!
//! `cargo run --release -p alias-mkey --example copy_offsets [-- SIZES OFFSETS]`, e.g.
//! `-- 4096,65536,1048576 0,16,32,48` (the defaults).

use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn list(arg: Option<String>, default: &str) -> Vec<usize> {
    arg.as_deref()
        .unwrap_or(default)
        .split(',')
        .map(|s| s.parse().expect("a comma-separated list of numbers"))
        .collect()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let sizes = list(args.next(), "4096,65536,1048576");
    let offsets = list(args.next(), "0,16,32,48");
    let max = *sizes.iter().max().unwrap();
    let mut src_mem = vec![0x5au8; max + 4096];
    let mut dst_mem = vec![0u8; max + 4096 + 64];
    let src = {
        let at = src_mem.as_ptr().align_offset(4096);
        src_mem[at..].as_mut_ptr()
    };
    let dst_page = {
        let at = dst_mem.as_ptr().align_offset(4096);
        dst_mem[at..].as_mut_ptr()
    };
    let pid = std::process::id() as libc::pid_t;
    println!(
        "{:>9} {:>6} {:>12} {:>12} {:>12}",
        "bytes", "offset", "memcpy_ns", "copy_bytes", "readv_ns"
    );
    for &n in &sizes {
        let reps = (64 << 20) / n.max(1) / 8;
        let reps = reps.clamp(20, 20_000);
        for &off in &offsets {
            let dst = dst_page.wrapping_add(off % 64);
            let time = |f: &mut dyn FnMut()| {
                f();
                median(
                    (0..reps)
                        .map(|_| {
                            let t = Instant::now();
                            f();
                            t.elapsed().as_nanos() as f64
                        })
                        .collect(),
                )
            };
            // SAFETY (all three): [src, +n) and [dst, +n) lie in two distinct live vectors.
            let memcpy = time(&mut || unsafe {
                libc::memcpy(dst.cast(), src.cast(), n);
            });
            let ours = time(&mut || unsafe { alias_mkey::copy::copy_bytes(src, dst, n) });
            let readv = time(&mut || {
                let local = libc::iovec {
                    iov_base: dst.cast(),
                    iov_len: n,
                };
                let remote = libc::iovec {
                    iov_base: src.cast(),
                    iov_len: n,
                };
                let got = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
                assert_eq!(got, n as isize, "process_vm_readv");
            });
            println!("{n:>9} {off:>6} {memcpy:>12.0} {ours:>12.0} {readv:>12.0}");
        }
    }
}
