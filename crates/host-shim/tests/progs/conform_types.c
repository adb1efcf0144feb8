/*
 * conform_types.c: random datatypes (type maps cross-checked with MPI) and their draws.
 * Part of conform.c, which includes it (see its header); not compiled on its own.
 */

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

