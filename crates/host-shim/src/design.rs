//! Which staged design (flat or hierarchical) a staged collective takes, whether the job's
//! bcasts and allgathers take the multicast designs (agreed by every rank at `MPI_Init`,
//! [`agree_mcast`]), and the other per-job settings of the collectives, read once from the
//! environment. Every input is the same on every rank of a collective (the message length, the
//! communicator's nodes, and, in a correct job, the environment), so every rank decides alike.

use crate::boundary::say;
use bootstrap::wire::{CollKind, StagedDesign};
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::raw::c_int;

/// The design of a staged collective of `kind` moving `len` bytes to each rank, on a
/// communicator whose members are on the emulated nodes `nodes`. A message larger than the
/// segment part (`SPOFF_SEGMENT_BYTES`) is always `Flat`; otherwise the kind's design variable
/// (`KindFacts::design_var`: `SPOFF_BCAST_DESIGN` for a bcast, `SPOFF_IALLGATHER_DESIGN` for a
/// staged iallgather) `=flat|hier` forces one, and `auto` picks `Hier` when some node has at
/// least `SPOFF_HIER_MIN_RANKS` (default the kind's `KindFacts::hier_min_ranks`) of the
/// members (the hierarchical designs write once per node). Without
/// a node segment (`segment_shared` false: ranks reached over TCP from another machine, which
/// share no memory with their SP) every design is `Flat`. The
/// nodes and the length are the same on every rank (and so, in a correct job, is the
/// environment), so every rank decides alike. The variables are read once, at the first
/// `MPI_Ibcast`/`MPI_Bcast` or `MPI_Iallgather` (a post is on the host's critical path).
pub fn staged_design(
    kind: CollKind,
    max_per_node: usize,
    len: u64,
    segment_shared: bool,
) -> StagedDesign {
    if !segment_shared {
        return StagedDesign::Flat;
    }
    let env = staged_env();
    let facts = kind.facts();
    let min = env.min_ranks.unwrap_or(facts.hier_min_ranks);
    choose_design(design_var(kind), min, max_per_node, len, env.part)
}

/// The value of `kind`'s design variable (`KindFacts::design_var`), trimmed, as read at first
/// use; `None` if unset or if the kind has none.
fn design_var(kind: CollKind) -> Option<&'static str> {
    let name = kind.facts().design_var?;
    staged_env()
        .designs
        .iter()
        .find(|(var, _)| *var == name)
        .and_then(|(_, v)| v.as_deref())
}

/// The environment of the staged designs, as read at first use.
struct StagedEnv {
    /// Every kind's design variable (`SPOFF_BCAST_DESIGN`, `SPOFF_IALLGATHER_DESIGN`) and its
    /// value, trimmed.
    designs: Vec<(&'static str, Option<String>)>,
    /// `SPOFF_HIER_MIN_RANKS`, if set to a number.
    min_ranks: Option<usize>,
    /// The segment part (`SPOFF_SEGMENT_BYTES`).
    part: u64,
}

fn staged_env() -> &'static StagedEnv {
    static ENV: std::sync::OnceLock<StagedEnv> = std::sync::OnceLock::new();
    ENV.get_or_init(|| {
        let var = |k: &str| std::env::var(k).ok().map(|v| v.trim().to_owned());
        StagedEnv {
            designs: bootstrap::kinds::KINDS
                .iter()
                .filter_map(|f| f.design_var)
                .map(|name| (name, var(name)))
                .collect(),
            min_ranks: var("SPOFF_HIER_MIN_RANKS").and_then(|v| v.parse().ok()),
            part: crate::segment::configured_len(),
        }
    })
}

/// [`staged_design`] once the environment is read: `forced` the design variable, `min` the
/// threshold, `max_per_node` the most members on one node, `part` the segment part.
fn choose_design(
    forced: Option<&str>,
    min: usize,
    max_per_node: usize,
    len: u64,
    part: u64,
) -> StagedDesign {
    if len > part {
        return StagedDesign::Flat;
    }
    match forced.map(str::trim) {
        Some("flat") => return StagedDesign::Flat,
        Some("hier") => return StagedDesign::Hier,
        _ => {}
    }
    if max_per_node >= min {
        StagedDesign::Hier
    } else {
        StagedDesign::Flat
    }
}

/// `MPI_Iallgather` takes the staged designs when `SPOFF_IALLGATHER_DESIGN` is `flat`, `hier`
/// or `auto` (the staged pair chosen by ranks per node); unset or `lb`, it takes the
/// load-balanced hierarchical allgather (issue 3's), as every other allgather does.
pub fn iallgather_staged() -> bool {
    matches!(
        design_var(CollKind::StagedAllgather),
        Some("flat" | "hier" | "auto")
    )
}

/// The multicast kinds and the staged kind whose design variable asks for each:
/// `SPOFF_BCAST_DESIGN=mcast` for the Bcast, `SPOFF_IALLGATHER_DESIGN=mcast` for the Allgather
/// (`MPI_Allgather` and `MPI_Iallgather`).
pub const MCAST_KINDS: [(CollKind, CollKind); 2] = [
    (CollKind::McastBcast, CollKind::Bcast),
    (CollKind::McastAllgather, CollKind::StagedAllgather),
];

/// The design variable of `asker` says `mcast` on this rank (read at `MPI_Init`).
pub fn asks_mcast(asker: CollKind) -> bool {
    design_var(asker) == Some("mcast")
}

/// The multicast kinds the job agreed on at `MPI_Init`, by their index in [`MCAST_KINDS`].
static MCAST_ON: [std::sync::atomic::AtomicBool; 2] = [
    std::sync::atomic::AtomicBool::new(false),
    std::sync::atomic::AtomicBool::new(false),
];

pub fn set_mcast(kind: CollKind, on: bool) {
    if let Some(i) = MCAST_KINDS.iter().position(|(k, _)| *k == kind) {
        MCAST_ON[i].store(on, std::sync::atomic::Ordering::Release);
    }
}

fn mcast_on(kind: CollKind) -> bool {
    MCAST_KINDS
        .iter()
        .position(|(k, _)| *k == kind)
        .is_some_and(|i| MCAST_ON[i].load(std::sync::atomic::Ordering::Acquire))
}

/// The kind an `MPI_Bcast`/`MPI_Ibcast` posts: the multicast Bcast when the job agreed on it
/// (`SPOFF_BCAST_DESIGN=mcast` on every rank, every SP running it), else the staged Bcast
/// (flat or hierarchical, see [`staged_design`]). `auto` never picks the multicast design:
/// docs/BENCHMARKS.md has not shown where it wins here.
pub fn bcast_kind() -> CollKind {
    if mcast_on(CollKind::McastBcast) {
        CollKind::McastBcast
    } else {
        CollKind::Bcast
    }
}

/// The multicast Allgather for an `MPI_Allgather`/`MPI_Iallgather`: the job agreed on it
/// (`SPOFF_IALLGATHER_DESIGN=mcast` on every rank, every SP running it).
pub fn allgather_mcast() -> bool {
    mcast_on(CollKind::McastAllgather)
}

/// Whether the job takes the multicast `kind`: asked for by `asker`'s design variable saying
/// `mcast` on some rank, it is on only if every rank asks for it and every rank's SP runs it
/// (`mcast_off`: why this rank's does not); else rank 0 says why, once. Collective.
///
/// # Safety
/// MPI is initialised.
pub unsafe fn agree_mcast(
    kind: CollKind,
    asker: CollKind,
    mcast_off: Option<&str>,
    rank: u32,
    size: u32,
) {
    let var = asker.facts().design_var.unwrap_or("the design variable");
    let wants = asks_mcast(asker);
    let mut asking: c_int = wants as c_int;
    // SAFETY: in-place reduction over one int.
    let rc = unsafe {
        ffi::PMPI_Allreduce(
            consts::IN_PLACE(),
            (&mut asking as *mut c_int).cast(),
            1,
            consts::INT(),
            consts::OP_SUM(),
            consts::COMM_WORLD(),
        )
    };
    if rc != consts::SUCCESS() || asking == 0 {
        return;
    }
    let mine = if !wants {
        Some(format!("{var} is not mcast there"))
    } else {
        mcast_off.map(|why| format!("its SP runs no multicast collective: {why}"))
    };
    // What takes the other design, and which one it is.
    let (what, other) = if kind == CollKind::McastBcast {
        ("bcast", "staged")
    } else {
        ("allgather", "load-balanced")
    };
    // SAFETY: forwarded; every rank calls it, as every rank saw `asking > 0`.
    match unsafe { crate::lifecycle::count_failures(mine.as_deref(), rank) } {
        Ok(None) => set_mcast(kind, true),
        Ok(Some((n, first, why))) => {
            if rank == 0 {
                say!(
                    "{var}=mcast: {n} of {size} ranks cannot take the multicast design (rank \
                     {first}: {why}); every {what} of this job takes the {other} design"
                );
            }
        }
        Err(rc) => {
            if rank == 0 {
                say!(
                    "{var}=mcast: the ranks could not agree (MPI error {rc}); every {what} of \
                     this job takes the {other} design"
                );
            }
        }
    }
}

/// Host-side intra-node copies in blocking allgathervs: on unless `SPOFF_HOST_COPIES=0`.
pub fn host_copies_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPOFF_HOST_COPIES").map_or(true, |v| v.trim() != "0"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_hier_by_ranks_per_node_and_never_beyond_the_segment_part() {
        // 2 nodes x 4 ranks, whatever the SPs per node.
        let nodes = [0, 0, 0, 0, 1, 1, 1, 1];
        let most = crate::comm::max_per_node(&nodes);
        assert_eq!(most, 4);
        let pick = |forced, min, len| choose_design(forced, min, most, len, 1 << 20);
        assert_eq!(pick(None, 4, 100), StagedDesign::Hier);
        assert_eq!(pick(Some("auto"), 5, 100), StagedDesign::Flat);
        assert_eq!(pick(None, 8, 100), StagedDesign::Flat);
        assert_eq!(pick(Some(" hier "), 8, 100), StagedDesign::Hier);
        assert_eq!(pick(Some("flat"), 1, 100), StagedDesign::Flat);
        // A message larger than an SP's part of the segment is flat, even if forced.
        assert_eq!(pick(Some("hier"), 1, (1 << 20) + 1), StagedDesign::Flat);
        assert_eq!(pick(None, 1, 1 << 20), StagedDesign::Hier);
        // One crowded node is enough.
        let skewed = crate::comm::max_per_node(&[0, 1, 0, 0]);
        assert_eq!(skewed, 3);
        assert_eq!(choose_design(None, 3, skewed, 1, 64), StagedDesign::Hier);
        assert_eq!(crate::comm::max_per_node(&[]), 0);
    }

    #[test]
    fn without_a_shared_segment_every_design_is_flat() {
        for kind in CollKind::all().filter(|k| k.facts().is_staged()) {
            assert_eq!(staged_design(kind, 1 << 10, 1, false), StagedDesign::Flat);
        }
    }
}
