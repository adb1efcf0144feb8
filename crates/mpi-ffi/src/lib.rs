//! Raw bindings to the system MPI library: every `MPI_*` and `PMPI_*` function of `mpi.h`, the
//! handle types, and the predefined handles (`MPI_COMM_WORLD`, `MPI_BYTE`, ...) as constants
//! that a small C file takes from the implementation's own macros. It never wraps, owns or
//! checks anything: callers (the host shim, the benchmark and the test programs) decide what is
//! safe. Works with Open MPI (the distribution's) and MPICH (`MPI_FLAVOUR=mpich`); see
//! `build.rs` for how MPI is found. What differs between the two ABIs and matters to a caller
//! beyond the bindings themselves is in [`abi`], and nowhere else.
#![allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    clippy::all
)]

include!(concat!(env!("OUT_DIR"), "/mpi_bindings.rs"));

/// How the build found MPI (`MPI_DIR=...`, `mpicc --showme`, `pkg-config ...`).
pub const FOUND_VIA: &str = env!("MPI_FFI_FOUND_VIA");

/// Predefined handles under their MPI names. They are `static`s defined in C, so reading one is
/// a plain load; they are valid after the library is loaded, before `MPI_Init`.
pub mod consts {
    use super::*;
    macro_rules! handle {
        ($($name:ident: $ty:ty = $c:ident;)*) => {$(
            #[inline(always)]
            #[allow(non_snake_case)]
            pub fn $name() -> $ty {
                // SAFETY: a constant defined once in mpi_ffi.c and never written.
                unsafe { $c }
            }
        )*};
    }
    handle! {
        COMM_WORLD: MPI_Comm = MPIFFI_COMM_WORLD;
        COMM_SELF: MPI_Comm = MPIFFI_COMM_SELF;
        COMM_NULL: MPI_Comm = MPIFFI_COMM_NULL;
        GROUP_NULL: MPI_Group = MPIFFI_GROUP_NULL;
        REQUEST_NULL: MPI_Request = MPIFFI_REQUEST_NULL;
        DATATYPE_NULL: MPI_Datatype = MPIFFI_DATATYPE_NULL;
        BYTE: MPI_Datatype = MPIFFI_BYTE;
        CHAR: MPI_Datatype = MPIFFI_CHAR;
        INT: MPI_Datatype = MPIFFI_INT;
        UNSIGNED: MPI_Datatype = MPIFFI_UNSIGNED;
        LONG: MPI_Datatype = MPIFFI_LONG;
        SHORT: MPI_Datatype = MPIFFI_SHORT;
        FLOAT: MPI_Datatype = MPIFFI_FLOAT;
        DOUBLE: MPI_Datatype = MPIFFI_DOUBLE;
        INT32_T: MPI_Datatype = MPIFFI_INT32_T;
        INT64_T: MPI_Datatype = MPIFFI_INT64_T;
        UINT8_T: MPI_Datatype = MPIFFI_UINT8_T;
        UINT32_T: MPI_Datatype = MPIFFI_UINT32_T;
        UINT64_T: MPI_Datatype = MPIFFI_UINT64_T;
        OP_MAX: MPI_Op = MPIFFI_OP_MAX;
        OP_MIN: MPI_Op = MPIFFI_OP_MIN;
        OP_SUM: MPI_Op = MPIFFI_OP_SUM;
        OP_BOR: MPI_Op = MPIFFI_OP_BOR;
        OP_LAND: MPI_Op = MPIFFI_OP_LAND;
        SIGNED_CHAR: MPI_Datatype = MPIFFI_SIGNED_CHAR;
        UNSIGNED_CHAR: MPI_Datatype = MPIFFI_UNSIGNED_CHAR;
        UNSIGNED_SHORT: MPI_Datatype = MPIFFI_UNSIGNED_SHORT;
        UNSIGNED_LONG: MPI_Datatype = MPIFFI_UNSIGNED_LONG;
        LONG_LONG: MPI_Datatype = MPIFFI_LONG_LONG;
        UNSIGNED_LONG_LONG: MPI_Datatype = MPIFFI_UNSIGNED_LONG_LONG;
        INT8_T: MPI_Datatype = MPIFFI_INT8_T;
        INT16_T: MPI_Datatype = MPIFFI_INT16_T;
        UINT16_T: MPI_Datatype = MPIFFI_UINT16_T;
        INTEGER: MPI_Datatype = MPIFFI_INTEGER;
        INTEGER4: MPI_Datatype = MPIFFI_INTEGER4;
        INTEGER8: MPI_Datatype = MPIFFI_INTEGER8;
        REAL: MPI_Datatype = MPIFFI_REAL;
        REAL4: MPI_Datatype = MPIFFI_REAL4;
        REAL8: MPI_Datatype = MPIFFI_REAL8;
        DOUBLE_PRECISION: MPI_Datatype = MPIFFI_DOUBLE_PRECISION;
        OP_PROD: MPI_Op = MPIFFI_OP_PROD;
        OP_LOR: MPI_Op = MPIFFI_OP_LOR;
        OP_LXOR: MPI_Op = MPIFFI_OP_LXOR;
        OP_BAND: MPI_Op = MPIFFI_OP_BAND;
        OP_BXOR: MPI_Op = MPIFFI_OP_BXOR;
        ERRORS_RETURN: MPI_Errhandler = MPIFFI_ERRORS_RETURN;
        IN_PLACE: *mut ::std::os::raw::c_void = MPIFFI_IN_PLACE;
        STATUS_IGNORE: *mut MPI_Status = MPIFFI_STATUS_IGNORE;
        STATUSES_IGNORE: *mut MPI_Status = MPIFFI_STATUSES_IGNORE;
        COMM_NULL_COPY_FN: MPI_Comm_copy_attr_function = MPIFFI_COMM_NULL_COPY_FN;
        COMM_NULL_DELETE_FN: MPI_Comm_delete_attr_function = MPIFFI_COMM_NULL_DELETE_FN;
        TYPE_NULL_COPY_FN: MPI_Type_copy_attr_function = MPIFFI_TYPE_NULL_COPY_FN;
        SUCCESS: i32 = MPIFFI_SUCCESS;
        UNDEFINED: i32 = MPIFFI_UNDEFINED;
        KEYVAL_INVALID: i32 = MPIFFI_KEYVAL_INVALID;
        ANY_SOURCE: i32 = MPIFFI_ANY_SOURCE;
        ANY_TAG: i32 = MPIFFI_ANY_TAG;
        PROC_NULL: i32 = MPIFFI_PROC_NULL;
        IDENT: i32 = MPIFFI_IDENT;
        CONGRUENT: i32 = MPIFFI_CONGRUENT;
        COMBINER_NAMED: i32 = MPIFFI_COMBINER_NAMED;
        COMBINER_DUP: i32 = MPIFFI_COMBINER_DUP;
        COMBINER_CONTIGUOUS: i32 = MPIFFI_COMBINER_CONTIGUOUS;
        COMBINER_VECTOR: i32 = MPIFFI_COMBINER_VECTOR;
        COMBINER_HVECTOR: i32 = MPIFFI_COMBINER_HVECTOR;
        COMBINER_INDEXED: i32 = MPIFFI_COMBINER_INDEXED;
        COMBINER_HINDEXED: i32 = MPIFFI_COMBINER_HINDEXED;
        COMBINER_INDEXED_BLOCK: i32 = MPIFFI_COMBINER_INDEXED_BLOCK;
        COMBINER_HINDEXED_BLOCK: i32 = MPIFFI_COMBINER_HINDEXED_BLOCK;
        COMBINER_STRUCT: i32 = MPIFFI_COMBINER_STRUCT;
        COMBINER_SUBARRAY: i32 = MPIFFI_COMBINER_SUBARRAY;
        COMBINER_DARRAY: i32 = MPIFFI_COMBINER_DARRAY;
        COMBINER_F90_REAL: i32 = MPIFFI_COMBINER_F90_REAL;
        COMBINER_F90_COMPLEX: i32 = MPIFFI_COMBINER_F90_COMPLEX;
        COMBINER_F90_INTEGER: i32 = MPIFFI_COMBINER_F90_INTEGER;
        COMBINER_RESIZED: i32 = MPIFFI_COMBINER_RESIZED;
        THREAD_SINGLE: i32 = MPIFFI_THREAD_SINGLE;
        THREAD_MULTIPLE: i32 = MPIFFI_THREAD_MULTIPLE;
        ERR_OTHER: i32 = MPIFFI_ERR_OTHER;
        ERR_TRUNCATE: i32 = MPIFFI_ERR_TRUNCATE;
        ERR_ARG: i32 = MPIFFI_ERR_ARG;
        ERR_INTERN: i32 = MPIFFI_ERR_INTERN;
        ERR_IN_STATUS: i32 = MPIFFI_ERR_IN_STATUS;
        ERR_PENDING: i32 = MPIFFI_ERR_PENDING;
        COMM_TYPE_SHARED: i32 = MPIFFI_COMM_TYPE_SHARED;
    }
}

/// The differences between the MPI ABIs (Open MPI's and the MPICH family's: MPICH, MVAPICH,
/// Intel MPI, Cray MPICH) that a program interposing on MPI must know beyond the bindings.
///
/// - Handles: Open MPI's are pointers to library objects; MPICH's are 32-bit integers that
///   encode a kind (bits 30-31: invalid, builtin, direct, indirect), an object class (bits
///   26-29) and an index. Code that stores a handle as an integer uses [`handle_bits`] and
///   [`handle_from_bits`], which are exact for both.
/// - Requests the interposer creates itself need handles that can never equal one of the
///   library's live requests: [`SHIM_REQUESTS`].
/// - `MPI_Status`: both have the public `MPI_SOURCE`, `MPI_TAG` and `MPI_ERROR` fields, but the
///   count and the cancelled flag are private fields laid out differently (`_ucount`,
///   `_cancelled` in Open MPI; `count_lo`, `count_hi_and_cancelled` in MPICH): set them only
///   through [`status_set_empty`].
/// - The predefined handles and constants are macros of different values: they come from C
///   ([`crate::consts`]), never as literals.
pub mod abi {
    use super::*;
    use std::os::raw::c_int;

    /// An MPI family, that is an ABI.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Flavour {
        OpenMpi,
        Mpich,
    }

    impl Flavour {
        /// The name used on command lines and in `MPI_FLAVOUR` (`openmpi`, `mpich`).
        pub const fn name(self) -> &'static str {
            match self {
                Flavour::OpenMpi => "openmpi",
                Flavour::Mpich => "mpich",
            }
        }
    }

    /// The family these bindings were built for (from the header's own macros).
    #[cfg(mpi_flavour = "openmpi")]
    pub const FLAVOUR: Flavour = Flavour::OpenMpi;
    /// The family these bindings were built for (from the header's own macros).
    #[cfg(mpi_flavour = "mpich")]
    pub const FLAVOUR: Flavour = Flavour::Mpich;

    /// How an interposer names the requests it creates (its handles are checked against its own
    /// table first; only the ones not in it reach the library).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum ShimRequests {
        /// The handle is the address of the interposer's live heap object: the library's own
        /// requests are live objects of the library, at other addresses (Open MPI).
        ObjectAddress,
        /// Handles are drawn from `first..first + count`, values the library never gives out
        /// (MPICH: kind "invalid", class request, index 1 up to 2^26 - 1; the library's requests
        /// are of kind builtin, direct or indirect, and `MPI_REQUEST_NULL` is index 0). Passed
        /// to the library by mistake, MPICH reports an invalid request instead of touching
        /// memory.
        Range { first: usize, count: usize },
    }

    /// How requests created by an interposer are named under this ABI.
    #[cfg(mpi_flavour = "openmpi")]
    pub const SHIM_REQUESTS: ShimRequests = ShimRequests::ObjectAddress;
    /// How requests created by an interposer are named under this ABI.
    #[cfg(mpi_flavour = "mpich")]
    pub const SHIM_REQUESTS: ShimRequests = ShimRequests::Range {
        first: 0x2c00_0001,
        count: 0x03ff_ffff,
    };

    /// A handle type of this ABI (a pointer in Open MPI, an `int` in MPICH).
    pub trait Handle: Copy + Eq {
        /// The handle's value as an integer, exact and reversible.
        fn bits(self) -> usize;
        /// The handle whose [`Handle::bits`] are `bits`.
        fn from_bits(bits: usize) -> Self;
    }

    impl<T> Handle for *mut T {
        fn bits(self) -> usize {
            self as usize
        }
        fn from_bits(bits: usize) -> Self {
            bits as *mut T
        }
    }

    impl Handle for c_int {
        fn bits(self) -> usize {
            // As unsigned 32 bits: MPICH's direct and indirect handles have the sign bit set.
            self as u32 as usize
        }
        fn from_bits(bits: usize) -> Self {
            bits as u32 as c_int
        }
    }

    /// A handle as an integer (for tables and atomics), exact under both ABIs.
    pub fn handle_bits<H: Handle>(handle: H) -> usize {
        handle.bits()
    }

    /// The handle stored by [`handle_bits`].
    pub fn handle_from_bits<H: Handle>(bits: usize) -> H {
        H::from_bits(bits)
    }

    /// Sets `status` as for a completed operation that moved no data: source `MPI_ANY_SOURCE`,
    /// tag `MPI_ANY_TAG`, error `code`, count 0, not cancelled (the private fields through the
    /// library, whatever their layout).
    ///
    /// # Safety
    /// `status` is valid for writes (not `MPI_STATUS_IGNORE`).
    pub unsafe fn status_set_empty(status: *mut MPI_Status, code: c_int) {
        // SAFETY: a valid status object (precondition).
        unsafe {
            (*status).MPI_SOURCE = crate::consts::ANY_SOURCE();
            (*status).MPI_TAG = crate::consts::ANY_TAG();
            (*status).MPI_ERROR = code;
            mpiffi_status_set_count_bytes(status, 0);
            PMPI_Status_set_cancelled(status, 0);
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn handles_round_trip_through_bits() {
            let world = crate::consts::COMM_WORLD();
            assert!(handle_from_bits::<MPI_Comm>(handle_bits(world)) == world);
            let null = crate::consts::REQUEST_NULL();
            assert!(handle_from_bits::<MPI_Request>(handle_bits(null)) == null);
        }

        #[test]
        fn shim_request_range_excludes_the_null_request() {
            let null = handle_bits(crate::consts::REQUEST_NULL());
            match SHIM_REQUESTS {
                ShimRequests::ObjectAddress => assert_eq!(FLAVOUR, Flavour::OpenMpi),
                ShimRequests::Range { first, count } => {
                    assert_eq!(FLAVOUR, Flavour::Mpich);
                    assert!(!(first..first + count).contains(&null));
                    // The same class as MPI_REQUEST_NULL (kind bits 0, class = request).
                    assert_eq!(first >> 26, null >> 26);
                    assert_eq!((first + count - 1) >> 26, null >> 26);
                }
            }
        }
    }
}
