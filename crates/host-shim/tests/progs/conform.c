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
 * Build: mpicc -O1 -Wall -pthread -o conform conform.c
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
 *   --timeout SEC     report a hang when a completion takes longer (default 60)
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
static double g_timeout = 60.0;
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

/* ---------------------------------------------------------------- strings */
typedef struct { char *s; size_t n, cap; } str_t;

static void sappend(str_t *b, const char *fmt, ...)
{
    for (;;) {
        size_t avail = b->cap - b->n;
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? avail : 0, fmt, ap);
        va_end(ap);
        if (k < 0) return;
        if (b->s && (size_t)k < avail) { b->n += (size_t)k; return; }
        b->cap = (b->n + (size_t)k + 1) * 2;
        b->s = realloc(b->s, b->cap);
        if (!b->s) abort();
    }
}

static char *xstrdup(const char *s)
{
    char *d = malloc(strlen(s) + 1);
    if (!d) abort();
    strcpy(d, s);
    return d;
}

static void *xcalloc(size_t n, size_t sz)
{
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    if (!p) { fprintf(stderr, "conform: out of memory\n"); abort(); }
    return p;
}

/* ---------------------------------------------------------------- watchdog */
static pthread_mutex_t wd_mu = PTHREAD_MUTEX_INITIALIZER;
static char wd_what[1024];
static double wd_stamp;
static int wd_on;

static void activity(const char *fmt, ...)
{
    pthread_mutex_lock(&wd_mu);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(wd_what, sizeof wd_what, fmt, ap);
    va_end(ap);
    wd_stamp = now();
    wd_on = 1;
    pthread_mutex_unlock(&wd_mu);
}

static void hang_exit(const char *what, double secs)
{
    printf("conform: FAIL seed=%llu case=%s rank=%d: hang: not done after %.0f s in %s\n",
           g_seed, g_case, wrank, secs, what);
    printf("conform: rank %d: %ld failures in %ld cases\n", wrank, g_fail + 1, g_cases_run);
    fflush(stdout);
    _exit(1);
}

static void *watchdog(void *arg)
{
    (void)arg;
    double last = now();
    for (;;) {
        sleep(1);
        pthread_mutex_lock(&wd_mu);
        /* this thread not scheduled for seconds: the machine (2 cores, shared) stalled us;
         * do not count the stall as time without progress */
        double tn = now();
        if (tn - last > 3.0) wd_stamp += tn - last - 1.0;
        last = tn;
        double t = tn - wd_stamp;
        if (wd_on && t > g_timeout + 5) {
            char what[1024];
            memcpy(what, wd_what, sizeof what);
            pthread_mutex_unlock(&wd_mu);
            hang_exit(what, t);
        }
        pthread_mutex_unlock(&wd_mu);
    }
    return NULL;
}

/* error handler on MPI_COMM_WORLD (inherited by every communicator made from it): report
 * what was being done, then abort as MPI_ERRORS_ARE_FATAL would */
static void on_mpi_error(MPI_Comm *comm, int *code, ...)
{
    (void)comm;
    char es[MPI_MAX_ERROR_STRING], what[1024];
    int len = 0;
    MPI_Error_string(*code, es, &len);
    pthread_mutex_lock(&wd_mu);
    memcpy(what, wd_what, sizeof what);
    pthread_mutex_unlock(&wd_mu);
    printf("conform: FAIL seed=%llu case=%s rank=%d: MPI error %d (%s) in %s\n", g_seed, g_case,
           wrank, *code, es, what);
    printf("conform: rank %d: %ld failures in %ld cases\n", wrank, g_fail + 1, g_cases_run);
    fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static void internal(const char *fmt, ...)
{
    char buf[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    printf("conform: INTERNAL ERROR (bug in conform.c) seed=%llu case=%s rank=%d: %s\n", g_seed,
           g_case, wrank, buf);
    fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 3);
}

static void fail_line(str_t *m)
{
    g_fail++;
    if (g_fail <= 200)
        printf("%s\n", m->s);
    else if (g_fail == 201)
        printf("conform: rank %d: further failures not printed\n", wrank);
    fflush(stdout);
    free(m->s);
    m->s = NULL;
    m->n = m->cap = 0;
}

/* ---------------------------------------------------------------- PRNG (splitmix64) */
typedef struct { uint64_t s; } rng_t;

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t rnext(rng_t *r)
{
    r->s += 0x9e3779b97f4a7c15ULL;
    return mix64(r->s);
}

static rng_t rstream(long k, long j, long w, long tag)
{
    uint64_t h = mix64(g_seed + 0x9e3779b97f4a7c15ULL);
    h = mix64(h ^ ((uint64_t)k + 0x632be59bd9b4e019ULL));
    h = mix64(h ^ ((uint64_t)j + 0x8cb92ba72f3d8dd7ULL));
    h = mix64(h ^ ((uint64_t)w + 0xd1b54a32d192ed03ULL));
    h = mix64(h ^ ((uint64_t)tag + 0xaef17502108ef2d9ULL));
    rng_t r = {h};
    return r;
}

static long rint_(rng_t *r, long lo, long hi)
{
    if (hi <= lo) return lo;
    return lo + (long)(rnext(r) % (uint64_t)(hi - lo + 1));
}

static int chance(rng_t *r, int pct) { return (int)(rnext(r) % 100) < pct; }

static void shuffle(rng_t *r, int *a, int n)
{
    for (int i = n - 1; i > 0; i--) {
        int j = (int)rint_(r, 0, i), t = a[i];
        a[i] = a[j];
        a[j] = t;
    }
}

static long gcd(long a, long b)
{
    while (b) { long t = a % b; a = b; b = t; }
    return a;
}

/* lcm where 0 means "must be zero" */
static long lcm0(long a, long b)
{
    if (a == 0 || b == 0) return 0;
    return a / gcd(a, b) * b;
}

static long rdiv(rng_t *r, long m)
{
    long d[64];
    int n = 0;
    for (long i = 1; i <= m && n < 64; i++)
        if (m % i == 0) d[n++] = i;
    return d[rint_(r, 0, n - 1)];
}

/* ---------------------------------------------------------------- datatypes */
typedef struct { MPI_Datatype dt; const char *name; int size; } base_t;
static base_t bases[6];
#define NBASE 6

typedef struct tnode {
    MPI_Datatype dt;
    int owned;          /* dt must be freed */
    long m;             /* signature: m x base */
    int bs;             /* base size */
    MPI_Aint *off;      /* byte offset of each of the m base elements (type map) */
    MPI_Aint lb, ext, tlb, text, tmin, tmax;
    char *desc;
} tnode;

static tnode *tn_new(const base_t *b, long m)
{
    tnode *t = xcalloc(1, sizeof *t);
    t->bs = b->size;
    t->m = m;
    t->off = xcalloc((size_t)(m > 0 ? m : 1), sizeof(MPI_Aint));
    t->dt = MPI_DATATYPE_NULL;
    return t;
}

static void tn_free(tnode *t)
{
    if (!t) return;
    if (t->owned && t->dt != MPI_DATATYPE_NULL) MPI_Type_free(&t->dt);
    free(t->off);
    free(t->desc);
    free(t);
}

/* query MPI and cross-check our type map with it */
static void tn_finish(tnode *t)
{
    int sz;
    MPI_Type_size(t->dt, &sz);
    MPI_Type_get_extent(t->dt, &t->lb, &t->ext);
    MPI_Type_get_true_extent(t->dt, &t->tlb, &t->text);
    if ((long)sz != t->m * t->bs)
        internal("type %s: MPI_Type_size %d, expected %ld", t->desc, sz, t->m * t->bs);
    if (t->m > 0) {
        t->tmin = t->tmax = t->off[0];
        for (long i = 1; i < t->m; i++) {
            if (t->off[i] < t->tmin) t->tmin = t->off[i];
            if (t->off[i] > t->tmax) t->tmax = t->off[i];
        }
        if (t->tmin != t->tlb || t->tmax + t->bs - t->tmin != t->text)
            internal("type %s: true lb/extent %ld/%ld, type map gives %ld/%ld", t->desc,
                     (long)t->tlb, (long)t->text, (long)t->tmin,
                     (long)(t->tmax + t->bs - t->tmin));
    }
}

static void put_copy(tnode *t, long *k, const tnode *c, MPI_Aint pos)
{
    for (long e = 0; e < c->m; e++) {
        if (*k >= t->m) internal("type map overflow building %s", c->desc);
        t->off[(*k)++] = pos + c->off[e];
    }
}

static tnode *mk_base(const base_t *b)
{
    tnode *t = tn_new(b, 1);
    t->dt = b->dt;
    t->owned = 0;
    t->off[0] = 0;
    t->desc = xstrdup(b->name);
    tn_finish(t);
    return t;
}

static tnode *mk_contig(const base_t *b, long m)
{
    tnode *t = tn_new(b, m);
    MPI_Type_contiguous((int)m, b->dt, &t->dt);
    t->owned = 1;
    for (long i = 0; i < m; i++) t->off[i] = i * b->size;
    str_t d = {0};
    sappend(&d, "contig(%ld,%s)", m, b->name);
    t->desc = d.s;
    tn_finish(t);
    return t;
}

/* Displacements for nb blocks of len[i] units (quantum q bytes or 1 unit). Receive side:
 * disjoint blocks, in random order, with random gaps, starting possibly below 0. Send side:
 * half the time anywhere (overlaps allowed), else like the receive side. */
static void place(rng_t *r, int nb, const long *len, long *disp, int recv, long q)
{
    long total = 0;
    for (int i = 0; i < nb; i++) total += len[i];
    if (!recv && chance(r, 50)) {
        for (int i = 0; i < nb; i++) disp[i] = rint_(r, -3, total / q + 3) * q;
        return;
    }
    int *perm = xcalloc((size_t)nb, sizeof(int));
    for (int i = 0; i < nb; i++) perm[i] = i;
    shuffle(r, perm, nb);
    long cur = rint_(r, -3, 3) * q;
    for (int t = 0; t < nb; t++) {
        int i = perm[t];
        if (len[i] == 0) { disp[i] = rint_(r, -3, 6) * q; continue; }
        disp[i] = cur;
        cur += len[i];
        if (chance(r, 40)) cur += rint_(r, 1, 3) * q;
    }
    free(perm);
}

static tnode *mk_resized(rng_t *r, tnode *c, int recv, int force_lb)
{
    const long bs = c->bs;
    MPI_Aint lb, ext;
    if (c->m > 0) {
        MPI_Aint span = c->tmax + bs - c->tmin;
        if (recv) {
            ext = span + (chance(r, 50) ? rint_(r, 0, 3) * bs : 0) + (chance(r, 15) ? span : 0);
            lb = c->tmin + rint_(r, -4, 2) * bs;
        } else {
            ext = rint_(r, 1, span / bs + 3) * bs;
            lb = c->tmin + rint_(r, -4, 4) * bs;
        }
    } else {
        lb = rint_(r, -4, 4) * bs;
        ext = rint_(r, 1, 4) * bs;
    }
    if (force_lb && lb == 0) lb = (chance(r, 50) ? -1 : 1) * bs * rint_(r, 1, 3);
    tnode *t = tn_new(&(base_t){MPI_DATATYPE_NULL, "", c->bs}, c->m);
    MPI_Type_create_resized(c->dt, lb, ext, &t->dt);
    t->owned = 1;
    long k = 0;
    put_copy(t, &k, c, 0);
    str_t d = {0};
    sappend(&d, "resized(lb=%ld,ext=%ld,%s)", (long)lb, (long)ext, c->desc);
    t->desc = d.s;
    tn_finish(t);
    tn_free(c);
    return t;
}

static tnode *mk_dup(tnode *c)
{
    tnode *t = tn_new(&(base_t){MPI_DATATYPE_NULL, "", c->bs}, c->m);
    MPI_Type_dup(c->dt, &t->dt);
    t->owned = 1;
    long k = 0;
    put_copy(t, &k, c, 0);
    str_t d = {0};
    sappend(&d, "dup(%s)", c->desc);
    t->desc = d.s;
    tn_finish(t);
    tn_free(c);
    return t;
}

enum { K_CONTIG, K_VECTOR, K_HVECTOR, K_INDEXED, K_HINDEXED, K_IBLOCK, K_HIBLOCK, K_STRUCT,
       K_SUBARRAY, K_RESIZED, K_DUP, NKIND };

static tnode *gen(rng_t *r, const base_t *b, long m, int depth, int recv);

/* t = `kind` made of `a` copies of c (signature a * c->m) */
static tnode *compose(rng_t *r, const base_t *b, int kind, long a, tnode *c, int recv)
{
    const long bs = b->size;
    const MPI_Aint ce = c->ext;
    tnode *t = tn_new(b, a * c->m);
    long k = 0;
    str_t d = {0};
    switch (kind) {
    case K_CONTIG:
        MPI_Type_contiguous((int)a, c->dt, &t->dt);
        for (long i = 0; i < a; i++) put_copy(t, &k, c, i * ce);
        sappend(&d, "contig(%ld,%s)", a, c->desc);
        break;
    case K_VECTOR:
    case K_HVECTOR: {
        long cnt, bl;
        if (a == 0) {
            if (chance(r, 50)) { cnt = 0; bl = rint_(r, 0, 3); }
            else { cnt = rint_(r, 1, 3); bl = 0; }
        } else {
            cnt = rdiv(r, a);
            bl = a / cnt;
        }
        if (kind == K_VECTOR) {
            long stride = recv ? (bl + rint_(r, 0, 2)) * (chance(r, 25) ? -1 : 1)
                               : rint_(r, -bl - 2, bl + 3);
            /* Open MPI 4.1 bug: a (h)vector whose stride is -1 byte is built as if the
             * stride were +blocklength (MPI_Type_get_true_extent gives lb 0, MPI_Pack reads
             * bytes 0,1 instead of 0,-1 for hvector(2,1,-1B,MPI_BYTE)). Avoid that stride. */
            if (ce == 1 && stride == -1) stride = -2;
            MPI_Type_vector((int)cnt, (int)bl, (int)stride, c->dt, &t->dt);
            for (long i = 0; i < cnt; i++)
                for (long jj = 0; jj < bl; jj++) put_copy(t, &k, c, (i * stride + jj) * ce);
            sappend(&d, "vector(%ld,%ld,%ld,%s)", cnt, bl, stride, c->desc);
        } else {
            MPI_Aint stride = recv ? (bl * ce + rint_(r, 0, 2) * bs) * (chance(r, 25) ? -1 : 1)
                                   : rint_(r, -bl - 2, bl + 3) * ce + rint_(r, -1, 1) * bs;
            if (stride == -1) stride = -2; /* Open MPI bug, see above */
            MPI_Type_create_hvector((int)cnt, (int)bl, stride, c->dt, &t->dt);
            for (long i = 0; i < cnt; i++)
                for (long jj = 0; jj < bl; jj++) put_copy(t, &k, c, i * stride + jj * ce);
            sappend(&d, "hvector(%ld,%ld,%ldB,%s)", cnt, bl, (long)stride, c->desc);
        }
        break;
    }
    case K_INDEXED:
    case K_HINDEXED:
    case K_STRUCT:
    case K_IBLOCK:
    case K_HIBLOCK: {
        int nb;
        long *len, blk = 0;
        if (kind == K_IBLOCK || kind == K_HIBLOCK) {
            if (a == 0) { nb = (int)rint_(r, 0, 2); blk = nb ? 0 : rint_(r, 0, 2); }
            else { nb = (int)rdiv(r, a); blk = a / nb; }
            len = xcalloc((size_t)nb + 1, sizeof(long));
            for (int i = 0; i < nb; i++) len[i] = blk;
        } else {
            nb = a == 0 ? (int)rint_(r, 0, 3) : (int)rint_(r, 1, 4);
            len = xcalloc((size_t)nb + 1, sizeof(long));
            for (long u = 0; u < a; u++) len[rint_(r, 0, nb - 1)]++;
        }
        /* struct: blocks of the child, or of the base when the child is a single element */
        tnode *bn = NULL;
        const tnode **ty = xcalloc((size_t)nb + 1, sizeof(tnode *));
        for (int i = 0; i < nb; i++) {
            ty[i] = c;
            if (kind == K_STRUCT && c->m == 1 && chance(r, 40)) {
                if (!bn) bn = mk_base(b);
                ty[i] = bn;
            }
        }
        long *disp = xcalloc((size_t)nb + 1, sizeof(long));
        long *blen = xcalloc((size_t)nb + 1, sizeof(long));
        int units = kind == K_INDEXED || kind == K_IBLOCK;
        for (int i = 0; i < nb; i++) blen[i] = units ? len[i] : len[i] * ty[i]->ext;
        place(r, nb, blen, disp, recv, units ? 1 : bs);
        int *ibl = xcalloc((size_t)nb + 1, sizeof(int)), *idi = xcalloc((size_t)nb + 1, sizeof(int));
        MPI_Aint *adi = xcalloc((size_t)nb + 1, sizeof(MPI_Aint));
        MPI_Datatype *tys = xcalloc((size_t)nb + 1, sizeof(MPI_Datatype));
        for (int i = 0; i < nb; i++) {
            ibl[i] = (int)len[i];
            idi[i] = (int)disp[i];
            adi[i] = disp[i];
            tys[i] = ty[i]->dt;
            for (long jj = 0; jj < len[i]; jj++)
                put_copy(t, &k, ty[i], units ? (disp[i] + jj) * ce : disp[i] + jj * ty[i]->ext);
        }
        const char *nm = kind == K_INDEXED ? "indexed" : kind == K_HINDEXED ? "hindexed"
                       : kind == K_STRUCT ? "struct" : kind == K_IBLOCK ? "indexed_block"
                       : "hindexed_block";
        switch (kind) {
        case K_INDEXED: MPI_Type_indexed(nb, ibl, idi, c->dt, &t->dt); break;
        case K_HINDEXED: MPI_Type_create_hindexed(nb, ibl, adi, c->dt, &t->dt); break;
        case K_STRUCT: MPI_Type_create_struct(nb, ibl, adi, tys, &t->dt); break;
        case K_IBLOCK: MPI_Type_create_indexed_block(nb, (int)blk, idi, c->dt, &t->dt); break;
        default: MPI_Type_create_hindexed_block(nb, (int)blk, adi, c->dt, &t->dt); break;
        }
        sappend(&d, "%s([", nm);
        for (int i = 0; i < nb; i++)
            sappend(&d, "%s%ld@%ld%s%s", i ? "," : "", len[i], disp[i], units ? "" : "B",
                    ty[i] == bn ? ":base" : "");
        sappend(&d, "],%s)", c->desc);
        if (bn) tn_free(bn);
        free(len); free(ty); free(disp); free(blen); free(ibl); free(idi); free(adi); free(tys);
        break;
    }
    case K_SUBARRAY: {
        int nd = (int)rint_(r, 1, 3), sizes[3], sub[3], starts[3];
        long rem = a;
        for (int dd = 0; dd < nd; dd++) {
            sub[dd] = (int)(dd == nd - 1 ? rem : rdiv(r, rem));
            rem /= sub[dd];
            sizes[dd] = sub[dd] + (chance(r, 60) ? (int)rint_(r, 1, 2) : 0);
            starts[dd] = (int)rint_(r, 0, sizes[dd] - sub[dd]);
        }
        int order = chance(r, 50) ? MPI_ORDER_C : MPI_ORDER_FORTRAN;
        MPI_Type_create_subarray(nd, sizes, sub, starts, order, c->dt, &t->dt);
        long str[3];
        for (int dd = 0; dd < nd; dd++) {
            str[dd] = 1;
            for (int e = 0; e < nd; e++)
                if (order == MPI_ORDER_C ? e > dd : e < dd) str[dd] *= sizes[e];
        }
        /* in type map order: the last dimension varies fastest in C order, the first in
         * Fortran order (the model of what is received depends on the order) */
        for (long idx = 0; idx < a; idx++) {
            long x = idx, lin = 0;
            for (int q = 0; q < nd; q++) {
                int dd = order == MPI_ORDER_C ? nd - 1 - q : q;
                lin += (starts[dd] + x % sub[dd]) * str[dd];
                x /= sub[dd];
            }
            put_copy(t, &k, c, lin * ce);
        }
        sappend(&d, "subarray(%s,sizes=[", order == MPI_ORDER_C ? "C" : "F");
        for (int dd = 0; dd < nd; dd++) sappend(&d, "%s%d", dd ? "," : "", sizes[dd]);
        sappend(&d, "],sub=[");
        for (int dd = 0; dd < nd; dd++) sappend(&d, "%s%d", dd ? "," : "", sub[dd]);
        sappend(&d, "],starts=[");
        for (int dd = 0; dd < nd; dd++) sappend(&d, "%s%d", dd ? "," : "", starts[dd]);
        sappend(&d, "],%s)", c->desc);
        break;
    }
    default:
        internal("compose: kind %d", kind);
    }
    if (k != t->m) internal("type map of %s has %ld elements, expected %ld", d.s, k, t->m);
    t->owned = 1;
    t->desc = d.s;
    tn_finish(t);
    tn_free(c); /* the parent keeps what it needs: freeing the child's handle is legal */
    return t;
}

static tnode *gen(rng_t *r, const base_t *b, long m, int depth, int recv)
{
    if (depth <= 0 || chance(r, 20)) {
        if (m == 1 && chance(r, 60)) return mk_base(b);
        return mk_contig(b, m);
    }
    int kind = (int)rint_(r, 0, NKIND - 1);
    if (kind == K_RESIZED) return mk_resized(r, gen(r, b, m, depth - 1, recv), recv, 0);
    if (kind == K_DUP) return mk_dup(gen(r, b, m, depth - 1, recv));
    long a, cm;
    if (m == 0) {
        if (chance(r, 50)) { a = 0; cm = rint_(r, 1, 3); }
        else { cm = 0; a = rint_(r, 1, 3); }
    } else {
        cm = rdiv(r, m);
        a = m / cm;
    }
    if (kind == K_SUBARRAY && a == 0) kind = K_CONTIG;
    tnode *c = gen(r, b, cm, depth - 1, recv);
    return compose(r, b, kind, a, c, recv);
}

/* single-block types whose data do not start at the buffer address */
static tnode *single_block(rng_t *r, const base_t *b, long m, int recv)
{
    tnode *c = gen(r, b, m, (int)rint_(r, 0, 1), recv);
    const long bs = b->size;
    int v = (int)rint_(r, 0, 6);
    long D = chance(r, 50) ? 8 : rint_(r, 1, 6) * bs;
    if (chance(r, 20)) D = -D;
    tnode *t = tn_new(b, m);
    long k = 0;
    str_t d = {0};
    int one = 1;
    MPI_Aint ad = D;
    switch (v) {
    case 0:
        MPI_Type_create_hindexed(1, &one, &ad, c->dt, &t->dt);
        put_copy(t, &k, c, D);
        sappend(&d, "hindexed([1@%ldB],%s)", D, c->desc);
        break;
    case 1: {
        int nd = (int)rint_(r, 1, 2), sizes[2], sub[2] = {1, 1}, starts[2];
        int order = chance(r, 50) ? MPI_ORDER_C : MPI_ORDER_FORTRAN;
        for (int dd = 0; dd < nd; dd++) {
            sizes[dd] = (int)rint_(r, 1, 4);
            starts[dd] = (int)rint_(r, 0, sizes[dd] - 1);
        }
        MPI_Type_create_subarray(nd, sizes, sub, starts, order, c->dt, &t->dt);
        long lin = nd == 1 ? starts[0]
                 : order == MPI_ORDER_C ? (long)starts[0] * sizes[1] + starts[1]
                                        : (long)starts[1] * sizes[0] + starts[0];
        put_copy(t, &k, c, lin * c->ext);
        if (nd == 1)
            sappend(&d, "subarray(%s,sizes=[%d],sub=[1],starts=[%d],%s)",
                    order == MPI_ORDER_C ? "C" : "F", sizes[0], starts[0], c->desc);
        else
            sappend(&d, "subarray(%s,sizes=[%d,%d],sub=[1,1],starts=[%d,%d],%s)",
                    order == MPI_ORDER_C ? "C" : "F", sizes[0], sizes[1], starts[0], starts[1],
                    c->desc);
        break;
    }
    case 2: {
        MPI_Datatype ct = c->dt;
        MPI_Type_create_struct(1, &one, &ad, &ct, &t->dt);
        put_copy(t, &k, c, D);
        sappend(&d, "struct([1@%ldB],%s)", D, c->desc);
        break;
    }
    case 3: {
        MPI_Aint st = rint_(r, -5, 5) * bs;
        MPI_Type_create_hvector(1, 1, st, c->dt, &t->dt);
        put_copy(t, &k, c, 0);
        sappend(&d, "hvector(1,1,%ldB,%s)", (long)st, c->desc);
        break;
    }
    case 4:
        tn_free(t);
        return mk_resized(r, c, recv, 1);
    case 5:
        MPI_Type_create_hindexed_block(1, 1, &ad, c->dt, &t->dt);
        put_copy(t, &k, c, D);
        sappend(&d, "hindexed_block([1@%ldB],%s)", D, c->desc);
        break;
    default: {
        int di = (int)rint_(r, 1, 3);
        MPI_Type_create_indexed_block(1, 1, &di, c->dt, &t->dt);
        put_copy(t, &k, c, di * c->ext);
        sappend(&d, "indexed_block([1@%d],%s)", di, c->desc);
        break;
    }
    }
    t->owned = 1;
    t->desc = d.s;
    tn_finish(t);
    tn_free(c);
    return t;
}

static int cmp_aint(const void *a, const void *b)
{
    MPI_Aint x = *(const MPI_Aint *)a, y = *(const MPI_Aint *)b;
    return x < y ? -1 : x > y;
}

/* receive types: no two elements overlap, and consecutive copies (at extent) do not overlap */
static int recv_ok(const tnode *t)
{
    if (t->m == 0) return 1;
    MPI_Aint *o = xcalloc((size_t)t->m, sizeof(MPI_Aint));
    memcpy(o, t->off, sizeof(MPI_Aint) * (size_t)t->m);
    qsort(o, (size_t)t->m, sizeof(MPI_Aint), cmp_aint);
    int ok = 1;
    for (long i = 0; i + 1 < t->m; i++)
        if (o[i + 1] - o[i] < t->bs) ok = 0;
    free(o);
    if (t->tmax + t->bs - t->tmin > t->ext) ok = 0;
    return ok;
}

/* Rank w's type for side (0 send, 1 recv) of op j of case k: a function of those only. */
static tnode *draw_type(long k, int j, int w, int side, const base_t *b, long m, int recv,
                        int plain_only)
{
    rng_t r = rstream(k, j, w, side ? T_TYPE_R : T_TYPE_S);
    tnode *t = NULL;
    for (int tries = 0; tries < 40 && !t; tries++) {
        int p = (int)rint_(&r, 0, 99);
        if (plain_only || p < 35)
            t = (m == 1 && chance(&r, 85)) ? mk_base(b) : mk_contig(b, m);
        else if (p < 55 && m > 0)
            t = single_block(&r, b, m, recv);
        else
            t = gen(&r, b, m, (int)rint_(&r, 1, 3), recv);
        if (recv && !recv_ok(t)) { tn_free(t); t = NULL; }
    }
    if (!t) t = mk_contig(b, m);
    if (t->owned) MPI_Type_commit(&t->dt);
    str_t d = {0};
    sappend(&d, "%s{m=%ld lb=%ld ext=%ld}", t->desc, t->m, (long)t->lb, (long)t->ext);
    free(t->desc);
    t->desc = d.s;
    return t;
}

static long draw_m(rng_t *r, int zero)
{
    static const long tab[] = {1, 1, 1, 1, 2, 2, 3, 4, 6};
    if (zero && chance(r, 30)) return 0;
    return tab[rint_(r, 0, 8)];
}

/* ---------------------------------------------------------------- communicators */
enum { L_WORLD, L_DUP, L_SPLIT, L_EXCL, L_SINGLE };
typedef struct {
    int kind, owned, n, me;
    MPI_Comm comm;
    int *wr; /* world rank of each comm rank */
    char desc[512];
} layer_t;

static void layer_make(rng_t *C, layer_t *L, int final)
{
    int r = (int)rint_(C, 0, 99);
    int kind = final ? L_WORLD : r < 30 ? L_WORLD : r < 45 ? L_DUP : r < 75 ? L_SPLIT
             : r < 90 ? L_EXCL : L_SINGLE;
    int *color = xcalloc((size_t)wsize, sizeof(int)), *key = xcalloc((size_t)wsize, sizeof(int));
    int nc = (int)rint_(C, 1, 3), keymode = (int)rint_(C, 0, 2);
    for (int w = 0; w < wsize; w++) {
        color[w] = (int)rint_(C, 0, nc - 1);
        int ex = chance(C, 35);
        key[w] = keymode == 0 ? 0 : keymode == 1 ? -w : (int)rint_(C, -3, 3);
        if (kind == L_EXCL) color[w] = ex ? MPI_UNDEFINED : 0;
        if (kind == L_SINGLE) color[w] = w;
    }
    if (kind == L_EXCL) {
        int any = 0;
        for (int w = 0; w < wsize; w++) any |= color[w] == 0;
        if (!any) color[rint_(C, 0, wsize - 1)] = 0;
    }
    memset(L, 0, sizeof *L);
    L->kind = kind;
    if (kind == L_WORLD) {
        L->comm = MPI_COMM_WORLD;
    } else if (kind == L_DUP) {
        MPI_Comm_dup(MPI_COMM_WORLD, &L->comm);
        L->owned = 1;
    } else {
        MPI_Comm_split(MPI_COMM_WORLD, color[wrank], key[wrank], &L->comm);
        L->owned = L->comm != MPI_COMM_NULL;
    }
    if (L->comm != MPI_COMM_NULL) {
        MPI_Comm_size(L->comm, &L->n);
        MPI_Comm_rank(L->comm, &L->me);
        L->wr = xcalloc((size_t)L->n, sizeof(int));
        int *ranks = xcalloc((size_t)L->n, sizeof(int));
        for (int i = 0; i < L->n; i++) ranks[i] = i;
        MPI_Group g, wg;
        MPI_Comm_group(L->comm, &g);
        MPI_Comm_group(MPI_COMM_WORLD, &wg);
        MPI_Group_translate_ranks(g, L->n, ranks, wg, L->wr);
        MPI_Group_free(&g);
        MPI_Group_free(&wg);
        free(ranks);
        static const char *kn[] = {"world", "dup(world)", "split", "split-excluding", "split-size1"};
        int p = snprintf(L->desc, sizeof L->desc, "%s", kn[kind]);
        if (kind >= L_SPLIT) p += snprintf(L->desc + p, sizeof L->desc - p, "(color %d)", color[wrank]);
        if (kind != L_WORLD) {
            p += snprintf(L->desc + p, sizeof L->desc - p, "{");
            for (int i = 0; i < L->n && p < (int)sizeof L->desc - 16; i++)
                p += snprintf(L->desc + p, sizeof L->desc - p, "%s%d", i ? "," : "", L->wr[i]);
            snprintf(L->desc + p, sizeof L->desc - p, "}");
        }
    }
    free(color);
    free(key);
}

static void layer_free(layer_t *L)
{
    if (L->owned) MPI_Comm_free(&L->comm);
    free(L->wr);
}

/* ---------------------------------------------------------------- buffers */
typedef struct { long off, cnt; int owner; } blk_t;

typedef struct {
    int used;
    tnode *t;
    size_t size, pre, gpre; /* allocation size, buffer pointer offset, front guard size */
    long hi;                /* data bytes lie below buffer pointer + hi */
    unsigned char *orig, *ref, *test;
    uint16_t *map;          /* 0: untouched by the type map, else owner comm rank + 1 */
    int nb;
    blk_t *bl;              /* the blocks (offset from the buffer pointer, count, peer) */
} buf_t;

static void fill(rng_t *r, unsigned char *p, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) { uint64_t x = rnext(r); memcpy(p + i, &x, 8); }
    if (i < n) { uint64_t x = rnext(r); memcpy(p + i, &x, n - i); }
}

static void buf_build(buf_t *B, tnode *t, const blk_t *bl, int nb, rng_t *G, int recv)
{
    long lo = LONG_MAX, hi = LONG_MIN;
    const long bs = t->bs;
    for (int i = 0; i < nb; i++) {
        if (bl[i].cnt <= 0 || t->m == 0) continue;
        long last = bl[i].off + (bl[i].cnt - 1) * (long)t->ext;
        long a = bl[i].off < last ? bl[i].off : last, z = bl[i].off < last ? last : bl[i].off;
        if (a + t->tmin < lo) lo = a + t->tmin;
        if (z + t->tmax + bs > hi) hi = z + t->tmax + bs;
    }
    if (lo > 0) lo = 0;
    if (hi < 0) hi = 0;
    memset(B, 0, sizeof *B);
    B->used = 1;
    B->t = t;
    B->nb = nb;
    B->bl = xcalloc((size_t)nb, sizeof(blk_t));
    memcpy(B->bl, bl, sizeof(blk_t) * (size_t)nb);
    B->gpre = (size_t)rint_(G, 1, 48);
    B->pre = B->gpre + (size_t)(-lo);
    B->hi = hi;
    B->size = B->pre + (size_t)hi + (size_t)rint_(G, 1, 48);
    B->orig = xcalloc(B->size, 1);
    B->ref = xcalloc(B->size, 1);
    B->test = xcalloc(B->size, 1);
    B->map = xcalloc(B->size, sizeof(uint16_t));
    fill(G, B->orig, B->size);
    memcpy(B->ref, B->orig, B->size);
    memcpy(B->test, B->orig, B->size);
    for (int i = 0; i < nb; i++)
        for (long c = 0; c < bl[i].cnt && t->m > 0; c++)
            for (long e = 0; e < t->m; e++) {
                long x = (long)B->pre + bl[i].off + c * (long)t->ext + (long)t->off[e];
                if (x < (long)B->gpre || x + bs > (long)B->size - 1)
                    internal("element outside the allocation");
                for (long q = 0; q < bs; q++) {
                    if (recv && B->map[x + q])
                        internal("receive elements overlap (type %s, block %d)", t->desc, i);
                    B->map[x + q] = (uint16_t)(bl[i].owner + 1);
                }
            }
}

static void buf_free(buf_t *B)
{
    if (!B->used) return;
    free(B->orig); free(B->ref); free(B->test); free(B->map); free(B->bl);
    B->used = 0;
}

/* ---------------------------------------------------------------- operations */
typedef struct {
    int member, coll, fam, j, final;
    int idx;        /* position in the batch (j is the stream index: a clone has its model's) */
    int clone_of;   /* -1, or the earlier op of the batch whose parameters and send buffer
                       (the same memory, read by both calls at once) this op shares */
    long k;
    layer_t *L;
    int n, me, root, bi, zero, big, huge, plain;
    const base_t *b;
    int *inpl;      /* per comm rank */
    long *ms, *mr;  /* per comm rank */
    int inplace;    /* mine */
    tnode *st, *rt;
    long bcnt, scount, rcount;
    int *scounts, *sdispls, *rcounts, *rdispls;
    int junk_count; /* sendcount passed with MPI_IN_PLACE (ignored by the standard) */
    buf_t sb, rb;
    MPI_Request rq_ref, rq_test;
} op_t;

static long draw_T(rng_t *O, long L, const op_t *o, long div)
{
    if (L == 0) return 0;
    if (o->big) {
        long target = (o->huge ? rint_(O, 4 << 20, 24 << 20) : rint_(O, 16384, 2200000)) /
                      (o->b->size * div);
        long t = target / L * L;
        return t ? t : L;
    }
    if (chance(O, 12)) return 0;
    return L * rint_(O, 1, L <= 2 ? 6 : 3);
}

/* all parameters every member agrees on, then this rank's types, counts, buffers */
/* me: the comm rank whose view to build (this rank, or a peer for the model) */
static void op_setup(op_t *o, long k, int j, int final, int me)
{
    layer_t *L = o->L;
    const int n = L->n;
    o->k = k;
    o->j = j;
    o->final = final;
    o->n = n;
    o->me = me;
    o->fam = FAM(o->coll);
    rng_t O = rstream(k, j, 0, T_OP);
    o->bi = (int)rint_(&O, 0, NBASE - 1);
    o->b = &bases[o->bi];
    o->zero = chance(&O, 10);
    o->big = !final && chance(&O, 5);
    o->huge = o->big && chance(&O, 20); /* beyond the default 8 MiB staging segments */
    o->plain = g_basic || o->big;
    o->root = (int)rint_(&O, 0, n - 1);
    int ipmode = (int)rint_(&O, 0, 99);
    o->inpl = xcalloc((size_t)n, sizeof(int));
    for (int i = 0; i < n; i++) {
        int coin = chance(&O, 50);
        if (o->fam != F_BCAST) {
            if (ipmode < 20) o->inpl[i] = 1;
            /* Not for the blocking MPI_Alltoall(v): Open MPI 4.1's in-place algorithm (coll
             * base, pairwise) does not match the messages of the other ranks' ordinary
             * algorithms (MPI_ERR_TRUNCATE or hang natively); its libnbc nonblocking ones
             * and the allgathers do mix. */
            else if (g_mixed && ipmode < 35 && o->coll != C_ALLTOALLV && o->coll != C_ALLTOALL
#ifdef MPICH_VERSION
                     /* MPICH 4.0: its in-place i(alltoall(v)) algorithm does not match the
                      * others' either (a hang natively) */
                     && FAM(o->coll) != F_A2A && FAM(o->coll) != F_A2AV
#endif
                     )
                o->inpl[i] = coin;
        }
    }
    o->inplace = o->inpl[me];
    o->ms = xcalloc((size_t)n, sizeof(long));
    o->mr = xcalloc((size_t)n, sizeof(long));
    int any_inpl = 0;
    for (int i = 0; i < n; i++) any_inpl |= o->inpl[i];
    /* Open MPI 4.1 libnbc bugs in the in-place MPI_Ialltoallv (a2av_sched_inplace):
     * - a rank whose receive span is 0 (all counts 0, or a zero-size type) returns a no-op
     *   request without consuming a collective tag, so the next nonblocking collective on
     *   the communicator never matches (hang; later fixed with
     *   ompi_coll_base_nbc_reserve_tags);
     * - when a count is 0 the schedule loses a round barrier, so the copy of the next block
     *   into the temporary buffer overwrites it while a rendezvous send of that buffer is
     *   still reading it: wrong data, intermittently (large blocks).
     * So an in-place ialltoallv gets no zero-size type and no zero count on any pair that
     * involves an in-place rank. */
    const int a2av_nz = o->coll == C_IALLTOALLV && any_inpl;
    for (int i = 0; i < n; i++) {
        rng_t M = rstream(k, j, L->wr[i], T_M);
        o->ms[i] = draw_m(&M, o->zero);
        o->mr[i] = draw_m(&M, o->zero);
        if (a2av_nz && o->ms[i] == 0) o->ms[i] = 1;
        if (a2av_nz && o->mr[i] == 0) o->mr[i] = 1;
    }
#ifdef MPICH_VERSION
    /* MPICH 4.0 bug: its ring (i)allgatherv (the algorithm for large messages) cuts every
     * block into chunks of MPIR_CVAR_ALLGATHERV_PIPELINE_MSG_SIZE / size(recvtype) elements
     * of each rank's own receive type, so ranks whose receive type sizes differ (legal MPI)
     * cut one block into different messages: MPI_ERR_TRUNCATE natively in the blocking call,
     * wrong bytes in the nonblocking one. A large allgatherv gives every rank the receive m
     * of comm rank 0 (equal receive type sizes). */
    if (o->fam == F_AGV && o->big)
        for (int i = 1; i < n; i++) o->mr[i] = o->mr[0];
#endif
    long *eff = xcalloc((size_t)n, sizeof(long));
    for (int i = 0; i < n; i++) eff[i] = o->inpl[i] ? o->mr[i] : o->ms[i];

    rng_t D = rstream(k, j, L->wr[me], T_DISPL);
    o->scounts = xcalloc((size_t)n, sizeof(int));
    o->sdispls = xcalloc((size_t)n, sizeof(int));
    o->rcounts = xcalloc((size_t)n, sizeof(int));
    o->rdispls = xcalloc((size_t)n, sizeof(int));
    o->junk_count = (int)rint_(&D, 0, 5);
    for (int i = 0; i < n; i++) { /* ignored with MPI_IN_PLACE: junk values */
        o->scounts[i] = (int)rint_(&D, 0, 5);
        o->sdispls[i] = (int)rint_(&D, -5, 5);
    }
    /* counts: base elements per pair from O (shared), in units of each rank's own type */
    switch (o->fam) {
    case F_BCAST: {
        long Lc = 1;
        for (int i = 0; i < n; i++) Lc = lcm0(Lc, i == o->root ? o->ms[i] : o->mr[i]);
        long T = draw_T(&O, Lc, o, 1), mm = me == o->root ? o->ms[me] : o->mr[me];
        /* A zero-size type could come with any count, but Open MPI (and MPICH) return at
         * once on count == 0 without looking at the type size, so a rank with count 0 would
         * skip the algorithm that a rank with count 3 of a zero-size type enters: hang. So
         * an empty signature is always count 0 here (same for allgather, alltoall and the
         * receive counts of allgatherv, which Open MPI short-cuts when all are 0). */
        o->bcnt = mm ? T / mm : 0;
        break;
    }
    case F_AG:
    case F_A2A: {
        long Lc = 1;
        for (int i = 0; i < n; i++) Lc = lcm0(lcm0(Lc, eff[i]), o->mr[i]);
        long T = draw_T(&O, Lc, o, n);
        o->scount = eff[me] ? T / eff[me] : 0;
        o->rcount = o->mr[me] ? T / o->mr[me] : 0;
        break;
    }
    case F_AGV: {
        int allzero = chance(&O, 5);
        long *T = xcalloc((size_t)n, sizeof(long)), sumT = 0;
        for (int s = 0; s < n; s++) {
            long Ls = eff[s];
            for (int d = 0; d < n; d++) Ls = lcm0(Ls, o->mr[d]);
            int zrow = chance(&O, 10);
            T[s] = draw_T(&O, Ls, o, n);
            if (allzero || zrow) T[s] = 0;
            sumT += T[s];
        }
        /* Open MPI 4.1 bug (coll/tuned allgatherv decision): the algorithm is chosen from
         * size(sendtype) * sum(recvcounts) / comm size, so ranks whose send and receive type
         * sizes differ compute different sizes, may choose different algorithms and hang
         * (legal MPI). Keep them apart only while every rank's size stays below 128 bytes
         * (the first bracket for every communicator size); else send m := receive m. T[s]
         * stays a multiple of the new m since it is a multiple of every receive m. */
        if (o->coll == C_ALLGATHERV) {
            long bs = o->b->size, real = bs * sumT / n;
            for (int r = 0; r < n; r++) {
                if (o->inpl[r] || o->ms[r] == o->mr[r] || o->mr[r] == 0) continue;
                long comp = o->ms[r] * bs * (sumT / o->mr[r]) / n;
                if (real >= 128 || comp >= 128) o->ms[r] = eff[r] = o->mr[r];
            }
        }
        /* a zero-size send type goes with count 0: Open MPI's gatherv (inside its default
         * allgatherv) sends a 0-byte message for any nonzero count, which the root, expecting
         * count 0, never receives; it then matches a later gatherv's receive (truncation) */
        o->scount = eff[me] ? T[me] / eff[me] : 0;
        for (int s = 0; s < n; s++) o->rcounts[s] = o->mr[me] ? (int)(T[s] / o->mr[me]) : 0;
        free(T);
        break;
    }
    case F_A2AV: {
        int allzero = chance(&O, 5);
        int *zrow = xcalloc((size_t)n, sizeof(int)), *zcol = xcalloc((size_t)n, sizeof(int));
        for (int i = 0; i < n; i++) { zrow[i] = chance(&O, 10); zcol[i] = chance(&O, 10); }
        /* E[s][d]: base elements from s to d. Z[s][d]: with E 0, whether both sides still
         * pass a nonzero count of their zero-size types (legal: both signatures are empty).
         * Only when both types are zero-size: Open MPI posts a send or receive for every
         * nonzero count whatever the type size, so a nonzero count facing a zero count
         * (both empty signatures, legal) hangs in Open MPI 4.1. */
        long *E = xcalloc((size_t)n * n, sizeof(long));
        int *Z = xcalloc((size_t)n * n, sizeof(int));
        for (int s = 0; s < n; s++)
            for (int d = 0; d < n; d++) {
                int sym = o->inpl[s] || o->inpl[d];
                if (sym && s > d) continue; /* drawn with (d, s) */
                long Lp = lcm0(eff[s], o->mr[d]);
                int zok = eff[s] == 0 && o->mr[d] == 0;
                if (sym) {
                    Lp = lcm0(Lp, lcm0(eff[d], o->mr[s]));
                    zok = zok && eff[d] == 0 && o->mr[s] == 0;
                }
                long v = draw_T(&O, Lp, o, n);
                int z = chance(&O, 60) && zok;
                if (allzero || zrow[s] || zcol[d]) v = 0;
                if (sym && (zrow[d] || zcol[s])) v = 0;
                if (sym && a2av_nz && v == 0) v = Lp; /* see the Open MPI bugs above */
                E[s * n + d] = v;
                Z[s * n + d] = z;
                if (sym) { E[d * n + s] = v; Z[d * n + s] = z; }
            }
        if (!o->inplace)
            for (int d = 0; d < n; d++)
                o->scounts[d] = eff[me] ? (int)(E[me * n + d] / eff[me])
                                        : Z[me * n + d] ? (int)rint_(&D, 1, 3) : 0;
        for (int s = 0; s < n; s++)
            o->rcounts[s] = o->mr[me] ? (int)(E[s * n + me] / o->mr[me])
                                      : Z[s * n + me] ? (int)rint_(&D, 1, 3) : 0;
        free(E); free(Z); free(zrow); free(zcol);
        break;
    }
    }
    free(eff);

    /* this rank's types */
    const int wme = L->wr[me];
    int need_st = o->fam == F_BCAST ? me == o->root : !o->inplace;
    int need_rt = o->fam == F_BCAST ? me != o->root : 1;
    if (need_st) o->st = draw_type(k, j, wme, 0, o->b, o->ms[me], 0, o->plain);
    if (need_rt) o->rt = draw_type(k, j, wme, 1, o->b, o->mr[me], 1, o->plain);

    /* layouts */
    blk_t *bl = xcalloc((size_t)n + 1, sizeof(blk_t));
    rng_t G = rstream(k, j, wme, T_FILL_S);
    rng_t H = rstream(k, j, wme, T_FILL_R);
    long sext = o->st ? (long)o->st->ext : 0, rext = o->rt ? (long)o->rt->ext : 0;
    switch (o->fam) {
    case F_BCAST:
        bl[0] = (blk_t){0, o->bcnt, o->root};
        if (me == o->root) buf_build(&o->sb, o->st, bl, 1, &G, 0);
        else buf_build(&o->rb, o->rt, bl, 1, &H, 1);
        break;
    case F_AG:
    case F_AGV:
        if (!o->inplace) {
            bl[0] = (blk_t){0, o->scount, me};
            buf_build(&o->sb, o->st, bl, 1, &G, 0);
        }
        if (o->fam == F_AG) {
            for (int s = 0; s < n; s++) bl[s] = (blk_t){s * o->rcount * rext, o->rcount, s};
        } else {
            long *len = xcalloc((size_t)n, sizeof(long)), *dsp = xcalloc((size_t)n, sizeof(long));
            for (int s = 0; s < n; s++) len[s] = o->rcounts[s];
            place(&D, n, len, dsp, 1, 1);
#ifdef MPICH_VERSION
            /* MPICH 4.0's (I)allgatherv on a one-rank communicator copies the data to the
             * start of the receive buffer whatever displs[0] says (the reference would be
             * wrong, and with a negative displacement it writes past the buffer): there the
             * only block stays at displacement 0. Drawn the same way, so seeds replay. */
            if (n == 1) dsp[0] = 0;
#endif
            for (int s = 0; s < n; s++) {
                o->rdispls[s] = (int)dsp[s];
                bl[s] = (blk_t){dsp[s] * rext, o->rcounts[s], s};
            }
            free(len); free(dsp);
        }
        buf_build(&o->rb, o->rt, bl, n, &H, 1);
        break;
    case F_A2A:
    case F_A2AV:
        if (!o->inplace) {
            if (o->fam == F_A2A) {
                for (int d = 0; d < n; d++) bl[d] = (blk_t){d * o->scount * sext, o->scount, d};
            } else {
                long *len = xcalloc((size_t)n, sizeof(long)), *dsp = xcalloc((size_t)n, sizeof(long));
                for (int d = 0; d < n; d++) len[d] = o->scounts[d];
                place(&D, n, len, dsp, 0, 1);
                for (int d = 0; d < n; d++) {
                    o->sdispls[d] = (int)dsp[d];
                    bl[d] = (blk_t){dsp[d] * sext, o->scounts[d], d};
                }
                free(len); free(dsp);
            }
            buf_build(&o->sb, o->st, bl, n, &G, 0);
        }
        if (o->fam == F_A2A) {
            for (int s = 0; s < n; s++) bl[s] = (blk_t){s * o->rcount * rext, o->rcount, s};
        } else {
            long *len = xcalloc((size_t)n, sizeof(long)), *dsp = xcalloc((size_t)n, sizeof(long));
            for (int s = 0; s < n; s++) len[s] = o->rcounts[s];
            place(&D, n, len, dsp, 1, 1);
            for (int s = 0; s < n; s++) {
                o->rdispls[s] = (int)dsp[s];
                bl[s] = (blk_t){dsp[s] * rext, o->rcounts[s], s};
            }
            free(len); free(dsp);
        }
        buf_build(&o->rb, o->rt, bl, n, &H, 1);
        break;
    }
    free(bl);
}

static void op_free(op_t *o)
{
    if (o->clone_of < 0) buf_free(&o->sb);
    buf_free(&o->rb);
    tn_free(o->st);
    tn_free(o->rt);
    free(o->inpl); free(o->ms); free(o->mr);
    free(o->scounts); free(o->sdispls); free(o->rcounts); free(o->rdispls);
}

static void ints(str_t *s, const char *name, const int *a, int n)
{
    sappend(s, " %s=[", name);
    for (int i = 0; i < n; i++) sappend(s, "%s%d", i ? "," : "", a[i]);
    sappend(s, "]");
}

static void op_counts_str(str_t *s, const op_t *o)
{
    sappend(s, "m_send=%ld m_recv=%ld", o->ms[o->me], o->mr[o->me]);
    switch (o->fam) {
    case F_BCAST: sappend(s, " count=%ld", o->bcnt); break;
    case F_AG:
    case F_A2A:
        if (!o->inplace) sappend(s, " sendcount=%ld", o->scount);
        sappend(s, " recvcount=%ld", o->rcount);
        break;
    case F_AGV:
        if (!o->inplace) sappend(s, " sendcount=%ld", o->scount);
        ints(s, "recvcounts", o->rcounts, o->n);
        ints(s, "displs", o->rdispls, o->n);
        break;
    case F_A2AV:
        if (!o->inplace) {
            ints(s, "sendcounts", o->scounts, o->n);
            ints(s, "sdispls", o->sdispls, o->n);
        }
        ints(s, "recvcounts", o->rcounts, o->n);
        ints(s, "rdispls", o->rdispls, o->n);
        break;
    }
}

static void op_head(str_t *s, const op_t *o, int nops)
{
    sappend(s, "conform: FAIL seed=%llu case=%s op=%d/%d coll=%s comm=%s rank=%d(comm rank %d) "
               "root=%d inplace=%s base=%s", g_seed, g_case, o->idx, nops, coll_name[o->coll],
            o->L->desc, wrank, o->me, o->root, o->inplace ? "yes" : "no", o->b->name);
}

static int op_post(op_t *o, int pmpi, int which)
{
    unsigned char *sbase = o->sb.used ? (which ? o->sb.test : o->sb.ref) + o->sb.pre : NULL;
    unsigned char *rbase = o->rb.used ? (which ? o->rb.test : o->rb.ref) + o->rb.pre : NULL;
    void *sbuf = o->inplace ? MPI_IN_PLACE : (void *)sbase;
    MPI_Datatype sdt = o->inplace ? o->b->dt : (o->st ? o->st->dt : MPI_DATATYPE_NULL);
    MPI_Datatype rdt = o->rt ? o->rt->dt : MPI_DATATYPE_NULL;
    int sc = o->inplace ? o->junk_count : (int)o->scount, rc = (int)o->rcount;
    MPI_Comm comm = o->L->comm;
    MPI_Request *rq = which ? &o->rq_test : &o->rq_ref;
    *rq = MPI_REQUEST_NULL;
    int rcode = MPI_SUCCESS;
    if (o->fam == F_BCAST) {
        void *buf = o->me == o->root ? (void *)sbase : (void *)rbase;
        MPI_Datatype dt = o->me == o->root ? o->st->dt : o->rt->dt;
        int c = (int)o->bcnt;
        if (o->coll == C_BCAST)
            rcode = pmpi ? PMPI_Bcast(buf, c, dt, o->root, comm) : MPI_Bcast(buf, c, dt, o->root, comm);
        else
            rcode = pmpi ? PMPI_Ibcast(buf, c, dt, o->root, comm, rq)
                         : MPI_Ibcast(buf, c, dt, o->root, comm, rq);
        return rcode;
    }
    switch (o->coll) {
    case C_ALLTOALLV:
        rcode = (pmpi ? PMPI_Alltoallv : MPI_Alltoallv)(sbuf, o->scounts, o->sdispls, sdt, rbase,
                                                        o->rcounts, o->rdispls, rdt, comm);
        break;
    case C_IALLTOALLV:
        rcode = (pmpi ? PMPI_Ialltoallv : MPI_Ialltoallv)(sbuf, o->scounts, o->sdispls, sdt, rbase,
                                                          o->rcounts, o->rdispls, rdt, comm, rq);
        break;
    case C_ALLTOALL:
        rcode = (pmpi ? PMPI_Alltoall : MPI_Alltoall)(sbuf, sc, sdt, rbase, rc, rdt, comm);
        break;
    case C_IALLTOALL:
        rcode = (pmpi ? PMPI_Ialltoall : MPI_Ialltoall)(sbuf, sc, sdt, rbase, rc, rdt, comm, rq);
        break;
    case C_ALLGATHERV:
        rcode = (pmpi ? PMPI_Allgatherv : MPI_Allgatherv)(sbuf, sc, sdt, rbase, o->rcounts,
                                                          o->rdispls, rdt, comm);
        break;
    case C_IALLGATHERV:
        rcode = (pmpi ? PMPI_Iallgatherv : MPI_Iallgatherv)(sbuf, sc, sdt, rbase, o->rcounts,
                                                            o->rdispls, rdt, comm, rq);
        break;
    case C_ALLGATHER:
        rcode = (pmpi ? PMPI_Allgather : MPI_Allgather)(sbuf, sc, sdt, rbase, rc, rdt, comm);
        break;
    case C_IALLGATHER:
        rcode = (pmpi ? PMPI_Iallgather : MPI_Iallgather)(sbuf, sc, sdt, rbase, rc, rdt, comm, rq);
        break;
    }
    return rcode;
}

/* description of the type with which comm rank p sends to us */
static char *peer_send_desc(const op_t *o, int p)
{
    if (p < 0 || p >= o->n) return xstrdup("?");
    if (o->fam == F_BCAST) p = o->root;
    int recvside = o->inpl[p];
    long m = recvside ? o->mr[p] : o->ms[p];
    tnode *t = draw_type(o->k, o->j, o->L->wr[p], recvside, o->b, m, recvside, o->plain);
    char *d = xstrdup(t->desc);
    tn_free(t);
    return d;
}

static void compare(const op_t *o, int nops, const char *what, const buf_t *B,
                    const unsigned char *exp, const unsigned char *got, int only_untouched,
                    int recvside, const unsigned char *model)
{
    long first = -1, nd = 0, nstale = 0;
    for (size_t x = 0; x < B->size; x++) {
        if (only_untouched && B->map[x]) continue;
        if (exp[x] != got[x]) {
            if (first < 0) first = (long)x;
            nd++;
            nstale += got[x] == B->orig[x];
        }
    }
    if (first < 0) return;
    str_t s = {0};
    op_head(&s, o, nops);
    long boff = first - (long)B->pre;
    char region[128];
    int owner = B->map[first] ? B->map[first] - 1 : -1;
    if ((size_t)first < B->gpre)
        snprintf(region, sizeof region, "front guard");
    else if (owner >= 0)
        snprintf(region, sizeof region, "data of the block for comm rank %d", owner);
    else if (boff >= B->hi)
        snprintf(region, sizeof region, "back guard");
    else
        snprintf(region, sizeof region, "gap/hole not in the type map");
    sappend(&s, ": %s: first diff at alloc offset %ld of %zu (buffer offset %ld, %s) expected "
                "0x%02x found 0x%02x, %ld bytes differ; send type %s; recv type %s",
            what, first, B->size, boff, region, exp[first], got[first], nd,
            o->inplace ? "MPI_IN_PLACE" : o->st ? o->st->desc : "-", o->rt ? o->rt->desc : "-");
    if (exp != B->orig)
        sappend(&s, "; %ld of the differing bytes still hold their initial contents", nstale);
    if (model) {
        long nm = 0;
        for (size_t x = 0; x < B->size; x++) nm += model[x] != got[x];
        if (nm) sappend(&s, "; the MPI result also differs from the model in %ld bytes", nm);
        else sappend(&s, "; the MPI result equals the model (so the PMPI reference is wrong)");
    }
    if (recvside && owner >= 0) {
        char *pd = peer_send_desc(o, owner);
        int p = o->fam == F_BCAST ? o->root : owner;
        sappend(&s, "; src %d (world %d) send type %s", p, o->L->wr[p], pd);
        free(pd);
    }
    sappend(&s, "; ");
    op_counts_str(&s, o);
    fail_line(&s);
}

/* The model: what the receive buffer must hold, computed from every source's initial send
 * data, type map, counts and displacements (each rebuilt here from (seed, case, its rank)),
 * independently of any MPI data movement. */
static unsigned char *model_recv(const op_t *o)
{
    const buf_t *R = &o->rb;
    const tnode *rt = o->rt;
    unsigned char *ex = xcalloc(R->size, 1);
    memcpy(ex, R->orig, R->size);
    for (int s = 0; s < o->n; s++) {
        const blk_t *rb;
        if (o->fam == F_BCAST) {
            if (s != o->root) continue;
            rb = &R->bl[0];
        } else {
            rb = &R->bl[s];
        }
        long nrecv = rb->cnt * rt->m;
        op_t v, *src = (op_t *)o;
        if (s != o->me) {
            memset(&v, 0, sizeof v);
            v.clone_of = -1;
            v.coll = o->coll;
            v.L = o->L;
            v.member = 1;
            op_setup(&v, o->k, o->j, o->final, s);
            src = &v;
        }
        const buf_t *SB;
        const blk_t *sbk;
        const tnode *st;
        if (o->fam == F_BCAST) { SB = &src->sb; sbk = &SB->bl[0]; st = src->st; }
        else if (src->inplace) {
            SB = &src->rb;
            sbk = &SB->bl[o->fam == F_AG || o->fam == F_AGV ? s : o->me];
            st = src->rt;
        } else {
            SB = &src->sb;
            sbk = &SB->bl[o->fam == F_AG || o->fam == F_AGV ? 0 : o->me];
            st = src->st;
        }
        long nsend = sbk->cnt * st->m;
        if (nsend != nrecv)
            internal("model: %s op %d: comm rank %d sends %ld elements, comm rank %d receives %ld",
                     coll_name[o->coll], o->j, s, nsend, o->me, nrecv);
        const long bs = rt->bs;
        for (long e = 0; e < nrecv; e++) {
            long from = (long)SB->pre + sbk->off + (e / st->m) * (long)st->ext + (long)st->off[e % st->m];
            long to = (long)R->pre + rb->off + (e / rt->m) * (long)rt->ext + (long)rt->off[e % rt->m];
            memcpy(ex + to, SB->orig + from, (size_t)bs);
        }
        if (src == &v) op_free(&v);
    }
    return ex;
}

static void op_check(op_t *o, int nops)
{
    if (o->rb.used) {
        unsigned char *ex = model_recv(o);
        compare(o, nops, "reference PMPI result differs from the model of the type maps (MPI "
                "library or conform.c bug)", &o->rb, ex, o->rb.ref, 0, 1, NULL);
        compare(o, nops, "reference PMPI call wrote outside the receive type map (self-check)",
                &o->rb, o->rb.orig, o->rb.ref, 1, 1, NULL);
        compare(o, nops, "receive buffer differs from the PMPI reference", &o->rb, o->rb.ref,
                o->rb.test, 0, 1, ex);
        free(ex);
    }
    if (o->sb.used) {
        compare(o, nops, "PMPI call modified the send buffer", &o->sb, o->sb.orig, o->sb.ref, 0, 0,
                NULL);
        compare(o, nops, "MPI call modified the send buffer", &o->sb, o->sb.orig, o->sb.test, 0, 0,
                NULL);
    }
}

static void op_verbose(const op_t *o, int nops)
{
    str_t s = {0};
    sappend(&s, "conform-v: seed=%llu case=%s op=%d/%d coll=%s comm=%s rank=%d(comm rank %d) "
                "root=%d inplace=%s base=%s big=%d send type %s; recv type %s; ", g_seed, g_case,
            o->idx, nops, coll_name[o->coll], o->L->desc, wrank, o->me, o->root,
            o->inplace ? "yes" : "no", o->b->name, o->big,
            o->inplace ? "MPI_IN_PLACE" : o->st ? o->st->desc : "-", o->rt ? o->rt->desc : "-");
    op_counts_str(&s, o);
    sappend(&s, " send alloc %zu recv alloc %zu", o->sb.used ? o->sb.size : 0,
            o->rb.used ? o->rb.size : 0);
    fprintf(stderr, "%s\n", s.s);
    free(s.s);
}

/* ---------------------------------------------------------------- completion */
enum { M_WAIT, M_WAITALL, M_WAITANY, M_WAITSOME, M_TEST, M_TESTALL, M_TESTANY, M_TESTSOME,
       M_GETSTATUS, NMETH };
static const char *meth_name[NMETH] = {"MPI_Wait", "MPI_Waitall", "MPI_Waitany", "MPI_Waitsome",
                                       "MPI_Test", "MPI_Testall", "MPI_Testany", "MPI_Testsome",
                                       "MPI_Request_get_status"};
enum { S_NULL, S_COLL, S_NSEND, S_NRECV };
typedef struct { int kind, op; } slot_t;

static const char *g_batch_desc;

static void cfail(const char *method, const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    str_t s = {0};
    sappend(&s, "conform: FAIL seed=%llu case=%s rank=%d batch=[%s] completion=%s: %s", g_seed,
            g_case, wrank, g_batch_desc, method, buf);
    fail_line(&s);
}

/* what the polling loop still waits for, for the hang report */
static const slot_t *pt_sl;
static const int *pt_done, *pt_active;
static int pt_n;
static const op_t *pt_ops;

static void poll_tick(double *t0, double *last, rng_t *S, int poll_sleep, const char *method)
{
    double tn = now();
    if (tn - *last > 3.0) *t0 += tn - *last; /* we were not scheduled: not the request's fault */
    *last = tn;
    if (tn - *t0 > g_timeout) {
        str_t w = {0};
        sappend(&w, "%s polling loop, batch [%s], not completed:", method, g_batch_desc);
        for (int i = 0; i < pt_n; i++)
            if (pt_active[i] && !pt_done[i])
                sappend(&w, " slot %d (%s)", i,
                        pt_sl[i].kind == S_COLL ? coll_name[pt_ops[pt_sl[i].op].coll]
                        : pt_sl[i].kind == S_NSEND ? "native MPI_Isend to self"
                                                   : "native MPI_Irecv from self");
        hang_exit(w.s, tn - *t0);
    }
    if (poll_sleep && chance(S, 20)) sleep_us(rint_(S, 0, 50));
}

static void complete(int method, int use_st, int poll_sleep, rng_t *S, MPI_Request *rq,
                     const slot_t *sl, int n, MPI_Status *st, int *have_st, const op_t *ops)
{
    pt_ops = ops;
    const char *mn = meth_name[method];
    int active[MAXSLOTS], done[MAXSLOTS], idx[MAXSLOTS], nact = 0, ndone = 0, rc;
    MPI_Status tmp[MAXSLOTS], s1;
    for (int i = 0; i < n; i++) {
        active[i] = rq[i] != MPI_REQUEST_NULL;
        if (active[i] != (sl[i].kind != S_NULL)) internal("slot %d active mismatch", i);
        done[i] = 0;
        have_st[i] = 0;
        nact += active[i];
    }
    double t0 = now(), tlast = t0;
    pt_sl = sl; pt_done = done; pt_active = active; pt_n = n;
    activity("%s on batch [%s] case %s", mn, g_batch_desc, g_case);
#define MARK(x, stp)                                                                      \
    do {                                                                                  \
        int x_ = (x);                                                                     \
        if (x_ < 0 || x_ >= n || !active[x_] || done[x_]) {                               \
            cfail(mn, "returned index %d, not an active request (%d slots)", x_, n);      \
        } else {                                                                          \
            done[x_] = 1;                                                                 \
            ndone++;                                                                      \
            if (use_st) { st[x_] = *(stp); have_st[x_] = 1; }                             \
            if (rq[x_] != MPI_REQUEST_NULL)                                               \
                cfail(mn, "completed request %d is not set to MPI_REQUEST_NULL", x_);      \
        }                                                                                 \
    } while (0)
    switch (method) {
    case M_WAIT: {
        int perm[MAXSLOTS];
        for (int i = 0; i < n; i++) perm[i] = i;
        shuffle(S, perm, n);
        for (int t = 0; t < n; t++) {
            int i = perm[t];
            rc = MPI_Wait(&rq[i], use_st ? &s1 : MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS) cfail(mn, "returned %d", rc);
            if (active[i]) MARK(i, &s1);
        }
        break;
    }
    case M_WAITALL:
        rc = MPI_Waitall(n, rq, use_st ? st : MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) cfail(mn, "returned %d", rc);
        for (int i = 0; i < n; i++)
            if (active[i]) { done[i] = 1; ndone++; have_st[i] = use_st; }
        break;
    case M_WAITANY: {
        int it, fin = 0;
        for (it = 0; it <= n + 1 && !fin; it++) {
            int x = -5;
            rc = MPI_Waitany(n, rq, &x, use_st ? &s1 : MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS) cfail(mn, "returned %d", rc);
            if (x == MPI_UNDEFINED) {
                fin = 1;
                if (ndone != nact)
                    cfail(mn, "returned MPI_UNDEFINED with %d of %d requests not completed",
                          nact - ndone, nact);
            } else {
                MARK(x, &s1);
            }
        }
        if (!fin) cfail(mn, "did not return MPI_UNDEFINED after all requests completed");
        break;
    }
    case M_WAITSOME: {
        int it, fin = 0;
        for (it = 0; it <= n + 1 && !fin; it++) {
            int oc = -5;
            rc = MPI_Waitsome(n, rq, &oc, idx, use_st ? tmp : MPI_STATUSES_IGNORE);
            if (rc != MPI_SUCCESS) cfail(mn, "returned %d", rc);
            if (oc == MPI_UNDEFINED) {
                fin = 1;
                if (ndone != nact)
                    cfail(mn, "returned MPI_UNDEFINED with %d of %d requests not completed",
                          nact - ndone, nact);
            } else if (oc < 1 || oc > n) {
                cfail(mn, "returned outcount %d", oc);
                break;
            } else {
                for (int q = 0; q < oc; q++) MARK(idx[q], &tmp[q]);
            }
        }
        if (!fin) cfail(mn, "did not return MPI_UNDEFINED after all requests completed");
        break;
    }
    case M_TEST:
        while (ndone < nact) {
            for (int i = 0; i < n; i++) {
                int f = 0;
                if (!active[i]) {
                    if (chance(S, 10)) {
                        MPI_Test(&rq[i], &f, MPI_STATUS_IGNORE);
                        if (!f) cfail(mn, "flag=false on MPI_REQUEST_NULL (slot %d)", i);
                    }
                    continue;
                }
                if (done[i]) continue;
                rc = MPI_Test(&rq[i], &f, use_st ? &s1 : MPI_STATUS_IGNORE);
                if (rc != MPI_SUCCESS) cfail(mn, "returned %d", rc);
                if (f) MARK(i, &s1);
            }
            if (ndone < nact) poll_tick(&t0, &tlast, S, poll_sleep, mn);
        }
        break;
    case M_TESTALL: {
        int warned = 0;
        for (;;) {
            MPI_Request snap[MAXSLOTS];
            memcpy(snap, rq, sizeof(MPI_Request) * (size_t)n);
            int f = 0;
            rc = MPI_Testall(n, rq, &f, use_st ? st : MPI_STATUSES_IGNORE);
            if (rc != MPI_SUCCESS) cfail(mn, "returned %d", rc);
            if (f) {
                for (int i = 0; i < n; i++)
                    if (active[i]) { done[i] = 1; ndone++; have_st[i] = use_st; }
                break;
            }
            if (!warned && memcmp(snap, rq, sizeof(MPI_Request) * (size_t)n)) {
                warned = 1;
                cfail(mn, "returned flag=false but modified the request array");
            }
            poll_tick(&t0, &tlast, S, poll_sleep, mn);
        }
        break;
    }
    case M_TESTANY: {
        int warned = 0;
        for (long it = 0;; it++) {
            int x = -5, f = -5;
            rc = MPI_Testany(n, rq, &x, &f, use_st ? &s1 : MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS) cfail(mn, "returned %d", rc);
            if (f && x == MPI_UNDEFINED) {
                if (ndone != nact)
                    cfail(mn, "returned flag=true index=MPI_UNDEFINED with %d of %d requests "
                              "not completed", nact - ndone, nact);
                break;
            }
            if (f) {
                MARK(x, &s1);
                continue;
            }
            if (x != MPI_UNDEFINED && !warned) {
                warned = 1;
                cfail(mn, "returned flag=false with index %d (must be MPI_UNDEFINED)", x);
            }
            if (ndone == nact && !warned) {
                warned = 1;
                cfail(mn, "returned flag=false with no active request left");
            }
            poll_tick(&t0, &tlast, S, poll_sleep, mn);
        }
        break;
    }
    case M_TESTSOME:
        for (;;) {
            int oc = -5;
            rc = MPI_Testsome(n, rq, &oc, idx, use_st ? tmp : MPI_STATUSES_IGNORE);
            if (rc != MPI_SUCCESS) cfail(mn, "returned %d", rc);
            if (oc == MPI_UNDEFINED) {
                if (ndone != nact)
                    cfail(mn, "returned MPI_UNDEFINED with %d of %d requests not completed",
                          nact - ndone, nact);
                break;
            }
            if (oc < 0 || oc > n) { cfail(mn, "returned outcount %d", oc); break; }
            for (int q = 0; q < oc; q++) MARK(idx[q], &tmp[q]);
            if (oc == 0) poll_tick(&t0, &tlast, S, poll_sleep, mn);
        }
        break;
    case M_GETSTATUS:
        for (int i = 0; i < n; i++) {
            int f = 0;
            if (!active[i]) {
                MPI_Request_get_status(rq[i], &f, MPI_STATUS_IGNORE);
                if (!f) cfail(mn, "flag=false on MPI_REQUEST_NULL (slot %d)", i);
                continue;
            }
            for (;;) {
                rc = MPI_Request_get_status(rq[i], &f, MPI_STATUS_IGNORE);
                if (rc != MPI_SUCCESS) cfail(mn, "returned %d", rc);
                if (f) break;
                poll_tick(&t0, &tlast, S, poll_sleep, mn);
            }
            if (rq[i] == MPI_REQUEST_NULL) {
                cfail(mn, "freed request %d (it must not)", i);
                done[i] = 1;
                ndone++;
                continue;
            }
            rc = MPI_Wait(&rq[i], use_st ? &s1 : MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS) cfail(mn, "MPI_Wait after it returned %d", rc);
            MARK(i, &s1);
        }
        break;
    }
#undef MARK
    if (ndone != nact) cfail(mn, "%d of %d requests completed", ndone, nact);
    for (int i = 0; i < n; i++)
        if (rq[i] != MPI_REQUEST_NULL) {
            cfail(mn, "request %d (%s) is not MPI_REQUEST_NULL after completion", i,
                  sl[i].kind == S_COLL ? "collective" : "native");
            if (!done[i]) MPI_Wait(&rq[i], MPI_STATUS_IGNORE);
        }
}

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
                        "[--timeout SEC] [--verbose]\n");
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
        for (long k = 0; k < g_ncases; k++) run_case(k, 0);
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
