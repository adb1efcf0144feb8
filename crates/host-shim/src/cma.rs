//! Reads from another process of this node (cross-memory attach): the host side of the
//! intra-node copies of a blocking allgatherv, which the SP hands to the waiting rank.

/// Copies `len` bytes from `src_addr` in process `pid` to `dst` in this process, looping over
/// partial transfers.
///
/// # Safety
/// `[dst, dst + len)` is writable memory of this process that nothing else uses meanwhile.
pub unsafe fn read_from(pid: u32, src_addr: u64, dst: usize, len: usize) -> Result<(), String> {
    let mut done = 0usize;
    while done < len {
        let local = libc::iovec {
            iov_base: (dst + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: (src_addr as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: `local` is writable (caller's precondition); the kernel checks `remote`
        // against the other process's mappings and our right to read them.
        let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(format!(
                "process_vm_readv from pid {pid} at {src_addr:#x} (+{done} of {len}): {e}"
            ));
        }
        if n == 0 {
            return Err(format!(
                "process_vm_readv from pid {pid} at {src_addr:#x} made no progress"
            ));
        }
        done += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_memory_and_refuses_bad_addresses() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let pid = std::process::id();
        // SAFETY: `dst` is ours and writable for its length.
        unsafe {
            read_from(
                pid,
                src.as_ptr() as u64,
                dst.as_mut_ptr() as usize,
                dst.len(),
            )
        }
        .unwrap();
        assert_eq!(src, dst);
        // SAFETY: as above; the source address is unmapped, the kernel refuses it.
        let err = unsafe { read_from(pid, 8, dst.as_mut_ptr() as usize, 16) }.unwrap_err();
        assert!(err.contains("process_vm_readv"), "{err}");
    }
}
