/* Checks allreduce results, natively or with libhost_shim.so preloaded: every MPI_Allreduce /
 * MPI_Iallreduce is compared with PMPI_Allreduce (never intercepted) on the same inputs.
 *
 * Usage: allreduce_check [ROUNDS [SEED]]. Each round, on MPI_COMM_WORLD and on a split
 * sub-communicator (even and odd world ranks), picks one predefined type and operation (the
 * same on every rank, from SEED and the round), a count (0, 1, a few, or up to 3000 elements:
 * sizes that are multiples of nothing in particular), and a mode: blocking, MPI_IN_PLACE
 * blocking, MPI_Iallreduce (two outstanding, completed by MPI_Waitall in reverse order) or
 * MPI_Iallreduce with MPI_IN_PLACE. The offloaded combinations (the predefined ops on the
 * predefined integer and floating-point types, arithmetic and min/max only on floating point)
 * are eligible; MPI_BYTE with a bitwise op is also run and must still be right (natively, not
 * counted as eligible). At the end, two large ones (4 MiB of MPI_INT on the world, 3 MiB of
 * MPI_DOUBLE in place on the half): many chunks of the SPs' pipeline.
 *
 * Integer results must be byte for byte those of PMPI_Allreduce, and PMPI's those of MPI's
 * definition computed here in C from every rank's contribution (PMPI_Allgather), except
 * unsigned MIN/MAX where some MPI versions compare as signed (noted on stderr): there the
 * result must be the definition's. Floating-point MIN/MAX must equal PMPI's bytes too;
 * SUM within 2 (n-1) eps sum|x_i| per element (each of the two results is within (n-1) eps
 * sum|x_i| of the exact sum, whatever the order of its n-1 additions), PROD within
 * 2 (n-1) eps |result| (inputs in [0.5, 2], no overflow). Every rank's result must be the same
 * bytes as rank 0's (one result is broadcast). The receive buffer has a guard after the data.
 * Prints "allreduce_check: all ok (N checks on rank 0, S ranks, E eligible calls per rank)"
 * (E counts the calls the shim offloads, the verdict's own allreduce included). */
#include <float.h>
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define GUARD 0xE7
#define MAX_BYTES (1 << 30)

static uint64_t shared, own;
/* SPOFF_ALLREDUCE_DESIGN asks for the SP tree: the eligible calls are offloaded. */
static int sp_design;
static uint32_t next(uint64_t *s) {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return (uint32_t)((*s * 0x2545F4914F6CDD1DULL) >> 32);
}
static int pick(int n) { return (int)(next(&shared) % (uint32_t)n); }

enum { K_SIGNED, K_UNSIGNED, K_FLOAT, K_BYTE };
struct type {
    const char *name;
    MPI_Datatype t;
    int kind;
};
static struct type types[24];
static int ntypes;

struct opdef {
    const char *name;
    MPI_Op op;
    int arith; /* defined on floating point */
};
static struct opdef ops[10];

static void setup(void) {
    struct type t[] = {
        {"signed char", MPI_SIGNED_CHAR, K_SIGNED},
        {"unsigned char", MPI_UNSIGNED_CHAR, K_UNSIGNED},
        {"short", MPI_SHORT, K_SIGNED},
        {"unsigned short", MPI_UNSIGNED_SHORT, K_UNSIGNED},
        {"int", MPI_INT, K_SIGNED},
        {"unsigned", MPI_UNSIGNED, K_UNSIGNED},
        {"long", MPI_LONG, K_SIGNED},
        {"unsigned long", MPI_UNSIGNED_LONG, K_UNSIGNED},
        {"long long", MPI_LONG_LONG, K_SIGNED},
        {"unsigned long long", MPI_UNSIGNED_LONG_LONG, K_UNSIGNED},
        {"int8_t", MPI_INT8_T, K_SIGNED},
        {"int16_t", MPI_INT16_T, K_SIGNED},
        {"int32_t", MPI_INT32_T, K_SIGNED},
        {"int64_t", MPI_INT64_T, K_SIGNED},
        {"uint8_t", MPI_UINT8_T, K_UNSIGNED},
        {"uint16_t", MPI_UINT16_T, K_UNSIGNED},
        {"uint32_t", MPI_UINT32_T, K_UNSIGNED},
        {"uint64_t", MPI_UINT64_T, K_UNSIGNED},
        {"float", MPI_FLOAT, K_FLOAT},
        {"double", MPI_DOUBLE, K_FLOAT},
    };
    ntypes = (int)(sizeof t / sizeof t[0]);
    memcpy(types, t, sizeof t);
    struct opdef o[] = {
        {"sum", MPI_SUM, 1},   {"prod", MPI_PROD, 1}, {"min", MPI_MIN, 1},   {"max", MPI_MAX, 1},
        {"land", MPI_LAND, 0}, {"lor", MPI_LOR, 0},   {"lxor", MPI_LXOR, 0}, {"band", MPI_BAND, 0},
        {"bor", MPI_BOR, 0},   {"bxor", MPI_BXOR, 0},
    };
    memcpy(ops, o, sizeof o);
}

/* Fills `n` elements of `tp` for operation `op` (own random values). */
static void fill(void *buf, const struct type *tp, const struct opdef *op, int n, int small) {
    int size;
    MPI_Type_size(tp->t, &size);
    unsigned char *b = buf;
    for (int i = 0; i < n; i++) {
        if (tp->kind == K_FLOAT) {
            double v;
            if (op->op == MPI_PROD) v = 0.5 + (double)(next(&own) % 1537) / 1024.0;
            else v = ((double)(next(&own) % 2000001) - 1e6) / 1024.0;
            if (size == 4) {
                float f = (float)v;
                memcpy(b + (size_t)i * 4, &f, 4);
            } else memcpy(b + (size_t)i * 8, &v, 8);
        } else {
            uint64_t v = ((uint64_t)next(&own) << 32) | next(&own);
            /* Logical operations see zeros and non-zeros. */
            if (!op->arith && next(&own) % 3 == 0) v = 0;
            /* No overflow anywhere: -1, 0 or 1 (PMPI then follows the definition). */
            if (small) v = (uint64_t)((int64_t)(next(&own) % 3) - 1);
            memcpy(b + (size_t)i * size, &v, (size_t)size);
        }
    }
}

#define RED(T, UT)                                                                     \
    do {                                                                               \
        T *a = (T *)acc;                                                               \
        const T *b = (const T *)x;                                                     \
        for (int i = 0; i < n; i++) {                                                  \
            T l = a[i], r = b[i], v;                                                   \
            if (op == MPI_SUM) v = (T)((UT)l + (UT)r);                                 \
            else if (op == MPI_PROD) v = (T)((UT)l * (UT)r);                           \
            else if (op == MPI_MIN) v = r < l ? r : l;                                 \
            else if (op == MPI_MAX) v = r > l ? r : l;                                 \
            else if (op == MPI_LAND) v = (T)(l && r);                                  \
            else if (op == MPI_LOR) v = (T)(l || r);                                   \
            else if (op == MPI_LXOR) v = (T)(!l != !r);                                \
            else if (op == MPI_BAND) v = l & r;                                        \
            else if (op == MPI_BOR) v = l | r;                                         \
            else v = l ^ r;                                                            \
            a[i] = v;                                                                  \
        }                                                                              \
    } while (0)

/* acc = acc op x on `n` integers of `kind` and `size` bytes: MPI's definition, in C. */
static void reduce_ref(void *acc, const void *x, int kind, int size, MPI_Op op, int n) {
    if (kind == K_SIGNED) switch (size) {
        case 1: RED(int8_t, uint8_t); break;
        case 2: RED(int16_t, uint16_t); break;
        case 4: RED(int32_t, uint32_t); break;
        default: RED(int64_t, uint64_t); break;
        }
    else switch (size) {
        case 1: RED(uint8_t, uint8_t); break;
        case 2: RED(uint16_t, uint16_t); break;
        case 4: RED(uint32_t, uint32_t); break;
        default: RED(uint64_t, uint64_t); break;
        }
}

struct call {
    int ti, oi, count, in_place, size, n, small;
    size_t bytes;
    unsigned char *send, *recv, *ref;
    MPI_Request req;
};

static void prepare(struct call *c, MPI_Comm comm) {
    const struct type *tp = &types[c->ti];
    MPI_Type_size(tp->t, &c->size);
    MPI_Comm_size(comm, &c->n);
    c->bytes = (size_t)c->count * (size_t)c->size;
    c->send = malloc(c->bytes + 1);
    c->recv = malloc(c->bytes + 1);
    c->ref = malloc(c->bytes + 1);
    fill(c->send, tp, &ops[c->oi], c->count, c->small);
    memset(c->recv, 0x11, c->bytes);
    c->recv[c->bytes] = GUARD;
    PMPI_Allreduce(c->send, c->ref, c->count, tp->t, ops[c->oi].op, comm);
    if (c->in_place) memcpy(c->recv, c->send, c->bytes);
}

static int offloaded(const struct call *c);

static void check(struct call *c, MPI_Comm comm, const char *mode) {
    const struct type *tp = &types[c->ti];
    const struct opdef *op = &ops[c->oi];
    CHECK(c->recv[c->bytes] == GUARD, "%s %s %s count %d: written past the data", mode, tp->name,
          op->name, c->count);
    if (tp->kind == K_FLOAT && (op->op == MPI_SUM || op->op == MPI_PROD)) {
        /* sum|x_i| per element, for the bound of a sum. */
        double *absx = malloc((size_t)c->count * sizeof(double) + 1);
        double *abssum = malloc((size_t)c->count * sizeof(double) + 1);
        for (int i = 0; i < c->count; i++) {
            double x;
            if (c->size == 4) {
                float f;
                memcpy(&f, c->send + (size_t)i * 4, 4);
                x = f;
            } else memcpy(&x, c->send + (size_t)i * 8, 8);
            absx[i] = fabs(x);
        }
        PMPI_Allreduce(absx, abssum, c->count, MPI_DOUBLE, MPI_SUM, comm);
        double eps = c->size == 4 ? FLT_EPSILON : DBL_EPSILON;
        int bad = 0;
        for (int i = 0; i < c->count && !bad; i++) {
            double got, want;
            if (c->size == 4) {
                float g, w;
                memcpy(&g, c->recv + (size_t)i * 4, 4);
                memcpy(&w, c->ref + (size_t)i * 4, 4);
                got = g;
                want = w;
            } else {
                memcpy(&got, c->recv + (size_t)i * 8, 8);
                memcpy(&want, c->ref + (size_t)i * 8, 8);
            }
            double scale = op->op == MPI_SUM ? abssum[i] : fabs(want) * 1.001;
            double bound = 2.0 * (c->n - 1) * eps * scale;
            if (!(fabs(got - want) <= bound)) {
                bad = 1;
                CHECK(0, "%s %s %s count %d: element %d is %.17g, PMPI says %.17g (bound %.3g)",
                      mode, tp->name, op->name, c->count, i, got, want, bound);
            }
        }
        if (!bad) checks++;
        free(absx);
        free(abssum);
    } else if (tp->kind == K_FLOAT) {
        CHECK(memcmp(c->recv, c->ref, c->bytes) == 0, "%s %s %s count %d: differs from PMPI",
              mode, tp->name, op->name, c->count);
    } else {
        /* The definition, in C, over every rank's contribution in rank order. */
        unsigned char *all = malloc((size_t)c->n * c->bytes + 1);
        unsigned char *cref = malloc(c->bytes + 1);
        PMPI_Allgather(c->send, (int)c->bytes, MPI_BYTE, all, (int)c->bytes, MPI_BYTE, comm);
        memcpy(cref, all, c->bytes);
        for (int r = 1; r < c->n; r++)
            reduce_ref(cref, all + (size_t)r * c->bytes, tp->kind, c->size, op->op, c->count);
        size_t at = 0;
        while (at < c->bytes && c->recv[at] == c->ref[at]) at++;
        int pmpi_right = memcmp(c->ref, cref, c->bytes) == 0;
        /* Where PMPI_Allreduce departs from MPI's definition in known ways, the offloaded
         * result must be the definition's and PMPI's is noted, not counted: Open MPI 4.1's
         * vectorized ops saturate 8- and 16-bit sums and products that overflow
         * (open-mpi/ompi#8045) and compare some unsigned types as signed in MIN/MAX (4.1.2 to
         * 4.1.4: open-mpi/ompi#10276, #10525; MPICH 4.0.2: pmodels/mpich#6083). Anywhere else
         * PMPI must agree with the definition (else the C reference here is wrong). A native
         * call is PMPI's own. */
        int known = (c->size <= 2 && (op->op == MPI_SUM || op->op == MPI_PROD)) ||
                    (tp->kind == K_UNSIGNED && (op->op == MPI_MIN || op->op == MPI_MAX));
        if (!pmpi_right && known && sp_design && offloaded(c)) {
            if (rank == 0)
                fprintf(stderr, "note: PMPI_Allreduce %s %s count %d departs from MPI's definition\n",
                        tp->name, op->name, c->count);
            CHECK(memcmp(c->recv, cref, c->bytes) == 0,
                  "%s %s %s count %d: differs from the definition", mode, tp->name, op->name,
                  c->count);
        } else if (!pmpi_right && known) {
            /* A call run natively is the MPI library's own; where its ops depart from the
             * definition, its blocking and nonblocking reductions depart differently (they
             * saturate different elements: Open MPI 4.1, an in-place 16-bit MPI_Iallreduce SUM
             * of 2361 elements on 4 ranks, seed 554980990, with and without the shim), so
             * neither PMPI_Allreduce's bytes nor the definition bind it. Noted, not counted. */
            if (rank == 0)
                fprintf(stderr, "note: %s %s %s count %d run natively where PMPI departs from "
                        "MPI's definition: not compared\n", mode, tp->name, op->name, c->count);
        } else {
            CHECK(pmpi_right || known, "%s %s %s count %d: PMPI differs from the C reference",
                  mode, tp->name, op->name, c->count);
            CHECK(at == c->bytes,
                  "%s %s %s count %d: differs from PMPI from byte %zu (0x%02x, PMPI 0x%02x)",
                  mode, tp->name, op->name, c->count, at, at < c->bytes ? c->recv[at] : 0,
                  at < c->bytes ? c->ref[at] : 0);
        }
        free(all);
        free(cref);
    }
    /* One result on every rank: rank 0's bytes. */
    unsigned char *root = malloc(c->bytes + 1);
    memcpy(root, c->recv, c->bytes);
    PMPI_Bcast(root, (int)c->bytes, MPI_BYTE, 0, comm);
    CHECK(memcmp(root, c->recv, c->bytes) == 0, "%s %s %s count %d: not rank 0's result", mode,
          tp->name, op->name, c->count);
    free(root);
    free(c->send);
    free(c->recv);
    free(c->ref);
}

static int offloaded(const struct call *c) {
    return types[c->ti].kind != K_BYTE && (types[c->ti].kind != K_FLOAT || ops[c->oi].arith) &&
           c->bytes <= MAX_BYTES;
}

static void pick_call(struct call *c) {
    memset(c, 0, sizeof *c);
    c->ti = pick(ntypes);
    c->oi = pick(10);
    c->small = pick(2);
    /* Logical and bitwise ops on floating point are not MPI: another type. */
    while (types[c->ti].kind == K_FLOAT && !ops[c->oi].arith) c->ti = pick(ntypes);
    switch (pick(4)) {
    case 0: c->count = 0; break;
    case 1: c->count = 1 + pick(7); break;
    default: c->count = 1 + pick(3000); break;
    }
}

static void round_on(MPI_Comm comm) {
    int mode = pick(4);
    int in_place = mode == 1 || mode == 3;
    if (mode <= 1) {
        struct call c;
        pick_call(&c);
        c.in_place = in_place;
        prepare(&c, comm);
        MPI_Allreduce(in_place ? MPI_IN_PLACE : c.send, c.recv, c.count, types[c.ti].t,
                      ops[c.oi].op, comm);
        eligible += offloaded(&c);
        check(&c, comm, in_place ? "in-place allreduce" : "allreduce");
        return;
    }
    struct call c[2];
    MPI_Request reqs[2];
    for (int i = 0; i < 2; i++) {
        pick_call(&c[i]);
        c[i].in_place = in_place;
        prepare(&c[i], comm);
    }
    for (int i = 0; i < 2; i++) {
        MPI_Iallreduce(in_place ? MPI_IN_PLACE : c[i].send, c[i].recv, c[i].count,
                       types[c[i].ti].t, ops[c[i].oi].op, comm, &reqs[i]);
        eligible += offloaded(&c[i]);
    }
    MPI_Wait(&reqs[1], MPI_STATUS_IGNORE);
    MPI_Wait(&reqs[0], MPI_STATUS_IGNORE);
    for (int i = 0; i < 2; i++)
        check(&c[i], comm, in_place ? "in-place iallreduce" : "iallreduce");
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    setup();
    const char *design = getenv("SPOFF_ALLREDUCE_DESIGN");
    sp_design = design && (!strcmp(design, "sp-tree") || !strcmp(design, "auto") || !strcmp(design, "canary"));
    int rounds = argc > 1 ? atoi(argv[1]) : 20;
    uint64_t seed = argc > 2 ? strtoull(argv[2], NULL, 10) : 1;
    own = (seed + 1) * 0x9E3779B97F4A7C15ULL + (uint64_t)rank * 0x632BE59BD9B4E019ULL + 1;
    MPI_Comm half;
    MPI_Comm_split(MPI_COMM_WORLD, rank % 2, size - rank, &half);
    for (int r = 0; r < rounds; r++) {
        /* The same choices on every rank, on both communicators. */
        shared = (seed + 1) * 0xD1B54A32D192ED03ULL + (uint64_t)r * 0x9E3779B97F4A7C15ULL + 7;
        round_on(MPI_COMM_WORLD);
        shared = (seed + 1) * 0xD1B54A32D192ED03ULL + (uint64_t)r * 0x9E3779B97F4A7C15ULL + 7;
        round_on(half);
    }
    /* Native ones: MPI_BYTE with a bitwise op, and a message above the offload bound. */
    {
        struct type byte = {"byte", MPI_BYTE, K_BYTE};
        types[ntypes] = byte;
        struct call c = {.ti = ntypes, .oi = 9, .count = 1000};
        prepare(&c, MPI_COMM_WORLD);
        MPI_Allreduce(c.send, c.recv, c.count, MPI_BYTE, MPI_BXOR, MPI_COMM_WORLD);
        eligible += offloaded(&c);
        check(&c, MPI_COMM_WORLD, "byte allreduce");
        /* 4 MiB and 12 bytes: many chunks through the SPs' pipeline. */
        struct call d = {.ti = 4, .oi = 0, .count = (4 << 20) / 4 + 3};
        prepare(&d, MPI_COMM_WORLD);
        MPI_Allreduce(d.send, d.recv, d.count, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        eligible += offloaded(&d);
        check(&d, MPI_COMM_WORLD, "large allreduce");
        struct call e = {.ti = 19, .oi = 0, .count = (3 << 20) / 8 + 1, .in_place = 1};
        prepare(&e, half);
        MPI_Iallreduce(MPI_IN_PLACE, e.recv, e.count, MPI_DOUBLE, MPI_SUM, half, &e.req);
        MPI_Wait(&e.req, MPI_STATUS_IGNORE);
        eligible += offloaded(&e);
        check(&e, half, "large in-place iallreduce");
    }
    MPI_Comm_free(&half);
    /* The verdict's own MPI_Allreduce (MPI_INT, MPI_SUM) is offloaded too. */
    eligible += sp_design;
    int rc = verdict("allreduce_check", "");
    MPI_Finalize();
    return rc;
}
