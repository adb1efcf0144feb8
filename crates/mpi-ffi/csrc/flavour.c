/* Which MPI family the header found belongs to; build.rs runs only the preprocessor on this
 * file and reads the MPIFFI_FLAVOUR line. */
#include <mpi.h>
#if defined(OPEN_MPI)
MPIFFI_FLAVOUR = openmpi
#elif defined(MPICH_VERSION) || defined(MPICH)
MPIFFI_FLAVOUR = mpich
#else
MPIFFI_FLAVOUR = unknown
#endif
