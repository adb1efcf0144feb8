//! The `ucx` grant cache learns about unmapped memory from libucm (real UCX, real munmap, in
//! this process): a buffer mapped, registered, unmapped and mapped again at the same address
//! gets a new generation (and a new `ucp_mem_map`) at its next registration, while a buffer
//! that stays mapped keeps its registration.

use alias_mkey::host::UcxRegistrar;
use alias_mkey::Rights;
use host_shim::unmapped;

fn map(at: *mut libc::c_void, len: usize) -> *mut libc::c_void {
    let fixed = if at.is_null() {
        0
    } else {
        libc::MAP_FIXED_NOREPLACE
    };
    // SAFETY: an anonymous mapping; with a hint, MAP_FIXED_NOREPLACE never replaces one.
    let p = unsafe {
        libc::mmap(
            at,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
    p
}

#[test]
fn unmapped_and_remapped_buffer_gets_a_new_generation() {
    let _hook = unmapped::install().expect("libucm unmap events are delivered here");
    let mut reg = UcxRegistrar::with_config(&[("TLS", "tcp")]).unwrap();
    let len = 1 << 20;
    let p = map(std::ptr::null_mut(), len);
    let keep = map(std::ptr::null_mut(), len);
    let (a, k) = (p as u64, keep as u64);
    unmapped::watch(a, len as u64);
    unmapped::watch(k, len as u64);
    unmapped::apply(&mut reg);
    // SAFETY: both mappings stay until invalidated (p) or the registrar is dropped (keep).
    let g1 = unsafe { reg.register(a, len as u64, Rights::READ) }.unwrap();
    let kept = unsafe { reg.register(k, len as u64, Rights::READ) }.unwrap();
    assert_eq!(unmapped::apply(&mut reg), 0, "nothing unmapped yet");
    let same = unsafe { reg.register(a, len as u64, Rights::READ) }.unwrap();
    assert_eq!(same, g1, "cached while mapped");

    let before = unmapped::recorded();
    // SAFETY: our mapping; its registration is invalidated (below) before any reuse.
    assert_eq!(unsafe { libc::munmap(p, len) }, 0);
    assert!(unmapped::recorded() > before, "munmap was not reported");
    let q = map(p, len);
    assert_eq!(q, p, "remapped at the same address");
    assert_eq!(
        unmapped::apply(&mut reg),
        1,
        "exactly the unmapped registration"
    );
    let g2 = unsafe { reg.register(a, len as u64, Rights::READ) }.unwrap();
    assert_eq!(g2.region, g1.region);
    assert_eq!(
        g2.generation,
        g1.generation + 1,
        "a new generation after the unmap"
    );
    assert_eq!(reg.mapped(), 2);
    let kept2 = unsafe { reg.register(k, len as u64, Rights::READ) }.unwrap();
    assert_eq!(
        kept2, kept,
        "the buffer that stayed mapped keeps its registration"
    );

    drop(reg);
    // SAFETY: both are ours and unregistered now.
    unsafe {
        libc::munmap(q, len);
        libc::munmap(keep, len);
    }
}
