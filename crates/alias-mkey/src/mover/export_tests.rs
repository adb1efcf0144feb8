//! Tests of the `ucx-export` mover that this machine (no device can export) allows: the framing
//! check, the checks before any UCX call, the RMA path with an ordinary registration standing in
//! for the imported alias (runs with Debian's UCX too), UCX's importer on well-framed buffers
//! naming a device this machine lacks, and the clear errors.

use super::*;
use crate::{Grant, Owner};

/// A buffer in the layout [`exported_framing`] reads (UCX 1.22's exported memory handle), for
/// the region `[addr, +len)`, one entry per `(key, device id)`; `wide` writes every size in the
/// 0-then-16-bit form.
fn frame(addr: u64, len: u64, keys: &[(&[u8], &[u8])], wide: bool) -> Vec<u8> {
    fn size(v: &mut Vec<u8>, n: usize, wide: bool) {
        if wide || n > 255 {
            v.push(0);
            v.extend_from_slice(&(n as u16).to_ne_bytes());
        } else {
            v.push(n as u8);
        }
    }
    let info = if wide { 3 } else { 1 } + 2 + 8 + 1 + 32;
    let mut v = Vec::new();
    size(&mut v, info, wide);
    v.extend_from_slice(&1u16.to_ne_bytes()); // flags: exported
    let md_map: u64 = (1u64 << keys.len()) - 1;
    v.extend_from_slice(&md_map.to_ne_bytes());
    v.push(0); // host memory
    for x in [addr, len, 0x1234_5678, 7] {
        v.extend_from_slice(&x.to_ne_bytes());
    }
    for (key, id) in keys {
        let entry = if wide { 3 } else { 1 } + 1 + key.len() + 1 + id.len();
        size(&mut v, entry, wide);
        v.push(key.len() as u8);
        v.extend_from_slice(key);
        v.push(id.len() as u8);
        v.extend_from_slice(id);
    }
    v
}

fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

#[test]
fn framing_reads_what_the_layout_says_and_refuses_anything_out_of_place() {
    let keys: [(&[u8], &[u8]); 2] = [(&[7; 40], b"mlx5_0-gvmi"), (&[9; 3], b"x")];
    for wide in [false, true] {
        let b = frame(0x7f00_0000_1000, 65536, &keys, wide);
        let ex = exported_framing(&b).expect("well framed");
        assert_eq!(
            ex,
            Exported {
                address: 0x7f00_0000_1000,
                length: 65536,
                keys: 2,
                framed_len: b.len()
            }
        );
        // Every truncation is refused.
        for cut in 0..b.len() {
            assert_eq!(
                exported_framing(&b[..cut]),
                None,
                "cut at {cut}, wide {wide}"
            );
        }
    }
    let ok = frame(0x1000, 4096, &keys[..1], false);
    // No keys, zero length, a wrapping region, an unknown memory type: refused.
    assert_eq!(exported_framing(&frame(0x1000, 4096, &[], false)), None);
    assert_eq!(exported_framing(&frame(0x1000, 0, &keys, false)), None);
    assert_eq!(
        exported_framing(&frame(u64::MAX - 10, 4096, &keys, false)),
        None
    );
    let mut t = ok.clone();
    t[11] = 200; // memory type
    assert_eq!(exported_framing(&t), None);
    // A map with more bits than there are entries runs off the end.
    let mut t = ok.clone();
    t[3..11].copy_from_slice(&0b11u64.to_ne_bytes());
    assert_eq!(exported_framing(&t), None);
    // An entry whose key claims more than the entry holds.
    let mut t = ok.clone();
    t[45] = 41;
    assert_eq!(exported_framing(&t), None);
    // The buffers that crash or fool UCX's importer.
    assert_eq!(exported_framing(&[0xff; 512]), None);
    assert_eq!(exported_framing(&[0; 512]), None);
}

#[test]
fn framing_never_panics_on_random_or_mutated_bytes() {
    let seed = std::process::id() as u64 * 0x9e37_79b9;
    println!("seed {seed}");
    let mut next = rng(seed);
    let base = frame(0x1000, 4096, &[(&[1; 16], b"dev")], false);
    for _ in 0..20_000 {
        let mut b = if next().is_multiple_of(2) {
            base.clone()
        } else {
            (0..(next() % 300) as usize).map(|_| next() as u8).collect()
        };
        for _ in 0..(next() % 4) {
            if !b.is_empty() {
                let i = (next() as usize) % b.len();
                b[i] = next() as u8;
            }
        }
        if let Some(ex) = exported_framing(&b) {
            assert!(ex.framed_len <= b.len() && ex.keys >= 1 && ex.length > 0);
        }
    }
}

fn owner() -> Owner {
    Owner {
        job: 1,
        world_rank: 3,
        pid: std::process::id(),
        start: 1,
        uid: 0,
        gid: 0,
    }
}

fn key_for(region: u64, addr: u64, len: u64, rights: Rights, blob: Vec<u8>) -> AliasKey {
    AliasKey {
        owner: owner(),
        grant: Grant {
            region,
            generation: 0,
            addr,
            len,
            rights,
            backend: BackendData::UcxExport { memh: blob },
        },
    }
}

/// A mover with a plain RMA context (no export feature needed: aliases are installed by hand).
fn plain_mover(chunk: usize) -> ExportMover {
    let cfg = ExportMoverConfig {
        chunk_bytes: chunk,
        timeout: Duration::from_secs(5),
        tls: Some("self".into()),
        ..Default::default()
    };
    ExportMover::with_features(cfg, Features::RMA).expect("a UCX context")
}

#[test]
fn the_rma_path_moves_exactly_the_granted_bytes() {
    let seed = std::process::id() as u64 ^ 0x51ed_2701;
    println!("seed {seed}");
    let mut next = rng(seed);
    let n = 3 * 4096 + 123;
    let mut a: Vec<u8> = (0..n).map(|_| next() as u8).collect();
    let mut b: Vec<u8> = (0..n).map(|_| next() as u8).collect();
    let (a0, b0) = (a.clone(), b.clone());
    let mut m = plain_mover(4096);
    let (pa, pb) = (a.as_mut_ptr(), b.as_mut_ptr());
    let ka = key_for(
        1,
        pa as u64,
        n as u64,
        Rights::READ,
        frame(pa as u64, n as u64, &[(&[1], b"d")], false),
    );
    let kb = key_for(
        2,
        pb as u64,
        n as u64,
        Rights::READ_WRITE,
        frame(pb as u64, n as u64, &[(&[1], b"d")], false),
    );
    let ctx = Rc::clone(m.worker.context());
    // SAFETY: `a` and `b` outlive the mover's handles (the mover is dropped before they are
    // read), and are not touched through Rust references while UCX may write them.
    unsafe {
        m.install_alias(&ka, MemHandle::map(&ctx, pa, n).unwrap());
        m.install_alias(&kb, MemHandle::map(&ctx, pb, n).unwrap());
    }
    // read: multi-chunk, from an offset.
    let mut out = vec![0u8; n - 100];
    m.read(&ka, 100, &mut out).unwrap();
    assert_eq!(out, a0[100..]);
    // write: multi-chunk, at an offset.
    let data: Vec<u8> = (0..9000).map(|_| next() as u8).collect();
    m.write(&kb, 50, &data).unwrap();
    // copy a -> b.
    m.copy(&ka, 7, &kb, 10_000, 2000).unwrap();
    // Refused: out of range, missing right, another backend; nothing moves.
    assert!(matches!(
        m.read(&ka, 1, &mut vec![0; n]),
        Err(AccessError::OutOfRange { .. })
    ));
    assert!(matches!(
        m.write(&ka, 0, &[1]),
        Err(AccessError::NoRight { .. })
    ));
    let mut cma = kb.clone();
    cma.grant.backend = BackendData::Cma;
    assert!(matches!(
        m.write(&cma, 0, &[1]),
        Err(AccessError::Unsupported(_))
    ));
    // A buffer that does not cover the grant, or is malformed: refused before UCX.
    let mut short = kb.clone();
    short.grant.backend = BackendData::UcxExport {
        memh: frame(pb as u64, 100, &[(&[1], b"d")], false),
    };
    let err = m.write(&short, 0, &[1]).unwrap_err();
    assert!(err.to_string().contains("not the granted"), "{err}");
    let mut junk = kb.clone();
    junk.grant.backend = BackendData::UcxExport {
        memh: vec![0xff; 300],
    };
    let err = m.write(&junk, 0, &[1]).unwrap_err();
    assert!(err.to_string().contains("malformed"), "{err}");
    // A stale generation is refused once a newer one was seen.
    m.note_generation(owner(), 2, 5);
    assert!(matches!(
        m.write(&kb, 0, &[1]),
        Err(AccessError::StaleGeneration { have: 5, got: 0 })
    ));
    assert_eq!(m.stats().stuck, 0);
    drop(m);

    let (a, b) = (a.clone(), b.clone());
    assert_eq!(a, a0, "the read-only source is untouched");
    let mut want = b0.clone();
    want[50..9050].copy_from_slice(&data);
    want[10_000..12_000].copy_from_slice(&a0[7..2007]);
    assert!(b == want, "b holds exactly the write and the copy");
}

#[test]
fn importing_where_no_device_matches_fails_cleanly_or_says_the_build_lacks_it() {
    let cfg = ExportMoverConfig {
        tls: Some("self".into()),
        ..Default::default()
    };
    match (ucx_sys::EXPORT_API, ExportMover::new(cfg)) {
        (false, Err(e)) => {
            assert!(matches!(e, AccessError::ExportNotBuilt { .. }));
            let msg = e.to_string();
            println!("{msg}");
            assert!(
                msg.contains("built without UCX >= 1.15 export support"),
                "{msg}"
            );
        }
        (true, Ok(mut m)) => {
            let mut buf = vec![0u8; 8192];
            let p = buf.as_mut_ptr() as u64;
            for (i, id) in [&b"mlx5_0:gvmi-1"[..], &[0xA5; 32][..]].iter().enumerate() {
                let k = key_for(
                    10 + i as u64,
                    p,
                    8192,
                    Rights::READ,
                    frame(p, 8192, &[(&[0x42; 60], id)], i == 1),
                );
                let err = m.read(&k, 0, &mut [0u8; 16]).unwrap_err();
                println!(
                    "import of a buffer naming device {:?}: {err}",
                    String::from_utf8_lossy(id)
                );
                // UCX 1.22 parsed the buffer up to the device ids (a misframed one gets "invalid
                // parameter" or worse) and found no local device with that id.
                assert!(
                    matches!(&err, AccessError::Ucx { op: "ucp_mem_map", status, .. }
                        if status.contains("unreachable")),
                    "UCX refuses it: {err}"
                );
            }
            assert_eq!(m.stats().imports, 0);
            drop(m);
            buf[0] = 1;
        }
        (api, r) => panic!("export API {api}, but the mover: {:?}", r.err()),
    }
}
