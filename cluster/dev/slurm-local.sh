#!/usr/bin/env bash
# A real 2-node Slurm cluster on this one machine, for tests and for trying cluster/slurm/ without a cluster.
#
#   cluster/dev/slurm-local.sh up   [STATE_DIR]   # idempotent; prints `export SLURM_CONF=...`
#   cluster/dev/slurm-local.sh down [STATE_DIR]   # stops the daemons it started (by PID), keeps the logs
#
# Debian's Slurm (22.05) from apt (installed on first use; needs root), munge for authentication, one
# slurmctld and two slurmd (nodes n1, n2 on 127.0.0.2 and 127.0.0.3, 4 CPUs each so that two 2-node jobs fit
# at once). Nothing in /etc/slurm is touched: every command finds the cluster through SLURM_CONF.
set -euo pipefail

ACTION=${1:?usage: slurm-local.sh up|down [STATE_DIR]}
STATE=${2:-/tmp/rtp-slurm}
CONF="$STATE/slurm.conf"
NODES=(n1 n2)
ADDRS=(127.0.0.2 127.0.0.3)
CTLD_PORT=${SLURM_LOCAL_PORT:-16817}

log() { echo "slurm-local: $*" >&2; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null && return
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    log "needs the Debian packages slurmctld slurmd slurm-client munge (apt-get as root)"; exit 2
  fi
  log "installing slurmctld slurmd slurm-client munge"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  [ -f /etc/munge/munge.key ] || { log "no /etc/munge/munge.key (reinstall munge)"; exit 2; }
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  munge -n | unmunge >/dev/null || { log "munged did not start"; exit 1; }
}

write_conf() {
  local host; host=$(hostname)
  mkdir -p "$STATE/ctld"
  cat >"$CONF" <<EOF
# Written by cluster/dev/slurm-local.sh: a 2-node Slurm on one machine.
ClusterName=rtpdev
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=600
# Scheduling passes every few seconds (defaults: 30 s backfill, 60 s main loop), so that a requeued job
# starts soon after its begin time rather than at the next pass; with a queue of a few jobs they cost nothing.
SchedulerParameters=bf_interval=2,sched_interval=5
NodeName=${NODES[0]} NodeAddr=${ADDRS[0]} NodeHostname=${host} Port=$((CTLD_PORT + 1)) CPUs=4 State=UNKNOWN
NodeName=${NODES[1]} NodeAddr=${ADDRS[1]} NodeHostname=${host} Port=$((CTLD_PORT + 2)) CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
EOF
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

healthy() {
  alive "$STATE/slurmctld.pid" && alive "$STATE/slurmd-n1.pid" && alive "$STATE/slurmd-n2.pid" \
    && [ "$(SLURM_CONF=$CONF sinfo -h -N -o '%N %T' 2>/dev/null | grep -c -E 'idle|mixed|allocated')" = 2 ]
}

stop_daemons() {  # TERM to all of them first: each takes seconds to exit, and they do it at the same time
  local pidfile pid pids=()
  for pidfile in "$STATE"/slurmd-*.pid "$STATE/slurmctld.pid"; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
      kill -CONT "$pid" 2>/dev/null || true  # a test may have stopped a node
      kill "$pid"
      pids+=("$pid")
    fi
    rm -f "$pidfile"
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
}

up() {
  install_packages
  if healthy; then echo "export SLURM_CONF=$CONF"; return; fi
  stop_daemons
  start_munge
  write_conf
  /usr/sbin/slurmctld -f "$CONF" -c
  for node in "${NODES[@]}"; do
    mkdir -p "$STATE/spool-$node"
    /usr/sbin/slurmd -f "$CONF" -N "$node"
  done
  # Bounded wait for both nodes to register (a few seconds here).
  for _ in $(seq 300); do
    if healthy; then log "up: ${NODES[*]} (SLURM_CONF=$CONF)"; echo "export SLURM_CONF=$CONF"; return; fi
    sleep 0.1
  done
  log "nodes did not register within 30 s; see $STATE/*.log"
  SLURM_CONF=$CONF sinfo -N >&2 || true
  exit 1
}

case "$ACTION" in
  up) up ;;
  down) stop_daemons; log "down" ;;
  *) echo "usage: slurm-local.sh up|down [STATE_DIR]" >&2; exit 2 ;;
esac
