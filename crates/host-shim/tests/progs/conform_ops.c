/*
 * conform_ops.c: communicator layers, guarded buffers, and one collective operation: setup,
 * posting, the model and the checks.
 * Part of conform.c, which includes it (see its header); not compiled on its own.
 */

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
    o->big = !final && chance(&O, (int)g_big_pct);
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

