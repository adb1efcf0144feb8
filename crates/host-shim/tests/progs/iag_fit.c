/* Several MPI_Iallgather outstanding at once, each receive buffer larger than half of FIT
 * bytes and at most FIT, checked byte for byte against PMPI_Allgather on the same inputs.
 * With the hierarchical staged design and SPOFF_SEGMENT_BYTES=FIT, each fits a node owner's
 * part of the segment alone but no two at once, so owners deliver some of them flat.
 * Usage: iag_fit FIT ROUNDS. Rank 0 prints "iag_fit: all ok (... eligible calls per rank)". */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OUTSTANDING 3

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    long fit = argc > 1 ? atol(argv[1]) : 65536;
    int rounds = argc > 2 ? atoi(argv[2]) : 4;
    int failures = 0, eligible = 0;
    for (int round = 0; round < rounds; round++) {
        char *send[OUTSTANDING], *recv[OUTSTANDING], *want;
        int len[OUTSTANDING];
        MPI_Request req[OUTSTANDING];
        for (int k = 0; k < OUTSTANDING; k++) {
            /* The same on every rank: a block length with size * len in (fit/2, fit]. */
            len[k] = (int)(fit / 2 / size) + 1 + (round * 7 + k * 13) % (int)(fit / 2 / size);
            send[k] = malloc(len[k]);
            recv[k] = malloc((size_t)len[k] * size);
            for (int i = 0; i < len[k]; i++) send[k][i] = (char)(rank * 31 + i * 7 + k + round);
            memset(recv[k], 0x5a, (size_t)len[k] * size);
            MPI_Iallgather(send[k], len[k], MPI_CHAR, recv[k], len[k], MPI_CHAR, MPI_COMM_WORLD,
                           &req[k]);
            eligible++;
        }
        MPI_Waitall(OUTSTANDING, req, MPI_STATUSES_IGNORE);
        for (int k = 0; k < OUTSTANDING; k++) {
            want = malloc((size_t)len[k] * size);
            PMPI_Allgather(send[k], len[k], MPI_CHAR, want, len[k], MPI_CHAR, MPI_COMM_WORLD);
            if (memcmp(want, recv[k], (size_t)len[k] * size) != 0) {
                failures++;
                fprintf(stderr, "iag_fit: rank %d round %d call %d: wrong bytes\n", rank, round, k);
            }
            free(want);
            free(send[k]);
            free(recv[k]);
        }
    }
    int all = 0;
    PMPI_Allreduce(&failures, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) {
        if (all == 0)
            printf("iag_fit: all ok (%d checks on rank 0, %d ranks, %d eligible calls per rank)\n",
                   eligible, size, eligible);
        else
            printf("iag_fit: %d failures\n", all);
    }
    MPI_Finalize();
    return all != 0;
}
