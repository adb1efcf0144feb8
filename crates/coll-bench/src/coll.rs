//! What `overlap` measures: the collectives, their designs and data layouts, and the limits of
//! a size.

use clap::ValueEnum;

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coll {
    /// MPI_Ialltoallv, every rank sends SIZE bytes to every rank (MPI_BYTE)
    Ialltoallv,
    /// MPI_Ialltoall, every rank sends SIZE bytes to every rank (MPI_BYTE)
    Ialltoall,
    /// MPI_Iallgatherv, every rank contributes SIZE bytes (MPI_BYTE)
    Iallgatherv,
    /// MPI_Iallgather, every rank contributes SIZE bytes (MPI_BYTE)
    Iallgather,
    /// MPI_Ibcast, SIZE bytes (MPI_BYTE) from a root that rotates: rank (iteration % ranks)
    Ibcast,
    /// MPI_Iallreduce, SIZE bytes as 64-bit integers (MPI_INT64_T), MPI_SUM
    Iallreduce,
}

impl Coll {
    pub fn name(self) -> &'static str {
        match self {
            Coll::Ialltoallv => "ialltoallv",
            Coll::Ialltoall => "ialltoall",
            Coll::Iallgatherv => "iallgatherv",
            Coll::Iallgather => "iallgather",
            Coll::Ibcast => "ibcast",
            Coll::Iallreduce => "iallreduce",
        }
    }

    /// Allgather family: one send block of SIZE bytes, the same block goes to every rank.
    pub fn is_allgather(self) -> bool {
        matches!(self, Coll::Iallgatherv | Coll::Iallgather)
    }

    /// The environment variable through which the shim takes this collective's design, if it
    /// has a design choice.
    pub fn design_env(self) -> Option<&'static str> {
        match self {
            Coll::Ibcast => Some("SPOFF_BCAST_DESIGN"),
            Coll::Iallgather => Some("SPOFF_IALLGATHER_DESIGN"),
            Coll::Iallreduce => Some("SPOFF_ALLREDUCE_DESIGN"),
            _ => None,
        }
    }

    /// Bytes of the send and receive buffers for SIZE on `n` ranks (before the at-least-one
    /// rule of [`run_size`]). Ibcast has one buffer, here the receive buffer.
    pub fn buffer_lens(self, n: usize, size: usize) -> (usize, usize) {
        match self {
            Coll::Ibcast => (0, size),
            Coll::Iallreduce => (size, size),
            c if c.is_allgather() => (size, n * size),
            _ => (n * size, n * size),
        }
    }
}

/// How `overlap` describes its data to MPI (`--datatype`).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataLayout {
    /// contiguous MPI_BYTE
    Byte,
    /// 8 data bytes then an 8-byte hole per element
    Strided,
}

impl DataLayout {
    pub fn name(self) -> &'static str {
        match self {
            DataLayout::Byte => "byte",
            DataLayout::Strided => "strided",
        }
    }
}

/// Designs of an offloaded collective, as the shim names them.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Design {
    /// staged: the service processes write every rank's buffer from their staging memory
    Flat,
    /// staged, hierarchical: a service process writes each chunk once into a segment shared by
    /// the ranks it serves, which copy out of it in the wait
    Hier,
    /// iallgather only: the hierarchical allgather with load-balanced late arrivals (after
    /// MIMOSA)
    Lb,
    /// let the shim choose by the number of ranks per service process
    Auto,
    /// multicast: a root's service process multicasts its chunks, the others' receive workers
    /// land them, a fetch ring recovers what was dropped (`SPOFF_BCAST_DESIGN=mcast`,
    /// `SPOFF_IALLGATHER_DESIGN=mcast`)
    Mcast,
    /// iallreduce only: the service processes reduce along a binomial tree
    /// (`SPOFF_ALLREDUCE_DESIGN=sp-tree`; auto picks it where no switch aggregates)
    #[value(name = "sp-tree")]
    SpTree,
    /// iallreduce only: each service process reduces its ranks' data and the Canary switches
    /// of the cluster combine them (`SPOFF_ALLREDUCE_DESIGN=canary`; run under `launch
    /// --canary-tree`)
    Canary,
}

impl Design {
    pub fn name(self) -> &'static str {
        match self {
            Design::Flat => "flat",
            Design::Hier => "hier",
            Design::Lb => "lb",
            Design::Auto => "auto",
            Design::Mcast => "mcast",
            Design::SpTree => "sp-tree",
            Design::Canary => "canary",
        }
    }
}

/// Whether `coll` accepts `design`: ibcast flat|hier|mcast|auto, iallgather
/// flat|hier|lb|mcast|auto, iallreduce sp-tree|canary|auto, the others only auto.
pub fn check_design(coll: Coll, design: Design) -> Result<(), String> {
    match (coll, design) {
        (_, Design::Auto) | (Coll::Iallreduce, Design::SpTree | Design::Canary) => Ok(()),
        (Coll::Iallreduce, d) => Err(format!(
            "--design {} does not apply to --coll iallreduce: it takes sp-tree, canary or auto",
            d.name()
        )),
        (_, Design::SpTree | Design::Canary) => Err(format!(
            "--design {} is an allreduce design, only for --coll iallreduce; {} does not take it",
            design.name(),
            coll.name()
        )),
        (Coll::Iallgather, _) => Ok(()),
        (Coll::Ibcast, Design::Flat | Design::Hier | Design::Mcast) => Ok(()),
        (Coll::Ibcast, Design::Lb) => Err(
            "--design lb is the load-balanced allgather, only for --coll iallgather; \
             ibcast takes flat, hier or auto"
                .into(),
        ),
        (c, d) => Err(format!(
            "--design {} does not apply to --coll {}: only ibcast (flat|hier|auto) and \
             iallgather (flat|hier|lb|auto) have a design choice",
            d.name(),
            c.name()
        )),
    }
}

/// The root of a broadcast in iteration `iter`: it rotates through the ranks.
pub fn bcast_root(iter: u64, n: usize) -> usize {
    (iter % n.max(1) as u64) as usize
}

/// Why a size cannot be run on `ranks` ranks (counts and displacements are MPI ints in
/// elements of MPI_BYTE), or `None`.
pub fn size_error(coll: Coll, sizes: &[usize], ranks: usize) -> Option<String> {
    let max = i32::MAX as usize;
    if coll == Coll::Iallreduce {
        let bad = sizes.iter().find(|&&s| s % 8 != 0 || s / 8 > max)?;
        return Some(format!(
            "iallreduce sums 64-bit integers: size {bad} is not a multiple of 8 bytes or \
             does not fit an MPI int count"
        ));
    }
    if coll == Coll::Ibcast {
        let bad = sizes.iter().find(|&&s| s > max)?;
        return Some(format!(
            "size {bad} does not fit an MPI int count (at most {max} bytes)"
        ));
    }
    let bad = sizes
        .iter()
        .find(|&&s| !matches!(s.checked_mul(ranks), Some(t) if t <= max))?;
    Some(format!(
        "size {bad} x {ranks} ranks does not fit MPI int displacements \
         (at most {max} bytes per rank in total)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn designs_per_collective() {
        use Design::*;
        for d in [Flat, Hier, Auto, Mcast] {
            assert_eq!(check_design(Coll::Ibcast, d), Ok(()));
        }
        assert_eq!(check_design(Coll::Iallgather, Mcast), Ok(()));
        let e = check_design(Coll::Ibcast, Lb).unwrap_err();
        assert!(e.contains("only for --coll iallgather"), "{e}");
        for d in [Flat, Hier, Lb, Auto] {
            assert_eq!(check_design(Coll::Iallgather, d), Ok(()));
        }
        for c in [Coll::Ialltoallv, Coll::Ialltoall, Coll::Iallgatherv] {
            assert_eq!(check_design(c, Auto), Ok(()));
            for d in [Flat, Hier, Lb] {
                let e = check_design(c, d).unwrap_err();
                assert!(e.contains(c.name()) && e.contains(d.name()), "{e}");
            }
        }
        assert_eq!(Coll::Ibcast.design_env(), Some("SPOFF_BCAST_DESIGN"));
        assert_eq!(
            Coll::Iallgather.design_env(),
            Some("SPOFF_IALLGATHER_DESIGN")
        );
        assert_eq!(Coll::Iallgatherv.design_env(), None);
        assert_eq!(Coll::Ialltoallv.design_env(), None);
    }

    #[test]
    fn bcast_root_rotates_through_every_rank() {
        for n in 1..=5 {
            let phase = 2u64 << 32;
            let mut roots: Vec<usize> = (0..n as u64).map(|i| bcast_root(phase | i, n)).collect();
            roots.sort();
            assert_eq!(roots, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn buffers_and_size_limits() {
        assert_eq!(Coll::Ibcast.buffer_lens(4, 100), (0, 100));
        assert_eq!(Coll::Iallgather.buffer_lens(4, 100), (100, 400));
        assert_eq!(Coll::Ialltoallv.buffer_lens(4, 100), (400, 400));
        let big = 1usize << 30;
        assert_eq!(size_error(Coll::Ibcast, &[0, big], 4), None);
        assert!(size_error(Coll::Ibcast, &[1 << 31], 4).is_some());
        let e = size_error(Coll::Ialltoallv, &[1, big], 4).unwrap();
        assert!(e.starts_with("size 1073741824 x 4 ranks"), "{e}");
    }
}
