//! Test helper playing the host process: it registers a buffer, publishes
//! what a peer needs to reach it, and then (by default) never progresses its
//! UCX worker, like an MPI rank busy computing.
//!
//! Usage: `ucx-peer [--alloc] [LEN]`
//!
//! * `LEN` (default 4096): buffer size in bytes. The buffer is filled with
//!   `pattern(0, i)`.
//! * `--alloc`: let UCX allocate the buffer (`MemHandle::allocate`) instead
//!   of registering a Vec (`MemHandle::map`).
//!
//! Prints, one per line: `addr HEX`, `rkey HEX`, `buf 0xADDR`, `len N`,
//! `ready`. Then obeys commands read from stdin, one per line, blocking in
//! the read (so not progressing UCX) between them:
//!
//! * `progress`: progress the worker until the next command arrives.
//! * `verify SEED`: check that the buffer holds `pattern(SEED, i)`; print
//!   `verified` and exit 0, or print the first mismatch and exit 1.
//! * `quit` (or end of input): exit 0.

use std::io::{BufRead, Write};
use std::os::fd::AsRawFd;

use ucx_sys::{Context, Features, MemHandle, Worker};

fn pattern(seed: u8, i: usize) -> u8 {
    (i as u8)
        .wrapping_mul(31)
        .wrapping_add(seed.wrapping_mul(101))
        .wrapping_add(7)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn main() {
    let mut alloc = false;
    let mut len = 4096usize;
    for a in std::env::args().skip(1) {
        match a.as_str() {
            "--alloc" => alloc = true,
            n => len = n.parse().expect("LEN must be a number"),
        }
    }

    let ctx = Context::new(Features::RMA).expect("context");
    let worker = Worker::new(&ctx).expect("worker");

    let mut owned: Vec<u8> = Vec::new();
    let mem = if alloc {
        MemHandle::allocate(&ctx, len).expect("ucp_mem_map(ALLOCATE)")
    } else {
        owned = (0..len).map(|i| pattern(0, i)).collect();
        // SAFETY: `owned` is neither moved, resized nor dropped before `mem`
        // (it is declared first, so dropped last), and this program holds no
        // Rust reference into it while the peer may write.
        unsafe { MemHandle::map(&ctx, owned.as_mut_ptr(), owned.len()).expect("ucp_mem_map") }
    };
    assert!(mem.len() >= len);
    let base = mem.address();
    if alloc {
        for i in 0..len {
            // SAFETY: i < len <= mem.len(); the region is ours and no peer
            // knows about it yet.
            unsafe { base.add(i).write(pattern(0, i)) };
        }
    }

    let mut out = std::io::stdout().lock();
    writeln!(out, "addr {}", hex(&worker.address().expect("address"))).unwrap();
    writeln!(out, "rkey {}", hex(&mem.rkey_pack().expect("rkey_pack"))).unwrap();
    writeln!(out, "buf {:#x}", base as u64).unwrap();
    writeln!(out, "len {len}").unwrap();
    writeln!(out, "ready").unwrap();
    out.flush().unwrap();

    let stdin = std::io::stdin();
    let fd = stdin.as_raw_fd();
    let mut lines = stdin.lock().lines();
    let mut progress = false;
    loop {
        if progress {
            // Progress until stdin has something to read.
            loop {
                worker.progress();
                let mut pfd = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: pfd is a valid pollfd array of length 1.
                if unsafe { libc::poll(&mut pfd, 1, 1) } > 0 {
                    break;
                }
            }
        }
        let line = match lines.next() {
            Some(l) => l.expect("stdin"),
            None => break,
        };
        let line = line.trim();
        if line == "progress" {
            progress = true;
        } else if let Some(seed) = line.strip_prefix("verify ") {
            let seed: u8 = seed.parse().expect("seed");
            for i in 0..len {
                // SAFETY: i < len; volatile because the bytes were written by
                // another process behind the compiler's back.
                let got = unsafe { base.add(i).read_volatile() };
                if got != pattern(seed, i) {
                    let want = pattern(seed, i);
                    writeln!(out, "mismatch at {i}: got {got:#04x} want {want:#04x}").unwrap();
                    std::process::exit(1);
                }
            }
            writeln!(out, "verified").unwrap();
            break;
        } else {
            break;
        }
    }
    out.flush().unwrap();
    drop(mem);
    drop(owned);
}
