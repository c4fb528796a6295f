#!/usr/bin/env bash
# Start or stop a private Slurm cluster (munged, slurmctld, slurmd) under one directory, for
# testing the job scripts in slurm/ on a workstation or in CI.
#
#   scripts/slurm-cluster.sh start [--nodes N] [DIR]   start, wait until the nodes are idle, print SLURM_CONF=...
#   scripts/slurm-cluster.sh stop  [DIR]               stop the daemons (and the network) started from DIR
#   scripts/slurm-cluster.sh status [DIR]              show sinfo, or exit 1 when the cluster is down
#
# Then: export SLURM_CONF=DIR/slurm.conf; sbatch slurm/train.sbatch ...
#
# One node (the default) is this machine under its own host name. With --nodes N (N >= 2) the
# cluster has N nodes n1..nN on this one machine, each slurmd in its own network namespace
# (its own address, host name nK) and all sharing the filesystem, as a cluster's nodes share a
# parallel filesystem; MPI between them talks TCP over a bridge. Each cluster claims a free id
# I (1-250): bridge hpbrI with 10.199.I.1/24, per node a namespace hpnI-K and a veth pair
# hpvI-K / hpvI-Kp with 10.199.I.(10+K). DIR/network.env records them (NET_ID, NET_SUBNET,
# NET_NODES) for the stop and for tests; a node is killed by killing the processes of
# `ip netns pids hpnI-K`, cut off by `ip link set hpvI-K down`.
#
# Everything (config, state, spool, logs, munge socket and key) lives in DIR (default
# /tmp/hpctrain-slurm), so the machine's own Slurm and munge, if any, are left alone.
# Variables: SLURM_CPUS (CPUs a node declares, default 4 on one node, 2 per node with --nodes;
# more than the machine has is fine for tests), SLURM_CTLD_PORT / SLURMD_PORT (default 6817 /
# 6818), SLURMD_TIMEOUT (seconds before a silent node is marked down, --nodes only, default 20).
#
# Needs root (slurmd launches jobs as their owner). As root on Debian/Ubuntu, missing
# slurm-wlm and munge are installed with apt; otherwise it says what to install.
set -euo pipefail

cmd=${1:-}
shift || true
NODES=1
if [ "${1:-}" = "--nodes" ]; then NODES=${2:-}; shift 2 || true; fi
case "$NODES" in ''|*[!0-9]*|0) printf '[slurm-cluster] ERROR: --nodes takes a node count, e.g. --nodes 3\n' >&2; exit 2 ;; esac
[ "$NODES" -le 9 ] || { printf '[slurm-cluster] ERROR: --nodes %s: at most 9 nodes\n' "$NODES" >&2; exit 2; }
DIR=${1:-${SLURM_CLUSTER_DIR:-/tmp/hpctrain-slurm}}
if [ "$NODES" -gt 1 ]; then CPUS=${SLURM_CPUS:-2}; else CPUS=${SLURM_CPUS:-4}; fi
CTLD_PORT=${SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}

say() { printf '[slurm-cluster] %s\n' "$*" >&2; }
die() { printf '[slurm-cluster] ERROR: %s\n' "$*" >&2; exit 1; }

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# End the daemons of these pid files together (SIGTERM, SIGKILL after 5 s): one by one, a 3-node
# cluster took about 10 s to stop, most of it waiting on each daemon in turn.
stop_pidfiles() {
  local file pid pids=() alive=() i
  for file in "$@"; do
    [ -f "$file" ] || continue
    pid=$(cat "$file")
    kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    rm -f "$file"
  done
  for i in $(seq 50); do
    alive=()
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
    [ ${#alive[@]} -eq 0 ] && return 0
    sleep 0.1
  done
  for pid in "${alive[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
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
  local host=$1 ctld=$1
  [ "$NODES" -gt 1 ] && ctld="$1($(net_addr 1))"
  cat >"$DIR/slurm.conf" <<EOF
# Written by scripts/slurm-cluster.sh: a $NODES-node test cluster, everything under $DIR.
ClusterName=hpctrain-test
SlurmctldHost=$ctld
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
# Job ids of their own: two test clusters on one machine (the test suite runs a single-node and a
# multi-node one side by side) would otherwise both count from 1, and Open MPI names the shared-memory
# segments of an srun step after its PMIx namespace (job and step id): the steps of two clusters with the
# same ids took each other's segments and crashed in MPI (SIGSEGV in btl_vader).
FirstJobId=$((CTLD_PORT * 1000 + 1))
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
EOF
  if [ "$NODES" -eq 1 ]; then
    # TmpFS: PMIx names its per-step directory after the job and step ids, which every test
    # cluster counts from 1; under /tmp two clusters on one machine would take each other's.
    cat >>"$DIR/slurm.conf" <<EOF
SlurmdSpoolDir=$DIR/spool
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmdLogFile=$DIR/log/slurmd.log
TmpFS=$DIR/tmp
NodeName=$host CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    return
  fi
  # Several slurmds on one machine: %n (the node name) keeps their files apart, and TmpFS
  # keeps their PMIx plug-ins from colliding on /tmp/spmix_appdir_* ("File exists").
  cat >>"$DIR/slurm.conf" <<EOF
SlurmdSpoolDir=$DIR/spool/%n
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmdLogFile=$DIR/log/slurmd-%n.log
TmpFS=$DIR/tmp-%n
# a node that stops answering (killed, cut off) is marked down after this many seconds
SlurmdTimeout=${SLURMD_TIMEOUT:-20}
EOF
  local k
  for k in $(seq "$NODES"); do
    echo "NodeName=n$k NodeAddr=$(net_addr $((10 + k))) CPUs=$CPUS State=UNKNOWN" >>"$DIR/slurm.conf"
  done
  echo "PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" >>"$DIR/slurm.conf"
}

# ---------------------------------------------------------------- the nodes' network (--nodes)
net_addr() { echo "10.199.$NET_ID.$1"; }

load_network() {
  NET_ID=
  # shellcheck disable=SC1091
  [ -f "$DIR/network.env" ] && . "$DIR/network.env"
  [ -n "${NET_NODES:-}" ] && NODES=$NET_NODES
  return 0
}

start_network() {
  local id k ns
  # `ip link add` either creates the bridge or fails: that claims an id against another
  # cluster starting at the same time (and skips one left over from a crash).
  for id in $(seq 1 250); do
    ip link add "hpbr$id" type bridge 2>/dev/null && NET_ID=$id && break
  done
  [ -n "${NET_ID:-}" ] || die "no free bridge name hpbr1..hpbr250 (ip link add failed; see ip -br link)"
  printf 'NET_ID=%s\nNET_SUBNET=10.199.%s.0/24\nNET_NODES=%s\n' "$NET_ID" "$NET_ID" "$NODES" >"$DIR/network.env"
  ip addr add "$(net_addr 1)/24" dev "hpbr$NET_ID"
  ip link set "hpbr$NET_ID" up
  for k in $(seq "$NODES"); do
    ns=hpn$NET_ID-$k
    ip netns add "$ns"
    ip link add "hpv$NET_ID-$k" type veth peer name "hpv$NET_ID-${k}p"
    ip link set "hpv$NET_ID-${k}p" netns "$ns"
    ip link set "hpv$NET_ID-$k" master "hpbr$NET_ID"
    ip link set "hpv$NET_ID-$k" up
    ip -n "$ns" addr add "$(net_addr $((10 + k)))/24" dev "hpv$NET_ID-${k}p"
    ip -n "$ns" link set "hpv$NET_ID-${k}p" up
    ip -n "$ns" link set lo up
  done
}

start_node() {
  local k=$1
  mkdir -p "$DIR/spool/n$k" "$DIR/tmp-n$k"
  pid_alive "$DIR/run/slurmd-n$k.pid" && return 0
  # Not `ip netns exec`: it remounts /sys, and slurmd then finds no /sys/fs/cgroup. The UTS
  # namespace gives the node its own host name, which slurmd takes as its node name.
  timeout 30 nsenter --net="/var/run/netns/hpn$NET_ID-$k" unshare --uts \
    sh -c "hostname n$k; exec slurmd -f '$SLURM_CONF'" || die "slurmd of n$k did not start; see $DIR/log/slurmd-n$k.log"
}

stop_network() {
  [ -n "${NET_ID:-}" ] || return 0
  local k ns pid
  for k in $(seq "$NODES"); do
    ns=hpn$NET_ID-$k
    # whatever still runs on the node (job steps, ranks) ends with it
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
    ip link del "hpv$NET_ID-$k" 2>/dev/null || true
  done
  ip link del "hpbr$NET_ID" 2>/dev/null || true
  rm -f "$DIR/network.env"
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
  # every node of the cluster idle (or busy with a job): the cluster is up
  local i states nodes
  for i in $(seq 120); do
    states=$(SLURM_CONF=$DIR/slurm.conf timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null || true)
    if [ -n "$states" ] && ! echo "$states" | grep -qvE ' (idle|mix|alloc)$'; then
      [ "$(echo "$states" | wc -l)" -ge "$NODES" ] && return 0
    fi
    nodes=$(echo "$states" | awk '$2 ~ /^(down|drain)/ {print $1}' | paste -sd, -)
    [ -n "$nodes" ] && SLURM_CONF=$DIR/slurm.conf scontrol update nodename="$nodes" state=resume >/dev/null 2>&1 || true
    # still completing a job after 30 s (a node that was cut off): down, and so idle once resumed above
    nodes=$(echo "$states" | awk '$2 ~ /^comp/ {print $1}' | paste -sd, -)
    [ "$i" -ge 60 ] && [ -n "$nodes" ] && SLURM_CONF=$DIR/slurm.conf scontrol update nodename="$nodes" state=down \
      reason="completing for 30 s" >/dev/null 2>&1 || true
    sleep 0.5
  done
  die "the nodes did not become idle in 60 s (${states:-no answer from sinfo}); see $DIR/log/slurmctld.log and slurmd*.log"
}

start() {
  [ "$(id -u)" = 0 ] || die "slurmd must run as root to launch jobs. HINT: run as root, or use a real cluster"
  ensure_installed
  export PATH=$PATH:/usr/sbin:/sbin
  local host k
  host=$(hostname -s)
  mkdir -p "$DIR"/{state,spool,run,log,tmp}
  if [ "$NODES" -gt 1 ]; then
    for prog in ip nsenter unshare; do command -v "$prog" >/dev/null || die "$prog not found (needed for --nodes)"; done
    load_network
    [ -n "${NET_ID:-}" ] || start_network
  fi
  write_conf "$host"
  start_munge
  export SLURM_CONF=$DIR/slurm.conf
  pid_alive "$DIR/run/slurmctld.pid" || timeout 30 slurmctld -f "$SLURM_CONF" \
    || die "slurmctld did not start; see $DIR/log/slurmctld.log"
  if [ "$NODES" -eq 1 ]; then
    pid_alive "$DIR/run/slurmd.pid" || timeout 30 slurmd -f "$SLURM_CONF" \
      || die "slurmd did not start; see $DIR/log/slurmd.log"
  else
    for k in $(seq "$NODES"); do start_node "$k"; done
  fi
  wait_idle
  if [ "$NODES" -eq 1 ]; then say "node $host idle with $CPUS CPUs"
  else say "nodes n[1-$NODES] idle with $CPUS CPUs each, on bridge hpbr$NET_ID (10.199.$NET_ID.0/24)"; fi
  echo "SLURM_CONF=$SLURM_CONF"
}

stop() {
  # cancel what is still running so that no job outlives its cluster
  if [ -f "$DIR/slurm.conf" ] && pid_alive "$DIR/run/slurmctld.pid"; then
    SLURM_CONF=$DIR/slurm.conf timeout 10 scancel --full --signal=KILL --partition=debug >/dev/null 2>&1 || true
    SLURM_CONF=$DIR/slurm.conf timeout 10 scancel --partition=debug >/dev/null 2>&1 || true
  fi
  load_network
  stop_pidfiles "$DIR"/run/slurmd.pid "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid"
  # a step daemon stuck on a job that would not die outlives slurmd: end ours, by their config
  local pid
  for pid in $(pgrep -x slurmstepd || true); do
    tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_CONF=$DIR/slurm.conf" \
      && kill -KILL "$pid" 2>/dev/null || true
  done
  stop_network
  stop_pidfiles "$DIR/munge/munged.pid"
  say "stopped the cluster in $DIR"
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  status)
    [ -f "$DIR/slurm.conf" ] || die "no cluster in $DIR"
    SLURM_CONF=$DIR/slurm.conf timeout 10 sinfo ;;
  *) die "usage: $0 start [--nodes N] [DIR] | stop [DIR] | status [DIR]" ;;
esac
