//! Single-process checks of the wrapper: loopback RMA over the `self`
//! transport, the event fd, and argument validation.

use std::rc::Rc;

use ucx_sys::{Context, Endpoint, Features, MemHandle, RemoteKey, Status, Worker};

fn loopback(features: Features) -> (Rc<Context>, Rc<Worker>, Rc<Endpoint>) {
    let ctx = Context::with_config(features, &[("TLS", "self")]).unwrap();
    let worker = Worker::new(&ctx).unwrap();
    let ep = Endpoint::connect(&worker, &worker.address().unwrap()).unwrap();
    (ctx, worker, ep)
}

#[test]
fn loopback_get_put_on_mapped_and_allocated_memory() {
    let (ctx, _worker, ep) = loopback(Features::RMA);

    // A registered Vec.
    let mut target: Vec<u8> = (0..=255).collect();
    // SAFETY: `target` outlives `mem` (dropped explicitly below) and is not
    // accessed through Rust references while UCX may write it.
    let mem = unsafe { MemHandle::map(&ctx, target.as_mut_ptr(), target.len()) }.unwrap();
    assert_eq!(mem.len(), 256);
    assert_eq!(mem.address(), target.as_mut_ptr());
    // SAFETY: a key this very process packed.
    let rkey = unsafe { RemoteKey::unpack(&ep, &mem.rkey_pack().unwrap()) }.unwrap();
    let mut got = [0u8; 16];
    ep.get(&mut got, mem.address() as u64 + 100, &rkey).unwrap();
    assert_eq!(got[0], 100);
    assert_eq!(got[15], 115);
    ep.put(&[0xAA; 4], mem.address() as u64 + 10, &rkey)
        .unwrap();
    ep.flush().unwrap();
    drop(rkey);
    drop(mem);
    assert_eq!(&target[8..16], &[8, 9, 0xAA, 0xAA, 0xAA, 0xAA, 14, 15]);

    // Memory UCX allocates.
    let mem = MemHandle::allocate(&ctx, 1000).unwrap();
    assert!(mem.len() >= 1000);
    assert!(!mem.address().is_null());
    // SAFETY: as above.
    let rkey = unsafe { RemoteKey::unpack(&ep, &mem.rkey_pack().unwrap()) }.unwrap();
    let data: Vec<u8> = (0..1000).map(|i| (i % 251) as u8).collect();
    ep.put(&data, mem.address() as u64, &rkey).unwrap();
    ep.flush().unwrap();
    let mut back = vec![0u8; 1000];
    ep.get(&mut back, mem.address() as u64, &rkey).unwrap();
    assert_eq!(back, data);
}

#[test]
fn request_outlives_caller_handles() {
    // A request keeps its endpoint and key alive even if the caller drops
    // its own handles first.
    let (ctx, worker, ep) = loopback(Features::RMA);
    let mem = MemHandle::allocate(&ctx, 64).unwrap();
    // SAFETY: a key this process packed.
    let rkey = unsafe { RemoteKey::unpack(&ep, &mem.rkey_pack().unwrap()) }.unwrap();
    let mut buf = [0u8; 64];
    // SAFETY: buf outlives the request, which is waited for below.
    let req =
        unsafe { ep.get_nbx(buf.as_mut_ptr(), buf.len(), mem.address() as u64, &rkey) }.unwrap();
    drop(rkey);
    drop(ep);
    req.wait().unwrap();
    drop(worker);
}

#[test]
fn short_rkey_and_address_are_rejected() {
    // Only inputs too short to be a packed key at all are tested: UCX's
    // ucp_ep_rkey_unpack takes no length and trusts the sizes encoded in
    // the buffer, so longer garbage can make it read out of bounds or make
    // a shared-memory unpacker attach a segment named by the garbage. That
    // cannot be tested safely, which is why RemoteKey::unpack is unsafe.
    let (_ctx, worker, ep) = loopback(Features::RMA);
    for bytes in [&[][..], &[0xff; 8][..]] {
        // SAFETY: rejected by length before UCX sees it.
        let err = unsafe { RemoteKey::unpack(&ep, bytes) }.unwrap_err();
        assert_eq!(err.status, Status::ERR_INVALID_PARAM);
        assert_eq!(err.op, "ucp_ep_rkey_unpack");
    }
    let err = Endpoint::connect(&worker, &[1, 2, 3]).unwrap_err();
    assert_eq!(err.status, Status::ERR_INVALID_PARAM);
}

#[test]
fn event_fd_and_arm() {
    let ctx = Context::with_config(Features::RMA, &[("TLS", "self")]).unwrap();
    let worker = Worker::new(&ctx).unwrap();
    assert!(
        worker.event_fd().is_err(),
        "event fd needs Features::WAKEUP"
    );

    let ctx = Context::with_config(Features::RMA | Features::WAKEUP, &[("TLS", "self")]).unwrap();
    let worker = Worker::new(&ctx).unwrap();
    let fd = worker.event_fd().unwrap();
    assert!(fd >= 0);
    // The documented loop: progress until idle, arm, retry on busy.
    let mut armed = false;
    for _ in 0..100 {
        worker.progress_until_idle();
        if worker.arm().unwrap() {
            armed = true;
            break;
        }
    }
    assert!(armed);
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: pfd is a valid pollfd array of length 1.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    assert!(n >= 0);
}

#[test]
fn bad_config_override_is_an_error() {
    // UCX 1.13 accepts unknown keys (it keeps them for transport configs), so
    // use a known key with a value that does not parse.
    let err = Context::with_config(Features::RMA, &[("MAX_EAGER_LANES", "many")]).unwrap_err();
    assert_eq!(err.op, "ucp_config_modify");
    assert!(err.status.is_err());
    let err = Context::with_config(Features::RMA, &[("TLS", "self\0tcp")]).unwrap_err();
    assert_eq!(err.status, Status::ERR_INVALID_PARAM);
}
