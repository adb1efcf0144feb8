//! The CPUs a process may run on, as the kernel says: what a rank reports to its SP at
//! registration and what the SP and its launcher place threads on.

/// The CPUs the calling thread may run on (its affinity mask); empty if the kernel does not
/// say.
pub fn allowed() -> Vec<u32> {
    use nix::sched::{sched_getaffinity, CpuSet};
    let Ok(set) = sched_getaffinity(nix::unistd::Pid::from_raw(0)) else {
        return Vec::new();
    };
    (0..CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .map(|c| c as u32)
        .collect()
}
