//! Test helper playing a host process with the `ucx` backend.
//!
//! Usage: `alias-mkey-ucx-host LEN SEED` (UCX configured from the environment, e.g. `UCX_TLS`).
//!
//! Allocates a LEN-byte buffer filled with `pattern(SEED, i)`, creates a
//! [`alias_mkey::host::UcxRegistrar`], prints `@ buf 0xADDR` and `@ ready`, then serves commands
//! from stdin, one per line, progressing its UCX worker between them (as a host rank must while
//! it waits, with UCX 1.13 here). Every reply line starts with `@ ` (UCX may print its own lines):
//!
//! * `register OFF LEN RIGHTS` (RIGHTS = `r`, `w` or `rw`): `@ grant REGION GEN ADDR LEN BITS
//!   WORKER_HEX RKEY_HEX` (an empty rkey is printed as `-`).
//! * `invalidate OFF LEN`: `@ invalidated N`.
//! * `expect OFF LEN SEED FROM`: checks `buf[OFF+i] == pattern(SEED, FROM+i)` for `i < LEN`;
//!   `@ ok` or `@ mismatch at I: got X want Y`.
//! * `pause`: `@ paused`, then stops progressing until the next command arrives.
//! * `quit` or end of input: exits 0.

use alias_mkey::host::UcxRegistrar;
use alias_mkey::{BackendData, Rights};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;

/// The test pattern: not periodic in any small power of two, so offset errors show.
fn pattern(seed: u8, i: u64) -> u8 {
    let x = (i ^ (u64::from(seed) << 40)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8
}

fn hex(b: &[u8]) -> String {
    if b.is_empty() {
        return "-".into();
    }
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn num(s: Option<&str>) -> u64 {
    s.and_then(|s| s.parse().ok()).expect("a number argument")
}

fn main() {
    let mut args = std::env::args().skip(1);
    let len: u64 = num(args.next().as_deref());
    let seed: u8 = num(args.next().as_deref()) as u8;

    // Leaked on purpose: the buffer lives as long as the process, and no Rust reference to it
    // is kept while SPs write it (it is only read with read_volatile).
    let buf: *mut u8 =
        Box::leak((0..len).map(|i| pattern(seed, i)).collect::<Box<[u8]>>()).as_mut_ptr();
    let base = buf as u64;
    let mut reg = UcxRegistrar::new().expect("UcxRegistrar");

    let mut out = std::io::stdout().lock();
    writeln!(out, "@ buf {base:#x}").unwrap();
    writeln!(out, "@ ready").unwrap();
    out.flush().unwrap();

    let stdin = std::io::stdin();
    let fd = stdin.as_raw_fd();
    let mut input = BufReader::new(stdin.lock());
    let mut progress = true;
    loop {
        // Progress until a command is readable (lines already buffered count).
        while progress && input.buffer().is_empty() {
            reg.progress();
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&mut pfd, 1, 1) } != 0 {
                break;
            }
        }
        let mut line = String::new();
        if input.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        progress = true;
        let mut w = line.split_whitespace();
        match w.next() {
            Some("register") => {
                let (off, n) = (num(w.next()), num(w.next()));
                assert!(off.checked_add(n).is_some_and(|e| e <= len), "range");
                let rights = match w.next() {
                    Some("r") => Rights::READ,
                    Some("w") => Rights::WRITE,
                    Some("rw") => Rights::READ_WRITE,
                    r => panic!("rights {r:?}"),
                };
                // SAFETY: the range lies in the leaked buffer, which is never freed.
                let g = unsafe { reg.register(base + off, n, rights) }.expect("register");
                let BackendData::Ucx {
                    worker_address,
                    rkey,
                } = &g.backend
                else {
                    unreachable!()
                };
                writeln!(
                    out,
                    "@ grant {} {} {} {} {} {} {}",
                    g.region,
                    g.generation,
                    g.addr,
                    g.len,
                    g.rights.bits(),
                    hex(worker_address),
                    hex(rkey)
                )
                .unwrap();
            }
            Some("invalidate") => {
                let (off, n) = (num(w.next()), num(w.next()));
                writeln!(out, "@ invalidated {}", reg.invalidate(base + off, n)).unwrap();
            }
            Some("expect") => {
                let (off, n, s, from) =
                    (num(w.next()), num(w.next()), num(w.next()), num(w.next()));
                assert!(off.checked_add(n).is_some_and(|e| e <= len), "range");
                let bad = (0..n).find_map(|i| {
                    // SAFETY: inside the buffer; volatile because SPs wrote it behind the
                    // compiler's back.
                    let got = unsafe { buf.add((off + i) as usize).read_volatile() };
                    let want = pattern(s as u8, from + i);
                    (got != want).then_some((i, got, want))
                });
                match bad {
                    None => writeln!(out, "@ ok").unwrap(),
                    Some((i, got, want)) => {
                        writeln!(out, "@ mismatch at {i}: got {got:#04x} want {want:#04x}").unwrap()
                    }
                }
            }
            Some("pause") => {
                writeln!(out, "@ paused").unwrap();
                progress = false;
            }
            _ => break,
        }
        out.flush().unwrap();
    }
}
