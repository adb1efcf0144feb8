/* Checks allgather(v) results, natively or with libhost_shim.so preloaded: every collective is
 * compared byte for byte with PMPI_Allgatherv (never intercepted) on the same inputs.
 *
 * Usage: ag_check [ROUNDS [SEED [late] [mixed] [return]]] (with "return", MPI_COMM_WORLD and
 * the communicators derived from it get MPI_ERRORS_RETURN and failed calls count as failures;
 * with "mixed", each batch also runs a blocking MPI_Alltoall on MPI_COMM_WORLD or its dup
 * while its allgathers are outstanding there). Each round issues a random batch of
 * MPI_Iallgatherv / MPI_Allgatherv / MPI_Iallgather / MPI_Allgather calls (random counts with
 * zeros, packed / gapped / reversed displacement layouts, MPI_CHAR, MPI_INT, MPI_DOUBLE, a
 * contiguous derived type, a non-contiguous resized vector type that the shim packs,
 * MPI_IN_PLACE; on MPI_COMM_WORLD, a dup, the even/odd
 * halves and a reversed-order split), several of them outstanding at once, completed by
 * MPI_Wait, MPI_Waitall or an MPI_Testsome loop mixed with a native point-to-point ring. The
 * layout decisions come from a generator seeded by SEED and are the same on every rank; the
 * data differ per rank. Before each call a rank sleeps a rank-dependent time; with "late" the
 * last world rank is consistently late (3-5 ms per call), so the others' service processes see
 * late arrivals. Receive buffers are pre-filled with a sentinel, so gaps and holes are checked
 * too. Prints "ag_check: all ok (N checks on rank 0, S ranks, E eligible calls per rank)" on
 * rank 0 when every rank passed (E counts the calls the shim offloads: all of them; an
 * offloading run posts exactly S * E collectives), "ag_check: F failures"
 * otherwise (exit 1). */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

#define SENTINEL 0xA5
#define MAX_BATCH 6

static int late, mixed;

/* xorshift64*: `shared` is the same on every rank, `own` differs per rank. */
static uint64_t shared, own;
static uint32_t next(uint64_t *s) {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return (uint32_t)((*s * 0x2545F4914F6CDD1DULL) >> 32);
}
static int pick(int n) { return (int)(next(&shared) % (uint32_t)n); }

enum kind { IALLGATHERV, ALLGATHERV, IALLGATHER, ALLGATHER, KINDS };
static const char *kind_name[] = {"iallgatherv", "allgatherv", "iallgather", "allgather"};

enum { T_CHAR, T_INT, T_DOUBLE, T_C3, T_C3_FROM_INT, T_VEC, TYPES };
static const char *type_name[] = {"char", "int", "double", "contiguous(3)", "int->contiguous(3)",
                                  "resized vector"};
static MPI_Datatype c3, vecr;

/* One collective of the batch. */
struct op {
    enum kind kind;
    int type, in_place, comm_idx, n, me, layout;
    MPI_Comm comm;
    MPI_Datatype stype, rtype;
    int scount;
    int *rcounts, *displs; /* in recvtype units */
    size_t sbytes, rbytes; /* buffer sizes */
    unsigned char *sb, *rb, *ref;
    MPI_Request req;
};

static void skew(void) {
    long us = rank * 150 + (long)(next(&own) % 400);
    if (late && rank == size - 1) us = 3000 + (long)(next(&own) % 2000);
    usleep((useconds_t)us);
}

static size_t extent_of(MPI_Datatype t) {
    MPI_Aint lb, ext;
    MPI_Type_get_extent(t, &lb, &ext);
    return (size_t)ext;
}

/* Draws the op (same decisions on every rank), fills its buffers and issues it. */
static void issue(struct op *o, MPI_Comm *comms) {
    memset(o, 0, sizeof *o);
    o->kind = (enum kind)pick(KINDS);
    o->type = pick(TYPES);
    o->comm_idx = pick(4);
    o->layout = pick(3);
    o->in_place = pick(12) == 0 && (o->kind == ALLGATHERV || o->kind == ALLGATHER);
    o->comm = comms[o->comm_idx];
    MPI_Comm_size(o->comm, &o->n);
    MPI_Comm_rank(o->comm, &o->me);
    int n = o->n, mult = 1;
    switch (o->type) {
    case T_CHAR: o->stype = o->rtype = MPI_CHAR; break;
    case T_INT: o->stype = o->rtype = MPI_INT; break;
    case T_DOUBLE: o->stype = o->rtype = MPI_DOUBLE; break;
    case T_C3: o->stype = o->rtype = c3; break;
    case T_C3_FROM_INT: o->stype = MPI_INT; o->rtype = c3; mult = 3; break;
    default: o->stype = o->rtype = vecr; break;
    }
    /* Counts for every possible comm rank are drawn (the same number of draws whatever the
     * communicator), so that the halves agree on the shared generator. */
    int counts[64], all = pick(7), gaps[64], lead = pick(3);
    for (int i = 0; i < 64; i++) {
        counts[i] = pick(4) == 0 ? 0 : 1 + pick(9);
        gaps[i] = o->layout == 0 ? 0 : pick(3);
    }
    o->rcounts = malloc(n * sizeof(int));
    o->displs = malloc(n * sizeof(int));
    int at = lead;
    for (int k = 0; k < n; k++) {
        /* Layout 2 places the blocks in reverse rank order. */
        int i = o->layout == 2 ? n - 1 - k : k;
        o->rcounts[i] = (o->kind == IALLGATHER || o->kind == ALLGATHER) ? all : counts[i];
        if (o->kind == IALLGATHER || o->kind == ALLGATHER) {
            o->displs[i] = i * all;
        } else {
            o->displs[i] = at;
            at += o->rcounts[i] + gaps[i];
        }
    }
    size_t rext = extent_of(o->rtype), sext = extent_of(o->stype);
    size_t rextent_units = 0;
    for (int i = 0; i < n; i++)
        if ((size_t)(o->displs[i] + o->rcounts[i]) > rextent_units)
            rextent_units = o->displs[i] + o->rcounts[i];
    o->rbytes = rextent_units * rext + 16;
    o->scount = o->rcounts[o->me] * mult;
    o->sbytes = (size_t)o->scount * sext + 1;
    o->sb = malloc(o->sbytes);
    o->rb = malloc(o->rbytes);
    o->ref = malloc(o->rbytes);
    for (size_t b = 0; b < o->sbytes; b++) o->sb[b] = (unsigned char)next(&own);
    memset(o->rb, SENTINEL, o->rbytes);
    memset(o->ref, SENTINEL, o->rbytes);
    const void *sendbuf = o->sb;
    if (o->in_place) {
        /* This rank's block already sits at its place in the receive buffer (copied by type,
         * so the holes of a non-contiguous type keep the sentinel). */
        size_t off = (size_t)o->displs[o->me] * rext;
        PMPI_Sendrecv(o->sb, o->scount, o->stype, 0, 5, o->rb + off, o->rcounts[o->me], o->rtype,
                      0, 5, MPI_COMM_SELF, MPI_STATUS_IGNORE);
        sendbuf = MPI_IN_PLACE;
    }
    eligible++;
    o->req = MPI_REQUEST_NULL;
    skew();
    int rc = MPI_SUCCESS;
    switch (o->kind) {
    case IALLGATHERV:
        rc = MPI_Iallgatherv(sendbuf, o->scount, o->stype, o->rb, o->rcounts, o->displs, o->rtype,
                             o->comm, &o->req);
        break;
    case ALLGATHERV:
        rc = MPI_Allgatherv(sendbuf, o->scount, o->stype, o->rb, o->rcounts, o->displs, o->rtype,
                            o->comm);
        break;
    case IALLGATHER:
        rc = MPI_Iallgather(sendbuf, o->scount, o->stype, o->rb, o->rcounts[0], o->rtype, o->comm,
                            &o->req);
        break;
    default:
        rc = MPI_Allgather(sendbuf, o->scount, o->stype, o->rb, o->rcounts[0], o->rtype, o->comm);
        break;
    }
    CHECK(rc == MPI_SUCCESS, "%s returned %d", kind_name[o->kind], rc);
}

/* Completes the batch's nonblocking requests: one by one with MPI_Wait (in reverse order), all
 * at once with MPI_Waitall, or with an MPI_Testsome loop; the last two mixed with a native
 * point-to-point ring exchange on MPI_COMM_WORLD. */
static void complete(struct op *ops, int k, int how) {
    int right = (rank + 1) % size, left = (rank + size - 1) % size;
    int out = rank, in = -1;
    MPI_Request reqs[MAX_BATCH + 2];
    int idx[MAX_BATCH + 2], outc, n = 0;
    if (how == 0) {
        for (int i = k - 1; i >= 0; i--)
            CHECK(MPI_Wait(&ops[i].req, MPI_STATUS_IGNORE) == MPI_SUCCESS, "wait");
        return;
    }
    MPI_Irecv(&in, 1, MPI_INT, left, 11, MPI_COMM_WORLD, &reqs[n++]);
    for (int i = 0; i < k; i++) reqs[n++] = ops[i].req;
    MPI_Isend(&out, 1, MPI_INT, right, 11, MPI_COMM_WORLD, &reqs[n++]);
    if (how == 1) {
        CHECK(MPI_Waitall(n, reqs, MPI_STATUSES_IGNORE) == MPI_SUCCESS, "waitall");
    } else {
        int done = 0, active = 0;
        for (int i = 0; i < n; i++) active += reqs[i] != MPI_REQUEST_NULL;
        while (done < active) {
            CHECK(MPI_Testsome(n, reqs, &outc, idx, MPI_STATUSES_IGNORE) == MPI_SUCCESS, "testsome");
            if (outc == MPI_UNDEFINED) break;
            for (int j = 0; j < outc; j++) CHECK(reqs[idx[j]] == MPI_REQUEST_NULL, "testsome null");
            done += outc;
        }
        CHECK(done == active, "testsome completed %d of %d", done, active);
    }
    for (int i = 0; i < n; i++) CHECK(reqs[i] == MPI_REQUEST_NULL, "request %d left", i);
    for (int i = 0; i < k; i++) ops[i].req = MPI_REQUEST_NULL;
    CHECK(in == left, "ring got %d want %d", in, left);
}

/* The reference result (PMPI_Allgatherv on the same inputs, into a sentinel-filled buffer),
 * compared byte for byte. A collective on the op's communicator: every rank verifies its
 * batch in the same order. */
static void verify(struct op *o, int round, int i) {
    int rc = PMPI_Allgatherv(o->sb, o->scount, o->stype, o->ref, o->rcounts, o->displs, o->rtype,
                             o->comm);
    CHECK(rc == MPI_SUCCESS, "reference allgatherv returned %d", rc);
    size_t bad = o->rbytes;
    for (size_t b = 0; b < o->rbytes; b++)
        if (o->rb[b] != o->ref[b]) {
            bad = b;
            break;
        }
    CHECK(bad == o->rbytes,
          "round %d op %d: %s of %s on comm %d (size %d, layout %d%s): byte %zu of %zu is %#x, "
          "expected %#x",
          round, i, kind_name[o->kind], type_name[o->type], o->comm_idx, o->n, o->layout,
          o->in_place ? ", in place" : "", bad, o->rbytes, bad < o->rbytes ? o->rb[bad] : 0,
          bad < o->rbytes ? o->ref[bad] : 0);
    free(o->sb);
    free(o->rb);
    free(o->ref);
    free(o->rcounts);
    free(o->displs);
}

/* A blocking MPI_Alltoall on `comm` while the batch's allgathers may be outstanding on it:
 * offloaded collectives of both kinds share the communicator's sequence. */
static void alltoall_between(MPI_Comm comm) {
    int n, me;
    MPI_Comm_size(comm, &n);
    MPI_Comm_rank(comm, &me);
    int *sb = malloc(2 * n * sizeof(int)), *rb = malloc(2 * n * sizeof(int));
    for (int i = 0; i < 2 * n; i++) {
        sb[i] = me * 1000 + i;
        rb[i] = -1;
    }
    eligible++;
    skew();
    CHECK(MPI_Alltoall(sb, 2, MPI_INT, rb, 2, MPI_INT, comm) == MPI_SUCCESS, "alltoall");
    for (int s = 0; s < n; s++)
        for (int j = 0; j < 2; j++)
            CHECK(rb[2 * s + j] == s * 1000 + 2 * me + j, "alltoall from %d elem %d got %d", s, j,
                  rb[2 * s + j]);
    free(sb);
    free(rb);
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
        if (strcmp(argv[a], "mixed") == 0) mixed = 1;
        if (strcmp(argv[a], "return") == 0) MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    }
    if (size > 64) {
        if (rank == 0) fprintf(stderr, "ag_check: at most 64 ranks\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
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
        for (int i = 0; i < k; i++) {
            issue(&ops[i], comms);
            if (mixed && i == k / 2) alltoall_between(comms[pick(2)]);
        }
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
    int status = verdict("ag_check", detail);
    MPI_Finalize();
    return status;
}
