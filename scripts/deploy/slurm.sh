# Slurm on the namespace cluster of scripts/deploy-test.sh (sourced after netns.sh): slurmctld
# in the fabric namespace (host name "fabric"), one slurmd per host namespace (nodeI), all from
# one slurm.conf in the run directory; no munge (auth/none and cred/none: the test cluster has
# one user, root, and no network beyond its bridge). Jobs start with `srun --mpi=pmix`.

DT_SLURM_PIDS=()

# dt_slurm_available: Debian's slurmctld, slurmd and srun with the PMIx plugin are installed.
dt_slurm_available() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null &&
    ls /usr/lib/*/slurm-wlm/mpi_pmix.so >/dev/null 2>&1
}

# dt_slurm_install: Debian's Slurm daemons and client (no munge: auth/none), when missing and
# apt-get is there; false if they still are not.
dt_slurm_install() {
  dt_slurm_available && return 0
  command -v apt-get >/dev/null || return 1
  echo "deploy-test: installing slurmd slurmctld slurm-client (DEPLOY_SLURM=0 skips Slurm)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmd slurmctld slurm-client > "$RUN/slurm-install.log" 2>&1 ||
    { tail -3 "$RUN/slurm-install.log" >&2; return 1; }
  dt_slurm_available
}

# dt_slurm_up N: writes the configuration for N nodes and starts the daemons; waits (bounded)
# until every node is idle.
dt_slurm_up() {
  local n=$1 i dir=$RUN/slurm
  mkdir -p "$dir/state"
  for i in $(seq 1 "$n"); do mkdir -p "$dir/spool-node$i"; done
  export SLURM_CONF=$dir/slurm.conf
  # slurmd (22.05) initialises its cgroup plugin even when no plugin of the configuration uses
  # cgroups, and `ip netns exec` remounts /sys without them: each slurmd mounts the freezer
  # hierarchy again in its private mount namespace (cgroup v1, as this kernel's are).
  printf 'CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n' > "$dir/cgroup.conf"
  {
    echo "ClusterName=spdt"
    echo "SlurmctldHost=fabric($DT_NET.1)"
    echo "AuthType=auth/none"
    echo "CredType=cred/none"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "MpiDefault=none"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "SchedulerType=sched/builtin"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "ReturnToService=2"
    echo "StateSaveLocation=$dir/state"
    echo "SlurmdSpoolDir=$dir/spool-%n"
    echo "SlurmctldPidFile=$dir/slurmctld.pid"
    echo "SlurmdPidFile=$dir/slurmd-%n.pid"
    echo "SlurmctldLogFile=$dir/slurmctld.log"
    echo "SlurmdLogFile=$dir/slurmd-%n.log"
    echo "SlurmctldPort=6817"
    echo "SlurmdPort=6818"
    echo "SlurmctldTimeout=30"
    echo "SlurmdTimeout=30"
    echo "InactiveLimit=0"
    echo "KillWait=5"
    # Every node of the emulation is the same 2-core machine: let the configuration say more CPUs.
    echo "SlurmdParameters=config_overrides"
    for i in $(seq 1 "$n"); do
      echo "NodeName=node$i NodeAddr=$(dt_addr_host "$i") CPUs=8 Sockets=1 CoresPerSocket=8 ThreadsPerCore=1 State=UNKNOWN"
    done
    echo "PartitionName=dt Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
  } > "$SLURM_CONF"
  # Each slurmd reads its own copy of the configuration, with a PMIx directory of its own (the
  # plugin makes /tmp/spmix_appdir_UID_JOB.STEP on every node: one file system here).
  for i in $(seq 1 "$n"); do
    mkdir -p "$dir/node$i/pmix"
    cp "$SLURM_CONF" "$dir/cgroup.conf" "$dir/node$i/"
    echo "PMIxCliTmpDirBase=$dir/node$i/pmix" > "$dir/node$i/mpi.conf"
  done
  ip netns exec "$DT_FAB" unshare --uts sh -c 'hostname fabric && exec "$@"' fabric \
    slurmctld -D -i -f "$SLURM_CONF" > "$dir/slurmctld.out" 2>&1 &
  DT_SLURM_PIDS+=($!)
  for i in $(seq 1 "$n"); do
    ip netns exec "$(dt_ns_host "$i")" unshare --uts sh -c \
      'hostname "$0" && mount -t tmpfs none /sys/fs/cgroup && mkdir /sys/fs/cgroup/freezer &&
       mount -t cgroup -o freezer none /sys/fs/cgroup/freezer && exec "$@"' "node$i" \
      slurmd -D -f "$dir/node$i/slurm.conf" > "$dir/slurmd-node$i.out" 2>&1 &
    DT_SLURM_PIDS+=($!)
  done
  local t idle=0
  for t in $(seq 1 300); do
    idle=$({ ip netns exec "$DT_FAB" sinfo -h -N -t idle -o '%N' 2>/dev/null || true; } | sort -u | wc -l)
    [ "$idle" -ge "$n" ] && return 0
    sleep 0.1
  done
  tail -5 "$dir/slurmctld.log" "$dir"/slurmd-node*.log >&2 2>/dev/null || true
  echo "deploy-test: Slurm: only $idle of $n nodes idle after 30 s" >&2
  return 1
}

# dt_slurm_down: stops the daemons (SIGTERM, then SIGKILL after a bounded wait).
dt_slurm_down() {
  local pid t
  for pid in "${DT_SLURM_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${DT_SLURM_PIDS[@]}"; do
    for t in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  DT_SLURM_PIDS=()
}
