/*
 * conform.c: randomized conformance test of the MPI collectives that a PMPI interposer (a
 * library preloaded with LD_PRELOAD) may intercept. It is an ordinary MPI program: it calls
 * every collective through MPI_* and compares the result byte for byte with the same call
 * made through PMPI_* (which no interposer intercepts) on identical inputs.
 *
 * Collectives: MPI_Bcast, MPI_Ibcast, MPI_Alltoallv, MPI_Ialltoallv, MPI_Alltoall,
 * MPI_Ialltoall, MPI_Allgatherv, MPI_Iallgatherv, MPI_Allgather, MPI_Iallgather.
 *
 * Every parameter of case K (communicators, collectives, roots, every rank's datatypes, counts,
 * displacements, buffer contents, guards, skew, completion method) is a function of (seed, K)
 * computed by every rank with splitmix64 streams, without communication, so `--case K`
 * replays case K alone. A case:
 *  - creates 1-2 communicator "layers" (MPI_COMM_WORLD, MPI_Comm_dup, MPI_Comm_split with
 *    random colors and keys so that several disjoint communicators run at once and ranks are
 *    reordered, a split that excludes some ranks, size-1 communicators);
 *  - draws a batch of 1-4 collectives (each on one layer, in the same order on every rank);
 *  - for each, per rank and side (send/receive), draws the rank's own datatype whose type
 *    signature is m x base (base: MPI_CHAR, MPI_SHORT, MPI_INT, MPI_DOUBLE, MPI_LONG_LONG,
 *    MPI_BYTE; m per rank per side, sometimes 0): predefined, contiguous, vector, hvector,
 *    indexed, hindexed, indexed_block, hindexed_block, struct, subarray (C and Fortran order),
 *    resized (negative lb, extents larger than the data), dup, nested up to 3 levels, and
 *    single-block types whose data do not start at the buffer address. Receive types never
 *    make two received elements overlap; send types may;
 *  - draws counts in units of each rank's own type so that every pair's signatures match
 *    (v-collectives: a matrix of base elements per pair with zeros, zero rows and columns),
 *    random non-monotone displacements with gaps (possibly negative), roots, MPI_IN_PLACE;
 *  - allocates every buffer with random guards before and after the bytes the type map can
 *    touch, fills send buffers and receive buffers (guards, gaps and holes included) with
 *    different patterns;
 *  - runs the batch through PMPI_* (reference, completed with PMPI_Waitall) into one copy of
 *    the allocations, then through MPI_* into another copy, with random arrival skew, the
 *    nonblocking ones completed by a random method (MPI_Wait in random order, Waitall,
 *    Waitany loop, Waitsome loop, Test/Testall/Testany/Testsome polling,
 *    Request_get_status polling), sometimes with native MPI_Isend/MPI_Irecv requests to self
 *    and MPI_REQUEST_NULL entries in the array, with and without statuses;
 *  - compares the whole receive allocations (MPI_* vs PMPI_*: guards, gaps between blocks and
 *    holes inside types included) and checks that neither call modified a send buffer;
 *  - also computes the expected receive buffer from a model (every source's initial data,
 *    type map, counts and displacements, rebuilt from (seed, case, its rank)) and checks the
 *    PMPI_* reference against it, which catches bugs of this program and of the MPI library
 *    (a failure of the MPI_* call says whether its result equals the model).
 * Legal cases that Open MPI 4.1 itself gets wrong are not drawn (see the comments at
 * "Open MPI"): a hvector stride of -1 byte, a zero-size type with a nonzero count facing a zero
 * count, allgatherv with send and receive type sizes differing above 128 bytes per rank,
 * in-place ialltoallv with zero counts or zero-size types, mixed in-place blocking
 * alltoall(v). Built against MPICH 4.0 (MPICH_VERSION), three more ("MPICH 4.0"): an
 * allgatherv displacement on a one-rank communicator, receive type sizes differing between
 * ranks in a large (i)allgatherv, mixed in-place nonblocking alltoall(v).
 *
 * Build: mpicc -O1 -Wall -pthread -o conform conform.c (it includes its parts, the sibling
 *   files conform_util.c, conform_types.c, conform_ops.c and conform_complete.c)
 * Usage: mpirun -np N ./conform [options]
 *   --seed S          seed (default: from the clock on rank 0, broadcast with PMPI_Bcast)
 *   --cases N         run cases 0..N-1 (default 200)
 *   --case K          run case K only
 *   --colls a,b,...   draw only these collectives: bcast ibcast alltoallv ialltoallv alltoall
 *                     ialltoall allgatherv iallgatherv allgather iallgather (default: all)
 *   --types basic     draw only predefined types and MPI_Type_contiguous of them
 *   --mixed-in-place  also draw MPI_IN_PLACE on only some ranks of a collective (not
 *                     standard-conforming for these collectives; Open MPI accepts it except
 *                     in its blocking alltoall(v), which is therefore never mixed; MPICH
 *                     in no alltoall(v))
 *   --finalize-early  run one more case, "final", on MPI_COMM_WORLD: one rank (the root for a
 *                     bcast) enters at once, the others 20 ms late; each rank checks its result,
 *                     prints its final line and calls MPI_Finalize at once (`--cases 0
 *                     --finalize-early` runs it alone)
 *   --corrupt         checker self-test: after the tested calls of each case, flip one received
 *                     byte on one rank; the run must report failures
 *   --big PCT         draw PCT % of the collectives "big" (default 5): predefined and contiguous
 *                     types, 16 KiB to 2.2 MB per rank, a fifth of them "huge", 4 to 24 MiB
 *                     (beyond the default 8 MiB staging segments); 100: every one
 *   --timeout SEC     report a hang when a completion takes longer (default 60)
 *   --until FILE      stop after the case during which FILE came to exist (rank 0 looks, tells
 *                     the others with PMPI_Bcast), or after --cases, whichever is first
 *   --verbose         print every rank's drawn parameters on stderr
 * Output (stdout):
 *   rank 0 first: "conform: seed S"
 *   one line per failing check: "conform: FAIL seed=S case=K op=J/N coll=NAME comm=DESC
 *     rank=R(comm rank r) root=.. inplace=.. base=..: WHAT: first diff at alloc offset X of
 *     SIZE (buffer offset Y, REGION) expected 0xEE found 0xFF, D bytes differ; send type ..;
 *     recv type ..; ...; src P (world W) send type ..; counts .." (expected = PMPI or the
 *     model, found = MPI or PMPI; REGION: front guard, back guard, gap/hole, or the block
 *     for comm rank P). Types read like "resized(lb=-8,ext=40,vector(2,3,-4,int)){m=6 lb=-8
 *     ext=40}" (counts and displacements in elements, "B" = bytes, "@" = displacement);
 *     completion failures: "conform: FAIL seed=S case=K rank=R batch=[..] completion=M: ..";
 *     hangs: "conform: FAIL seed=S case=K rank=R: hang: ..." and MPI errors (reported by an
 *     error handler): "conform: FAIL ... MPI error ..", both then exit 1 without finalizing
 *   every rank last: "conform: rank R: ok, C cases, K calls" (K: collective calls this rank
 *     made through the MPI_* names) or "conform: rank R: F failures in C cases" (exit 1
 *     after MPI_Finalize).
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <limits.h>
#include <mpi.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { C_BCAST, C_IBCAST, C_ALLTOALLV, C_IALLTOALLV, C_ALLTOALL, C_IALLTOALL,
       C_ALLGATHERV, C_IALLGATHERV, C_ALLGATHER, C_IALLGATHER, NCOLL };
enum { F_BCAST, F_A2AV, F_A2A, F_AGV, F_AG };
#define FAM(c) ((c) / 2)
#define NONBLOCKING(c) ((c) & 1)
static const char *coll_name[NCOLL] = {"bcast", "ibcast", "alltoallv", "ialltoallv", "alltoall",
                                       "ialltoall", "allgatherv", "iallgatherv", "allgather",
                                       "iallgather"};

/* stream tags */
enum { T_CASE = 1, T_OP, T_M, T_TYPE_S, T_TYPE_R, T_DISPL, T_FILL_S, T_FILL_R, T_SKEW };
#define FINAL_CASE (-7L)
#define MAXOPS 4
#define MAXSLOTS 16

/* ---------------------------------------------------------------- options, state */
static unsigned long long g_seed;
static long g_ncases = 200, g_only = -1;
static unsigned g_mask = (1u << NCOLL) - 1;
static int g_mixed, g_final, g_corrupt, g_basic, g_verbose;
static long g_big_pct = 5; /* --big */
static double g_timeout = 60.0;
static const char *g_until = NULL; /* --until FILE */
static int wrank, wsize;
static long g_fail, g_calls, g_cases_run;
static char g_case[32] = "-";

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void sleep_us(long us)
{
    if (us <= 0) return;
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

/* The parts, in this order (each uses what the ones before it define). */
#include "conform_util.c"
#include "conform_types.c"
#include "conform_ops.c"
#include "conform_complete.c"

/* ---------------------------------------------------------------- a case */
static void run_case(long k, int final)
{
    if (final) snprintf(g_case, sizeof g_case, "final");
    else snprintf(g_case, sizeof g_case, "%ld", k);
    g_cases_run++;
    rng_t C = rstream(k, 0, 0, T_CASE);
    rng_t S = rstream(k, 0, wrank, T_SKEW);
    int nl = final ? 1 : (chance(&C, 30) ? 2 : 1);
    layer_t L[2];
    activity("communicator creation, case %s", g_case);
    for (int l = 0; l < nl; l++) layer_make(&C, &L[l], final);
    int nops = final ? 1 : (chance(&C, 50) ? 1 : (int)rint_(&C, 2, MAXOPS));
    int allowed[NCOLL], na = 0;
    for (int c = 0; c < NCOLL; c++)
        if (g_mask & (1u << c)) allowed[na++] = c;
    op_t ops[MAXOPS];
    memset(ops, 0, sizeof ops);
    for (int j = 0; j < nops; j++) {
        ops[j].coll = allowed[rint_(&C, 0, na - 1)];
        ops[j].L = &L[rint_(&C, 0, nl - 1)];
        ops[j].idx = j;
        ops[j].clone_of = j > 0 && chance(&C, 15) ? (int)rint_(&C, 0, j - 1) : -1;
        if (ops[j].clone_of >= 0) {
            while (ops[ops[j].clone_of].clone_of >= 0) ops[j].clone_of = ops[ops[j].clone_of].clone_of;
            ops[j].coll = ops[ops[j].clone_of].coll;
            ops[j].L = ops[ops[j].clone_of].L;
        }
        ops[j].member = ops[j].L->comm != MPI_COMM_NULL;
    }
    int late_w = chance(&C, 20) ? (int)rint_(&C, 0, wsize - 1) : -1;
    long late_us = rint_(&C, 2000, 5000);
    int corrupt_w = (int)rint_(&C, 0, wsize - 1);
    int method = final ? M_WAIT : (int)rint_(&C, 0, NMETH - 1);
    int use_st = chance(&C, 50);
    int nat = !final && chance(&C, 30), natn = (int)rint_(&C, 1, 64), nat_first = chance(&C, 50);
    int nnull = chance(&C, 30) ? (int)rint_(&C, 1, 2) : 0;
    int poll_sleep = chance(&C, 30);
    int early_w = (int)rint_(&C, 0, wsize - 1);

    str_t bd = {0};
    for (int j = 0; j < nops; j++)
    {
        sappend(&bd, "%s%s on %s", j ? ", " : "", coll_name[ops[j].coll],
                ops[j].member ? ops[j].L->desc : "(not member)");
        if (ops[j].clone_of >= 0)
            sappend(&bd, " (parameters and send buffer of op %d)", ops[j].clone_of);
    }
    g_batch_desc = bd.s ? bd.s : "";

    for (int j = 0; j < nops; j++)
        if (ops[j].member) {
            activity("setting up op %d, case %s", j, g_case);
            op_t *o = &ops[j];
            int cl = o->clone_of;
            op_setup(o, k, cl >= 0 ? cl : j, final, o->L->me);
            if (cl >= 0 && o->sb.used) { /* read the same send memory as op cl */
                buf_free(&o->sb);
                o->sb = ops[cl].sb;
            }
            if (g_verbose) op_verbose(o, nops);
        }
    if (final && ops[0].fam == F_BCAST) early_w = ops[0].L->wr[ops[0].root];

    /* reference: PMPI */
    MPI_Request refrq[MAXOPS];
    int nref = 0;
    for (int j = 0; j < nops; j++) {
        op_t *o = &ops[j];
        if (!o->member) continue;
        activity("reference PMPI_%s op %d, case %s", coll_name[o->coll], j, g_case);
        int rc = op_post(o, 1, 0);
        if (rc != MPI_SUCCESS) internal("PMPI_%s returned %d", coll_name[o->coll], rc);
        if (NONBLOCKING(o->coll)) refrq[nref++] = o->rq_ref;
    }
    if (nref) {
        activity("reference PMPI_Waitall, case %s", g_case);
        PMPI_Waitall(nref, refrq, MPI_STATUSES_IGNORE);
    }

    /* tested: MPI */
    if (final) {
        if (wrank != early_w) sleep_us(20000);
    } else if (wrank == late_w) {
        sleep_us(late_us);
    }
    MPI_Request rq[MAXSLOTS];
    slot_t sl[MAXSLOTS];
    int ns = 0, any_nb = 0;
    int *nsend = xcalloc((size_t)natn, sizeof(int)), *nrecv = xcalloc((size_t)natn, sizeof(int));
    MPI_Request nrq[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    const int tag = 1000 + (int)((unsigned long)k % 1000);
    for (int j = 0; j < nops; j++) any_nb |= ops[j].member && NONBLOCKING(ops[j].coll);
    nat = nat && any_nb;
    for (int q = 0; q < natn; q++) { nsend[q] = (int)rnext(&S); nrecv[q] = ~nsend[q]; }
#define POST_NATIVE()                                                               \
    do {                                                                            \
        if (chance(&S, 50)) {                                                       \
            MPI_Irecv(nrecv, natn, MPI_INT, 0, tag, MPI_COMM_SELF, &nrq[1]);        \
            MPI_Isend(nsend, natn, MPI_INT, 0, tag, MPI_COMM_SELF, &nrq[0]);        \
        } else {                                                                    \
            MPI_Isend(nsend, natn, MPI_INT, 0, tag, MPI_COMM_SELF, &nrq[0]);        \
            MPI_Irecv(nrecv, natn, MPI_INT, 0, tag, MPI_COMM_SELF, &nrq[1]);        \
        }                                                                           \
    } while (0)
    if (nat && nat_first) POST_NATIVE();
    for (int j = 0; j < nops; j++) {
        op_t *o = &ops[j];
        if (!o->member) continue;
        if (!final && chance(&S, 50)) sleep_us(rint_(&S, 0, 300));
        activity("MPI_%s op %d on %s, case %s", coll_name[o->coll], j, o->L->desc, g_case);
        int rc = op_post(o, 0, 1);
        g_calls++;
        if (rc != MPI_SUCCESS) {
            str_t s = {0};
            op_head(&s, o, nops);
            sappend(&s, ": MPI_%s returned %d", coll_name[o->coll], rc);
            fail_line(&s);
        }
        if (NONBLOCKING(o->coll)) {
            if (o->rq_test == MPI_REQUEST_NULL) {
                str_t s = {0};
                op_head(&s, o, nops);
                sappend(&s, ": MPI_%s returned MPI_REQUEST_NULL", coll_name[o->coll]);
                fail_line(&s);
            } else {
                sl[ns] = (slot_t){S_COLL, j};
                rq[ns++] = o->rq_test;
            }
        }
    }
    if (nat && !nat_first) POST_NATIVE();
#undef POST_NATIVE
    int nslot_recv = -1;
    if (nat) {
        sl[ns] = (slot_t){S_NSEND, -1};
        rq[ns++] = nrq[0];
        sl[ns] = (slot_t){S_NRECV, -1};
        rq[ns++] = nrq[1];
    }
    if (any_nb)
        for (int q = 0; q < nnull; q++) {
            sl[ns] = (slot_t){S_NULL, -1};
            rq[ns++] = MPI_REQUEST_NULL;
        }
    if (ns) {
        int perm[MAXSLOTS];
        MPI_Request r2[MAXSLOTS];
        slot_t s2[MAXSLOTS];
        for (int i = 0; i < ns; i++) perm[i] = i;
        shuffle(&S, perm, ns);
        for (int i = 0; i < ns; i++) { r2[i] = rq[perm[i]]; s2[i] = sl[perm[i]]; }
        for (int i = 0; i < ns; i++) { rq[i] = r2[i]; sl[i] = s2[i]; }
        for (int i = 0; i < ns; i++)
            if (sl[i].kind == S_NRECV) nslot_recv = i;
        MPI_Status st[MAXSLOTS];
        int have_st[MAXSLOTS];
        complete(method, use_st, poll_sleep, &S, rq, sl, ns, st, have_st, ops);
        if (nat) {
            if (memcmp(nsend, nrecv, sizeof(int) * (size_t)natn))
                cfail(meth_name[method], "native MPI_Irecv from self received wrong data");
            if (nslot_recv >= 0 && have_st[nslot_recv]) {
                MPI_Status *s = &st[nslot_recv];
                int cnt = -1;
                MPI_Get_count(s, MPI_INT, &cnt);
                if (s->MPI_SOURCE != 0 || s->MPI_TAG != tag || cnt != natn)
                    cfail(meth_name[method], "native MPI_Irecv status source %d tag %d count %d, "
                          "expected 0 %d %d", s->MPI_SOURCE, s->MPI_TAG, cnt, tag, natn);
            }
        }
    }
    free(nsend);
    free(nrecv);

    /* checks */
    if (g_corrupt && wrank == corrupt_w) {
        int done = 0;
        for (int j = 0; j < nops && !done; j++) {
            op_t *o = &ops[j];
            if (!o->member || !o->rb.used) continue;
            for (size_t x = 0; x < o->rb.size && !done; x++)
                if (o->rb.map[x]) { o->rb.test[x] ^= 0x5A; done = 1; }
        }
    }
    for (int j = 0; j < nops; j++)
        if (ops[j].member) op_check(&ops[j], nops);
    activity("cleanup, case %s", g_case);
    for (int j = 0; j < nops; j++)
        if (ops[j].member) op_free(&ops[j]);
    for (int l = 0; l < nl; l++) layer_free(&L[l]);
    g_batch_desc = "";
    free(bd.s);
}

/* ---------------------------------------------------------------- main */
static void usage(void)
{
    if (wrank == 0)
        fprintf(stderr, "usage: conform [--seed S] [--cases N] [--case K] [--colls a,b,...] "
                        "[--types all|basic] [--mixed-in-place] [--finalize-early] [--corrupt] "
                        "[--timeout SEC] [--until FILE] [--verbose]\n");
    MPI_Finalize();
    exit(2);
}

int main(int argc, char **argv)
{
    int prov;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &prov);
    MPI_Comm_rank(MPI_COMM_WORLD, &wrank);
    MPI_Comm_size(MPI_COMM_WORLD, &wsize);
    int have_seed = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--seed") && v) { g_seed = strtoull(v, NULL, 0); have_seed = 1; i++; }
        else if (!strcmp(a, "--cases") && v) { g_ncases = atol(v); i++; }
        else if (!strcmp(a, "--case") && v) { g_only = atol(v); i++; }
        else if (!strcmp(a, "--timeout") && v) { g_timeout = atof(v); i++; }
        else if (!strcmp(a, "--big") && v) { g_big_pct = atol(v); i++; }
        else if (!strcmp(a, "--until") && v) { g_until = v; i++; }
        else if (!strcmp(a, "--types") && v) {
            if (!strcmp(v, "basic")) g_basic = 1;
            else if (strcmp(v, "all")) usage();
            i++;
        } else if (!strcmp(a, "--colls") && v) {
            g_mask = 0;
            char *dup = xstrdup(v), *save = NULL;
            for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                int found = 0;
                for (int c = 0; c < NCOLL; c++)
                    if (!strcmp(t, coll_name[c])) { g_mask |= 1u << c; found = 1; }
                if (!strcmp(t, "all")) { g_mask = (1u << NCOLL) - 1; found = 1; }
                if (!found) {
                    if (wrank == 0) fprintf(stderr, "conform: unknown collective %s\n", t);
                    usage();
                }
            }
            free(dup);
            i++;
        } else if (!strcmp(a, "--mixed-in-place")) g_mixed = 1;
        else if (!strcmp(a, "--finalize-early")) g_final = 1;
        else if (!strcmp(a, "--corrupt")) g_corrupt = 1;
        else if (!strcmp(a, "--verbose")) g_verbose = 1;
        else usage();
    }
    if (!g_mask) usage();
    if (!have_seed && wrank == 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        g_seed = mix64((uint64_t)ts.tv_sec * 1000000007ULL + (uint64_t)ts.tv_nsec + (uint64_t)getpid()) % 1000000000ULL;
    }
    unsigned long long sd = g_seed;
    PMPI_Bcast(&sd, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD); /* not counted, not tested */
    g_seed = sd;
    if (wrank == 0) { printf("conform: seed %llu\n", g_seed); fflush(stdout); }

    base_t b0[NBASE] = {{MPI_CHAR, "char", 1},       {MPI_SHORT, "short", 0},
                        {MPI_INT, "int", 0},         {MPI_DOUBLE, "double", 0},
                        {MPI_LONG_LONG, "long long", 0}, {MPI_BYTE, "byte", 1}};
    for (int i = 0; i < NBASE; i++) {
        bases[i] = b0[i];
        MPI_Type_size(bases[i].dt, &bases[i].size);
    }

    MPI_Errhandler eh;
    MPI_Comm_create_errhandler(on_mpi_error, &eh);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, eh);
    MPI_Comm_set_errhandler(MPI_COMM_SELF, eh);
    activity("start");
    pthread_t th;
    pthread_create(&th, NULL, watchdog, NULL);
    pthread_detach(th);

    if (g_only >= 0) run_case(g_only, 0);
    else
        for (long k = 0; k < g_ncases; k++) {
            run_case(k, 0);
            if (g_until) {
                int stop = wrank == 0 && access(g_until, F_OK) == 0;
                PMPI_Bcast(&stop, 1, MPI_INT, 0, MPI_COMM_WORLD); /* not counted, not tested */
                if (stop) break;
            }
        }
    if (g_final) run_case(FINAL_CASE, 1);
    snprintf(g_case, sizeof g_case, "-");

    if (g_fail == 0)
        printf("conform: rank %d: ok, %ld cases, %ld calls\n", wrank, g_cases_run, g_calls);
    else
        printf("conform: rank %d: %ld failures in %ld cases\n", wrank, g_fail, g_cases_run);
    fflush(stdout);
    activity("MPI_Finalize");
    MPI_Finalize();
    return g_fail ? 1 : 0;
}
