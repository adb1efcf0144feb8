/* Checks alltoall(v) results and the Wait/Test family, natively or with libhost_shim.so
 * preloaded: the same binary must give the same answers either way.
 *
 * Usage: a2a_check [ROUNDS [free] [return]]. With "return", MPI_COMM_WORLD (and so every
 * communicator derived from it) gets MPI_ERRORS_RETURN and failed calls count as failures;
 * otherwise the default MPI_ERRORS_ARE_FATAL aborts the job at the first failed call. Every test fills send buffers with a pattern naming
 * (source, destination, index), runs the collective, and checks every received element. After
 * each round the ranks agree whether anything failed and stop if so. Prints
 * "a2a_check: all ok (N checks on rank 0, S ranks, E eligible calls per rank)" on rank 0 when
 * every rank passed, "a2a_check: F failures" otherwise (exit 1). E counts the calls the shim
 * offloads (every intercepted call on an intracommunicator, whatever its datatypes and with
 * MPI_IN_PLACE): the same on every rank, so an offloading run posts exactly S * E collectives
 * to the service processes. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static int val(int src, int dst, int i) { return src * 1000000 + dst * 1000 + i; }

/* Irregular counts: rank r sends (r + d) % 3 + d elements to d (possibly 0). */
static int cnt(int src, int dst) { return (src + dst) % 3 + (dst % 2) * src; }

static void fill_v(int *sc, int *sd, int *rc, int *rd, int gap) {
    int s = 0, r = 0;
    for (int d = 0; d < size; d++) {
        sc[d] = cnt(rank, d);
        sd[d] = s;
        s += sc[d] + gap;
        rc[d] = cnt(d, rank);
        rd[d] = r;
        r += rc[d] + gap;
    }
}

static int total(const int *c, int gap) {
    int t = 0;
    for (int d = 0; d < size; d++) t += c[d] + gap;
    return t + 1;
}

/* Which way the test waits for a nonblocking collective. */
enum how { WAIT, WAITALL_MIXED, WAITANY_MIXED, WAITSOME_MIXED, TEST_LOOP, TESTALL_LOOP,
           TESTANY_LOOP, TESTSOME_LOOP, GET_STATUS_LOOP, HOW_COUNT };
static const char *how_name[] = {"wait", "waitall+p2p", "waitany+p2p", "waitsome+p2p", "test",
                                 "testall", "testany", "testsome", "get_status"};

static void complete(MPI_Request coll, enum how how) {
    /* A ring exchange mixed with the collective request, with MPI_REQUEST_NULL in between. */
    int right = (rank + 1) % size, left = (rank + size - 1) % size;
    int out = rank, in = -1, flag = 0, idx, outc, idxs[4];
    MPI_Request reqs[4] = {MPI_REQUEST_NULL, coll, MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    MPI_Status sts[4];
    int mixed = how == WAITALL_MIXED || how == WAITANY_MIXED || how == WAITSOME_MIXED;
    if (mixed) {
        MPI_Irecv(&in, 1, MPI_INT, left, 7, MPI_COMM_WORLD, &reqs[0]);
        MPI_Isend(&out, 1, MPI_INT, right, 7, MPI_COMM_WORLD, &reqs[3]);
    }
    switch (how) {
    case WAIT:
        CHECK(MPI_Wait(&reqs[1], MPI_STATUS_IGNORE) == MPI_SUCCESS, "wait");
        break;
    case WAITALL_MIXED:
        CHECK(MPI_Waitall(4, reqs, sts) == MPI_SUCCESS, "waitall");
        CHECK(sts[0].MPI_SOURCE == left && sts[0].MPI_TAG == 7, "waitall recv status %d %d",
              sts[0].MPI_SOURCE, sts[0].MPI_TAG);
        break;
    case WAITANY_MIXED:
        for (int k = 0; k < 3; k++) {
            CHECK(MPI_Waitany(4, reqs, &idx, &sts[0]) == MPI_SUCCESS, "waitany");
            CHECK(idx == 0 || idx == 1 || idx == 3, "waitany index %d", idx);
            CHECK(reqs[idx] == MPI_REQUEST_NULL, "waitany did not null %d", idx);
        }
        CHECK(MPI_Waitany(4, reqs, &idx, MPI_STATUS_IGNORE) == MPI_SUCCESS && idx == MPI_UNDEFINED,
              "waitany on all-null gave %d", idx);
        break;
    case WAITSOME_MIXED: {
        int done = 0;
        while (done < 3) {
            CHECK(MPI_Waitsome(4, reqs, &outc, idxs, sts) == MPI_SUCCESS, "waitsome");
            CHECK(outc >= 1 && outc <= 3, "waitsome outcount %d", outc);
            for (int k = 0; k < outc; k++) CHECK(reqs[idxs[k]] == MPI_REQUEST_NULL, "waitsome null");
            done += outc;
        }
        CHECK(MPI_Waitsome(4, reqs, &outc, idxs, sts) == MPI_SUCCESS && outc == MPI_UNDEFINED,
              "waitsome on all-null gave %d", outc);
        break;
    }
    case TEST_LOOP:
        while (!flag) CHECK(MPI_Test(&reqs[1], &flag, &sts[1]) == MPI_SUCCESS, "test");
        break;
    case TESTALL_LOOP:
        while (!flag) CHECK(MPI_Testall(4, reqs, &flag, MPI_STATUSES_IGNORE) == MPI_SUCCESS, "testall");
        break;
    case TESTANY_LOOP:
        while (!flag) CHECK(MPI_Testany(4, reqs, &idx, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS, "testany");
        CHECK(idx == 1, "testany index %d", idx);
        break;
    case TESTSOME_LOOP:
        outc = 0;
        while (outc == 0) CHECK(MPI_Testsome(4, reqs, &outc, idxs, sts) == MPI_SUCCESS, "testsome");
        CHECK(outc == 1 && idxs[0] == 1, "testsome %d %d", outc, idxs[0]);
        break;
    case GET_STATUS_LOOP:
        while (!flag) CHECK(MPI_Request_get_status(reqs[1], &flag, &sts[1]) == MPI_SUCCESS, "get_status");
        CHECK(reqs[1] != MPI_REQUEST_NULL, "get_status freed the request");
        CHECK(MPI_Wait(&reqs[1], MPI_STATUS_IGNORE) == MPI_SUCCESS, "wait after get_status");
        break;
    default:
        break;
    }
    for (int k = 0; k < 4; k++) CHECK(reqs[k] == MPI_REQUEST_NULL, "request %d left (%s)", k, how_name[how]);
    if (mixed) CHECK(in == left, "ring got %d want %d", in, left);
}

static void check_v(MPI_Comm comm, int nonblocking, enum how how, int gap, const char *what) {
    int me, n;
    MPI_Comm_rank(comm, &me);
    MPI_Comm_size(comm, &n);
    int save_rank = rank, save_size = size;
    rank = me;
    size = n;
    int *sc = malloc(n * sizeof(int)), *sd = malloc(n * sizeof(int));
    int *rc = malloc(n * sizeof(int)), *rd = malloc(n * sizeof(int));
    fill_v(sc, sd, rc, rd, gap);
    int *sb = malloc(total(sc, gap) * sizeof(int)), *rb = malloc(total(rc, gap) * sizeof(int));
    for (int d = 0; d < n; d++)
        for (int i = 0; i < sc[d]; i++) sb[sd[d] + i] = val(me, d, i);
    for (int i = 0; i < total(rc, gap); i++) rb[i] = -1;
    eligible++;
    if (nonblocking) {
        MPI_Request req;
        CHECK(MPI_Ialltoallv(sb, sc, sd, MPI_INT, rb, rc, rd, MPI_INT, comm, &req) == MPI_SUCCESS,
              "ialltoallv %s", what);
        rank = save_rank;
        size = save_size;
        complete(req, how);
        rank = me;
        size = n;
    } else {
        CHECK(MPI_Alltoallv(sb, sc, sd, MPI_INT, rb, rc, rd, MPI_INT, comm) == MPI_SUCCESS,
              "alltoallv %s", what);
    }
    for (int s = 0; s < n; s++) {
        for (int i = 0; i < rc[s]; i++)
            CHECK(rb[rd[s] + i] == val(s, me, i), "%s: from %d elem %d got %d", what, s, i, rb[rd[s] + i]);
        for (int i = 0; i < gap; i++)
            CHECK(rb[rd[s] + rc[s] + i] == -1, "%s: gap after %d overwritten", what, s);
    }
    free(sc); free(sd); free(rc); free(rd); free(sb); free(rb);
    rank = save_rank;
    size = save_size;
}

/* Alltoall of `count` elements of `type` (whose elements hold `per` ints each, `stride` ints
 * apart per element), checked element by element. */
static void check_all(MPI_Datatype type, int per, int stride, int count, int nonblocking, const char *what) {
    int n = size * count * stride;
    int *sb = malloc(n * sizeof(int)), *rb = malloc(n * sizeof(int));
    for (int i = 0; i < n; i++) { sb[i] = -2; rb[i] = -1; }
    for (int d = 0; d < size; d++)
        for (int e = 0; e < count; e++)
            for (int k = 0; k < per; k++) sb[(d * count + e) * stride + k] = val(rank, d, e * per + k);
    eligible++;
    if (nonblocking) {
        MPI_Request req;
        CHECK(MPI_Ialltoall(sb, count, type, rb, count, type, MPI_COMM_WORLD, &req) == MPI_SUCCESS, "%s", what);
        CHECK(MPI_Wait(&req, MPI_STATUS_IGNORE) == MPI_SUCCESS, "%s wait", what);
    } else {
        CHECK(MPI_Alltoall(sb, count, type, rb, count, type, MPI_COMM_WORLD) == MPI_SUCCESS, "%s", what);
    }
    for (int s = 0; s < size; s++)
        for (int e = 0; e < count; e++)
            for (int k = 0; k < stride; k++) {
                int got = rb[(s * count + e) * stride + k];
                if (k < per) CHECK(got == val(s, rank, e * per + k), "%s: from %d elem %d got %d", what, s, e, got);
                else CHECK(got == -1, "%s: gap written", what);
            }
    free(sb); free(rb);
}

int main(int argc, char **argv) {
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_SINGLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int rounds = argc > 1 ? atoi(argv[1]) : 2;
    int free_req = 0;
    for (int a = 2; a < argc; a++) {
        if (strcmp(argv[a], "free") == 0) free_req = 1;
        if (strcmp(argv[a], "return") == 0) MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    }

    for (int round = 0; round < rounds; round++) {
        check_v(MPI_COMM_WORLD, 0, WAIT, 0, "alltoallv packed");
        check_v(MPI_COMM_WORLD, 0, WAIT, 2, "alltoallv with gaps");
        for (int h = 0; h < HOW_COUNT; h++) check_v(MPI_COMM_WORLD, 1, (enum how)h, 1, how_name[h]);
        check_all(MPI_INT, 1, 1, 5, 0, "alltoall int");
        check_all(MPI_INT, 1, 1, 5, 1, "ialltoall int");
        check_all(MPI_INT, 1, 1, 0, 0, "alltoall zero count");
        MPI_Datatype c3, vec, vecr;
        MPI_Type_contiguous(3, MPI_INT, &c3);
        MPI_Type_commit(&c3);
        check_all(c3, 3, 3, 4, 0, "alltoall contiguous(3)");
        check_all(c3, 3, 3, 4, 1, "ialltoall contiguous(3)");
        MPI_Type_free(&c3);
        /* vector(2 blocks of 1 int, stride 2) resized to 4 ints: not contiguous, offloaded
         * packed. */
        MPI_Type_vector(2, 1, 2, MPI_INT, &vec);
        MPI_Type_create_resized(vec, 0, 4 * sizeof(int), &vecr);
        MPI_Type_commit(&vecr);
        {
            int n = size * 2 * 4;
            int *sb = malloc(n * sizeof(int)), *rb = malloc(n * sizeof(int));
            for (int i = 0; i < n; i++) { sb[i] = val(rank, i / 8, i % 8); rb[i] = -1; }
            eligible++;
            CHECK(MPI_Alltoall(sb, 2, vecr, rb, 2, vecr, MPI_COMM_WORLD) == MPI_SUCCESS, "vector");
            for (int s = 0; s < size; s++)
                for (int i = 0; i < 8; i++) {
                    int want = (i % 2 == 0) ? val(s, rank, i) : -1;
                    CHECK(rb[s * 8 + i] == want, "vector from %d at %d got %d want %d", s, i, rb[s * 8 + i], want);
                }
            free(sb); free(rb);
        }
        MPI_Type_free(&vecr);
        MPI_Type_free(&vec);

        /* Sub-communicators: halves (disjoint, different leaders), a reversed-order one and a dup. */
        MPI_Comm half, rev, dup;
        MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &half);
        MPI_Comm_split(MPI_COMM_WORLD, 0, size - rank, &rev);
        MPI_Comm_dup(MPI_COMM_WORLD, &dup);
        check_v(half, 0, WAIT, 1, "alltoallv on halves");
        check_v(rev, 1, WAIT, 0, "ialltoallv on reversed");
        check_v(dup, 0, WAIT, 0, "alltoallv on dup");
        check_v(half, 1, WAIT, 0, "ialltoallv on halves");
        MPI_Comm_free(&half);
        MPI_Comm_free(&rev);
        MPI_Comm_free(&dup);

        /* MPI_IN_PLACE: offloaded, the send side copied from the receive buffer. */
        {
            int n = size * 2;
            int *rb = malloc(n * sizeof(int));
            for (int i = 0; i < n; i++) rb[i] = val(rank, i / 2, i % 2);
            eligible++;
            CHECK(MPI_Alltoall(MPI_IN_PLACE, 2, MPI_INT, rb, 2, MPI_INT, MPI_COMM_WORLD) == MPI_SUCCESS, "in place");
            for (int i = 0; i < n; i++) CHECK(rb[i] == val(i / 2, rank, i % 2), "in place elem %d", i);
            free(rb);
        }

        /* Several outstanding collectives at once, completed in reverse order. */
        {
            enum { K = 6 };
            MPI_Request reqs[K];
            int *sb[K], *rb[K];
            for (int k = 0; k < K; k++) {
                sb[k] = malloc(size * sizeof(int));
                rb[k] = malloc(size * sizeof(int));
                for (int d = 0; d < size; d++) { sb[k][d] = val(rank, d, k); rb[k][d] = -1; }
                MPI_Ialltoall(sb[k], 1, MPI_INT, rb[k], 1, MPI_INT, MPI_COMM_WORLD, &reqs[k]);
                eligible++;
            }
            for (int k = K - 1; k >= 0; k--) CHECK(MPI_Wait(&reqs[k], MPI_STATUS_IGNORE) == MPI_SUCCESS, "multi wait");
            for (int k = 0; k < K; k++) {
                for (int s = 0; s < size; s++) CHECK(rb[k][s] == val(s, rank, k), "multi %d from %d", k, s);
                free(sb[k]);
                free(rb[k]);
            }
        }

        int any = 0;
        MPI_Allreduce(&failures, &any, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        if (any) break;
    }

    /* With a second argument "free": a collective request freed before completion, which the
     * shim must finish before MPI_Finalize. Only for the shim: MPI calls freeing a nonblocking
     * collective's request erroneous, and Open MPI refuses it. The buffers stay valid until
     * MPI_Finalize. */
    static int free_sb[1024], free_rb[1024];
    if (free_req && size <= 1024) {
        MPI_Request req;
        for (int d = 0; d < size; d++) free_sb[d] = val(rank, d, 0);
        CHECK(MPI_Ialltoall(free_sb, 1, MPI_INT, free_rb, 1, MPI_INT, MPI_COMM_WORLD, &req) == MPI_SUCCESS, "ialltoall to free");
        eligible++;
        CHECK(MPI_Request_free(&req) == MPI_SUCCESS && req == MPI_REQUEST_NULL, "request_free");
    }

    int status = verdict("a2a_check", "");
    MPI_Finalize();
    return status;
}
