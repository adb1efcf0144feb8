//! CPUs of the command line: CPU lists (`0,2-3`), pinning to them, and real-time scheduling
//! (`serve --cpus/--realtime`, `launch --sp-cpus/--rank-cpus/--sp-realtime`, `rank-exec`).

/// A CPU list from the command line, such as `0,2-3`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuList(pub Vec<u32>);

impl std::str::FromStr for CpuList {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_cpu_list(s).map(CpuList)
    }
}

/// Parses a CPU list such as `0,2-3`.
pub fn parse_cpu_list(s: &str) -> Result<Vec<u32>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let a: u32 = a
            .parse()
            .map_err(|_| format!("bad CPU number {a:?} in {s:?}"))?;
        let b: u32 = b
            .parse()
            .map_err(|_| format!("bad CPU number {b:?} in {s:?}"))?;
        if b < a || b - a > 4096 {
            return Err(format!("bad CPU range {part:?}"));
        }
        out.extend(a..=b);
    }
    if out.is_empty() {
        return Err(format!("empty CPU list {s:?}"));
    }
    Ok(out)
}

/// How many CPUs an SP's datapath threads have, of `reserved` (its `--cpus`): with
/// `busy_poll` on K >= 2 distinct CPUs the loop takes the first alone and they have the other
/// K-1; 0 without `--cpus` (they go wherever the kernel puts them).
pub fn movers_cpus(reserved: &[u32], busy_poll: bool) -> usize {
    let mut d = reserved.to_vec();
    d.sort_unstable();
    d.dedup();
    match d.len() {
        k if busy_poll && k >= 2 => k - 1,
        k => k,
    }
}

/// The CPUs the calling thread may run on (empty if the kernel does not say).
pub use bootstrap::cpus::allowed as allowed_cpus;

/// Pins the calling thread (and what it execs) to `cpus`.
pub fn pin_to(cpus: &[u32]) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            if (c as usize) < libc::CPU_SETSIZE as usize {
                libc::CPU_SET(c as usize, &mut set);
            }
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Switches the calling process to SCHED_FIFO at a low real-time priority; threads it creates
/// afterwards inherit it. Linux's real-time throttling still leaves the other tasks 5% of a CPU.
pub fn make_realtime() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 10 };
    // SAFETY: `param` is a valid sched_param for the duration of the call.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0,2-4").unwrap(), vec![0, 2, 3, 4]);
        assert_eq!(parse_cpu_list("1").unwrap(), vec![1]);
        assert!(parse_cpu_list("").is_err());
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("a").is_err());
    }

    #[test]
    fn movers_have_the_sps_distinct_cpus_but_the_polling_loops() {
        assert_eq!(movers_cpus(&[], false), 0);
        assert_eq!(movers_cpus(&[], true), 0);
        assert_eq!(movers_cpus(&[1], true), 1);
        assert_eq!(movers_cpus(&[1, 2], false), 2);
        assert_eq!(movers_cpus(&[1, 2], true), 1);
        assert_eq!(movers_cpus(&[1, 2, 3], true), 2);
        assert_eq!(
            movers_cpus(&[2, 2], false),
            1,
            "a CPU named twice is one CPU"
        );
        assert_eq!(movers_cpus(&[2, 2, 3], true), 1);
    }

    /// `allowed_cpus` reads back what `pin_to` set, on a thread of its own.
    #[test]
    fn allowed_cpus_reads_back_a_pinning() {
        let all = allowed_cpus();
        assert!(!all.is_empty());
        let last = *all.last().unwrap();
        let seen = std::thread::spawn(move || {
            pin_to(&[last]).unwrap();
            allowed_cpus()
        })
        .join()
        .unwrap();
        assert_eq!(seen, vec![last]);
        assert_eq!(
            allowed_cpus(),
            all,
            "the test thread's own mask is untouched"
        );
    }
}
