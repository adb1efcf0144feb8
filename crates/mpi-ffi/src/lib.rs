//! Raw bindings to the system MPI library: every `MPI_*` and `PMPI_*` function of `mpi.h`, the
//! handle types, and the predefined handles (`MPI_COMM_WORLD`, `MPI_BYTE`, ...) as constants
//! that a small C file takes from the implementation's own macros. It never wraps, owns or
//! checks anything: callers (the host shim, the benchmark and the test programs) decide what is
//! safe. Works with Open MPI (the distribution's) and MPICH; see `build.rs` for how MPI is found.
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
