//! What an SP says at registration about the multicast collectives (issue 26): a rank's shim
//! chooses the multicast Bcast only if every rank's SP runs it, so an SP that cannot must say
//! so, with the reason, before any collective; and one that can must not claim otherwise.

mod common;

use bootstrap::wire::{Channel, Hello, HostHello, SpToHost};
use bootstrap::Layout;
use common::{new_job, register, SpSet, SLOTS};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// Registers rank `world_rank` of a new job with its SP; returns what the SP said of multicast.
fn offer(set: &SpSet, world_rank: u32, world_size: u32) -> Option<String> {
    let p = set.cluster.placement(world_rank, world_size).unwrap();
    let path = &set.cluster.sp(p.sp).unwrap().host_socket;
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut ch = Channel::new(s);
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let credential =
        bootstrap::auth::JobCredential::issue(&set.key, new_job(), uid, world_size).encode();
    ch.send_hello(&Hello::Host(HostHello {
        credential,
        world_rank,
        world_size,
        node: p.node,
        local_rank: p.local_rank,
        pid: std::process::id(),
    }))
    .unwrap();
    assert_eq!(ch.recv_hello().unwrap(), Hello::Welcome { sp: p.sp });
    let mailbox: &'static [u64] = Box::leak(
        vec![0u64; (SLOTS as u64 * bootstrap::mailbox::SLOT_BYTES / 8) as usize].into_boxed_slice(),
    );
    let mut reg = alias_mkey::host::Registrar::new();
    let grant = reg.register(
        mailbox.as_ptr() as u64,
        SLOTS as u64 * bootstrap::mailbox::SLOT_BYTES,
        alias_mkey::Rights::READ_WRITE,
    );
    match register(&mut ch, grant, SLOTS) {
        SpToHost::Registered { mcast_off, .. } => mcast_off,
        other => panic!("register answered with {other:?}"),
    }
}

#[test]
fn an_sp_started_without_multicast_says_so_at_registration_and_the_others_offer_it() {
    // SP 1 of two runs without multicast; SP 0 with it (the default).
    let set = SpSet::start_each(2, 1, 1, Layout::Block, &[], &[(1, "--mcast=off")]);
    let on = offer(&set, 0, 2);
    assert_eq!(on, None, "SP 0 runs multicast but said {on:?}");
    let off = offer(&set, 1, 2);
    let why = off.expect("SP 1 was started with --mcast=off and offered multicast");
    assert!(why.contains("--mcast=off"), "{why}");
}
