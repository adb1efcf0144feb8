/* The soak job: N collectives of every intercepted kind, back to back, each checked.
 *
 * Usage: soak N [SEED]. Iteration i runs one collective, chosen from (SEED, i) alike on every
 * rank: MPI_Ialltoallv, MPI_Alltoall, MPI_Allgatherv, MPI_Iallgather, MPI_Bcast or MPI_Ibcast,
 * on MPI_COMM_WORLD or a duplicate, with MPI_INT or a vector type (packed by the shim), some
 * with MPI_IN_PLACE, up to 8 nonblocking ones outstanding before a MPI_Waitall. Every received
 * element is a known function of (sender, receiver, iteration) and is checked. Rank 0 prints
 * "soak: N collectives, ok" or "soak: F failures" (exit 1) at the end; ranks finalize without
 * a barrier. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXB 8
#define ELEMS 64

static int rank, size, failures;

static uint64_t mix(uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static int val(int src, int dst, long it, int k) { return (int)((src * 131 + dst * 7 + it * 3 + k) & 0x7fffffff); }

struct pending {
    int kind, n, root;
    long it;
    int *rb;
    int *sb;
};

static void check(struct pending *p) {
    for (int s = 0; s < size; s++)
        for (int k = 0; k < p->n; k++) {
            int want, got;
            switch (p->kind) {
            case 0: /* alltoall(v): block s from s */
                want = val(s, rank, p->it, k);
                got = p->rb[s * p->n + k];
                break;
            case 1: /* allgather(v): block s from s */
                want = val(s, -1, p->it, k);
                got = p->rb[s * p->n + k];
                break;
            default: /* bcast: only block 0 */
                if (s) return;
                want = val(p->root, -1, p->it, k);
                got = p->rb[k];
                break;
            }
            if (got != want && failures++ < 5)
                fprintf(stderr, "soak: rank %d iteration %ld kind %d from %d elem %d: %d, not %d\n",
                        rank, p->it, p->kind, s, k, got, want);
        }
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    long n = argc > 1 ? atol(argv[1]) : 1000;
    uint64_t seed = argc > 2 ? strtoull(argv[2], 0, 10) : 1;
    MPI_Comm dup;
    MPI_Comm_dup(MPI_COMM_WORLD, &dup);
    /* ELEMS ints, every other one of 2*ELEMS ints (resized to that extent): a vector the
     * shim packs. */
    MPI_Datatype vec0, vec;
    MPI_Type_vector(ELEMS, 1, 2, MPI_INT, &vec0);
    MPI_Type_create_resized(vec0, 0, 2 * ELEMS * sizeof(int), &vec);
    MPI_Type_commit(&vec);
    MPI_Type_free(&vec0);
    int *counts = malloc(size * sizeof(int)), *displs = malloc(size * sizeof(int));
    struct pending pend[MAXB];
    MPI_Request reqs[MAXB];
    int np = 0;
    /* Strided scratch for the vector cases. */
    int *wide_s = malloc(2 * ELEMS * sizeof(int) * size), *wide_r = malloc(2 * ELEMS * sizeof(int) * size);
    for (long it = 0; it < n; it++) {
        uint64_t r = mix(seed ^ mix((uint64_t)it));
        int kind = (int)(r % 6), on_dup = (r >> 8) & 1, nb = (r >> 9) & 1, strided = ((r >> 10) % 8) == 0;
        int en = 1 + (int)((r >> 16) % ELEMS);
        MPI_Comm c = on_dup ? dup : MPI_COMM_WORLD;
        struct pending *p = &pend[np];
        p->it = it;
        p->n = en;
        p->sb = malloc(size * ELEMS * sizeof(int));
        p->rb = malloc(size * ELEMS * sizeof(int));
        for (int i = 0; i < size * ELEMS; i++) p->rb[i] = -1;
        MPI_Request *req = &reqs[np];
        *req = MPI_REQUEST_NULL;
        for (int s = 0; s < size; s++) { counts[s] = en; displs[s] = s * en; }
        if (kind <= 1) { /* alltoallv / alltoall */
            p->kind = 0;
            for (int d = 0; d < size; d++)
                for (int k = 0; k < en; k++) p->sb[d * en + k] = val(rank, d, it, k);
            if (strided && !nb) {
                /* The same data through the vector type, one element of it per peer when en
                 * is ELEMS; otherwise plain ints. */
                for (int i = 0; i < 2 * ELEMS * size; i++) { wide_s[i] = -3; wide_r[i] = -4; }
                for (int d = 0; d < size; d++)
                    for (int k = 0; k < ELEMS; k++) wide_s[d * 2 * ELEMS + 2 * k] = val(rank, d, it, k);
                MPI_Alltoall(wide_s, 1, vec, wide_r, 1, vec, c);
                p->n = ELEMS;
                for (int s = 0; s < size; s++)
                    for (int k = 0; k < ELEMS; k++) p->rb[s * ELEMS + k] = wide_r[s * 2 * ELEMS + 2 * k];
            } else if (kind == 0 && nb) {
                MPI_Ialltoallv(p->sb, counts, displs, MPI_INT, p->rb, counts, displs, MPI_INT, c, req);
            } else if (kind == 0) {
                MPI_Alltoallv(p->sb, counts, displs, MPI_INT, p->rb, counts, displs, MPI_INT, c);
            } else {
                memcpy(p->rb, p->sb, size * en * sizeof(int));
                MPI_Alltoall(MPI_IN_PLACE, en, MPI_INT, p->rb, en, MPI_INT, c);
            }
        } else if (kind <= 3) { /* allgather(v) */
            p->kind = 1;
            for (int k = 0; k < en; k++) p->sb[k] = val(rank, -1, it, k);
            if (kind == 2) {
                MPI_Allgatherv(p->sb, en, MPI_INT, p->rb, counts, displs, MPI_INT, c);
            } else if (nb) {
                MPI_Iallgather(p->sb, en, MPI_INT, p->rb, en, MPI_INT, c, req);
            } else {
                memcpy(p->rb + rank * en, p->sb, en * sizeof(int));
                MPI_Allgather(MPI_IN_PLACE, en, MPI_INT, p->rb, en, MPI_INT, c);
            }
        } else { /* bcast */
            p->kind = 2;
            p->root = (int)((r >> 24) % size);
            if (rank == p->root)
                for (int k = 0; k < en; k++) p->rb[k] = val(p->root, -1, it, k);
            if (kind == 4 && nb) MPI_Ibcast(p->rb, en, MPI_INT, p->root, c, req);
            else MPI_Bcast(p->rb, en, MPI_INT, p->root, c);
        }
        if (*req != MPI_REQUEST_NULL) {
            np++;
        } else {
            check(p);
            free(p->sb);
            free(p->rb);
        }
        if (np == MAXB || (np > 0 && it == n - 1)) {
            MPI_Waitall(np, reqs, MPI_STATUSES_IGNORE);
            for (int i = 0; i < np; i++) {
                check(&pend[i]);
                free(pend[i].sb);
                free(pend[i].rb);
            }
            np = 0;
        }
    }
    int all = 0;
    MPI_Allreduce(&failures, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) {
        if (all) printf("soak: %d failures\n", all);
        else printf("soak: %ld collectives, ok\n", n);
        fflush(stdout);
    }
    MPI_Type_free(&vec);
    MPI_Comm_free(&dup);
    MPI_Finalize();
    return all ? 1 : 0;
}
