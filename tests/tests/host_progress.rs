//! A rank with an offloaded collective outstanding that waits in the Wait family for a native
//! request keeps its UCX progress going (the `ucx` grants over TCP, as from another machine):
//! on UCX 1.13 the SP's gets from its buffers complete only while it progresses. Rank 0 posts
//! `MPI_Ialltoall`, then waits for a message that rank 1 sends only once its own `MPI_Ialltoall`
//! completed, which needs the SP's reads of rank 0's send buffer. Before, the shim handed that
//! wait to `PMPI_Wait*`, which blocked rank 0's progress: the SP's reads stalled until its 10 s
//! transfer timeout failed the collective (`alltoallv_check` hit it in `make test` as
//! "memory access refused or failed" after a native `MPI_Wait`).

#[path = "../../crates/service-process/tests/tcp/mod.rs"]
mod tcp;

use integration_tests::*;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;
use tcp::TcpSps;

const PROG: &str = r#"
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define N 4096
int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int r, p;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_size(MPI_COMM_WORLD, &p);
    const char *how = argv[1];
    unsigned char *s = malloc((size_t)N * p), *d = malloc((size_t)N * p);
    for (int i = 0; i < N * p; i++) s[i] = (unsigned char)(r * 37 + i);
    memset(d, 0, (size_t)N * p);
    MPI_Request coll, msg[2];
    MPI_Ialltoall(s, N, MPI_BYTE, d, N, MPI_BYTE, MPI_COMM_WORLD, &coll);
    int token = 0;
    if (r == 0) {
        MPI_Irecv(&token, 1, MPI_INT, 1, 7, MPI_COMM_WORLD, &msg[0]);
        msg[1] = MPI_REQUEST_NULL;
        int idx, out, ids[2];
        if (!strcmp(how, "wait")) MPI_Wait(&msg[0], MPI_STATUS_IGNORE);
        else if (!strcmp(how, "waitall")) MPI_Waitall(2, msg, MPI_STATUSES_IGNORE);
        else if (!strcmp(how, "waitany")) MPI_Waitany(2, msg, &idx, MPI_STATUS_IGNORE);
        else MPI_Waitsome(2, msg, &out, ids, MPI_STATUSES_IGNORE);
        MPI_Wait(&coll, MPI_STATUS_IGNORE);
    } else {
        MPI_Wait(&coll, MPI_STATUS_IGNORE);
        if (r == 1) { token = 42; MPI_Send(&token, 1, MPI_INT, 0, 7, MPI_COMM_WORLD); }
    }
    int bad = 0;
    for (int src = 0; src < p; src++)
        for (int i = 0; i < N; i++)
            if (d[src * N + i] != (unsigned char)(src * 37 + r * N + i)) bad++;
    if (r == 0 && token != 42) bad++;
    printf("rank %d: %s: %s\n", r, how, bad ? "WRONG" : "ok");
    MPI_Finalize();
    return bad != 0;
}
"#;

fn program() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let src = dir.join("host_progress.c");
    let exe = dir.join(format!("host_progress-{}", std::process::id()));
    std::fs::write(&src, PROG).unwrap();
    let st = Command::new("mpicc")
        .arg("-O1")
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .status()
        .expect("mpicc runs");
    assert!(st.success(), "mpicc failed");
    exe
}

#[test]
fn a_native_wait_keeps_the_rank_progressing_for_its_offloaded_collective() {
    let exe = program();
    let mut sps = TcpSps::describe(&service_process(), 2, 1, 2);
    for sp in 0..2 {
        sps.start(sp, &["--ucx=on"]);
    }
    let ready = run(
        {
            let mut c = Command::new(service_process());
            c.args(["wait-ready", "--timeout-secs", "30", "--cluster"])
                .arg(&sps.cluster_path);
            c
        },
        Duration::from_secs(60),
    );
    ready.assert_ok("service-process wait-ready");
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    for how in ["wait", "waitall", "waitany", "waitsome"] {
        let cred = bootstrap::auth::JobCredential::issue_new(&sps.key, uid, 4).encode();
        let mut cmd = mpirun_offloaded(4, &sps.cluster_path, cred);
        cmd.env_remove("SPOFF_BACKEND")
            .env_remove("SPOFF_HOSTS_SAME_KERNEL")
            .env_remove("SPOFF_HOST_TRANSPORT")
            .arg(&exe)
            .arg(how);
        let job = run(cmd, Duration::from_secs(120));
        job.assert_ok(&format!("host_progress {how}"));
        assert_eq!(
            job.stdout.matches(&format!(": {how}: ok")).count(),
            4,
            "{how}: {}",
            job.stdout
        );
        // A stall would show as the SP's 10 s transfer timeout; a progressing rank takes
        // milliseconds (not a timing benchmark: the bound is far from both).
        assert!(
            job.elapsed < Duration::from_secs(8),
            "{how}: the job took {:?}: the SP waited for rank 0's progress",
            job.elapsed
        );
        eprintln!("{how}: ok in {:?}", job.elapsed);
    }
    let stats = sps.stop_and_stats();
    let posts: u64 = stats.iter().map(|s| s["posts"].as_u64().unwrap_or(0)).sum();
    assert!(
        posts >= 16,
        "the collectives were not offloaded: {posts} posts"
    );
}
