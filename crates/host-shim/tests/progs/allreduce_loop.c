/* allreduce_loop CALLS COUNT [SEED [LATE_MS]]: CALLS allreduces (MPI_SUM of COUNT int64 each,
 * alternately MPI_Allreduce and MPI_Iallreduce + MPI_Wait, every fourth in place) on
 * MPI_COMM_WORLD under MPI_ERRORS_RETURN, each checked against its closed form (element j of
 * rank r in call k is (r + 1) * (j + 1) + k * s, s from the seed, so the sum is known without
 * another collective); with LATE_MS, the last rank sleeps LATE_MS before every 50th call
 * (calls 1, 51, ...), arriving that late. For jobs whose network is broken on purpose: a call that returns an
 * error ends the loop on that rank, said with MPI's error string; a wrong value is said and
 * counted. Every rank prints one verdict line:
 *   allreduce_loop: rank R: ok CALLS calls
 *   allreduce_loop: rank R: call K failed: <error string> (after K ok calls)
 * and, on a wrong value, allreduce_loop: rank R: call K WRONG at element J.
 * Exit status: 0 all ok, 3 a call failed (no wrong value), 2 a wrong value. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    long calls = argc > 1 ? atol(argv[1]) : 100;
    int count = argc > 2 ? atoi(argv[2]) : 1024;
    int64_t s = argc > 3 ? (int64_t)(strtoull(argv[3], NULL, 10) % 1000003) + 1 : 1;
    long late_ms = argc > 4 ? atol(argv[4]) : 0;
    int64_t *send = malloc(sizeof(int64_t) * (size_t)(count + 1));
    int64_t *recv = malloc(sizeof(int64_t) * (size_t)(count + 1));
    int wrong = 0, failed = 0;
    long k;
    for (k = 0; k < calls && !failed; k++) {
        for (int j = 0; j < count; j++) send[j] = (int64_t)(rank + 1) * (j + 1) + k * s;
        if (late_ms > 0 && rank == size - 1 && k % 50 == 1) {
            struct timespec ts = {late_ms / 1000, (late_ms % 1000) * 1000000L};
            nanosleep(&ts, NULL);
        }
        int in_place = k % 4 == 3;
        if (in_place)
            for (int j = 0; j < count; j++) recv[j] = send[j];
        const void *sb = in_place ? MPI_IN_PLACE : (const void *)send;
        int rc;
        if (k % 2 == 0) {
            rc = MPI_Allreduce(sb, recv, count, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
        } else {
            MPI_Request req;
            rc = MPI_Iallreduce(sb, recv, count, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD, &req);
            if (rc == MPI_SUCCESS) rc = MPI_Wait(&req, MPI_STATUS_IGNORE);
        }
        if (rc != MPI_SUCCESS) {
            char msg[MPI_MAX_ERROR_STRING];
            int len = 0;
            MPI_Error_string(rc, msg, &len);
            printf("allreduce_loop: rank %d: call %ld failed: %s (after %ld ok calls)\n", rank, k,
                   msg, k);
            failed = 1;
            break;
        }
        int64_t tri = (int64_t)size * (size + 1) / 2;
        for (int j = 0; j < count; j++) {
            if (recv[j] != tri * (j + 1) + (int64_t)size * k * s) {
                printf("allreduce_loop: rank %d: call %ld WRONG at element %d\n", rank, k, j);
                wrong++;
                break;
            }
        }
    }
    if (!failed) printf("allreduce_loop: rank %d: ok %ld calls\n", rank, calls);
    fflush(stdout);
    free(send);
    free(recv);
    MPI_Finalize();
    return wrong ? 2 : failed ? 3 : 0;
}
