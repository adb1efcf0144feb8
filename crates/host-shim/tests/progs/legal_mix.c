/* The four symptoms of legal MPI programs that once went wrong under the shim, one per mode,
 * each checked against PMPI_* (never intercepted) on the same inputs.
 *
 * Usage: legal_mix MODE [ROUNDS], MODE one of
 *   offsets  MPI_Bcast and MPI_Alltoall with single-block derived types whose data do not
 *            start at the buffer address (hindexed of one block at byte 8, a subarray picking
 *            one element, a struct with one displaced block, hvector of one block, a resized
 *            int with a negative lower bound), on every rank alike; every byte of each buffer
 *            (before, between and after the data) is compared.
 *   mixed    One message described differently by different ranks (same type signature): the
 *            root broadcasts 4 contiguous MPI_INT, the others receive one
 *            MPI_Type_vector(4,1,2,MPI_INT); an alltoallv where odd ranks use a vector type;
 *            an allgather where only some ranks use MPI_IN_PLACE (Open MPI accepts it); a
 *            struct listed out of address order against plain ints.
 *   early    The root of a 1-int MPI_Bcast (the last rank) returns, checks, prints and calls
 *            MPI_Finalize at once while ranks 0 and 1 enter the broadcast 200 ms late.
 *   many     Even ranks post 1100 MPI_Ialltoallv on communicator A then 1100 on B, odd ranks
 *            the reverse, then wait for all of them.
 * Every rank prints "legal_mix MODE: rank R ok (E eligible calls)" or "legal_mix MODE: rank R:
 * F failures" (exit 1). E counts the intercepted calls it made (each one offloaded under the
 * shim). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int rank, size, failures, eligible;
static const char *mode;

#define CHECK(cond, ...)                                                              \
    do {                                                                              \
        if (!(cond)) {                                                                \
            failures++;                                                               \
            if (failures < 10) {                                                      \
                fprintf(stderr, "legal_mix %s: rank %d: line %d: ", mode, rank, __LINE__); \
                fprintf(stderr, __VA_ARGS__);                                         \
                fprintf(stderr, "\n");                                                \
            }                                                                         \
        }                                                                             \
    } while (0)

static void fill(unsigned char *b, size_t n, int salt) {
    for (size_t i = 0; i < n; i++) b[i] = (unsigned char)(i * 37 + salt * 101 + 7);
}

static void same(const unsigned char *got, const unsigned char *want, size_t n, const char *what) {
    for (size_t i = 0; i < n; i++) {
        if (got[i] != want[i]) {
            CHECK(0, "%s: byte %zu is %d, native gives %d", what, i, got[i], want[i]);
            return;
        }
    }
}

/* The single-block derived types of mode "offsets", each holding one int. */
enum { NTYPES = 5 };
static MPI_Datatype offset_types[NTYPES];
static const char *offset_names[NTYPES] = {"hindexed@8", "subarray[2] of 4", "struct@12",
                                           "hvector(1)", "resized lb -4"};
static void make_offset_types(void) {
    int one = 1;
    MPI_Aint d8 = 8, d12 = 12;
    MPI_Type_create_hindexed(1, &one, &d8, MPI_INT, &offset_types[0]);
    int sizes[1] = {4}, sub[1] = {1}, start[1] = {2};
    MPI_Type_create_subarray(1, sizes, sub, start, MPI_ORDER_C, MPI_INT, &offset_types[1]);
    MPI_Datatype t = MPI_INT;
    MPI_Type_create_struct(1, &one, &d12, &t, &offset_types[2]);
    MPI_Type_create_hvector(1, 1, 64, MPI_INT, &offset_types[3]);
    MPI_Type_create_resized(MPI_INT, -4, 8, &offset_types[4]);
    for (int i = 0; i < NTYPES; i++) MPI_Type_commit(&offset_types[i]);
}

/* Room for `count` elements of `t` starting `pad` bytes into a buffer (the type may reach
 * before its buffer address: the buffer pointer is `pad` bytes in). */
static size_t span(MPI_Datatype t, int count) {
    MPI_Aint lb, ext, tlb, text;
    MPI_Type_get_extent(t, &lb, &ext);
    MPI_Type_get_true_extent(t, &tlb, &text);
    return (size_t)(count > 0 ? (count - 1) * ext : 0) + (size_t)(tlb + text) + 64;
}

static void offsets(void) {
    enum { PAD = 64 };
    for (int k = 0; k < NTYPES; k++) {
        MPI_Datatype t = offset_types[k];
        for (int count = 1; count <= 3; count += 2) {
            size_t blk = span(t, count), n = PAD + blk * size;
            unsigned char *sa = malloc(n), *ra = malloc(n), *rb = malloc(n);
            fill(sa, n, rank + 3);
            fill(ra, n, 9);
            memcpy(rb, ra, n);
            /* Resized to its span so that block p starts at p * span. */
            MPI_Datatype blocks;
            MPI_Type_contiguous(count, t, &blocks);
            MPI_Datatype wide;
            MPI_Type_create_resized(blocks, 0, (MPI_Aint)blk, &wide);
            MPI_Type_commit(&wide);
            PMPI_Alltoall(sa + PAD, 1, wide, ra + PAD, 1, wide, MPI_COMM_WORLD);
            eligible++;
            CHECK(MPI_Alltoall(sa + PAD, 1, wide, rb + PAD, 1, wide, MPI_COMM_WORLD) == MPI_SUCCESS,
                  "alltoall");
            char what[96];
            snprintf(what, sizeof what, "alltoall %s x%d", offset_names[k], count);
            same(rb, ra, n, what);
            MPI_Type_free(&wide);
            MPI_Type_free(&blocks);
            free(sa);
            free(ra);
            free(rb);
            /* Broadcasts from every root back to back, with the native results taken first:
             * between offloaded calls nothing synchronises the ranks. */
            n = PAD + span(t, count);
            unsigned char *a = malloc(n * size), *b = malloc(n * size);
            for (int root = 0; root < size; root++) {
                fill(a + root * n, n, rank == root ? 1 + root : 2);
                PMPI_Bcast(a + root * n + PAD, count, t, root, MPI_COMM_WORLD);
            }
            for (int root = 0; root < size; root++) {
                fill(b + root * n, n, rank == root ? 1 + root : 2);
                eligible++;
                CHECK(MPI_Bcast(b + root * n + PAD, count, t, root, MPI_COMM_WORLD) == MPI_SUCCESS,
                      "bcast");
            }
            for (int root = 0; root < size; root++) {
                char what[96];
                snprintf(what, sizeof what, "bcast %s x%d root %d", offset_names[k], count, root);
                same(b + root * n, a + root * n, n, what);
            }
            free(a);
            free(b);
        }
    }
    /* The end: five broadcasts of the first type from rank 0, back to back, the upper half of
     * the ranks entering them 100 ms late: the root's node (block placement) finishes and
     * finalizes while the other node's ranks are still in them. */
    enum { TAIL = 5 };
    size_t n = PAD + span(offset_types[0], 1);
    unsigned char *a = malloc(n * TAIL), *b = malloc(n * TAIL);
    for (int i = 0; i < TAIL; i++) {
        fill(a + i * n, n, rank == 0 ? 50 + i : 3);
        memcpy(b + i * n, a + i * n, n);
        PMPI_Bcast(a + i * n + PAD, 1, offset_types[0], 0, MPI_COMM_WORLD);
    }
    if (rank >= size / 2) usleep(100000);
    for (int i = 0; i < TAIL; i++, eligible++)
        CHECK(MPI_Bcast(b + i * n + PAD, 1, offset_types[0], 0, MPI_COMM_WORLD) == MPI_SUCCESS,
              "bcast");
    same(b, a, n * TAIL, "back-to-back bcasts of hindexed@8");
    free(a);
    free(b);
}

static void mixed(void) {
    MPI_Datatype vec, vec2, swapped;
    MPI_Type_vector(4, 1, 2, MPI_INT, &vec);
    MPI_Type_commit(&vec);
    MPI_Type_vector(2, 1, 2, MPI_INT, &vec2);
    MPI_Type_commit(&vec2);
    /* Two ints listed high address first: 8 bytes without a gap, but not in memory order. */
    int bl[2] = {1, 1};
    MPI_Aint dl[2] = {4, 0};
    MPI_Datatype tl[2] = {MPI_INT, MPI_INT};
    MPI_Type_create_struct(2, bl, dl, tl, &swapped);
    MPI_Type_commit(&swapped);

    for (int root = 0; root < size; root++) {
        int a[8], b[8];
        for (int i = 0; i < 8; i++) a[i] = b[i] = rank == root ? 10 + i : -1;
        if (rank == root) {
            PMPI_Bcast(a, 4, MPI_INT, root, MPI_COMM_WORLD);
            eligible++;
            CHECK(MPI_Bcast(b, 4, MPI_INT, root, MPI_COMM_WORLD) == MPI_SUCCESS, "bcast");
        } else {
            PMPI_Bcast(a, 1, vec, root, MPI_COMM_WORLD);
            eligible++;
            CHECK(MPI_Bcast(b, 1, vec, root, MPI_COMM_WORLD) == MPI_SUCCESS, "bcast");
        }
        same((unsigned char *)b, (unsigned char *)a, sizeof a, "bcast contiguous against vector");
        /* The struct listed out of order against plain ints. */
        for (int i = 0; i < 8; i++) a[i] = b[i] = rank == root ? 20 + i : -1;
        MPI_Datatype t = rank % 2 ? swapped : MPI_INT;
        int count = rank % 2 ? 1 : 2;
        PMPI_Bcast(a, count, t, root, MPI_COMM_WORLD);
        eligible++;
        CHECK(MPI_Bcast(b, count, t, root, MPI_COMM_WORLD) == MPI_SUCCESS, "bcast");
        same((unsigned char *)b, (unsigned char *)a, sizeof a, "bcast struct out of order");
    }

    /* Alltoallv: 2 ints to every peer; odd ranks describe each block as one vec2. */
    int *sc = malloc(size * sizeof(int)), *sd = malloc(size * sizeof(int));
    int *sa = malloc(4 * size * sizeof(int)), *ra = malloc(4 * size * sizeof(int));
    int *rb = malloc(4 * size * sizeof(int));
    int odd = rank % 2;
    /* Even ranks: 2 ints per peer, blocks in reverse peer order. Odd ranks: one vec2 resized
     * to 4 ints per peer (ints 0 and 2 of each 4-int slot), block p in slot p. */
    for (int p = 0; p < size; p++) {
        sc[p] = odd ? 1 : 2;
        sd[p] = odd ? p : 2 * (size - 1 - p);
    }
    if (odd) {
        MPI_Datatype v4;
        MPI_Type_create_resized(vec2, 0, 4 * sizeof(int), &v4);
        MPI_Type_commit(&v4);
        for (int i = 0; i < 4 * size; i++) { sa[i] = rank * 100 + i; ra[i] = rb[i] = -1; }
        PMPI_Alltoallv(sa, sc, sd, v4, ra, sc, sd, v4, MPI_COMM_WORLD);
        eligible++;
        CHECK(MPI_Alltoallv(sa, sc, sd, v4, rb, sc, sd, v4, MPI_COMM_WORLD) == MPI_SUCCESS, "alltoallv");
        MPI_Type_free(&v4);
    } else {
        for (int i = 0; i < 4 * size; i++) { sa[i] = rank * 100 + i; ra[i] = rb[i] = -1; }
        PMPI_Alltoallv(sa, sc, sd, MPI_INT, ra, sc, sd, MPI_INT, MPI_COMM_WORLD);
        eligible++;
        CHECK(MPI_Alltoallv(sa, sc, sd, MPI_INT, rb, sc, sd, MPI_INT, MPI_COMM_WORLD) == MPI_SUCCESS,
              "alltoallv");
    }
    same((unsigned char *)rb, (unsigned char *)ra, 4 * size * sizeof(int), "alltoallv int against vector");
    free(sc);
    free(sd);
    free(sa);
    free(ra);
    free(rb);

    /* Allgather with MPI_IN_PLACE on even ranks only. */
    int *ga = malloc(3 * size * sizeof(int)), *gb = malloc(3 * size * sizeof(int));
    int mine[3] = {rank, rank * 7, -rank};
    for (int i = 0; i < 3 * size; i++) ga[i] = gb[i] = -5;
    memcpy(ga + 3 * rank, mine, sizeof mine);
    memcpy(gb + 3 * rank, mine, sizeof mine);
    const void *s = rank % 2 ? (const void *)mine : MPI_IN_PLACE;
    PMPI_Allgather(s, 3, MPI_INT, ga, 3, MPI_INT, MPI_COMM_WORLD);
    eligible++;
    CHECK(MPI_Allgather(s, 3, MPI_INT, gb, 3, MPI_INT, MPI_COMM_WORLD) == MPI_SUCCESS, "allgather");
    same((unsigned char *)gb, (unsigned char *)ga, 3 * size * sizeof(int), "allgather in place on some ranks");
    free(ga);
    free(gb);
    MPI_Type_free(&vec);
    MPI_Type_free(&vec2);
    MPI_Type_free(&swapped);
}

static void early(void) {
    int root = size - 1, x = rank == root ? 42 : 0;
    if (rank < 2 && rank != root) usleep(200000);
    eligible++;
    CHECK(MPI_Bcast(&x, 1, MPI_INT, root, MPI_COMM_WORLD) == MPI_SUCCESS, "bcast");
    CHECK(x == 42, "got %d", x);
}

static void many(void) {
    enum { N = 1100 };
    MPI_Comm a, b;
    MPI_Comm_dup(MPI_COMM_WORLD, &a);
    MPI_Comm_dup(MPI_COMM_WORLD, &b);
    int *c = malloc(size * sizeof(int)), *d = malloc(size * sizeof(int));
    for (int i = 0; i < size; i++) { c[i] = 1; d[i] = i; }
    int *sb = malloc(size * sizeof(int)), *rb = malloc((size_t)2 * N * size * sizeof(int));
    for (int i = 0; i < size; i++) sb[i] = rank * 100 + i;
    for (int i = 0; i < 2 * N * size; i++) rb[i] = -1;
    MPI_Request *q = malloc(2 * N * sizeof(MPI_Request));
    MPI_Comm first = rank % 2 ? b : a, second = rank % 2 ? a : b;
    for (int i = 0; i < N; i++, eligible++)
        MPI_Ialltoallv(sb, c, d, MPI_INT, rb + (size_t)i * size, c, d, MPI_INT, first, &q[i]);
    for (int i = 0; i < N; i++, eligible++)
        MPI_Ialltoallv(sb, c, d, MPI_INT, rb + (size_t)(N + i) * size, c, d, MPI_INT, second, &q[N + i]);
    CHECK(MPI_Waitall(2 * N, q, MPI_STATUSES_IGNORE) == MPI_SUCCESS, "waitall");
    for (int k = 0; k < 2 * N; k++)
        for (int i = 0; i < size; i++)
            if (rb[(size_t)k * size + i] != i * 100 + rank) {
                CHECK(0, "collective %d from %d: %d", k, i, rb[(size_t)k * size + i]);
                k = 2 * N;
                break;
            }
    free(c);
    free(d);
    free(sb);
    free(rb);
    free(q);
    MPI_Comm_free(&a);
    MPI_Comm_free(&b);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    mode = argc > 1 ? argv[1] : "";
    int rounds = argc > 2 ? atoi(argv[2]) : 1;
    make_offset_types();
    for (int r = 0; r < rounds; r++) {
        if (!strcmp(mode, "offsets")) offsets();
        else if (!strcmp(mode, "mixed")) mixed();
        else if (!strcmp(mode, "early")) early();
        else if (!strcmp(mode, "many")) many();
        else {
            if (rank == 0) fprintf(stderr, "usage: legal_mix offsets|mixed|early|many [ROUNDS]\n");
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    /* No barrier: a rank whose part is done leaves at once. */
    if (failures) printf("legal_mix %s: rank %d: %d failures\n", mode, rank, failures);
    else printf("legal_mix %s: rank %d ok (%d eligible calls)\n", mode, rank, eligible);
    fflush(stdout);
    for (int i = 0; i < NTYPES; i++) MPI_Type_free(&offset_types[i]);
    MPI_Finalize();
    return failures ? 1 : 0;
}
