/*
 * conform_util.c: strings, the hang watchdog, MPI error reporting, the PRNG (splitmix64) and
 * small arithmetic.
 * Part of conform.c, which includes it (see its header); not compiled on its own.
 */

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

