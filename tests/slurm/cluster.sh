#!/usr/bin/env bash
# A throw-away SLURM cluster on this machine for the tests: slurmctld plus NNODES emulated nodes n1..nN (one
# `slurmd -N nX` each, on its own port), munge auth, no systemd, no cgroups, no accounting. Needs root and the
# Debian packages slurmctld slurmd slurm-client munge (`cluster.sh install` adds them).
#
#   tests/slurm/cluster.sh up [DIR]       start (restart if DIR holds one); prints `export SLURM_CONF=DIR/slurm.conf`
#   tests/slurm/cluster.sh down [DIR]     cancel its jobs, stop its daemons (by their PID files only)
#   tests/slurm/cluster.sh install        apt-get install the packages unless already there (idempotent)
#
# Env: NNODES=2, CPUS_PER_NODE=the cores this process may use (more than the hardware drains the node; nproc
# without OMP_NUM_THREADS, which it would report instead), MEM_PER_NODE=2000 (MB, must be
# below the real memory), PORT_BASE=17000 (slurmctld; slurmd n_i on PORT_BASE+i), FIRST_JOB_ID=1 (clusters
# running side by side should differ in both: train.sbatch derives MASTER_PORT from the job id).
# Notes (docs/slurm.md): node names are added to /etc/hosts so MASTER_ADDR=n1 resolves; requeued jobs are held
# until BeginTime (~cred_expire) unless `scontrol update jobid=J StartTime=now`; munged is shared and left running.
set -euo pipefail
CMD=${1:?usage: cluster.sh up|down|install [DIR]}
DIR=${2:-/tmp/slurm-cluster}
NNODES=${NNODES:-2}
CPUS_PER_NODE=${CPUS_PER_NODE:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
MEM_PER_NODE=${MEM_PER_NODE:-2000}
PORT_BASE=${PORT_BASE:-17000}
FIRST_JOB_ID=${FIRST_JOB_ID:-1}
PACKAGES=(slurmctld slurmd slurm-client munge)
export SLURM_CONF=$DIR/slurm.conf

installed() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
              && command -v munged >/dev/null; }

install() {
  installed && return 0
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${PACKAGES[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y --no-install-recommends "${PACKAGES[@]}" >/dev/null; }
}

start_munge() {  # one munged per machine, shared by every cluster; reused when it answers
  munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    mungekey --create --force 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
  chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key; chmod 755 /run/munge
  runuser -u munge -- munged || true  # another cluster may be starting it right now
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "munged did not start; see /var/log/munge/munged.log" >&2; return 1
}

add_hosts() {  # n1..nN -> 127.0.0.1; `cat >`, not mv: /etc/hosts may be a bind mount
  local line tmp
  line="127.0.0.1 $(seq -f 'n%g' 1 "$NNODES" | tr '\n' ' ')# slurm-test-nodes"
  grep -qxF "$line" /etc/hosts && return 0
  tmp=$(mktemp)
  { grep -v '# slurm-test-nodes$' /etc/hosts || true; echo "$line"; } > "$tmp"
  cat "$tmp" > /etc/hosts
  rm -f "$tmp"
}

write_conf() {
  local host
  host=$(hostname -s)
  cat > "$SLURM_CONF" <<CONF
ClusterName=test
FirstJobId=$FIRST_JOB_ID
SlurmctldHost=$host
SlurmctldPort=$PORT_BASE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_min_interval=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=30
MinJobAge=600
Waittime=0
SlurmctldDebug=info
SlurmdDebug=info
CONF
  for i in $(seq 1 "$NNODES"); do
    echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT_BASE + i)) CPUs=$CPUS_PER_NODE" \
         "RealMemory=$MEM_PER_NODE State=UNKNOWN" >> "$SLURM_CONF"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >> "$SLURM_CONF"
}

idle_nodes() { sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l; }

up() {
  installed || { echo "SLURM is not installed: run '$0 install' (apt: ${PACKAGES[*]})" >&2; exit 1; }
  [ "$(id -u)" = 0 ] || { echo "cluster.sh up needs root (daemons run as root, /etc/hosts gets n1..n$NNODES)" >&2; exit 1; }
  [ -f "$SLURM_CONF" ] && down
  start_munge
  rm -rf "$DIR"
  mkdir -p "$DIR/state" "$DIR/log"
  for i in $(seq 1 "$NNODES"); do mkdir -p "$DIR/spool/n$i"; done
  add_hosts
  write_conf
  # -D: foreground in a background session of its own; the PID files hold the daemons' PIDs for `down`
  setsid slurmctld -D -f "$SLURM_CONF" > "$DIR/log/slurmctld.out" 2>&1 < /dev/null &
  for i in $(seq 1 "$NNODES"); do
    setsid slurmd -D -N "n$i" -f "$SLURM_CONF" > "$DIR/log/slurmd-n$i.out" 2>&1 < /dev/null &
  done
  for _ in $(seq 150); do [ "$(idle_nodes)" -ge "$NNODES" ] && break; sleep 0.2; done
  if [ "$(idle_nodes)" -lt "$NNODES" ]; then
    echo "cluster in $DIR did not come up:" >&2; sinfo -N >&2 || true; tail -n 20 "$DIR"/log/* >&2; exit 1
  fi
  echo "export SLURM_CONF=$SLURM_CONF"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

down() {
  if alive "$DIR/slurmctld.pid"; then  # scancel against a dead controller retries for seconds
    timeout 5 scancel --full --signal=KILL --user="$(id -un)" >/dev/null 2>&1 || true
    for _ in $(seq 30); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.1; done
  fi
  local pids="" f p
  for f in "$DIR"/slurmd-*.pid "$DIR"/slurmctld.pid; do
    alive "$f" || continue
    p=$(cat "$f"); kill -TERM "$p"; pids="$pids $p"
  done
  for _ in $(seq 100); do
    local left=""
    for p in $pids; do kill -0 "$p" 2>/dev/null && left="$left $p"; done
    pids=$left
    [ -z "$pids" ] && break
    sleep 0.1
  done
  for p in $pids; do kill -KILL "$p" 2>/dev/null || true; done
  rm -f "$DIR"/*.pid
}

case "$CMD" in
  up) up ;;
  down) down ;;
  install) install ;;
  *) echo "usage: cluster.sh up|down|install [DIR]" >&2; exit 2 ;;
esac
