#!/usr/bin/env bash
# Start or stop a private single-node Slurm cluster (munged, slurmctld, slurmd) under one
# directory, for testing the job scripts in slurm/ on a workstation or in CI.
#
#   scripts/slurm-cluster.sh start [DIR]    start, wait until the node is idle, print SLURM_CONF=...
#   scripts/slurm-cluster.sh stop  [DIR]    stop the daemons started from DIR
#   scripts/slurm-cluster.sh status [DIR]   show sinfo, or exit 1 when the cluster is down
#
# Then: export SLURM_CONF=DIR/slurm.conf; sbatch slurm/train.sbatch ...
#
# Everything (config, state, spool, logs, munge socket and key) lives in DIR (default
# /tmp/hpctrain-slurm), so the machine's own Slurm and munge, if any, are left alone.
# Variables: SLURM_CPUS (CPUs the node declares, default 4; more than the machine has is
# fine for tests), SLURM_CTLD_PORT / SLURMD_PORT (default 6817 / 6818).
#
# Needs root (slurmd launches jobs as their owner). As root on Debian/Ubuntu, missing
# slurm-wlm and munge are installed with apt; otherwise it says what to install.
set -euo pipefail

cmd=${1:-}
DIR=${2:-${SLURM_CLUSTER_DIR:-/tmp/hpctrain-slurm}}
CPUS=${SLURM_CPUS:-4}
CTLD_PORT=${SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}

say() { printf '[slurm-cluster] %s\n' "$*" >&2; }
die() { printf '[slurm-cluster] ERROR: %s\n' "$*" >&2; exit 1; }

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pidfile() {
  local file=$1 pid i
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

ensure_installed() {
  local missing=()
  for prog in slurmctld:slurm-wlm slurmd:slurm-wlm sbatch:slurm-wlm munged:munge mungekey:munge; do
    PATH=$PATH:/usr/sbin:/sbin command -v "${prog%%:*}" >/dev/null 2>&1 || missing+=("${prog##*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing ${missing[*]} with apt"
    export DEBIAN_FRONTEND=noninteractive
    timeout 300 apt-get update -qq >/dev/null
    timeout 600 apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    die "missing: ${missing[*]}. HINT: as root on Debian/Ubuntu: apt-get install -y slurm-wlm munge (elsewhere: your distribution's Slurm and munge packages)"
  fi
}

write_conf() {
  local host=$1
  cat >"$DIR/slurm.conf" <<EOF
# Written by scripts/slurm-cluster.sh: a one-node test cluster, everything under $DIR.
ClusterName=hpctrain-test
SlurmctldHost=$host
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# lets the node declare more CPUs than the test machine has
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# one line per finished job (state, exit code): lets tests see outcomes without slurmdbd
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
# finished jobs stay visible to 'scontrol show job' this long
MinJobAge=900
# seconds between SIGTERM and SIGKILL when a job ends or is cancelled
KillWait=10
# slurmctld checks time limits every 30 s: the --signal warning and the end come at those
# checks. A minute of grace past the limit keeps tests with a real --time=1 from being cut
# off by that jitter before they have saved and requeued (the warning is unchanged: it is
# sent relative to the limit itself).
OverTimeLimit=1
MailProg=/bin/true
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$host CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

start_munge() {
  local m=$DIR/munge
  pid_alive "$m/munged.pid" && return 0
  mkdir -p "$m/key"
  [ -f "$m/key/munge.key" ] || mungekey --create --keyfile="$m/key/munge.key" >/dev/null 2>&1 \
    || dd if=/dev/urandom of="$m/key/munge.key" bs=1 count=1024 status=none
  # the socket's directory must be searchable by all (clients connect as any user), the key private
  chmod 755 "$DIR" "$m"; chmod 700 "$m/key"; chmod 600 "$m/key/munge.key"
  # munged refuses to run as root and checks that its files are private to its user
  local run=()
  if [ "$(id -u)" = 0 ] && id munge >/dev/null 2>&1; then
    chown -R munge:munge "$m"
    run=(runuser -u munge --)
  fi
  "${run[@]}" munged --socket="$m/munge.socket.2" --key-file="$m/key/munge.key" \
    --pid-file="$m/munged.pid" --log-file="$m/munged.log" --seed-file="$m/munged.seed" \
    || die "munged did not start; see $m/munged.log"
  munge --socket="$m/munge.socket.2" -n | unmunge --socket="$m/munge.socket.2" >/dev/null \
    || die "munge does not authenticate; see $m/munged.log"
}

wait_idle() {
  local i state
  for i in $(seq 120); do
    state=$(SLURM_CONF=$DIR/slurm.conf timeout 10 sinfo -h -N -o '%t' 2>/dev/null | head -n1 || true)
    case "$state" in
      idle|mix|alloc) return 0 ;;
      down*|drain*) SLURM_CONF=$DIR/slurm.conf scontrol update nodename="$1" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  die "node $1 did not become idle in 60 s (state: ${state:-none}); see $DIR/log/slurmctld.log and slurmd.log"
}

start() {
  [ "$(id -u)" = 0 ] || die "slurmd must run as root to launch jobs. HINT: run as root, or use a real cluster"
  ensure_installed
  export PATH=$PATH:/usr/sbin:/sbin
  local host
  host=$(hostname -s)
  mkdir -p "$DIR"/{state,spool,run,log}
  write_conf "$host"
  start_munge
  export SLURM_CONF=$DIR/slurm.conf
  pid_alive "$DIR/run/slurmctld.pid" || timeout 30 slurmctld -f "$SLURM_CONF" \
    || die "slurmctld did not start; see $DIR/log/slurmctld.log"
  pid_alive "$DIR/run/slurmd.pid" || timeout 30 slurmd -f "$SLURM_CONF" \
    || die "slurmd did not start; see $DIR/log/slurmd.log"
  wait_idle "$host"
  say "node $host idle with $CPUS CPUs"
  echo "SLURM_CONF=$SLURM_CONF"
}

stop() {
  # cancel what is still running so that no job outlives its cluster
  if [ -f "$DIR/slurm.conf" ] && pid_alive "$DIR/run/slurmctld.pid"; then
    SLURM_CONF=$DIR/slurm.conf timeout 10 scancel --full --signal=KILL --partition=debug >/dev/null 2>&1 || true
    SLURM_CONF=$DIR/slurm.conf timeout 10 scancel --partition=debug >/dev/null 2>&1 || true
  fi
  stop_pidfile "$DIR/run/slurmd.pid"
  stop_pidfile "$DIR/run/slurmctld.pid"
  # a step daemon stuck on a job that would not die outlives slurmd: end ours, by their config
  local pid
  for pid in $(pgrep -x slurmstepd || true); do
    tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_CONF=$DIR/slurm.conf" \
      && kill -KILL "$pid" 2>/dev/null || true
  done
  stop_pidfile "$DIR/munge/munged.pid"
  say "stopped the cluster in $DIR"
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  status)
    [ -f "$DIR/slurm.conf" ] || die "no cluster in $DIR"
    SLURM_CONF=$DIR/slurm.conf timeout 10 sinfo ;;
  *) die "usage: $0 start|stop|status [DIR]" ;;
esac
