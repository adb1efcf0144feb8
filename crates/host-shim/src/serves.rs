//! Which grant backend a rank uses, decided at `MPI_Init` from what its SP serves it.
//!
//! The SP's answer to the registration lists the backends it serves this connection
//! (`wire::Serves`: `cma` where it can attach to the rank, `ucx` where UCX is on in it).
//! Each rank chooses on its own ([`choose`]): `SPOFF_BACKEND` if set, else `cma` on the SP's
//! kernel and `ucx` over TCP from another machine; when its SP does not serve that one, the
//! other one it serves. Then the job agrees ([`agree`], one reduction): if some rank has no
//! backend its SP serves, or some rank grants through `ucx` while an SP of the job does not
//! serve it (that SP could not reach the rank's buffers), the whole job runs natively, and the
//! lowest rank that knows why says so, once for the job. A grant no SP of the job serves is
//! never posted, so the first collective is never refused for it.

use crate::boundary::say;
use crate::grants::{Backend, Grants};
use alias_mkey::host::Registrar;
use bootstrap::wire::Serves;
use mpi_ffi as ffi;
use mpi_ffi::consts;
use std::os::raw::c_int;

/// What `SPOFF_BACKEND` asks for: `None` when unset (the default), a bad value said once by
/// the rank and taken as `cma`, as before.
pub fn asked(parsed: &Result<Backend, String>, rank: u32) -> Option<Backend> {
    std::env::var_os("SPOFF_BACKEND").filter(|v| !v.is_empty())?;
    Some(match parsed {
        Ok(b) => *b,
        Err(why) => {
            say!("rank {rank}: {why}");
            Backend::Cma
        }
    })
}

fn name(b: Backend) -> &'static str {
    match b {
        Backend::Cma => "cma",
        Backend::Ucx => "ucx",
        Backend::UcxExport => "ucx-export",
    }
}

fn served(b: Backend, s: Serves) -> bool {
    match b {
        Backend::Cma => s.cma,
        Backend::Ucx => s.ucx,
        Backend::UcxExport => s.ucx_export,
    }
}

/// Why an SP does not serve `b`.
fn why_not(b: Backend) -> &'static str {
    match b {
        Backend::Cma => {
            "it cannot attach to this process over TCP: see serve --hosts-same-kernel and \
             SPOFF_HOSTS_SAME_KERNEL"
        }
        Backend::Ucx | Backend::UcxExport => "UCX is off on it: see serve --ucx",
    }
}

/// A rank's choice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    /// What it asked for (or the default).
    Wanted(Backend),
    /// `SPOFF_BACKEND` asked for a backend its SP does not serve (why); it takes this one.
    Other(Backend, String),
    /// Its SP serves it no backend it can use (why).
    Nothing(String),
}

/// The backend of a rank that asked for `asked` (`None`: the default), reaches its SP over
/// TCP from another machine (`remote`), and whose SP `sp` (at `at`) serves it `serves`.
pub fn choose(asked: Option<Backend>, remote: bool, serves: Serves, sp: u32, at: &str) -> Choice {
    let default = if remote { Backend::Ucx } else { Backend::Cma };
    let want = asked.unwrap_or(default);
    if served(want, serves) {
        return Choice::Wanted(want);
    }
    let other = if want == Backend::Cma {
        Backend::Ucx
    } else {
        Backend::Cma
    };
    let refused = format!(
        "SP {sp} at {at} does not serve {} grants ({}); it serves this rank {serves}",
        name(want),
        why_not(want)
    );
    match asked {
        Some(_) if served(other, serves) => Choice::Other(
            other,
            format!(
                "SPOFF_BACKEND={}: {refused}, so ranks whose SP does not serve it grant through {}",
                name(want),
                name(other)
            ),
        ),
        Some(_) => Choice::Nothing(format!("SPOFF_BACKEND={}: {refused}", name(want))),
        None if served(other, serves) => Choice::Wanted(other),
        None if remote => Choice::Nothing(format!(
            "{refused} (a rank that reaches its SP over TCP from another machine grants memory \
             through ucx)"
        )),
        None => Choice::Nothing(refused),
    }
}

/// Chooses this rank's backend and sets its grants up, then agrees with the whole job
/// (collective: every rank calls it, whatever it found). `None`: the job runs natively (said
/// once, by the lowest rank that knows why).
///
/// # Safety
/// MPI is initialised.
#[allow(clippy::too_many_arguments)]
pub unsafe fn agree(
    asked: Option<Backend>,
    remote: bool,
    serves: Serves,
    registrar: Registrar,
    sp: u32,
    at: &str,
    rank: u32,
    size: u32,
    tcp_ports: Option<bootstrap::cluster::PortRange>,
) -> Option<Grants> {
    let choice = choose(asked, remote, serves, sp, at);
    let (grants, nothing) = match &choice {
        Choice::Wanted(b) | Choice::Other(b, _) => {
            let g = Grants::new(registrar, *b, rank, tcp_ports);
            // A rank whose UCX did not initialise grants with cma (it said why).
            let got = g.backend();
            let why = (!served(got, serves)).then(|| {
                format!(
                    "SP {sp} at {at} does not serve {} grants ({}), and {} grants are not \
                     possible here (see above)",
                    name(got),
                    why_not(got),
                    name(*b)
                )
            });
            (Some(g), why)
        }
        Choice::Nothing(why) => (None, Some(why.clone())),
    };
    let uses_ucx = grants.as_ref().is_some_and(|g| g.backend() != Backend::Cma);
    // [lowest rank without a backend, lowest rank that took another backend, a rank grants
    // through ucx, lowest rank whose SP does not serve ucx]: ranks as size - rank, so that
    // MAX finds the lowest (0: none).
    let lowest = |yes: bool| if yes { (size - rank) as c_int } else { 0 };
    let mut v: [c_int; 4] = [
        lowest(nothing.is_some()),
        lowest(matches!(choice, Choice::Other(..))),
        uses_ucx as c_int,
        lowest(!serves.ucx),
    ];
    // SAFETY: in-place reduction over four ints in a live array.
    let rc = unsafe {
        ffi::PMPI_Allreduce(
            consts::IN_PLACE(),
            v.as_mut_ptr().cast(),
            v.len() as c_int,
            consts::INT(),
            consts::OP_MAX(),
            consts::COMM_WORLD(),
        )
    };
    if rc != consts::SUCCESS() {
        if rank == 0 {
            say!("offload is off for this job: cannot agree on the grant backends (MPI error {rc}); running natively");
        }
        return None;
    }
    let me = (size - rank) as c_int;
    if v[0] != 0 {
        if v[0] == me {
            say!(
                "offload is off for this job: world rank {rank}: {}; running natively",
                nothing.unwrap_or_default()
            );
        }
        return None;
    }
    if v[2] != 0 && v[3] != 0 {
        if v[3] == me {
            say!(
                "offload is off for this job: ranks grant memory through ucx, which SP {sp} (world rank {rank}'s, at {at}) does not serve (UCX is off on it: see serve --ucx); running natively"
            );
        }
        return None;
    }
    if v[1] == me {
        if let Choice::Other(_, why) = &choice {
            say!("{why}");
        }
    }
    grants
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: Serves = Serves {
        cma: false,
        ucx: false,
        ucx_export: false,
    };
    const CMA: Serves = Serves {
        cma: true,
        ucx: false,
        ucx_export: false,
    };
    const UCX: Serves = Serves {
        cma: false,
        ucx: true,
        ucx_export: true,
    };
    const BOTH: Serves = Serves {
        cma: true,
        ucx: true,
        ucx_export: true,
    };

    fn c(asked: Option<Backend>, remote: bool, s: Serves) -> Choice {
        choose(asked, remote, s, 1, "tcp:10.0.0.1:7000")
    }

    #[test]
    fn defaults_follow_the_connection_and_what_the_sp_serves() {
        assert_eq!(c(None, false, BOTH), Choice::Wanted(Backend::Cma));
        assert_eq!(c(None, true, BOTH), Choice::Wanted(Backend::Ucx));
        assert_eq!(c(None, false, UCX), Choice::Wanted(Backend::Ucx));
        assert_eq!(c(None, true, CMA), Choice::Wanted(Backend::Cma));
        let Choice::Nothing(why) = c(None, true, NONE) else {
            panic!()
        };
        assert!(
            why.contains("SP 1 at tcp:10.0.0.1:7000 does not serve ucx grants (UCX is off on it: see serve --ucx)")
                && why.contains("serves this rank no grant backend")
                && why.contains("over TCP from another machine"),
            "{why}"
        );
    }

    #[test]
    fn an_asked_backend_falls_back_only_to_one_served() {
        assert_eq!(
            c(Some(Backend::Ucx), false, BOTH),
            Choice::Wanted(Backend::Ucx)
        );
        let Choice::Other(b, why) = c(Some(Backend::Ucx), false, CMA) else {
            panic!()
        };
        assert_eq!(b, Backend::Cma);
        assert!(why.starts_with("SPOFF_BACKEND=ucx: SP 1"), "{why}");
        let Choice::Nothing(why) = c(Some(Backend::Cma), true, NONE) else {
            panic!()
        };
        assert!(
            why.contains("does not serve cma grants") && why.contains("hosts-same-kernel"),
            "{why}"
        );
        assert!(matches!(
            c(Some(Backend::UcxExport), true, UCX),
            Choice::Wanted(Backend::UcxExport)
        ));
    }
}
