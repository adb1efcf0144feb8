/* What the checking programs (a2a_check.c, ag_check.c, bcast_check.c) share: the rank's
 * counters, CHECK, and the job's verdict line, which the mpirun tests parse. */
#ifndef PROGS_CHECK_H
#define PROGS_CHECK_H

#include <mpi.h>
#include <stdio.h>

/* This rank and the world size; the checks that failed and all checks run; the calls the shim
 * offloads (the same on every rank). */
static int rank, size, failures, checks, eligible;

#define CHECK(cond, ...)                                                                \
    do {                                                                                \
        checks++;                                                                       \
        if (!(cond)) {                                                                  \
            failures++;                                                                 \
            if (failures < 10) {                                                        \
                fprintf(stderr, "rank %d: check failed at line %d: ", rank, __LINE__);  \
                fprintf(stderr, __VA_ARGS__);                                           \
                fprintf(stderr, "\n");                                                  \
            }                                                                           \
        }                                                                               \
    } while (0)

/* The job's verdict: sums every rank's failures; rank 0 prints "NAME: all ok (N checks on rank
 * 0, S ranks, E eligible calls per rank)" when there are none, "NAME: F failures" followed by
 * `detail` otherwise. Returns the exit status (1 when any rank failed). */
static int verdict(const char *name, const char *detail) {
    int all_failures = 0;
    MPI_Allreduce(&failures, &all_failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) {
        if (all_failures == 0)
            printf("%s: all ok (%d checks on rank 0, %d ranks, %d eligible calls per rank)\n",
                   name, checks, size, eligible);
        else printf("%s: %d failures%s\n", name, all_failures, detail);
        fflush(stdout);
    }
    return all_failures == 0 ? 0 : 1;
}

#endif
