#!/usr/bin/env bash
# A real single-node Slurm on this machine, from Debian's packages, for the launch test
# (tests/integration/orchestration/test_slurm.py) and for trying slurm/ locally:
#
#   bash tools/slurm_localhost.sh start     # install if needed, configure, start munged/slurmctld/slurmd
#   bash tools/slurm_localhost.sh stop
#
# Needs root (it writes /etc/slurm/slurm.conf and runs the daemons). The node is this host with all its
# cores and no GPUs. Each task is bound to the CPUs its step asked for (task/affinity, TaskPluginParam=Cores), as
# on clusters that bind: a step without --cpus-per-task runs on one core, whatever sbatch asked for. No cgroups
# (proctrack/linuxproc; affinity is a sched_setaffinity mask), so it also works inside containers.
set -euo pipefail
action=${1:-start}
STATE=/var/spool/megatron_rl_slurm

ours() {  # the pid in $STATE/<daemon>.pid, if that process is still the daemon this script started
  local pid
  pid=$(cat "$STATE/$1.pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] && echo "$pid"
}

stop() {
  # Only what this script started, found by its pid files: never other users' or other clusters' daemons.
  # Jobs first: scancel has their steps' processes signalled and reaped by slurmstepd while slurmd is up
  # (stopping the daemons alone leaves a running job's slurmstepd and its processes behind).
  if ours slurmctld >/dev/null; then
    scancel --full --quiet --user "$(id -un)" 2>/dev/null || true
    for _ in $(seq 100); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  for daemon in slurmd slurmctld munged; do
    if pid=$(ours "$daemon"); then
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$STATE/$daemon.pid"
  done
}

if [ "$action" = stop ]; then stop; exit 0; fi

if [ "$(id -u)" != 0 ]; then
  echo "slurm_localhost.sh: needs root to configure and run the Slurm daemons" >&2
  exit 3
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

stop
host=$(hostname -s)
cpus=$(getconf _NPROCESSORS_ONLN)  # not nproc: it honours OMP_NUM_THREADS
memory=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" /var/log/slurm /run/munge
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=megatron_rl
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
# A requeued job waits cred_expire s before it may start again (default 120): 20 s keeps the requeue test short
# while still far above a step launch here.
AuthInfo=cred_expire=20
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
TaskPluginParam=Cores
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
ReturnToService=2
KillWait=30
MinJobAge=600
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
if ! pgrep -x munged >/dev/null; then  # a munged already running is used, not stopped later
  sudo_munge() { if command -v runuser >/dev/null; then runuser -u munge -- "$@"; else "$@" --force; fi; }
  sudo_munge /usr/sbin/munged
  for _ in $(seq 50); do [ -s /run/munge/munged.pid ] && break; sleep 0.1; done
  cp /run/munge/munged.pid "$STATE/munged.pid"  # ours: stopped by `stop` (a munged we found running is not)
fi
/usr/sbin/slurmctld
/usr/sbin/slurmd
for _ in $(seq 1 30); do
  if sinfo -h -o %T 2>/dev/null | grep -qE "idle|mixed|alloc"; then
    echo "slurm up: $(sinfo -h -o '%P %D %T %c')"
    exit 0
  fi
  sleep 1
done
echo "slurm_localhost.sh: the node did not come up" >&2
tail -20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2
exit 1
