/* Checks broadcast results, natively or with libhost_shim.so preloaded: every MPI_Bcast /
 * MPI_Ibcast is compared byte for byte with PMPI_Bcast (never intercepted) on the same inputs.
 *
 * Usage: bcast_check [ROUNDS [SEED [big] [late] [late=MS] [fit=N]]]. Each round issues a
 * random batch of 1-5 broadcasts (blocking MPI_Bcast, or MPI_Ibcast left outstanding) with a
 * random root, on MPI_COMM_WORLD, a dup, the even/odd halves or a reversed-order split, of
 * MPI_CHAR, MPI_INT, MPI_DOUBLE, a contiguous derived type, or a non-contiguous resized vector
 * type that the shim packs. Sizes: 0 bytes, 1 byte, a few bytes, and sizes around and between
 * multiples of 64 KiB (the default chunk is 256 KiB: sizes that are not multiples of it);
 * with "big", up to 6 MiB; with "fit=N", every size is in (N/2, N], so that a message fits a
 * segment of N bytes but no two do at once. The batch's requests complete by MPI_Wait (reverse order),
 * MPI_Waitall or an MPI_Testsome loop. The buffers of non-roots start as a sentinel and have a
 * guard byte after the data, so short or long writes are caught. With "late", the last world
 * rank enters every call 2-4 ms late; with "late=MS", MS to MS + 2 ms late. Prints
 * "bcast_check: all ok (N checks on rank 0, S ranks, E eligible calls per rank)" on rank 0 when
 * every rank passed (E counts the calls the shim offloads: all of them), "bcast_check: F
 * failures" otherwise (exit 1). */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

#define SENTINEL 0x5C
#define GUARD 0xE7
#define MAX_BATCH 5

static int late, big;
static long late_ms; /* late=MS */
static long fit;

static uint64_t shared, own;
static uint32_t next(uint64_t *s) {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return (uint32_t)((*s * 0x2545F4914F6CDD1DULL) >> 32);
}
static int pick(int n) { return (int)(next(&shared) % (uint32_t)n); }

enum { T_CHAR, T_INT, T_DOUBLE, T_C3, T_VEC, TYPES };
static const char *type_name[] = {"char", "int", "double", "contiguous(3)", "resized vector"};
static MPI_Datatype c3, vecr;

struct op {
    int type, comm_idx, root, blocking, count, n, me;
    MPI_Comm comm;
    MPI_Datatype t;
    size_t bytes; /* extent of the data */
    unsigned char *buf, *ref, *data;
    MPI_Request req;
};

static void skew(void) {
    long us = (long)(next(&own) % 300);
    if (late && rank == size - 1) us = 2000 + (long)(next(&own) % 2000);
    if (late_ms > 0 && rank == size - 1) us = late_ms * 1000 + (long)(next(&own) % 2000);
    usleep((useconds_t)us);
}

static size_t extent_of(MPI_Datatype t) {
    MPI_Aint lb, ext;
    MPI_Type_get_extent(t, &lb, &ext);
    return (size_t)ext;
}

/* A size in bytes: 0, 1, small, or around multiples of 64 KiB (up to 6 MiB with "big"). */
static size_t draw_bytes(void) {
    if (fit > 1) return (size_t)(fit / 2 + 1 + pick((int)(fit - fit / 2)));
    switch (pick(6)) {
    case 0: return 0;
    case 1: return 1;
    case 2: return 2 + pick(200);
    default: {
        size_t units = big ? 1 + pick(96) : 1 + pick(12);
        long jitter = pick(3) == 0 ? 0 : (long)pick(2001) - 1000;
        long b = (long)(units * 65536) + jitter;
        return b < 1 ? 1 : (size_t)b;
    }
    }
}

static void issue(struct op *o, MPI_Comm *comms) {
    memset(o, 0, sizeof *o);
    o->type = pick(TYPES);
    o->comm_idx = pick(4);
    o->blocking = pick(3) == 0;
    o->comm = comms[o->comm_idx];
    MPI_Comm_size(o->comm, &o->n);
    MPI_Comm_rank(o->comm, &o->me);
    o->root = pick(64) % o->n;
    switch (o->type) {
    case T_CHAR: o->t = MPI_CHAR; break;
    case T_INT: o->t = MPI_INT; break;
    case T_DOUBLE: o->t = MPI_DOUBLE; break;
    case T_C3: o->t = c3; break;
    default: o->t = vecr; break;
    }
    size_t ext = extent_of(o->t);
    o->count = (int)(draw_bytes() / ext);
    o->bytes = (size_t)o->count * ext;
    o->buf = malloc(o->bytes + 1);
    o->ref = malloc(o->bytes + 1);
    o->data = malloc(o->bytes + 1);
    /* The root's data are drawn from its own generator: they differ between roots and rounds. */
    for (size_t b = 0; b < o->bytes; b++) o->data[b] = (unsigned char)next(&own);
    if (o->me == o->root) {
        memcpy(o->buf, o->data, o->bytes);
        memcpy(o->ref, o->data, o->bytes);
    } else {
        memset(o->buf, SENTINEL, o->bytes);
        memset(o->ref, SENTINEL, o->bytes);
    }
    o->buf[o->bytes] = GUARD;
    o->ref[o->bytes] = GUARD;
    eligible++;
    o->req = MPI_REQUEST_NULL;
    skew();
    int rc = o->blocking ? MPI_Bcast(o->buf, o->count, o->t, o->root, o->comm)
                         : MPI_Ibcast(o->buf, o->count, o->t, o->root, o->comm, &o->req);
    CHECK(rc == MPI_SUCCESS, "%s returned %d", o->blocking ? "bcast" : "ibcast", rc);
}

static void complete(struct op *ops, int k, int how) {
    MPI_Request reqs[MAX_BATCH];
    int idx[MAX_BATCH], outc;
    if (how == 0) {
        for (int i = k - 1; i >= 0; i--)
            CHECK(MPI_Wait(&ops[i].req, MPI_STATUS_IGNORE) == MPI_SUCCESS, "wait");
        return;
    }
    for (int i = 0; i < k; i++) reqs[i] = ops[i].req;
    if (how == 1) {
        CHECK(MPI_Waitall(k, reqs, MPI_STATUSES_IGNORE) == MPI_SUCCESS, "waitall");
    } else {
        int done = 0, active = 0;
        for (int i = 0; i < k; i++) active += reqs[i] != MPI_REQUEST_NULL;
        while (done < active) {
            CHECK(MPI_Testsome(k, reqs, &outc, idx, MPI_STATUSES_IGNORE) == MPI_SUCCESS, "testsome");
            if (outc == MPI_UNDEFINED) break;
            done += outc;
        }
        CHECK(done == active, "testsome completed %d of %d", done, active);
    }
    for (int i = 0; i < k; i++) {
        CHECK(reqs[i] == MPI_REQUEST_NULL, "request %d left", i);
        ops[i].req = MPI_REQUEST_NULL;
    }
}

static void verify(struct op *o, int round, int i) {
    int rc = PMPI_Bcast(o->ref, o->count, o->t, o->root, o->comm);
    CHECK(rc == MPI_SUCCESS, "reference bcast returned %d", rc);
    size_t bad = o->bytes + 1;
    for (size_t b = 0; b <= o->bytes; b++)
        if (o->buf[b] != o->ref[b]) {
            bad = b;
            break;
        }
    CHECK(bad == o->bytes + 1,
          "round %d op %d: %s of %d %s from root %d on comm %d (size %d): byte %zu of %zu is "
          "%#x, expected %#x",
          round, i, o->blocking ? "bcast" : "ibcast", o->count, type_name[o->type], o->root,
          o->comm_idx, o->n, bad, o->bytes, bad <= o->bytes ? o->buf[bad] : 0,
          bad <= o->bytes ? o->ref[bad] : 0);
    free(o->buf);
    free(o->ref);
    free(o->data);
}

int main(int argc, char **argv) {
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_SINGLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int rounds = argc > 1 ? atoi(argv[1]) : 20;
    uint64_t seed = argc > 2 ? strtoull(argv[2], NULL, 0) : 1;
    for (int a = 3; a < argc; a++) {
        if (strcmp(argv[a], "late") == 0) late = 1;
        if (strcmp(argv[a], "big") == 0) big = 1;
        if (strncmp(argv[a], "fit=", 4) == 0) fit = atol(argv[a] + 4);
        if (strncmp(argv[a], "late=", 5) == 0) late_ms = atol(argv[a] + 5);
    }
    shared = seed * 0x9E3779B97F4A7C15ULL + 1;
    own = (seed + 1000003ULL * (uint64_t)(rank + 1)) * 0xD1B54A32D192ED03ULL + 7;

    MPI_Type_contiguous(3, MPI_INT, &c3);
    MPI_Type_commit(&c3);
    MPI_Datatype vec;
    MPI_Type_vector(2, 1, 2, MPI_INT, &vec);
    MPI_Type_create_resized(vec, 0, 4 * sizeof(int), &vecr);
    MPI_Type_commit(&vecr);
    MPI_Type_free(&vec);

    MPI_Comm comms[4];
    comms[0] = MPI_COMM_WORLD;
    MPI_Comm_dup(MPI_COMM_WORLD, &comms[1]);
    MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &comms[2]);
    MPI_Comm_split(MPI_COMM_WORLD, 0, size - rank, &comms[3]);

    struct op ops[MAX_BATCH];
    for (int round = 0; round < rounds; round++) {
        int k = 1 + pick(MAX_BATCH);
        for (int i = 0; i < k; i++) issue(&ops[i], comms);
        complete(ops, k, pick(3));
        for (int i = 0; i < k; i++) verify(&ops[i], round, i);
        int any = 0;
        MPI_Allreduce(&failures, &any, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        if (any) break;
    }

    MPI_Comm_free(&comms[1]);
    MPI_Comm_free(&comms[2]);
    MPI_Comm_free(&comms[3]);
    MPI_Type_free(&c3);
    MPI_Type_free(&vecr);
    char detail[64];
    snprintf(detail, sizeof detail, " (seed %llu)", (unsigned long long)seed);
    int status = verdict("bcast_check", detail);
    MPI_Finalize();
    return status;
}
