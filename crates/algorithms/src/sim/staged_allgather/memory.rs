//! Provenance memory: buffers as extents of known origin.

use super::*;

// ---- provenance memory ----------------------------------------------------

/// Where the bytes of an extent come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Src {
    /// Never written: byte at position `p` is `sentinel(p)`.
    Init,
    /// The send block of this rank.
    Send(Rank),
    /// Unknown (a failed copy, or staging never filled).
    Garbage,
}

/// `len` bytes equal to bytes `base..base + len` of `src`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Ext {
    pub(super) len: u64,
    pub(super) src: Src,
    pub(super) base: u64,
}

impl Ext {
    pub(super) fn continued_by(&self, next: &Ext) -> bool {
        self.src == next.src && (self.src == Src::Garbage || self.base + self.len == next.base)
    }
}

/// A buffer of `size` bytes as extents keyed by their start.
#[derive(Clone, Debug)]
pub(super) struct Mem {
    pub(super) size: u64,
    pub(super) ext: BTreeMap<u64, Ext>,
}

impl Mem {
    pub(super) fn new(size: u64, src: Src) -> Mem {
        let mut ext = BTreeMap::new();
        if size > 0 {
            ext.insert(
                0,
                Ext {
                    len: size,
                    src,
                    base: 0,
                },
            );
        }
        Mem { size, ext }
    }

    /// Make an extent start at `at`.
    pub(super) fn split(&mut self, at: u64) {
        if at == 0 || at >= self.size {
            return;
        }
        let (&start, &e) = self.ext.range(..=at).next_back().expect("covered");
        if start == at {
            return;
        }
        let left = at - start;
        self.ext.insert(start, Ext { len: left, ..e });
        self.ext.insert(
            at,
            Ext {
                len: e.len - left,
                src: e.src,
                base: e.base + left,
            },
        );
    }

    /// The extents of bytes `at..at + len` (`at + len <= size`).
    pub(super) fn read(&self, at: u64, len: u64) -> Vec<Ext> {
        let end = at + len;
        let mut out = Vec::new();
        if len == 0 {
            return out;
        }
        let first = *self.ext.range(..=at).next_back().expect("covered").0;
        for (&s, e) in self.ext.range(first..end) {
            let (lo, hi) = (s.max(at), (s + e.len).min(end));
            out.push(Ext {
                len: hi - lo,
                src: e.src,
                base: if e.src == Src::Garbage {
                    0
                } else {
                    e.base + (lo - s)
                },
            });
        }
        out
    }

    /// Overwrite bytes from `at` with `pieces`.
    pub(super) fn write(&mut self, at: u64, pieces: &[Ext]) {
        let mut ps: Vec<Ext> = Vec::with_capacity(pieces.len());
        for p in pieces.iter().filter(|p| p.len > 0) {
            match ps.last_mut() {
                Some(l) if l.continued_by(p) => l.len += p.len,
                _ => ps.push(*p),
            }
        }
        let len: u64 = ps.iter().map(|p| p.len).sum();
        let end = at + len;
        assert!(end <= self.size, "write past the end of a buffer");
        if len == 0 {
            return;
        }
        // Cut `at..end` out.
        let (&s, &e) = self.ext.range(..=at).next_back().expect("covered");
        if s + e.len >= end {
            // One extent covers it (the common case): keep its ends.
            if end < s + e.len {
                let base = if e.src == Src::Garbage {
                    0
                } else {
                    e.base + (end - s)
                };
                self.ext.insert(
                    end,
                    Ext {
                        len: s + e.len - end,
                        src: e.src,
                        base,
                    },
                );
            }
            if at > s {
                self.ext.get_mut(&s).unwrap().len = at - s;
            } else {
                self.ext.remove(&s);
            }
        } else {
            self.split(at);
            self.split(end);
            while let Some((&k, _)) = self.ext.range(at..end).next() {
                self.ext.remove(&k);
            }
        }
        // Put the pieces in, merged with their neighbours.
        let (mut pos, mut skip, mut last) = (at, 0, None);
        if let Some((&k, pred)) = self.ext.range_mut(..at).next_back() {
            if pred.continued_by(&ps[0]) {
                pred.len += ps[0].len;
                pos += ps[0].len;
                skip = 1;
                last = Some(k);
            }
        }
        for p in &ps[skip..] {
            self.ext.insert(pos, *p);
            last = Some(pos);
            pos += p.len;
        }
        let last = last.expect("something was written");
        if let Some(&succ) = self.ext.get(&end) {
            if self.ext[&last].continued_by(&succ) {
                self.ext.remove(&end);
                self.ext.get_mut(&last).unwrap().len += succ.len;
            }
        }
    }

    /// First byte at or after `from` that is not untouched.
    pub(super) fn touched_from(&self, from: u64) -> Option<u64> {
        if from >= self.size {
            return None;
        }
        let mut pos = from;
        for e in self.read(from, self.size - from) {
            if e.src != Src::Init || e.base != pos {
                return Some(pos);
            }
            pos += e.len;
        }
        None
    }

    /// First byte of `0..p * len` that is not byte `j % len` of the block of
    /// rank `j / len`.
    pub(super) fn wrong_block_byte(&self, p: u64, len: u64) -> Option<u64> {
        let mut pos = 0;
        for e in self.read(0, p * len) {
            let s = pos / len;
            let ok = e.src == Src::Send(s as Rank)
                && e.base == pos - s * len
                && (pos + e.len - 1) / len == s;
            if !ok {
                return Some(pos);
            }
            pos += e.len;
        }
        None
    }
}
