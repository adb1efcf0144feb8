/* Buffers freed and reallocated between collectives: checks MPI_Alltoall results when every
 * round uses fresh memory, often at the addresses of the previous round's buffers.
 *
 * Usage: realloc_check [ROUNDS]. Odd rounds mmap/munmap their buffers explicitly (the kernel
 * hands the same addresses back), even rounds malloc/free large buffers (glibc maps and unmaps
 * them). Each round fills the send buffer with a pattern naming (round, source, destination,
 * index), runs a blocking and a nonblocking alltoall, and checks every element. Prints
 * "realloc_check: all ok (N checks on rank 0, S ranks, E eligible calls per rank)" on rank 0
 * when every rank passed, "realloc_check: F failures" otherwise (exit 1). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#define PER_PEER (64 * 1024) /* ints per peer: 256 KiB */

static int val(int round, int src, int dst, int i) {
    return round * 100000000 + src * 1000000 + dst * 10000 + i % 10000;
}

static int *get(size_t bytes, int round) {
    if (round % 2) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
    return malloc(bytes);
}

static void put(int *p, size_t bytes, int round) {
    if (round % 2)
        munmap(p, bytes);
    else
        free(p);
}

int main(int argc, char **argv) {
    int rank, size, failures = 0, checks = 0, eligible = 0;
    int rounds = argc > 1 ? atoi(argv[1]) : 6;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    size_t bytes = (size_t)size * PER_PEER * sizeof(int);
    for (int round = 0; round < rounds; round++) {
        int *sb = get(bytes, round), *rb = get(bytes, round);
        if (!sb || !rb) {
            fprintf(stderr, "rank %d: cannot allocate %zu bytes\n", rank, bytes);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        for (int nb = 0; nb < 2; nb++) {
            for (int d = 0; d < size; d++)
                for (int i = 0; i < PER_PEER; i++) sb[d * PER_PEER + i] = val(round + nb, rank, d, i);
            for (size_t i = 0; i < (size_t)size * PER_PEER; i++) rb[i] = -1;
            if (nb) {
                MPI_Request req;
                MPI_Ialltoall(sb, PER_PEER, MPI_INT, rb, PER_PEER, MPI_INT, MPI_COMM_WORLD, &req);
                MPI_Wait(&req, MPI_STATUS_IGNORE);
            } else {
                MPI_Alltoall(sb, PER_PEER, MPI_INT, rb, PER_PEER, MPI_INT, MPI_COMM_WORLD);
            }
            eligible++;
            for (int s = 0; s < size; s++)
                for (int i = 0; i < PER_PEER; i++) {
                    checks++;
                    int want = val(round + nb, s, rank, i), got = rb[s * PER_PEER + i];
                    if (got != want && failures++ < 10)
                        fprintf(stderr, "rank %d: round %d%s from %d [%d]: got %d want %d\n", rank,
                                round, nb ? " (nonblocking)" : "", s, i, got, want);
                }
        }
        put(sb, bytes, round);
        put(rb, bytes, round);
    }
    int all = 0;
    MPI_Allreduce(&failures, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) {
        if (all)
            printf("realloc_check: %d failures\n", all);
        else
            printf("realloc_check: all ok (%d checks on rank 0, %d ranks, %d eligible calls per rank)\n",
                   checks, size, eligible);
    }
    MPI_Finalize();
    return all ? 1 : 0;
}
