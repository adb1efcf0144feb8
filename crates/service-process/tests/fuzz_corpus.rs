//! The fuzzer's targets (`service_process::fuzz_targets`) in `make test`, without libFuzzer:
//! every kept input (the seed corpus recorded from real traffic, `fuzz/corpus/TARGET/`, and the
//! crash inputs found so far, `fuzz/regressions/TARGET/`) is replayed, then mutations of them
//! (bit flips, truncations, splices, inserted bytes) drawn from a printed seed. Any panic
//! fails the test and names the input. `make fuzz` runs the coverage-guided fuzzer itself.
//!
//! `build_corpus` (ignored; `scripts/fuzz.sh corpus`) turns frames recorded from real jobs
//! (`SPOFF_RECORD_FRAMES`) into the seed corpus.

mod common;

use common::{test_seed, Rng};
use service_process::fuzz_targets::{machine_input, TARGETS};
use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

fn inputs(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let Ok(d) = std::fs::read_dir(dir) else {
        return vec![];
    };
    let mut v: Vec<(PathBuf, Vec<u8>)> = d
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| (e.path(), std::fs::read(e.path()).unwrap()))
        .collect();
    v.sort();
    v
}

/// Uniform in `0..n` as an index (0 for n = 0).
fn below(rng: &mut Rng, n: usize) -> usize {
    rng.below(n as u64) as usize
}

fn mutate(rng: &mut Rng, base: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = base.to_vec();
    for _ in 0..1 + below(rng, 4) {
        match below(rng, 5) {
            0 if !v.is_empty() => {
                let i = below(rng, v.len());
                v[i] ^= 1 << below(rng, 8);
            }
            1 if !v.is_empty() => {
                let i = below(rng, v.len());
                v[i] = [0, 0xff, 0x7f, 0x80, 1][below(rng, 5)];
            }
            2 => v.truncate(below(rng, v.len() + 1)),
            3 if !other.is_empty() => {
                let at = below(rng, v.len() + 1);
                let from = below(rng, other.len());
                let n = below(rng, other.len() - from + 1);
                v.splice(at..at, other[from..from + n].iter().copied());
            }
            _ => {
                let at = below(rng, v.len() + 1);
                v.insert(at, rng.next() as u8);
            }
        }
    }
    v
}

#[test]
fn every_fuzz_target_survives_its_corpus_and_mutations_of_it() {
    let seed = test_seed();
    let iters: usize = std::env::var("FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    eprintln!("FUZZ_ITERS={iters}");
    let mut rng = Rng(seed);
    for (name, target) in TARGETS {
        let corpus = inputs(&fuzz_dir().join("corpus").join(name));
        let crashes = inputs(&fuzz_dir().join("regressions").join(name));
        assert!(
            !corpus.is_empty(),
            "no seed corpus for {name} in fuzz/corpus/{name}: the replay would test nothing"
        );
        for (path, data) in corpus.iter().chain(&crashes) {
            let r = std::panic::catch_unwind(|| target(data));
            assert!(r.is_ok(), "{name} panicked on {}", path.display());
        }
        for i in 0..iters {
            let base = &corpus[below(&mut rng, corpus.len())].1;
            let other = &corpus[below(&mut rng, corpus.len())].1;
            let data = mutate(&mut rng, base, other);
            let r = std::panic::catch_unwind(|| target(&data));
            if r.is_err() {
                let keep = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("crash-{name}-{i}"));
                std::fs::write(&keep, &data).unwrap();
                panic!(
                    "{name} panicked on mutation {i} (TEST_SEED={seed}); input kept in {} (copy \
                     it to fuzz/regressions/{name}/)",
                    keep.display()
                );
            }
        }
        eprintln!(
            "{name}: {} corpus inputs, {} crash regressions, {iters} mutations",
            corpus.len(),
            crashes.len()
        );
    }
}

/// Splits a recorded stream into its frames (length prefix included).
fn frames(stream: &[u8]) -> Vec<Vec<u8>> {
    let mut out = vec![];
    let mut at = 0;
    while at + 4 <= stream.len() {
        let n = u32::from_le_bytes(stream[at..at + 4].try_into().unwrap()) as usize;
        if at + 4 + n > stream.len() {
            break;
        }
        out.push(stream[at..at + 4 + n].to_vec());
        at += 4 + n;
    }
    out
}

fn hash(data: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data {
        h = (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Builds `fuzz/corpus/` from the frames real jobs sent (`SPOFF_RECORD_FRAMES=DIR` on the SPs,
/// then `SPOFF_RECORDED=DIR` here; `scripts/fuzz.sh corpus` does both).
#[test]
#[ignore = "builds the seed corpus from recorded traffic (scripts/fuzz.sh corpus)"]
fn build_corpus() {
    let dir = PathBuf::from(std::env::var("SPOFF_RECORDED").expect("SPOFF_RECORDED=DIR"));
    let out = fuzz_dir().join("corpus");
    let mut written = std::collections::BTreeMap::<&str, usize>::new();
    let mut put = |target: &'static str, data: &[u8]| {
        let n = written.entry(target).or_default();
        if *n >= 120 || data.len() > 8192 {
            return;
        }
        let d = out.join(target);
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join(hash(data));
        if !p.exists() {
            std::fs::write(p, data).unwrap();
            *n += 1;
        }
    };
    let mut by_kind: Vec<Vec<Vec<u8>>> = vec![vec![]; bootstrap::kinds::KINDS.len()];
    for (path, stream) in inputs(&dir) {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let fs = frames(&stream);
        if name.starts_with("host-") {
            // The hello with each later frame on its own.
            if let Some((hello, rest)) = fs.split_first() {
                for f in rest.iter().take(40) {
                    put("host_frames", &[hello.as_slice(), f.as_slice()].concat());
                }
            }
        } else {
            for f in &fs {
                put("peer_frames", f);
                if let Ok(
                    bootstrap::wire::SpToSp::Coll { msg, .. }
                    | bootstrap::wire::SpToSp::Data { msg, .. },
                ) = bootstrap::wire::decode::<bootstrap::wire::SpToSp>(&f[4..])
                {
                    // The machine target picks its kind as `KINDS[k % len]`.
                    let kind = bootstrap::kinds::KINDS
                        .iter()
                        .position(|f| f.kind == msg.kind())
                        .expect("every kind is in KINDS");
                    by_kind[kind].push(bootstrap::wire::encode(&msg)[4..].to_vec());
                }
            }
        }
    }
    for (kind, msgs) in by_kind.iter().enumerate() {
        for group in msgs.chunks(6) {
            put("machine", &machine_input(kind as u8, group));
        }
    }
    let key = bootstrap::auth::ClusterKey::from_bytes([7; 32]);
    for (job, uid, size) in [(1u64, 0u32, 4u32), (u64::MAX, 1000, 1), (5, 0, 1 << 20)] {
        put(
            "credential",
            bootstrap::auth::JobCredential::issue(&key, job, uid, size)
                .encode()
                .as_bytes(),
        );
    }
    put("credential", b"spoffjob1:00:0:4:zz");
    // Multicast datagrams come from no recorded stream (they are not framed): generated.
    for seed in service_process::fuzz_targets::mcast_datagram_seeds() {
        put("mcast_datagram", &seed);
    }
    eprintln!("corpus written: {written:?}");
    assert!(
        written.len() == service_process::fuzz_targets::TARGETS.len(),
        "every target needs inputs: {written:?}"
    );
}

/// The generated seeds of `mcast_datagram` are in its corpus, under their hashes (written by
/// `build_corpus`; `SPOFF_WRITE_MCAST_SEEDS=1` writes just them): a change of the datagram
/// format that leaves the kept corpus behind fails here.
#[test]
fn the_mcast_datagram_corpus_holds_the_generated_seeds() {
    let dir = fuzz_dir().join("corpus").join("mcast_datagram");
    for seed in service_process::fuzz_targets::mcast_datagram_seeds() {
        let p = dir.join(hash(&seed));
        if std::env::var_os("SPOFF_WRITE_MCAST_SEEDS").is_some() {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&p, &seed).unwrap();
        }
        assert_eq!(
            std::fs::read(&p).ok().as_deref(),
            Some(&seed[..]),
            "{} missing or stale",
            p.display()
        );
    }
}
