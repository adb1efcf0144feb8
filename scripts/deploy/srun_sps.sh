# SPs started by Slurm's srun, and stopped the ways a site stops them (issue 25): sourced by
# scripts/deploy-test.sh after slurm.sh; runs inside slurm_phase while Slurm is up.
#
# The SPs run on the host namespaces themselves (the slurmds are there): a cluster without DPUs,
# its description from `cluster init --dpu-map` naming each host's own address. Each SP finds
# its id from its host name and SLURM_LOCALID (`serve --sp-id auto`).
#
# Two stops:
#  - `scancel --signal=TERM` of the SPs' job, as docs/DEPLOY.md says: every SP must print its
#    counters (STATS), keep them in HOST_SOCKET.stopped.json, and remove its socket;
#  - SIGTERM to the srun itself: Slurm's srun answers it with SIGKILL to its tasks (nothing can
#    act on that), so the counters of each job's end, kept by the SP when the job ended, must
#    still be readable with `service-process stats`.

# dt_srun_sps_start LABEL N: srun starts one SP on each of the N host namespaces (background;
# DT_SRUN_PID), then `wait-ready` (bounded).
dt_srun_sps_start() {
  local label=$1 n=$2
  ip netns exec "$DT_FAB" env UCX_TLS=tcp srun -N "$n" --ntasks-per-node=1 --job-name "spoff-sps-$label" \
    --kill-on-bad-exit=0 "$SP" serve --cluster "$DT_SRUN_CLUSTER" --key "$DT_KEY" --sp-id auto \
    "${DT_SERVE_ARGS[@]}" > "$RUN/srun-sps-$label.out" 2> "$RUN/srun-sps-$label.err" < /dev/null &
  DT_SRUN_PID=$!
  if ! ip netns exec "$DT_FAB" "$SP" wait-ready --cluster "$DT_SRUN_CLUSTER" --key "$DT_KEY" \
    --timeout-secs 60 > "$RUN/srun-wait-ready-$label.out" 2>&1; then
    cat "$RUN/srun-wait-ready-$label.out" >&2
    tail -5 "$RUN/srun-sps-$label.err" >&2
    fail "srun-sps-$label: the SPs started by srun did not all become ready"
    kill -TERM "$DT_SRUN_PID" 2>/dev/null || true
    wait "$DT_SRUN_PID" 2>/dev/null || true
    return 1
  fi
}

# dt_srun_job LABEL N: a small offloaded job (srun, one rank per node) through the srun SPs.
dt_srun_job() {
  local label=$1 n=$2 saved=$DT_CLUSTER
  DT_CLUSTER=$DT_SRUN_CLUSTER
  dt_job "$label" ok 120 "srun:$n:$n:1" 1 -- "$RUN/progs/conform" --cases 4 --seed "$seed" --timeout 30
  local rc=$?
  DT_CLUSTER=$saved
  return $rc
}

# dt_srun_wait_gone SECS: until the SPs' srun ended (bounded); false if it did not.
dt_srun_wait_gone() {
  local t
  for t in $(seq 1 $(($1 * 10))); do
    kill -0 "$DT_SRUN_PID" 2>/dev/null || { wait "$DT_SRUN_PID" 2>/dev/null || true; return 0; }
    sleep 0.1
  done
  return 1
}

# srun_sps_phase N: both stops, each after a job the SPs served.
srun_sps_phase() {
  local n=$1 i id sock stopped
  DT_SRUN_CLUSTER=$RUN/cluster-srun.json
  : > "$RUN/srun-map"
  for i in $(seq 1 "$n"); do echo "node$i $(dt_addr_host "$i")" >> "$RUN/srun-map"; done
  ip netns exec "$DT_FAB" "$SP" cluster init --hosts-file "$RUN/nodes" --dpu-map "$RUN/srun-map" \
    --peer-port 7300 --host-port 7400 --socket-dir "$RUN/srun-sock" -o "$DT_SRUN_CLUSTER" \
    2> "$RUN/srun-cluster-init.err" ||
    { cat "$RUN/srun-cluster-init.err" >&2; fail "srun-sps: cluster init failed"; return 0; }
  echo "-- SPs started by srun on the $n hosts (a cluster without DPUs), stopped with scancel --signal=TERM, then by SIGTERM to srun"
  # 1. scancel --signal=TERM: counters printed and kept, sockets removed.
  dt_srun_sps_start term "$n" || return 0
  dt_srun_job srun-sps-job1 "$n" || true
  local t0
  t0=$(date +%s%N)
  ip netns exec "$DT_FAB" scancel --signal=TERM --name spoff-sps-term
  if ! dt_srun_wait_gone 30; then
    fail "srun-sps: the SPs' srun still runs 30 s after scancel --signal=TERM"
    kill -KILL "$DT_SRUN_PID" 2>/dev/null || true
    wait "$DT_SRUN_PID" 2>/dev/null || true
  fi
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  # Every SP stopped in order: its counters kept as of its stop (stopped_at_unix, not a job-end
  # snapshot), with the job's posts, and its socket removed. Its STATS line goes through
  # srun's output forwarding, which may drop a task's last line as the step ends (seen once
  # in three runs): counted, not required.
  local stats_lines
  stats_lines=$(grep -c '^STATS ' "$RUN/srun-sps-term.out" || true)
  for id in $(seq 0 $((n - 1))); do
    sock=$RUN/srun-sock/$id/host.sock
    [ ! -e "$sock" ] || fail "srun-sps: SP $id left its socket after scancel --signal=TERM"
    stopped=$sock.stopped.json
    grep -q '"stopped_at_unix"' "$stopped" 2>/dev/null ||
      fail "srun-sps: SP $id did not keep its counters as it stopped ($stopped: $(cut -c1-80 "$stopped" 2>/dev/null))"
    grep -q '"posts":[1-9]' "$stopped" 2>/dev/null ||
      fail "srun-sps: SP $id kept no counters with posts in $stopped"
  done
  say "srun-sps: scancel --signal=TERM: srun ended in $ms ms; $n of $n SPs stopped in order (counters kept, sockets removed); srun passed on $stats_lines of their $n STATS lines"
  # 2. SIGTERM to srun: Slurm SIGKILLs the SPs; the job-end counters stay readable.
  rm -rf "$RUN/srun-sock"
  dt_srun_sps_start kill "$n" || return 0
  dt_srun_job srun-sps-job2 "$n" || true
  # The SP keeps the counters of a job once the job has ended there (its ranks gone).
  sleep 1
  kill -TERM "$DT_SRUN_PID" 2>/dev/null || true
  if ! dt_srun_wait_gone 30; then
    fail "srun-sps: srun still runs 30 s after SIGTERM"
    kill -KILL "$DT_SRUN_PID" 2>/dev/null || true
    wait "$DT_SRUN_PID" 2>/dev/null || true
  fi
  # Every SP process on the hosts is gone (Slurm killed them), none left behind (the DPUs'
  # SPs, started by mpirun, serve on).
  local left=0 p
  for i in $(seq 1 "$n"); do
    for p in $(ip netns pids "$(dt_ns_host "$i")" 2>/dev/null); do
      [ "$(readlink "/proc/$p/exe" 2>/dev/null)" = "$SP" ] && left=$((left + 1))
    done
  done
  [ "$left" -eq 0 ] || fail "srun-sps: $left SP processes still run after SIGTERM to srun"
  local kept
  kept=$(ip netns exec "$DT_FAB" "$SP" stats --cluster "$DT_SRUN_CLUSTER" --key "$DT_KEY" 2>&1 |
    grep -c 'gone without stopping; counters as of' || true)
  [ "$kept" -eq "$n" ] ||
    fail "srun-sps: stats shows the kept counters of $kept of $n SPs after SIGTERM to srun"
  for id in $(seq 0 $((n - 1))); do
    grep -q '"posts":[1-9]' "$RUN/srun-sock/$id/host.sock.stopped.json" 2>/dev/null ||
      fail "srun-sps: SP $id's kept counters hold no post of the job it served"
  done
  say "srun-sps: SIGTERM to srun: Slurm killed the SPs (as it does); stats reads the counters each kept at its job's end for $kept of $n SPs"
  rm -rf "$RUN/srun-sock"
}
