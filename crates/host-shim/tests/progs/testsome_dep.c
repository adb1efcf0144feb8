/* Rank 0 waits in MPI_Testsome for an offloaded MPI_Iallgather together with a native receive
 * that rank 1 sends only once its own MPI_Iallgather completed. With the ucx backend on UCX
 * over tcp/shared memory, the SPs' reads of rank 0's send block complete only while rank 0
 * progresses UCX, so its Testsome must do so even while a native request is pending: else
 * nothing moves until the SPs' copy timeout fails the collective.
 * Usage: testsome_dep <ints per rank>. Rank 0 prints the verdict. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int n = argc > 1 ? atoi(argv[1]) : 65536;
    int *send = malloc(sizeof(int) * n), *recv = malloc(sizeof(int) * n * size);
    for (int i = 0; i < n; i++) send[i] = rank * 1000003 + i;
    for (int i = 0; i < n * size; i++) recv[i] = -1;
    MPI_Request reqs[2];
    int token = 0;
    MPI_Iallgather(send, n, MPI_INT, recv, n, MPI_INT, MPI_COMM_WORLD, &reqs[0]);
    if (rank == 0) {
        MPI_Irecv(&token, 1, MPI_INT, 1, 7, MPI_COMM_WORLD, &reqs[1]);
        int done = 0, idx[2], out;
        while (done < 2) {
            MPI_Testsome(2, reqs, &out, idx, MPI_STATUSES_IGNORE);
            if (out != MPI_UNDEFINED) done += out;
        }
    } else {
        MPI_Wait(&reqs[0], MPI_STATUS_IGNORE);
        if (rank == 1) {
            token = 42;
            MPI_Send(&token, 1, MPI_INT, 0, 7, MPI_COMM_WORLD);
        }
    }
    int bad = 0;
    for (int r = 0; r < size; r++)
        for (int i = 0; i < n; i++)
            if (recv[r * n + i] != r * 1000003 + i) bad++;
    if (rank == 0 && token != 42) bad++;
    if (bad) {
        fprintf(stderr, "testsome_dep: rank %d: %d wrong values\n", rank, bad);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) printf("testsome_dep: all ok (1 eligible calls per rank)\n");
    free(send);
    free(recv);
    MPI_Finalize();
    return 0;
}
