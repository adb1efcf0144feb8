/* Broadcasts on many communicators at once, for the multicast Bcast (SPOFF_BCAST_DESIGN=mcast),
 * whose communicators share the fabric's groups when their slots collide: every byte of every
 * broadcast must come from its own communicator's root and collective, never from another
 * broadcast running at the same time on the same groups.
 *
 * Usage: mcast_comms [ROUNDS [SEED [comms=N] [cold]]]. The program makes N communicators
 * (default 24: MPI_Comm_dup of MPI_COMM_WORLD, splits into halves, reversed-order splits, dups of
 * those; every rank is a member of one communicator of each index, so every rank makes the same
 * calls) and broadcasts one byte on each in the same order on every rank (without it, "cold":
 * the shim agrees a communicator's id at its first offloaded collective with a blocking
 * PMPI_Bcast on it, so ranks whose first MPI_Ibcasts on several communicators come in different
 * orders deadlock), then each round starts 1-2 MPI_Ibcast on every communicator, in an order drawn per rank (legal:
 * nonblocking collectives on different communicators need no common order), all outstanding
 * together, and completes them with MPI_Waitall. Each broadcast has a random root and size (0 B
 * to 300 KiB, rarely a multiple of any MTU), and the root's data are a pattern of (round,
 * communicator, op, byte), so a byte that crossed from another broadcast shows where it came
 * from. Every non-root buffer starts as a sentinel and has a guard after the data. Then each
 * result is also compared with PMPI_Bcast on the same communicator. Prints "mcast_comms: all ok
 * (N checks on rank 0, S ranks, E eligible calls per rank)" on rank 0 when every rank passed,
 * "mcast_comms: F failures" otherwise (exit 1). */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define SENTINEL 0x5C
#define GUARD 0xE7
#define PER_COMM 2

static uint64_t shared, own;
static uint32_t next(uint64_t *s) {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return (uint32_t)((*s * 0x2545F4914F6CDD1DULL) >> 32);
}

/* The root's byte b of op j on communicator c in round r. */
static unsigned char pattern(int r, int c, int j, size_t b) {
    uint64_t x = ((uint64_t)r << 40) ^ ((uint64_t)c << 32) ^ ((uint64_t)j << 28) ^ b;
    x *= 0x9E3779B97F4A7C15ULL;
    return (unsigned char)(x >> 56);
}

struct op {
    int comm, j, root, me, n;
    size_t bytes;
    unsigned char *buf, *ref;
    MPI_Request req;
};

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int rounds = argc > 1 ? atoi(argv[1]) : 10;
    uint64_t seed = argc > 2 ? strtoull(argv[2], NULL, 0) : 1;
    int ncomm = 24, cold = 0;
    for (int a = 3; a < argc; a++) {
        if (strncmp(argv[a], "comms=", 6) == 0) ncomm = atoi(argv[a] + 6);
        if (strcmp(argv[a], "cold") == 0) cold = 1;
    }
    if (ncomm < 1) ncomm = 1;
    shared = seed * 0x9E3779B97F4A7C15ULL + 1;
    own = (seed + 1000003ULL * (uint64_t)(rank + 1)) * 0xD1B54A32D192ED03ULL + 7;

    MPI_Comm *comms = calloc((size_t)ncomm, sizeof *comms);
    for (int c = 0; c < ncomm; c++) {
        switch (c % 4) {
        case 0: MPI_Comm_dup(MPI_COMM_WORLD, &comms[c]); break;
        case 1: MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &comms[c]); break;
        case 2: MPI_Comm_split(MPI_COMM_WORLD, 0, size - rank, &comms[c]); break;
        default: MPI_Comm_dup(comms[c - 2], &comms[c]); break;
        }
    }

    /* First use of each communicator in one order on every rank (see the header). */
    if (!cold) {
        for (int c = 0; c < ncomm; c++) {
            char x = 1;
            MPI_Bcast(&x, 1, MPI_BYTE, 0, comms[c]);
            CHECK(x == 1, "first bcast on comm %d", c);
            eligible++;
        }
    }
    int max_ops = ncomm * PER_COMM;
    struct op *ops = calloc((size_t)max_ops, sizeof *ops);
    int *order = calloc((size_t)max_ops, sizeof *order);
    MPI_Request *reqs = calloc((size_t)max_ops, sizeof *reqs);
    for (int r = 0; r < rounds; r++) {
        int k = 0;
        for (int c = 0; c < ncomm; c++) {
            int per = 1 + (int)(next(&shared) % PER_COMM);
            for (int j = 0; j < per; j++) {
                struct op *o = &ops[k++];
                o->comm = c;
                o->j = j;
                MPI_Comm_size(comms[c], &o->n);
                MPI_Comm_rank(comms[c], &o->me);
                o->root = (int)(next(&shared) % (uint32_t)o->n);
                switch (next(&shared) % 5) {
                case 0: o->bytes = next(&shared) % 3; break;
                case 1: o->bytes = 1 + next(&shared) % 5000; break;
                default: o->bytes = 1 + next(&shared) % (300 * 1024); break;
                }
                o->buf = malloc(o->bytes + 1);
                o->ref = malloc(o->bytes + 1);
                for (size_t b = 0; b < o->bytes; b++) {
                    unsigned char v = o->me == o->root ? pattern(r, c, j, b) : SENTINEL;
                    o->buf[b] = v;
                    o->ref[b] = v;
                }
                o->buf[o->bytes] = GUARD;
                o->ref[o->bytes] = GUARD;
            }
        }
        /* This rank's order of starting them: any, as long as the ops of one communicator
         * keep theirs (the per-communicator order of collectives is MPI's rule). */
        for (int i = 0; i < k; i++) order[i] = i;
        for (int i = k - 1; i > 0; i--) {
            int s = (int)(next(&own) % (uint32_t)(i + 1));
            int t = order[i];
            order[i] = order[s];
            order[s] = t;
        }
        int *started = calloc((size_t)ncomm, sizeof(int));
        for (int i = 0; i < k; i++) {
            /* the communicator's next op in its own order */
            int c = ops[order[i]].comm;
            int first = 0;
            while (ops[first].comm != c) first++;
            struct op *o = &ops[first + started[c]++];
            int rc = MPI_Ibcast(o->buf, (int)o->bytes, MPI_BYTE, o->root, comms[c], &o->req);
            CHECK(rc == MPI_SUCCESS, "ibcast returned %d", rc);
            eligible++;
        }
        free(started);
        for (int i = 0; i < k; i++) reqs[i] = ops[i].req;
        CHECK(MPI_Waitall(k, reqs, MPI_STATUSES_IGNORE) == MPI_SUCCESS, "waitall");
        for (int i = 0; i < k; i++) {
            struct op *o = &ops[i];
            size_t bad = o->bytes + 1;
            for (size_t b = 0; b < o->bytes && bad > o->bytes; b++)
                if (o->buf[b] != pattern(r, o->comm, o->j, b)) bad = b;
            if (bad > o->bytes && o->buf[o->bytes] != GUARD) bad = o->bytes;
            CHECK(bad > o->bytes,
                  "round %d: ibcast %d of %zu bytes from root %d on comm %d (size %d): byte %zu "
                  "is %#x, expected %#x",
                  r, o->j, o->bytes, o->root, o->comm, o->n, bad, o->buf[bad],
                  bad < o->bytes ? pattern(r, o->comm, o->j, bad) : GUARD);
            int rc = PMPI_Bcast(o->ref, (int)o->bytes, MPI_BYTE, o->root, comms[o->comm]);
            CHECK(rc == MPI_SUCCESS && memcmp(o->ref, o->buf, o->bytes + 1) == 0,
                  "round %d: ibcast %d on comm %d differs from PMPI_Bcast", r, o->j, o->comm);
            free(o->buf);
            free(o->ref);
        }
        int any = 0;
        MPI_Allreduce(&failures, &any, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        if (any) break;
    }
    for (int c = 0; c < ncomm; c++) MPI_Comm_free(&comms[c]);
    free(comms);
    free(ops);
    free(order);
    free(reqs);
    char detail[64];
    snprintf(detail, sizeof detail, " (seed %llu)", (unsigned long long)seed);
    int status = verdict("mcast_comms", detail);
    MPI_Finalize();
    return status;
}
