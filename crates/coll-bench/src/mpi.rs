//! A small, safe-ish layer over the raw `mpi_ffi` bindings: only what the benchmark needs.
//!
//! Every call goes through the `MPI_*` entry points (never `PMPI_*`) so that an LD_PRELOADed
//! shim sees exactly the calls an ordinary MPI program makes. Every return code is checked and
//! turned into an [`MpiError`]; communicators used here are set to `MPI_ERRORS_RETURN` so errors
//! come back as codes instead of aborting inside the library.
//!
//! Lifetimes tie a pending [`Request`] to the buffers it reads and writes. Dropping a pending
//! request waits for it (so buffers are never released under MPI); `mem::forget` on a pending
//! request is the one way to break that, as with any scope-guard design.

use mpi_ffi::consts;
use mpi_ffi::{MPI_Comm, MPI_Datatype, MPI_Op, MPI_Request};
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::c_int;
use std::ptr;

/// A failed MPI call: which function, the code, and the library's text for it.
#[derive(Debug, Clone)]
pub struct MpiError {
    pub call: &'static str,
    pub code: i32,
    pub text: String,
}

impl fmt::Display for MpiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} failed with code {}: {}",
            self.call, self.code, self.text
        )
    }
}

impl std::error::Error for MpiError {}

pub type Result<T> = std::result::Result<T, MpiError>;

/// The library's description of an error code.
pub fn error_string(code: i32) -> String {
    let mut buf = vec![0u8; mpi_ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: buf holds MPI_MAX_ERROR_STRING bytes as the standard requires.
    let rc = unsafe { mpi_ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    if rc != consts::SUCCESS() {
        return format!("(unknown MPI error {code})");
    }
    buf.truncate(len.clamp(0, buf.len() as c_int) as usize);
    String::from_utf8_lossy(&buf).into_owned()
}

/// Turns an MPI return code into a `Result`.
pub fn check(call: &'static str, code: c_int) -> Result<()> {
    if code == consts::SUCCESS() {
        Ok(())
    } else {
        Err(MpiError {
            call,
            code,
            text: error_string(code),
        })
    }
}

/// Proof that MPI is initialized; [`Mpi::finalize`] consumes it.
pub struct Mpi {
    _not_send: PhantomData<*const ()>,
}

impl Mpi {
    /// `MPI_Init`, then `MPI_ERRORS_RETURN` on `MPI_COMM_WORLD`.
    pub fn init() -> Result<Mpi> {
        // SAFETY: MPI_Init accepts null argc/argv.
        check("MPI_Init", unsafe {
            mpi_ffi::MPI_Init(ptr::null_mut(), ptr::null_mut())
        })?;
        let mpi = Mpi {
            _not_send: PhantomData,
        };
        mpi.world().set_errors_return()?;
        Ok(mpi)
    }

    pub fn world(&self) -> Comm {
        Comm {
            raw: consts::COMM_WORLD(),
        }
    }

    pub fn finalize(self) -> Result<()> {
        // SAFETY: MPI is initialized (self exists) and finalized once (self is consumed).
        check("MPI_Finalize", unsafe { mpi_ffi::MPI_Finalize() })
    }

    /// `MPI_Abort` on `MPI_COMM_WORLD`; does not return.
    pub fn abort(code: i32) -> ! {
        // SAFETY: plain call; if it returns anyway, exit.
        unsafe { mpi_ffi::MPI_Abort(consts::COMM_WORLD(), code) };
        std::process::exit(code)
    }
}

/// `MPI_Wtime`.
pub fn wtime() -> f64 {
    // SAFETY: no arguments.
    unsafe { mpi_ffi::MPI_Wtime() }
}

/// A borrowed communicator handle (world, or one owned by an [`OwnedComm`]).
#[derive(Clone, Copy, Debug)]
pub struct Comm {
    raw: MPI_Comm,
}

impl Comm {
    pub fn raw(&self) -> MPI_Comm {
        self.raw
    }

    pub fn rank(&self) -> Result<i32> {
        let mut r = 0;
        // SAFETY: valid communicator, out-pointer to a local.
        check("MPI_Comm_rank", unsafe {
            mpi_ffi::MPI_Comm_rank(self.raw, &mut r)
        })?;
        Ok(r)
    }

    pub fn size(&self) -> Result<i32> {
        let mut s = 0;
        // SAFETY: as above.
        check("MPI_Comm_size", unsafe {
            mpi_ffi::MPI_Comm_size(self.raw, &mut s)
        })?;
        Ok(s)
    }

    pub fn set_errors_return(&self) -> Result<()> {
        // SAFETY: valid communicator and predefined error handler.
        check("MPI_Comm_set_errhandler", unsafe {
            mpi_ffi::MPI_Comm_set_errhandler(self.raw, consts::ERRORS_RETURN())
        })
    }

    pub fn barrier(&self) -> Result<()> {
        // SAFETY: valid communicator.
        check("MPI_Barrier", unsafe { mpi_ffi::MPI_Barrier(self.raw) })
    }

    fn allreduce_one<T: Copy>(&self, v: T, dt: MPI_Datatype, op: MPI_Op) -> Result<T> {
        let mut out = v;
        // SAFETY: one element of the type matching `dt` in and out.
        check("MPI_Allreduce", unsafe {
            mpi_ffi::MPI_Allreduce(
                (&v as *const T).cast(),
                (&mut out as *mut T).cast(),
                1,
                dt,
                op,
                self.raw,
            )
        })?;
        Ok(out)
    }

    pub fn allreduce_f64(&self, v: f64, op: MPI_Op) -> Result<f64> {
        self.allreduce_one(v, consts::DOUBLE(), op)
    }

    pub fn allreduce_u64(&self, v: u64, op: MPI_Op) -> Result<u64> {
        self.allreduce_one(v, consts::UINT64_T(), op)
    }

    /// Logical AND of `v` over all ranks (`MPI_LAND` on an `int`).
    pub fn all_true(&self, v: bool) -> Result<bool> {
        let r: c_int = self.allreduce_one(v as c_int, consts::INT(), consts::OP_LAND())?;
        Ok(r != 0)
    }

    /// `MPI_Comm_dup`; the new communicator returns errors as codes.
    pub fn dup(&self) -> Result<OwnedComm> {
        let mut c = consts::COMM_NULL();
        // SAFETY: valid communicator, out-pointer to a local.
        check("MPI_Comm_dup", unsafe {
            mpi_ffi::MPI_Comm_dup(self.raw, &mut c)
        })?;
        OwnedComm::adopt(c)
    }

    /// `MPI_Comm_split`; `None` for `color == None` (`MPI_UNDEFINED`).
    pub fn split(&self, color: Option<i32>, key: i32) -> Result<Option<OwnedComm>> {
        let mut c = consts::COMM_NULL();
        let color = color.unwrap_or(consts::UNDEFINED());
        // SAFETY: valid communicator, out-pointer to a local.
        check("MPI_Comm_split", unsafe {
            mpi_ffi::MPI_Comm_split(self.raw, color, key, &mut c)
        })?;
        if c == consts::COMM_NULL() {
            return Ok(None);
        }
        OwnedComm::adopt(c).map(Some)
    }

    /// `MPI_Isend` of bytes.
    pub fn isend<'a>(&self, buf: &'a [u8], dest: i32, tag: i32) -> Result<Request<'a>> {
        let count = to_int(buf.len(), "MPI_Isend")?;
        // SAFETY: the buffer outlives the request (lifetime 'a).
        Request::start("MPI_Isend", |req| unsafe {
            mpi_ffi::MPI_Isend(
                buf.as_ptr().cast(),
                count,
                consts::BYTE(),
                dest,
                tag,
                self.raw,
                req,
            )
        })
    }

    /// `MPI_Irecv` of bytes.
    pub fn irecv<'a>(&self, buf: &'a mut [u8], source: i32, tag: i32) -> Result<Request<'a>> {
        let count = to_int(buf.len(), "MPI_Irecv")?;
        // SAFETY: the buffer outlives the request and is borrowed mutably by it.
        Request::start("MPI_Irecv", |req| unsafe {
            mpi_ffi::MPI_Irecv(
                buf.as_mut_ptr().cast(),
                count,
                consts::BYTE(),
                source,
                tag,
                self.raw,
                req,
            )
        })
    }

    /// `MPI_Sendrecv` of bytes: `send` to `dest`, `recv` (filled exactly) from `source`, with
    /// `MPI_STATUS_IGNORE`.
    pub fn sendrecv(
        &self,
        send: &[u8],
        dest: i32,
        recv: &mut [u8],
        source: i32,
        tag: i32,
    ) -> Result<()> {
        let scount = to_int(send.len(), "MPI_Sendrecv")?;
        let rcount = to_int(recv.len(), "MPI_Sendrecv")?;
        // SAFETY: both buffers are valid for their lengths during the (blocking) call.
        check("MPI_Sendrecv", unsafe {
            mpi_ffi::MPI_Sendrecv(
                send.as_ptr().cast(),
                scount,
                consts::BYTE(),
                dest,
                tag,
                recv.as_mut_ptr().cast(),
                rcount,
                consts::BYTE(),
                source,
                tag,
                self.raw,
                consts::STATUS_IGNORE(),
            )
        })
    }

    /// `MPI_Ialltoallv` on byte-addressed buffers with datatype `dt` (counts and displacements
    /// in elements of `dt`). Checks that every block lies inside its buffer.
    #[allow(clippy::too_many_arguments)]
    pub fn ialltoallv<'a>(
        &self,
        send: &'a [u8],
        sendcounts: &'a [i32],
        sdispls: &'a [i32],
        recv: &'a mut [u8],
        recvcounts: &'a [i32],
        rdispls: &'a [i32],
        dt: &Datatype,
    ) -> Result<Request<'a>> {
        let n = self.size()? as usize;
        check_blocks("MPI_Ialltoallv", n, send.len(), sendcounts, sdispls, dt)?;
        check_blocks("MPI_Ialltoallv", n, recv.len(), recvcounts, rdispls, dt)?;
        // SAFETY: blocks checked against the buffers; buffers and arrays outlive the request.
        Request::start("MPI_Ialltoallv", |req| unsafe {
            mpi_ffi::MPI_Ialltoallv(
                send.as_ptr().cast(),
                sendcounts.as_ptr(),
                sdispls.as_ptr(),
                dt.raw,
                recv.as_mut_ptr().cast(),
                recvcounts.as_ptr(),
                rdispls.as_ptr(),
                dt.raw,
                self.raw,
                req,
            )
        })
    }

    /// `MPI_Alltoallv` (blocking), same conventions as [`Comm::ialltoallv`].
    #[allow(clippy::too_many_arguments)]
    pub fn alltoallv(
        &self,
        send: &[u8],
        sendcounts: &[i32],
        sdispls: &[i32],
        recv: &mut [u8],
        recvcounts: &[i32],
        rdispls: &[i32],
        dt: &Datatype,
    ) -> Result<()> {
        let n = self.size()? as usize;
        check_blocks("MPI_Alltoallv", n, send.len(), sendcounts, sdispls, dt)?;
        check_blocks("MPI_Alltoallv", n, recv.len(), recvcounts, rdispls, dt)?;
        // SAFETY: blocks checked against the buffers.
        check("MPI_Alltoallv", unsafe {
            mpi_ffi::MPI_Alltoallv(
                send.as_ptr().cast(),
                sendcounts.as_ptr(),
                sdispls.as_ptr(),
                dt.raw,
                recv.as_mut_ptr().cast(),
                recvcounts.as_ptr(),
                rdispls.as_ptr(),
                dt.raw,
                self.raw,
            )
        })
    }

    /// `MPI_Iallgatherv`: `sendcount` elements of `dt` from every rank into block `j` of
    /// `recv` at element offset `rdispls[j]`. Checks that every block lies inside its buffer.
    pub fn iallgatherv<'a>(
        &self,
        send: &'a [u8],
        sendcount: i32,
        recv: &'a mut [u8],
        recvcounts: &'a [i32],
        rdispls: &'a [i32],
        dt: &Datatype,
    ) -> Result<Request<'a>> {
        let n = self.size()? as usize;
        check_blocks("MPI_Iallgatherv", 1, send.len(), &[sendcount], &[0], dt)?;
        check_blocks("MPI_Iallgatherv", n, recv.len(), recvcounts, rdispls, dt)?;
        // SAFETY: blocks checked against the buffers; buffers and arrays outlive the request.
        Request::start("MPI_Iallgatherv", |req| unsafe {
            mpi_ffi::MPI_Iallgatherv(
                send.as_ptr().cast(),
                sendcount,
                dt.raw,
                recv.as_mut_ptr().cast(),
                recvcounts.as_ptr(),
                rdispls.as_ptr(),
                dt.raw,
                self.raw,
                req,
            )
        })
    }

    /// `MPI_Allgatherv` (blocking), same conventions as [`Comm::iallgatherv`].
    pub fn allgatherv(
        &self,
        send: &[u8],
        sendcount: i32,
        recv: &mut [u8],
        recvcounts: &[i32],
        rdispls: &[i32],
        dt: &Datatype,
    ) -> Result<()> {
        let n = self.size()? as usize;
        check_blocks("MPI_Allgatherv", 1, send.len(), &[sendcount], &[0], dt)?;
        check_blocks("MPI_Allgatherv", n, recv.len(), recvcounts, rdispls, dt)?;
        // SAFETY: blocks checked against the buffers.
        check("MPI_Allgatherv", unsafe {
            mpi_ffi::MPI_Allgatherv(
                send.as_ptr().cast(),
                sendcount,
                dt.raw,
                recv.as_mut_ptr().cast(),
                recvcounts.as_ptr(),
                rdispls.as_ptr(),
                dt.raw,
                self.raw,
            )
        })
    }

    /// `MPI_Iallgather`: `count` elements of `dt` from every rank, block `j` at element offset
    /// `j * count` of `recv`.
    pub fn iallgather<'a>(
        &self,
        send: &'a [u8],
        recv: &'a mut [u8],
        count: i32,
        dt: &Datatype,
    ) -> Result<Request<'a>> {
        let n = self.size()?;
        check_gather("MPI_Iallgather", n, send.len(), recv.len(), count, dt)?;
        // SAFETY: sizes checked above; the buffers outlive the request.
        Request::start("MPI_Iallgather", |req| unsafe {
            mpi_ffi::MPI_Iallgather(
                send.as_ptr().cast(),
                count,
                dt.raw,
                recv.as_mut_ptr().cast(),
                count,
                dt.raw,
                self.raw,
                req,
            )
        })
    }

    /// `MPI_Allgather` (blocking): `count` elements of `dt` from every rank, block `j` at
    /// element offset `j * count` of `recv`.
    pub fn allgather(&self, send: &[u8], recv: &mut [u8], count: i32, dt: &Datatype) -> Result<()> {
        let n = self.size()?;
        check_gather("MPI_Allgather", n, send.len(), recv.len(), count, dt)?;
        // SAFETY: sizes checked above.
        check("MPI_Allgather", unsafe {
            mpi_ffi::MPI_Allgather(
                send.as_ptr().cast(),
                count,
                dt.raw,
                recv.as_mut_ptr().cast(),
                count,
                dt.raw,
                self.raw,
            )
        })
    }

    /// `MPI_Iallreduce` of `count` 64-bit integers (`MPI_INT64_T`) with `MPI_SUM`.
    pub fn iallreduce_sum_i64<'a>(
        &self,
        send: &'a [u8],
        recv: &'a mut [u8],
        count: i32,
    ) -> Result<Request<'a>> {
        let need = count as u128 * 8;
        if count < 0 || (send.len() as u128) < need || (recv.len() as u128) < need {
            return Err(arg_error("MPI_Iallreduce", "buffer smaller than count * 8"));
        }
        // SAFETY: sizes checked above; the buffers outlive the request.
        Request::start("MPI_Iallreduce", |req| unsafe {
            mpi_ffi::MPI_Iallreduce(
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                count,
                consts::INT64_T(),
                consts::OP_SUM(),
                self.raw,
                req,
            )
        })
    }

    /// `MPI_Ibcast`: `count` elements of `dt` of `buf` from `root` to every rank (the root's
    /// buffer is read, the others' written).
    pub fn ibcast<'a>(
        &self,
        buf: &'a mut [u8],
        count: i32,
        dt: &Datatype,
        root: i32,
    ) -> Result<Request<'a>> {
        check_bcast("MPI_Ibcast", self.size()?, buf.len(), count, dt, root)?;
        // SAFETY: size and root checked above; the buffer outlives the request.
        Request::start("MPI_Ibcast", |req| unsafe {
            mpi_ffi::MPI_Ibcast(buf.as_mut_ptr().cast(), count, dt.raw, root, self.raw, req)
        })
    }

    /// `MPI_Bcast` (blocking), same conventions as [`Comm::ibcast`].
    pub fn bcast(&self, buf: &mut [u8], count: i32, dt: &Datatype, root: i32) -> Result<()> {
        check_bcast("MPI_Bcast", self.size()?, buf.len(), count, dt, root)?;
        // SAFETY: size and root checked above.
        check("MPI_Bcast", unsafe {
            mpi_ffi::MPI_Bcast(buf.as_mut_ptr().cast(), count, dt.raw, root, self.raw)
        })
    }

    /// `MPI_Ialltoall`: `count` elements of `dt` to and from every rank, block `j` at element
    /// offset `j * count`.
    pub fn ialltoall<'a>(
        &self,
        send: &'a [u8],
        recv: &'a mut [u8],
        count: i32,
        dt: &Datatype,
    ) -> Result<Request<'a>> {
        let n = self.size()?;
        check_alltoall("MPI_Ialltoall", n, send.len(), recv.len(), count, dt)?;
        // SAFETY: both buffers hold n * count elements; they outlive the request.
        Request::start("MPI_Ialltoall", |req| unsafe {
            mpi_ffi::MPI_Ialltoall(
                send.as_ptr().cast(),
                count,
                dt.raw,
                recv.as_mut_ptr().cast(),
                count,
                dt.raw,
                self.raw,
                req,
            )
        })
    }

    /// `MPI_Alltoall` (blocking), same conventions as [`Comm::ialltoall`].
    pub fn alltoall(&self, send: &[u8], recv: &mut [u8], count: i32, dt: &Datatype) -> Result<()> {
        let n = self.size()?;
        check_alltoall("MPI_Alltoall", n, send.len(), recv.len(), count, dt)?;
        // SAFETY: both buffers hold n * count elements.
        check("MPI_Alltoall", unsafe {
            mpi_ffi::MPI_Alltoall(
                send.as_ptr().cast(),
                count,
                dt.raw,
                recv.as_mut_ptr().cast(),
                count,
                dt.raw,
                self.raw,
            )
        })
    }
}

fn arg_error(call: &'static str, what: &str) -> MpiError {
    MpiError {
        call,
        code: consts::ERR_ARG(),
        text: format!("argument check before the call: {what}"),
    }
}

fn to_int(n: usize, call: &'static str) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| arg_error(call, "count does not fit in an int"))
}

/// A broadcast's arguments: `count` elements of `dt` fit in `len` bytes, `root` is a rank.
fn check_bcast(
    call: &'static str,
    n: i32,
    len: usize,
    count: i32,
    dt: &Datatype,
    root: i32,
) -> Result<()> {
    if count < 0 || count as u128 * dt.extent as u128 > len as u128 {
        return Err(arg_error(call, "buffer smaller than count * extent"));
    }
    if !(0..n).contains(&root) {
        return Err(arg_error(call, "root is not a rank of the communicator"));
    }
    Ok(())
}

/// An allgather's arguments: `count` elements of `dt` fit in `send_len` bytes, and `n` times
/// that in `recv_len`.
fn check_gather(
    call: &'static str,
    n: i32,
    send_len: usize,
    recv_len: usize,
    count: i32,
    dt: &Datatype,
) -> Result<()> {
    let one = count.max(0) as u128 * dt.extent as u128;
    if count < 0 || one > send_len as u128 || n.max(0) as u128 * one > recv_len as u128 {
        return Err(arg_error(
            call,
            "buffers smaller than (size *) count * extent",
        ));
    }
    Ok(())
}

/// An alltoall's arguments: `n` blocks of `count` elements of `dt` fit in both buffers.
fn check_alltoall(
    call: &'static str,
    n: i32,
    send_len: usize,
    recv_len: usize,
    count: i32,
    dt: &Datatype,
) -> Result<()> {
    let need = n.max(0) as u128 * count.max(0) as u128 * dt.extent as u128;
    if count < 0 || need > send_len as u128 || need > recv_len as u128 {
        return Err(arg_error(
            call,
            "buffers smaller than size * count * extent",
        ));
    }
    Ok(())
}

fn check_blocks(
    call: &'static str,
    n: usize,
    len: usize,
    counts: &[i32],
    displs: &[i32],
    dt: &Datatype,
) -> Result<()> {
    if counts.len() < n || displs.len() < n {
        return Err(arg_error(
            call,
            "counts/displacements shorter than the communicator",
        ));
    }
    for j in 0..n {
        if counts[j] < 0 || displs[j] < 0 {
            return Err(arg_error(call, "negative count or displacement"));
        }
        let end = (displs[j] as u128 + counts[j] as u128) * dt.extent as u128;
        if counts[j] > 0 && end > len as u128 {
            return Err(arg_error(call, "a block lies outside its buffer"));
        }
    }
    Ok(())
}

/// A communicator this program created; must be released with [`OwnedComm::free`] before
/// `MPI_Finalize`.
pub struct OwnedComm {
    comm: Comm,
}

impl OwnedComm {
    /// Takes ownership of a communicator just created and makes it return errors as codes.
    fn adopt(raw: MPI_Comm) -> Result<OwnedComm> {
        let owned = OwnedComm { comm: Comm { raw } };
        owned.comm.set_errors_return()?;
        Ok(owned)
    }

    pub fn comm(&self) -> Comm {
        self.comm
    }

    pub fn free(self) -> Result<()> {
        let mut raw = self.comm.raw;
        // SAFETY: created by dup/split and freed once (self is consumed).
        check("MPI_Comm_free", unsafe { mpi_ffi::MPI_Comm_free(&mut raw) })
    }
}

/// A datatype with its extent (lower bound must be 0). Predefined ones need no freeing;
/// derived ones are committed on creation and released with [`Datatype::free`].
pub struct Datatype {
    raw: MPI_Datatype,
    extent: usize,
    derived: bool,
}

impl Datatype {
    fn predefined(raw: MPI_Datatype) -> Result<Datatype> {
        let extent = extent_of(raw)?;
        Ok(Datatype {
            raw,
            extent,
            derived: false,
        })
    }

    pub fn byte() -> Result<Datatype> {
        Self::predefined(consts::BYTE())
    }

    pub fn int() -> Result<Datatype> {
        Self::predefined(consts::INT())
    }

    pub fn double() -> Result<Datatype> {
        Self::predefined(consts::DOUBLE())
    }

    pub fn int64() -> Result<Datatype> {
        Self::predefined(consts::INT64_T())
    }

    /// `MPI_Type_contiguous(count, old)` + `MPI_Type_commit`.
    pub fn contiguous(count: i32, old: &Datatype) -> Result<Datatype> {
        let mut t = consts::DATATYPE_NULL();
        // SAFETY: valid old type, out-pointer to a local.
        check("MPI_Type_contiguous", unsafe {
            mpi_ffi::MPI_Type_contiguous(count, old.raw, &mut t)
        })?;
        Datatype::commit(t)
    }

    /// The layout of [`crate::strided`]: 8 bytes of data, then an 8-byte hole
    /// (`MPI_Type_create_resized(MPI_Type_contiguous(8, MPI_BYTE), 0, 16)`), committed.
    pub fn strided() -> Result<Datatype> {
        let data = Datatype::contiguous(crate::strided::DATA as i32, &Datatype::byte()?)?;
        let mut t = consts::DATATYPE_NULL();
        // SAFETY: valid old type, out-pointer to a local.
        let rc = check("MPI_Type_create_resized", unsafe {
            mpi_ffi::MPI_Type_create_resized(
                data.raw,
                0,
                crate::strided::EXTENT as mpi_ffi::MPI_Aint,
                &mut t,
            )
        });
        data.free()?;
        rc?;
        Datatype::commit(t)
    }

    /// `MPI_Type_commit` of a derived type just created, which the result then owns.
    fn commit(mut t: MPI_Datatype) -> Result<Datatype> {
        // SAFETY: t was just created.
        check("MPI_Type_commit", unsafe {
            mpi_ffi::MPI_Type_commit(&mut t)
        })?;
        let extent = extent_of(t)?;
        Ok(Datatype {
            raw: t,
            extent,
            derived: true,
        })
    }

    pub fn raw(&self) -> MPI_Datatype {
        self.raw
    }

    pub fn extent(&self) -> usize {
        self.extent
    }

    pub fn free(self) -> Result<()> {
        if !self.derived {
            return Ok(());
        }
        let mut raw = self.raw;
        // SAFETY: a derived type created here, freed once.
        check("MPI_Type_free", unsafe { mpi_ffi::MPI_Type_free(&mut raw) })
    }
}

fn extent_of(raw: MPI_Datatype) -> Result<usize> {
    let (mut lb, mut extent) = (0, 0);
    // SAFETY: valid type, out-pointers to locals.
    check("MPI_Type_get_extent", unsafe {
        mpi_ffi::MPI_Type_get_extent(raw, &mut lb, &mut extent)
    })?;
    if lb != 0 || extent < 0 {
        return Err(arg_error(
            "MPI_Type_get_extent",
            "only types with lower bound 0 are supported here",
        ));
    }
    Ok(extent as usize)
}

/// A pending nonblocking operation borrowing its buffers for `'a`.
pub struct Request<'a> {
    raw: MPI_Request,
    _buffers: PhantomData<&'a mut [u8]>,
}

impl<'a> Request<'a> {
    /// Runs `post`, a nonblocking call writing its request through the pointer it is given,
    /// and returns that request.
    fn start(call: &'static str, post: impl FnOnce(*mut MPI_Request) -> c_int) -> Result<Self> {
        let mut raw = consts::REQUEST_NULL();
        check(call, post(&mut raw))?;
        Ok(Request {
            raw,
            _buffers: PhantomData,
        })
    }

    /// `MPI_Wait` with `MPI_STATUS_IGNORE`.
    pub fn wait(mut self) -> Result<()> {
        let r = self.wait_in_place();
        std::mem::forget(self); // already completed (or failed): nothing left for Drop
        r
    }

    fn wait_in_place(&mut self) -> Result<()> {
        // SAFETY: a request from a nonblocking call (or REQUEST_NULL, which MPI_Wait accepts).
        check("MPI_Wait", unsafe {
            mpi_ffi::MPI_Wait(&mut self.raw, consts::STATUS_IGNORE())
        })
    }

    /// `MPI_Waitall` with `MPI_STATUSES_IGNORE` over several requests.
    pub fn wait_all(reqs: Vec<Request<'a>>) -> Result<()> {
        let mut raw: Vec<MPI_Request> = reqs.iter().map(|r| r.raw).collect();
        for r in reqs {
            std::mem::forget(r);
        }
        let n = to_int(raw.len(), "MPI_Waitall")?;
        // SAFETY: the requests came from nonblocking calls; their buffers outlive 'a.
        check("MPI_Waitall", unsafe {
            mpi_ffi::MPI_Waitall(n, raw.as_mut_ptr(), consts::STATUSES_IGNORE())
        })
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        if self.raw != consts::REQUEST_NULL() {
            // Never let the buffers go while MPI may still use them.
            if let Err(e) = self.wait_in_place() {
                eprintln!("coll-bench: {e} while dropping a pending request");
            }
        }
    }
}
