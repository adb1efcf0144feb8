//! Recording received frames (`SPOFF_RECORD_FRAMES=DIR`): each connection's frames, length
//! prefix included, appended to `DIR/<host|peer>-sp<id>-<connection>.bin`, the same stream the
//! fuzzer's `host_frames` and `peer_frames` targets take. This is how the fuzzer's seed corpus
//! comes from real traffic (`scripts/fuzz.sh corpus`). Bounded: at most [`MAX_FILES`] files of
//! at most [`MAX_FILE_BYTES`] each; nothing is recorded unless the variable is set.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

const MAX_FILES: usize = 200;
const MAX_FILE_BYTES: usize = 64 << 10;

pub struct Recorder {
    dir: PathBuf,
    sp: u32,
    written: HashMap<u64, usize>,
}

impl Recorder {
    pub fn from_env(sp: u32) -> Option<Recorder> {
        let dir = PathBuf::from(std::env::var_os("SPOFF_RECORD_FRAMES")?);
        std::fs::create_dir_all(&dir).ok()?;
        Some(Recorder {
            dir,
            sp,
            written: HashMap::new(),
        })
    }

    /// Appends one frame of connection `conn` (a `kind` connection: host or peer).
    pub fn record(&mut self, kind: &str, conn: u64, payload: &[u8]) {
        if !self.written.contains_key(&conn) && self.written.len() >= MAX_FILES {
            return;
        }
        let n = self.written.entry(conn).or_insert(0);
        if *n + payload.len() + 4 > MAX_FILE_BYTES {
            return;
        }
        *n += payload.len() + 4;
        let path = self.dir.join(format!("{kind}-sp{}-{conn}.bin", self.sp));
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = f.write_all(&bootstrap::wire::frame(payload));
        }
    }
}
