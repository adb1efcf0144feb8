/*
 * conform_complete.c: completing a batch of requests by a random method (Wait/Test families,
 * Request_get_status).
 * Part of conform.c, which includes it (see its header); not compiled on its own.
 */

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

