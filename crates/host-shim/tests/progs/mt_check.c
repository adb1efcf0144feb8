/* MPI_THREAD_MULTIPLE: several threads per rank run nonblocking alltoallv on their own
 * communicators at the same time (first use included, so communicator ids are agreed
 * concurrently), then wait with MPI_Wait / MPI_Waitall / MPI_Test loops. Prints
 * "mt_check: all ok (E eligible calls per rank)" on rank 0 when every element on every rank is
 * right; E is the number of collectives each rank may offload. */
#include <mpi.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

enum { THREADS = 3, ITERS = 20 };
static int rank, size;
static MPI_Comm comms[THREADS];
static int failures[THREADS];

static int val(int t, int it, int src, int dst, int i) { return ((t * 64 + it) * 64 + src) * 4096 + dst * 64 + i; }

static void *worker(void *arg) {
    int t = (int)(long)arg;
    int *sc = malloc(size * sizeof(int)), *sd = malloc(size * sizeof(int));
    int *rc = malloc(size * sizeof(int)), *rd = malloc(size * sizeof(int));
    int *sb = malloc(size * 8 * sizeof(int)), *rb = malloc(size * 8 * sizeof(int));
    for (int it = 0; it < ITERS; it++) {
        for (int d = 0; d < size; d++) {
            sc[d] = (rank + d + it + t) % 5;
            sd[d] = d * 8;
            rc[d] = (d + rank + it + t) % 5;
            rd[d] = d * 8;
            for (int i = 0; i < sc[d]; i++) sb[d * 8 + i] = val(t, it, rank, d, i);
        }
        for (int i = 0; i < size * 8; i++) rb[i] = -1;
        MPI_Request req;
        MPI_Ialltoallv(sb, sc, sd, MPI_INT, rb, rc, rd, MPI_INT, comms[t], &req);
        if (it % 3 == 0) {
            MPI_Wait(&req, MPI_STATUS_IGNORE);
        } else if (it % 3 == 1) {
            MPI_Waitall(1, &req, MPI_STATUSES_IGNORE);
        } else {
            int flag = 0;
            while (!flag) MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
        }
        for (int s = 0; s < size; s++)
            for (int i = 0; i < 8; i++) {
                int want = i < rc[s] ? val(t, it, s, rank, i) : -1;
                if (rb[s * 8 + i] != want) failures[t]++;
            }
    }
    free(sc); free(sd); free(rc); free(rd); free(sb); free(rb);
    return NULL;
}

int main(int argc, char **argv) {
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (provided < MPI_THREAD_MULTIPLE) {
        if (rank == 0) printf("mt_check: skipped (no MPI_THREAD_MULTIPLE)\n");
        MPI_Finalize();
        return 0;
    }
    for (int t = 0; t < THREADS; t++) MPI_Comm_dup(MPI_COMM_WORLD, &comms[t]);
    pthread_t th[THREADS];
    for (int t = 0; t < THREADS; t++) pthread_create(&th[t], NULL, worker, (void *)(long)t);
    for (int t = 0; t < THREADS; t++) pthread_join(th[t], NULL);
    int mine = 0, all = 0;
    for (int t = 0; t < THREADS; t++) mine += failures[t];
    MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    for (int t = 0; t < THREADS; t++) MPI_Comm_free(&comms[t]);
    if (rank == 0) {
        if (all == 0) printf("mt_check: all ok (%d eligible calls per rank)\n", THREADS * ITERS);
        else printf("mt_check: %d wrong elements\n", all);
        fflush(stdout);
    }
    MPI_Finalize();
    return all == 0 ? 0 : 1;
}
