//! Posting the collectives and completing them with every member of the Wait/Test family.

use crate::checker::Checker;
use crate::fail::abort;
use crate::inst::{Inst, Kind};
use crate::rng::Rng;
use crate::types::Ty;
use mpi_ffi::consts as c;
use mpi_ffi::{MPI_Request, MPI_Status};
use std::os::raw::c_int;
use std::time::{Duration, Instant};

/// Posts (or, for the blocking kinds, runs) `inst` through MPI_* or PMPI_*. The caller keeps
/// `inst` alive and unmoved until a nonblocking request completes.
pub fn post(inst: &mut Inst, types: &[Ty], pmpi: bool, req: &mut MPI_Request) {
    let dt = types[inst.ty].dt;
    let (sb, rb) = (
        inst.send.as_ptr().cast(),
        if pmpi {
            inst.reference.as_mut_ptr()
        } else {
            inst.recv.as_mut_ptr()
        }
        .cast(),
    );
    let (sc, sd, rc, rd) = (
        inst.scounts.as_ptr(),
        inst.sdispls.as_ptr(),
        inst.rcounts.as_ptr(),
        inst.rdispls.as_ptr(),
    );
    let cnt = inst.scounts.first().copied().unwrap_or(0);
    let comm = inst.comm;
    match (inst.kind, pmpi) {
        (Kind::Ialltoallv, false) => {
            mpi!(MPI_Ialltoallv(sb, sc, sd, dt, rb, rc, rd, dt, comm, req))
        }
        (Kind::Ialltoallv, true) => {
            mpi!(PMPI_Ialltoallv(sb, sc, sd, dt, rb, rc, rd, dt, comm, req))
        }
        (Kind::Alltoallv, false) => mpi!(MPI_Alltoallv(sb, sc, sd, dt, rb, rc, rd, dt, comm)),
        (Kind::Alltoallv, true) => mpi!(PMPI_Alltoallv(sb, sc, sd, dt, rb, rc, rd, dt, comm)),
        (Kind::Ialltoall, false) => mpi!(MPI_Ialltoall(sb, cnt, dt, rb, cnt, dt, comm, req)),
        (Kind::Ialltoall, true) => mpi!(PMPI_Ialltoall(sb, cnt, dt, rb, cnt, dt, comm, req)),
        (Kind::Alltoall, false) => mpi!(MPI_Alltoall(sb, cnt, dt, rb, cnt, dt, comm)),
        (Kind::Alltoall, true) => mpi!(PMPI_Alltoall(sb, cnt, dt, rb, cnt, dt, comm)),
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Slot {
    Coll(usize),
    Send,
    Recv,
    Null,
}

#[derive(Clone, Copy, Debug)]
pub enum Method {
    Wait,
    Waitall,
    Waitany,
    Waitsome,
    Test,
    Testall,
    Testany,
    Testsome,
    TestThenWaitall,
}

pub const METHODS: [Method; 9] = [
    Method::Wait,
    Method::Waitall,
    Method::Waitany,
    Method::Waitsome,
    Method::Test,
    Method::Testall,
    Method::Testany,
    Method::Testsome,
    Method::TestThenWaitall,
];

/// A request that is still pending after this long is reported and the job aborted.
pub const STUCK: Duration = Duration::from_secs(60);

pub struct Completion<'a> {
    pub op: u64,
    pub reqs: Vec<MPI_Request>,
    pub slots: Vec<Slot>,
    pub done: Vec<bool>,
    pub ring_left: i32,
    pub ring_tag: i32,
    pub checker: &'a mut Checker,
    pub started: Instant,
}

impl Completion<'_> {
    pub fn completed(&mut self, i: usize, status: Option<&MPI_Status>) {
        if i >= self.slots.len() {
            self.checker.report(format!(
                "op={} completion reported index {i} out of range",
                self.op
            ));
            return;
        }
        if self.slots[i] == Slot::Null {
            self.checker.report(format!(
                "op={} completion reported MPI_REQUEST_NULL entry {i}",
                self.op
            ));
            return;
        }
        if std::mem::replace(&mut self.done[i], true) {
            self.checker.report(format!(
                "op={} request {i} ({:?}) completed twice",
                self.op, self.slots[i]
            ));
        }
        if let (Slot::Recv, Some(st)) = (self.slots[i], status) {
            if st.MPI_SOURCE != self.ring_left || st.MPI_TAG != self.ring_tag {
                self.checker.report(format!(
                    "op={} Irecv status source={} tag={}, expected source={} tag={}",
                    self.op, st.MPI_SOURCE, st.MPI_TAG, self.ring_left, self.ring_tag
                ));
            }
        }
    }

    pub fn check_stuck(&self, method: Method) {
        if self.started.elapsed() > STUCK {
            let pending: Vec<String> = (0..self.slots.len())
                .filter(|&i| self.slots[i] != Slot::Null && !self.done[i])
                .map(|i| format!("{i}:{:?}", self.slots[i]))
                .collect();
            eprintln!(
                "alltoallv_check: STUCK: rank {} op {} {method:?}: requests still pending after {:?}: {}",
                self.checker.wrank,
                self.op,
                STUCK,
                pending.join(", ")
            );
            abort(5);
        }
    }

    pub fn run(&mut self, method: Method, ignore: bool, r: &mut Rng) {
        let n = self.reqs.len();
        let nc = n as c_int;
        let mut sts = vec![MPI_Status::default(); n.max(1)];
        let mut st = MPI_Status::default();
        let one = |st: &mut MPI_Status| {
            if ignore {
                c::STATUS_IGNORE()
            } else {
                st as *mut _
            }
        };
        let many = |sts: &mut Vec<MPI_Status>| {
            if ignore {
                c::STATUSES_IGNORE()
            } else {
                sts.as_mut_ptr()
            }
        };
        let status_of = |i: usize, sts: &[MPI_Status]| if ignore { None } else { Some(sts[i]) };
        match method {
            Method::Wait => {
                let mut order: Vec<usize> = (0..n).collect();
                r.shuffle(&mut order);
                for i in order {
                    let was_null = self.slots[i] == Slot::Null;
                    mpi!(MPI_Wait(&mut self.reqs[i], one(&mut st)));
                    if !was_null {
                        self.completed(i, if ignore { None } else { Some(&st) });
                    }
                }
            }
            Method::Waitall => {
                mpi!(MPI_Waitall(nc, self.reqs.as_mut_ptr(), many(&mut sts)));
                for i in 0..n {
                    if self.slots[i] != Slot::Null {
                        self.completed(i, status_of(i, &sts).as_ref());
                    }
                }
            }
            Method::Waitany | Method::Testany => loop {
                let (mut idx, mut flag) = (0, 0);
                if matches!(method, Method::Waitany) {
                    mpi!(MPI_Waitany(
                        nc,
                        self.reqs.as_mut_ptr(),
                        &mut idx,
                        one(&mut st)
                    ));
                    flag = 1;
                } else {
                    mpi!(MPI_Testany(
                        nc,
                        self.reqs.as_mut_ptr(),
                        &mut idx,
                        &mut flag,
                        one(&mut st)
                    ));
                }
                if flag == 0 {
                    self.check_stuck(method);
                    continue;
                }
                if idx == c::UNDEFINED() {
                    break;
                }
                self.completed(idx as usize, if ignore { None } else { Some(&st) });
            },
            Method::Waitsome | Method::Testsome => loop {
                let mut out = 0;
                let mut idxs = vec![0 as c_int; n.max(1)];
                if matches!(method, Method::Waitsome) {
                    mpi!(MPI_Waitsome(
                        nc,
                        self.reqs.as_mut_ptr(),
                        &mut out,
                        idxs.as_mut_ptr(),
                        many(&mut sts)
                    ));
                } else {
                    mpi!(MPI_Testsome(
                        nc,
                        self.reqs.as_mut_ptr(),
                        &mut out,
                        idxs.as_mut_ptr(),
                        many(&mut sts)
                    ));
                }
                if out == c::UNDEFINED() {
                    break;
                }
                if out == 0 {
                    if matches!(method, Method::Waitsome) {
                        self.checker
                            .report(format!("op={} MPI_Waitsome returned outcount 0", self.op));
                    }
                    self.check_stuck(method);
                    continue;
                }
                for (k, &i) in idxs.iter().enumerate().take(out as usize) {
                    self.completed(i as usize, status_of(k, &sts).as_ref());
                }
            },
            Method::Test => {
                // Round-robin MPI_Test over the array; null entries are tested once too.
                let mut first = true;
                loop {
                    let mut pending = false;
                    for i in 0..n {
                        let is_null_slot = self.slots[i] == Slot::Null;
                        if (is_null_slot && !first) || (!is_null_slot && self.done[i]) {
                            continue;
                        }
                        let mut flag = 0;
                        mpi!(MPI_Test(&mut self.reqs[i], &mut flag, one(&mut st)));
                        if is_null_slot {
                            if flag == 0 {
                                self.checker.report(format!(
                                    "op={} MPI_Test on MPI_REQUEST_NULL gave flag=0",
                                    self.op
                                ));
                            }
                        } else if flag != 0 {
                            self.completed(i, if ignore { None } else { Some(&st) });
                        } else {
                            pending = true;
                        }
                    }
                    first = false;
                    if !pending {
                        break;
                    }
                    self.check_stuck(method);
                }
            }
            Method::Testall => loop {
                let mut flag = 0;
                mpi!(MPI_Testall(
                    nc,
                    self.reqs.as_mut_ptr(),
                    &mut flag,
                    many(&mut sts)
                ));
                if flag != 0 {
                    for i in 0..n {
                        if self.slots[i] != Slot::Null {
                            self.completed(i, status_of(i, &sts).as_ref());
                        }
                    }
                    break;
                }
                self.check_stuck(method);
            },
            Method::TestThenWaitall => {
                for i in 0..n {
                    let mut flag = 0;
                    mpi!(MPI_Test(&mut self.reqs[i], &mut flag, one(&mut st)));
                    if flag != 0 && self.slots[i] != Slot::Null {
                        self.completed(i, if ignore { None } else { Some(&st) });
                    }
                }
                let still: Vec<usize> = (0..n)
                    .filter(|&i| self.slots[i] != Slot::Null && !self.done[i])
                    .collect();
                mpi!(MPI_Waitall(nc, self.reqs.as_mut_ptr(), many(&mut sts)));
                for i in still {
                    self.completed(i, status_of(i, &sts).as_ref());
                }
            }
        }
        // Everything must be complete, once, and every handle reset to MPI_REQUEST_NULL.
        for i in 0..n {
            if self.slots[i] != Slot::Null && !self.done[i] {
                self.checker.report(format!(
                    "op={} {method:?}: request {i} ({:?}) never reported complete",
                    self.op, self.slots[i]
                ));
            }
            if self.reqs[i] != c::REQUEST_NULL() {
                self.checker.report(format!(
                    "op={} {method:?}: request {i} ({:?}) not set to MPI_REQUEST_NULL after completion",
                    self.op, self.slots[i]
                ));
            }
        }
    }
}
