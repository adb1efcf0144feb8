//! Exported memory handles (UCX >= 1.15), as far as a machine without a BlueField allows:
//! which UCX the crate was built against, that exporting is refused with `UCS_ERR_UNSUPPORTED`
//! under every transport set this machine has (or, built against UCX < 1.15, with the
//! "no export API" error), and the local-memory-handle RMA path an SP uses with an imported
//! handle, exercised with an ordinary registration in its place.
//!
//! Run against the wheel's UCX: `UCX_DIR=$(scripts/ucx-wheel.sh) cargo test --release -p
//! ucx-sys --test export` (`make ucx-export-test`).

use std::rc::Rc;

use ucx_sys::{Context, Endpoint, Features, MemHandle, RemoteKey, Status, Worker};

/// Every `UCX_TLS` value that names transports this machine has.
const TLS: &[&str] = &[
    "all", "tcp", "sm", "posix", "sysv", "cma", "self", "cma,self",
];

#[test]
fn export_api_matches_the_build() {
    let (major, minor, release) = ucx_sys::library_version();
    println!(
        "ucx-sys built with {} (export API: {}), running UCX {major}.{minor}.{release}",
        ucx_sys::BUILD_PROBE,
        ucx_sys::EXPORT_API
    );
    assert_eq!(
        ucx_sys::EXPORT_API,
        (major, minor) >= (1, 15),
        "the library loaded is the one the headers describe"
    );
    assert_eq!(
        ucx_sys::EXPORT_API,
        Features::EXPORTED_MEMH.0 != 0,
        "the feature bit exists exactly with the export API"
    );
    if ucx_sys::BUILD_PROBE.starts_with("pkg-config ucx 1.1") {
        let minor: u32 = ucx_sys::BUILD_PROBE["pkg-config ucx 1.".len()..]
            .split('.')
            .next()
            .and_then(|m| m.parse().ok())
            .expect("a minor version");
        assert_eq!(ucx_sys::EXPORT_API, minor >= 15, "{}", ucx_sys::BUILD_PROBE);
    }
}

#[test]
fn exporting_is_refused_on_this_machine_under_every_transport() {
    let mut buf = vec![0x5au8; 1 << 16];
    for tls in TLS {
        let ctx = Context::with_config(Features::RMA | Features::EXPORTED_MEMH, &[("TLS", tls)])
            .unwrap_or_else(|e| panic!("UCX_TLS={tls}: {e}"));
        // SAFETY: `buf` outlives `mapped` (dropped at the end of the iteration).
        let mapped = unsafe { MemHandle::map(&ctx, buf.as_mut_ptr(), buf.len()) }.unwrap();
        let allocated = MemHandle::allocate(&ctx, 1 << 16).unwrap();
        for (what, m) in [
            ("user memory", &mapped),
            ("UCX-allocated memory", &allocated),
        ] {
            let err = m.export_pack().expect_err("no device here can export");
            println!("UCX_TLS={tls}, {what}: {err}");
            assert_eq!(err.status, Status::ERR_UNSUPPORTED, "UCX_TLS={tls} {what}");
            if ucx_sys::EXPORT_API {
                assert_eq!(err.op, "ucp_memh_pack");
            } else {
                assert!(err.op.contains("UCX < 1.15"), "{err}");
            }
            // An ordinary rkey of the same registration still packs.
            assert!(m.rkey_pack().unwrap().len() >= 9);
        }
    }
}

#[test]
fn import_without_the_export_api_says_so() {
    if ucx_sys::EXPORT_API {
        return; // the importer is exercised by alias-mkey's ucx-export tests
    }
    let ctx = Context::with_config(Features::RMA, &[("TLS", "self")]).unwrap();
    // SAFETY: never handed to UCX in this build.
    let err = unsafe { MemHandle::import(&ctx, &[0u8; 64]) }.unwrap_err();
    assert_eq!(err.status, Status::ERR_UNSUPPORTED);
    assert!(err.op.contains("UCX < 1.15"), "{err}");
}

/// The SP's side of an alias: operations whose *local* buffer is named by a memory handle
/// (`UCP_OP_ATTR_FIELD_MEMH`), on a loopback endpoint, against a staging region reached by
/// rkey. With an imported handle the local address is the host's; here an ordinary
/// registration of this process's buffer stands in for it.
#[test]
fn rma_with_a_local_memory_handle_moves_the_bytes() {
    let seed = std::process::id() as u64 ^ 0x9e37_79b9_7f4a_7c15;
    println!("seed {seed}");
    let mut x = seed;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x as u8
    };
    let ctx = Context::with_config(Features::RMA, &[("TLS", "self")]).unwrap();
    let worker = Worker::new(&ctx).unwrap();
    let ep = Endpoint::connect(&worker, &worker.address().unwrap()).unwrap();
    let n = 100_000usize;
    let mut alias: Vec<u8> = (0..n).map(|_| next()).collect();
    let original = alias.clone();
    // SAFETY: `alias` outlives `memh` (dropped before `alias` is read below).
    let memh = Rc::new(unsafe { MemHandle::map(&ctx, alias.as_mut_ptr(), n) }.unwrap());
    let staging = MemHandle::allocate(&ctx, n).unwrap();
    // SAFETY: a key this process packed.
    let rkey = unsafe { RemoteKey::unpack(&ep, &staging.rkey_pack().unwrap()) }.unwrap();

    // alias[1000..] -> staging (a put from the aliased memory), then made visible by a flush.
    let len = 50_000;
    // SAFETY: inside `memh`'s region, not touched until the request completes (wait).
    let req = unsafe {
        ep.put_nbx_memh(
            memh.address().add(1000),
            len,
            &memh,
            staging.address() as u64,
            &rkey,
        )
    }
    .unwrap();
    req.wait().unwrap();
    ep.flush().unwrap();
    // SAFETY: staging is UCX-allocated, n bytes; no request is outstanding.
    let staged = unsafe { std::slice::from_raw_parts(staging.address(), len) }.to_vec();
    assert_eq!(staged, original[1000..1000 + len]);

    // staging -> alias[7..] (a get into the aliased memory).
    // SAFETY: as above.
    let req = unsafe {
        ep.get_nbx_memh(
            memh.address().add(7),
            len,
            &memh,
            staging.address() as u64,
            &rkey,
        )
    }
    .unwrap();
    req.wait().unwrap();
    drop(rkey);
    drop(memh);
    let mut want = original.clone();
    want[7..7 + len].copy_from_slice(&original[1000..1000 + len]);
    assert!(alias == want, "the get wrote exactly [7, 7+{len})");
}
