#!/usr/bin/env bash
# A single-node Slurm cluster for tests: munged, slurmctld and slurmd on this host, started by
# `start` and stopped by `stop`, which ends exactly the daemons `start` started (by their pids).
#
#   scripts/slurm-local.sh start   # prints the SLURM_CONF to export for srun
#   SLURM_CONF=... srun -n 2 hostname
#   scripts/slurm-local.sh stop
#
# Needs root (the daemons run as root). Installs Debian's slurm-wlm and munge when missing.
# State (config, munge key and socket, logs, pid files) lives in $STOKE_SLURM_STATE, by default
# target/slurm-local under the repository.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${STOKE_SLURM_STATE:-$ROOT/target/slurm-local}"
CTLD_PORT="${STOKE_SLURM_PORT:-16817}"
SLURMD_PORT="$((CTLD_PORT + 1))"

die() { echo "slurm-local: $*" >&2; exit 1; }

install_if_missing() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v srun >/dev/null; then
        return
    fi
    [ "$(id -u)" = 0 ] || die "slurm-wlm and munge are missing and installing them needs root"
    echo "slurm-local: installing slurm-wlm and munge" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2
    apt-get install -y -q slurm-wlm munge >&2
}

# Starts a foreground daemon in the background and records its pid.
spawn() {
    local name="$1"; shift
    nohup "$@" >"$STATE/$name.out" 2>&1 &
    echo $! >"$STATE/$name.started-pid"
}

alive() { [ -f "$STATE/$1.started-pid" ] && kill -0 "$(cat "$STATE/$1.started-pid")" 2>/dev/null; }

stop() {
    local name pid i
    for name in slurmd slurmctld munged; do
        [ -f "$STATE/$name.started-pid" ] || continue
        pid="$(cat "$STATE/$name.started-pid")"
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$STATE/$name.started-pid"
    done
}

start() {
    [ "$(id -u)" = 0 ] || die "start needs root (slurmd runs jobs as their users)"
    install_if_missing
    if alive slurmctld || alive slurmd || alive munged; then
        die "a cluster started from $STATE is still running; run '$0 stop' first"
    fi
    local host ncpu
    host="$(hostname -s)"
    ncpu="$(nproc)"
    rm -rf "$STATE"
    mkdir -p "$STATE/ctld" "$STATE/spool"
    chmod 700 "$STATE"

    # munge with a key generated for this cluster, on its own socket.
    dd if=/dev/urandom of="$STATE/munge.key" bs=1024 count=1 status=none
    chmod 400 "$STATE/munge.key"
    spawn munged munged --foreground --force --key-file="$STATE/munge.key" \
        --socket="$STATE/munge.socket" --pid-file="$STATE/munged.pid" \
        --log-file="$STATE/munged.log" --seed-file="$STATE/munged.seed"
    for _ in $(seq 1 100); do [ -S "$STATE/munge.socket" ] && break; sleep 0.1; done
    [ -S "$STATE/munge.socket" ] || { stop; die "munged did not start: $(cat "$STATE/munged.out" "$STATE/munged.log" 2>/dev/null)"; }

    cat >"$STATE/slurm.conf" <<CONF
ClusterName=stoke-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
AuthInfo=socket=$STATE/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
NodeName=$host NodeAddr=127.0.0.1 CPUs=$ncpu State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
    export SLURM_CONF="$STATE/slurm.conf"
    spawn slurmctld slurmctld -D -i -f "$SLURM_CONF"
    spawn slurmd slurmd -D -f "$SLURM_CONF"
    for _ in $(seq 1 300); do
        if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            echo "export SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        alive slurmctld || break
        alive slurmd || break
        sleep 0.2
    done
    echo "slurm-local: the node did not come up; logs:" >&2
    tail -n 20 "$STATE"/slurmctld.out "$STATE"/slurmctld.log "$STATE"/slurmd.out "$STATE"/slurmd.log >&2 2>/dev/null || true
    stop
    exit 1
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) die "usage: $0 start|stop" ;;
esac
