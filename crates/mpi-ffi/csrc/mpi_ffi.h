/* The MPI header plus the predefined handles as real objects.
 *
 * MPI implementations define MPI_COMM_WORLD, MPI_BYTE, ... as macros (addresses of globals in
 * Open MPI, integer constants in MPICH). Rust cannot expand C macros, so mpi_ffi.c stores each
 * one in a constant that bindgen can see. */
#ifndef MPI_FFI_H
#define MPI_FFI_H
#include <mpi.h>

extern const MPI_Comm MPIFFI_COMM_WORLD;
extern const MPI_Comm MPIFFI_COMM_SELF;
extern const MPI_Comm MPIFFI_COMM_NULL;
extern const MPI_Group MPIFFI_GROUP_NULL;
extern const MPI_Request MPIFFI_REQUEST_NULL;
extern const MPI_Datatype MPIFFI_DATATYPE_NULL;
extern const MPI_Datatype MPIFFI_BYTE;
extern const MPI_Datatype MPIFFI_CHAR;
extern const MPI_Datatype MPIFFI_INT;
extern const MPI_Datatype MPIFFI_UNSIGNED;
extern const MPI_Datatype MPIFFI_LONG;
extern const MPI_Datatype MPIFFI_FLOAT;
extern const MPI_Datatype MPIFFI_DOUBLE;
extern const MPI_Datatype MPIFFI_INT32_T;
extern const MPI_Datatype MPIFFI_INT64_T;
extern const MPI_Datatype MPIFFI_UINT8_T;
extern const MPI_Datatype MPIFFI_UINT32_T;
extern const MPI_Datatype MPIFFI_UINT64_T;
extern const MPI_Datatype MPIFFI_SHORT;
extern const MPI_Op MPIFFI_OP_MAX;
extern const MPI_Op MPIFFI_OP_MIN;
extern const MPI_Op MPIFFI_OP_SUM;
extern const MPI_Op MPIFFI_OP_BOR;
extern const MPI_Op MPIFFI_OP_LAND;
extern const MPI_Datatype MPIFFI_SIGNED_CHAR;
extern const MPI_Datatype MPIFFI_UNSIGNED_CHAR;
extern const MPI_Datatype MPIFFI_UNSIGNED_SHORT;
extern const MPI_Datatype MPIFFI_UNSIGNED_LONG;
extern const MPI_Datatype MPIFFI_LONG_LONG;
extern const MPI_Datatype MPIFFI_UNSIGNED_LONG_LONG;
extern const MPI_Datatype MPIFFI_INT8_T;
extern const MPI_Datatype MPIFFI_INT16_T;
extern const MPI_Datatype MPIFFI_UINT16_T;
extern const MPI_Datatype MPIFFI_INTEGER;
extern const MPI_Datatype MPIFFI_INTEGER4;
extern const MPI_Datatype MPIFFI_INTEGER8;
extern const MPI_Datatype MPIFFI_REAL;
extern const MPI_Datatype MPIFFI_REAL4;
extern const MPI_Datatype MPIFFI_REAL8;
extern const MPI_Datatype MPIFFI_DOUBLE_PRECISION;
extern const MPI_Op MPIFFI_OP_PROD;
extern const MPI_Op MPIFFI_OP_LOR;
extern const MPI_Op MPIFFI_OP_LXOR;
extern const MPI_Op MPIFFI_OP_BAND;
extern const MPI_Op MPIFFI_OP_BXOR;
extern const MPI_Errhandler MPIFFI_ERRORS_RETURN;
extern void *const MPIFFI_IN_PLACE;
extern MPI_Status *const MPIFFI_STATUS_IGNORE;
extern MPI_Status *const MPIFFI_STATUSES_IGNORE;
extern MPI_Comm_copy_attr_function *const MPIFFI_COMM_NULL_COPY_FN;
extern MPI_Comm_delete_attr_function *const MPIFFI_COMM_NULL_DELETE_FN;
extern MPI_Type_copy_attr_function *const MPIFFI_TYPE_NULL_COPY_FN;
extern const int MPIFFI_SUCCESS;
extern const int MPIFFI_UNDEFINED;
extern const int MPIFFI_KEYVAL_INVALID;
extern const int MPIFFI_ANY_SOURCE;
extern const int MPIFFI_ANY_TAG;
extern const int MPIFFI_PROC_NULL;
extern const int MPIFFI_IDENT;
extern const int MPIFFI_CONGRUENT;
extern const int MPIFFI_COMBINER_NAMED;
extern const int MPIFFI_COMBINER_DUP;
extern const int MPIFFI_COMBINER_CONTIGUOUS;
extern const int MPIFFI_COMBINER_VECTOR;
extern const int MPIFFI_COMBINER_HVECTOR;
extern const int MPIFFI_COMBINER_INDEXED;
extern const int MPIFFI_COMBINER_HINDEXED;
extern const int MPIFFI_COMBINER_INDEXED_BLOCK;
extern const int MPIFFI_COMBINER_HINDEXED_BLOCK;
extern const int MPIFFI_COMBINER_STRUCT;
extern const int MPIFFI_COMBINER_SUBARRAY;
extern const int MPIFFI_COMBINER_DARRAY;
extern const int MPIFFI_COMBINER_F90_REAL;
extern const int MPIFFI_COMBINER_F90_COMPLEX;
extern const int MPIFFI_COMBINER_F90_INTEGER;
extern const int MPIFFI_COMBINER_RESIZED;
extern const int MPIFFI_THREAD_SINGLE;
extern const int MPIFFI_THREAD_MULTIPLE;
extern const int MPIFFI_ERR_OTHER;
extern const int MPIFFI_ERR_TRUNCATE;
extern const int MPIFFI_ERR_ARG;
extern const int MPIFFI_ERR_INTERN;
extern const int MPIFFI_ERR_IN_STATUS;
extern const int MPIFFI_ERR_PENDING;
extern const int MPIFFI_MAX_PROCESSOR_NAME;
extern const int MPIFFI_COMM_TYPE_SHARED;

/* Status fields that are not part of the public struct in every implementation. */
void mpiffi_status_set_count_bytes(MPI_Status *status, MPI_Count bytes);

/* Fortran handle conversion (functions in Open MPI, macros in MPICH). */
MPI_Comm mpiffi_comm_f2c(MPI_Fint comm);
MPI_Datatype mpiffi_type_f2c(MPI_Fint datatype);
MPI_Request mpiffi_request_f2c(MPI_Fint request);
MPI_Op mpiffi_op_f2c(MPI_Fint op);
MPI_Fint mpiffi_request_c2f(MPI_Request request);
#endif
