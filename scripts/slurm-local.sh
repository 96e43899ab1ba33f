#!/usr/bin/env bash
# A Slurm cluster on this host for tests, started by `start` or `start-two` and stopped by `stop`,
# which ends exactly the daemons a start started (by their pids) and removes the network
# namespaces and bridge it made.
#
#   scripts/slurm-local.sh start       # one node: munged, slurmctld and slurmd on this host
#   scripts/slurm-local.sh start-two   # two nodes, each a slurmd in its own network namespace
#   SLURM_CONF=... srun -n 2 hostname  # start prints the SLURM_CONF to export
#   scripts/slurm-local.sh stop
#
# `start-two` makes a bridge on this host (slurmctld listens there) and two network namespaces
# joined to it by veth pairs; each runs a slurmd as its own node (`slurmd -N`, NodeAddr its
# namespace's address, its own hostname through a UTS namespace), so a step on both nodes
# rendezvouses over TCP between two addresses. Every node has `STOKE_SLURM_NODE_CPUS` CPUs (1 by
# default), so a step of two tasks spans both. The namespaces share this host's file systems, as
# the nodes of a cluster share one.
#
# With STOKE_SLURM_ACCOUNTING=1, Slurm's accounting is on, so `sacct` lists every job and step:
# a MariaDB server of its own (data, socket and TCP port under the state folder) and slurmdbd
# storing into it (`accounting_storage/slurmdbd`; Slurm 22.05's sacct reads nothing else).
#
# Needs root (the daemons run as root). Installs Debian's slurm-wlm and munge (and slurmdbd and
# mariadb-server for accounting) when missing. State (configs, munge key and socket, logs, pid
# files, the database) lives in $STOKE_SLURM_STATE, by default target/slurm-local under the
# repository. STOKE_SLURM_PORT (16817) is slurmctld's port; slurmd, slurmdbd and MariaDB take the
# next three. STOKE_SLURM_SUBNET (10.231.0) is the first three octets of the two-node network.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${STOKE_SLURM_STATE:-$ROOT/target/slurm-local}"
CTLD_PORT="${STOKE_SLURM_PORT:-16817}"
SLURMD_PORT="$((CTLD_PORT + 1))"
DBD_PORT="$((CTLD_PORT + 2))"
DB_PORT="$((CTLD_PORT + 3))"
SUBNET="${STOKE_SLURM_SUBNET:-10.231.0}"
ACCOUNTING="${STOKE_SLURM_ACCOUNTING:-0}"
NODE_CPUS="${STOKE_SLURM_NODE_CPUS:-1}"
# Interface and namespace names carry the port, so clusters on other ports do not collide.
BRIDGE="stkbr$CTLD_PORT"
NODES=(stoke-n1 stoke-n2)

die() { echo "slurm-local: $*" >&2; exit 1; }

install_if_missing() {
    local want=(slurmctld slurmd munged srun sacct) pkgs=(slurm-wlm munge)
    if [ "$ACCOUNTING" = 1 ]; then want+=(slurmdbd mariadbd mariadb-install-db); pkgs+=(slurmdbd mariadb-server); fi
    local missing=0 c
    for c in "${want[@]}"; do command -v "$c" >/dev/null || [ -x "/usr/sbin/$c" ] || missing=1; done
    [ "$missing" = 0 ] && return
    [ "$(id -u)" = 0 ] || die "${pkgs[*]} are missing and installing them needs root"
    echo "slurm-local: installing ${pkgs[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2
    apt-get install -y -q --no-install-recommends "${pkgs[@]}" >&2
}

# Starts a foreground daemon in the background and records its pid.
spawn() {
    local name="$1"; shift
    nohup "$@" >"$STATE/$name.out" 2>&1 &
    echo $! >"$STATE/$name.started-pid"
}

alive() { [ -f "$STATE/$1.started-pid" ] && kill -0 "$(cat "$STATE/$1.started-pid")" 2>/dev/null; }

stop() {
    local name pid i ns
    for name in slurmd slurmd-stoke-n1 slurmd-stoke-n2 slurmctld slurmdbd mariadbd munged; do
        [ -f "$STATE/$name.started-pid" ] || continue
        pid="$(cat "$STATE/$name.started-pid")"
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for i in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$STATE/$name.started-pid"
    done
    # The namespaces and bridge this state's start-two made (their names are recorded).
    if [ -f "$STATE/netns" ]; then
        while read -r ns; do ip netns del "$ns" 2>/dev/null || true; done <"$STATE/netns"
        rm -f "$STATE/netns"
    fi
    if [ -f "$STATE/bridge" ]; then
        ip link del "$(cat "$STATE/bridge")" 2>/dev/null || true
        rm -f "$STATE/bridge"
    fi
}

start_munge() {
    dd if=/dev/urandom of="$STATE/munge.key" bs=1024 count=1 status=none
    chmod 400 "$STATE/munge.key"
    spawn munged munged --foreground --force --key-file="$STATE/munge.key" \
        --socket="$STATE/munge.socket" --pid-file="$STATE/munged.pid" \
        --log-file="$STATE/munged.log" --seed-file="$STATE/munged.seed"
    for _ in $(seq 1 100); do [ -S "$STATE/munge.socket" ] && break; sleep 0.1; done
    [ -S "$STATE/munge.socket" ] || { stop; die "munged did not start: $(cat "$STATE/munged.out" "$STATE/munged.log" 2>/dev/null)"; }
}

# MariaDB on its own data folder and port, then slurmdbd storing into it, then the cluster
# registered (sacctmgr) so slurmctld's records are kept.
start_accounting() {
    local cluster="$1"
    mariadb-install-db --no-defaults --user=root --datadir="$STATE/mysql" --auth-root-authentication-method=normal \
        --skip-test-db >"$STATE/mariadb-install.out" 2>&1 \
        || { stop; die "mariadb-install-db failed: $(tail -n 20 "$STATE/mariadb-install.out")"; }
    spawn mariadbd mariadbd --no-defaults --user=root --datadir="$STATE/mysql" --socket="$STATE/mysql.sock" \
        --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve --pid-file="$STATE/mariadbd.pid" \
        --log-error="$STATE/mariadbd.log" --innodb-buffer-pool-size=32M --innodb-log-file-size=8M
    local ok=0
    for _ in $(seq 1 300); do
        if mariadb --no-defaults -S "$STATE/mysql.sock" -uroot -e 'select 1' >/dev/null 2>&1; then ok=1; break; fi
        alive mariadbd || break
        sleep 0.1
    done
    [ "$ok" = 1 ] || { stop; die "MariaDB did not start: $(tail -n 20 "$STATE/mariadbd.log" 2>/dev/null)"; }
    mariadb --no-defaults -S "$STATE/mysql.sock" -uroot -e "create database slurm_acct_db; \
        create user 'slurm'@'127.0.0.1' identified by 'stoke'; \
        grant all on slurm_acct_db.* to 'slurm'@'127.0.0.1';"
    cat >"$STATE/slurmdbd.conf" <<CONF
AuthType=auth/munge
AuthInfo=socket=$STATE/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=stoke
StorageLoc=slurm_acct_db
CONF
    chmod 600 "$STATE/slurmdbd.conf"
    # slurmdbd finds slurmdbd.conf beside SLURM_CONF.
    SLURM_CONF="$STATE/slurm.conf" spawn slurmdbd slurmdbd -D
    ok=0
    for _ in $(seq 1 300); do
        if SLURM_CONF="$STATE/slurm.conf" timeout 5 sacctmgr -i -n list cluster >/dev/null 2>&1; then ok=1; break; fi
        alive slurmdbd || break
        sleep 0.2
    done
    [ "$ok" = 1 ] || { stop; die "slurmdbd did not start: $(tail -n 20 "$STATE/slurmdbd.out" "$STATE/slurmdbd.log" 2>/dev/null)"; }
    SLURM_CONF="$STATE/slurm.conf" timeout 30 sacctmgr -i add cluster "$cluster" >/dev/null \
        || { stop; die "cannot register cluster $cluster with slurmdbd"; }
}

# The settings both layouts share; the caller appends its nodes and partition.
common_conf() {
    local cluster="$1" ctld_addr="$2"
    local accounting="AccountingStorageType=accounting_storage/none"
    if [ "$ACCOUNTING" = 1 ]; then
        accounting="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$STATE/munge.socket"
    fi
    cat <<CONF
ClusterName=$cluster
SlurmctldHost=$(hostname -s)($ctld_addr)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
AuthInfo=socket=$STATE/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
$accounting
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
SlurmdParameters=config_overrides
CONF
}

prepare() {
    [ "$(id -u)" = 0 ] || die "start needs root (slurmd runs jobs as their users)"
    install_if_missing
    local name
    for name in slurmctld slurmd slurmd-stoke-n1 slurmd-stoke-n2 slurmdbd mariadbd munged; do
        alive "$name" && die "a cluster started from $STATE is still running; run '$0 stop' first"
    done
    stop
    rm -rf "$STATE"
    mkdir -p "$STATE/ctld" "$STATE/spool"
    chmod 700 "$STATE"
    start_munge
}

# Waits until sinfo shows `want` nodes up; on failure prints the logs, stops and exits.
wait_up() {
    local want="$1"; shift
    for _ in $(seq 1 300); do
        if [ "$(timeout 5 sinfo -h -N -o '%T' 2>/dev/null | grep -cE '^(idle|mixed|allocated)')" -ge "$want" ]; then
            echo "export SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        alive slurmctld || break
        local d
        for d in "$@"; do alive "$d" || break 2; done
        sleep 0.2
    done
    echo "slurm-local: the nodes did not come up; logs:" >&2
    tail -n 20 "$STATE"/*.out "$STATE"/slurmctld.log "$STATE"/slurmd*.log >&2 2>/dev/null || true
    stop
    exit 1
}

start() {
    prepare
    local host ncpu
    host="$(hostname -s)"
    ncpu="$(nproc)"
    {
        common_conf stoke-local 127.0.0.1
        echo "NodeName=$host NodeAddr=127.0.0.1 CPUs=$ncpu State=UNKNOWN"
        echo "PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE"
    } >"$STATE/slurm.conf"
    export SLURM_CONF="$STATE/slurm.conf"
    [ "$ACCOUNTING" = 1 ] && start_accounting stoke-local
    spawn slurmctld slurmctld -D -i -f "$SLURM_CONF"
    mkdir -p "$STATE/spool/$host"
    spawn slurmd slurmd -D -f "$SLURM_CONF"
    wait_up 1 slurmd
}

start_two() {
    prepare
    # The network: a bridge here, one namespace per node on a veth pair.
    ip link add "$BRIDGE" type bridge || { stop; die "cannot create bridge $BRIDGE"; }
    echo "$BRIDGE" >"$STATE/bridge"
    ip addr add "$SUBNET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    local i node ns addr
    for i in 0 1; do
        node="${NODES[$i]}"
        ns="$node-$CTLD_PORT"
        addr="$SUBNET.$((i + 2))"
        ip netns add "$ns" || { stop; die "cannot create network namespace $ns"; }
        echo "$ns" >>"$STATE/netns"
        ip link add "stk$CTLD_PORT$i" type veth peer name eth0 netns "$ns"
        ip link set "stk$CTLD_PORT$i" master "$BRIDGE" up
        ip -n "$ns" addr add "$addr/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
    done
    {
        common_conf stoke-two "$SUBNET.1"
        for i in 0 1; do
            echo "NodeName=${NODES[$i]} NodeHostname=${NODES[$i]} NodeAddr=$SUBNET.$((i + 2)) CPUs=$NODE_CPUS State=UNKNOWN"
        done
        echo "PartitionName=two Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
    } >"$STATE/slurm.conf"
    export SLURM_CONF="$STATE/slurm.conf"
    [ "$ACCOUNTING" = 1 ] && start_accounting stoke-two
    spawn slurmctld slurmctld -D -i -f "$SLURM_CONF"
    for i in 0 1; do
        node="${NODES[$i]}"
        # In the node's network namespace, with its own hostname.
        mkdir -p "$STATE/spool/$node"
        # nsenter, not `ip netns exec`: that mounts a fresh /sys, without the cgroup file system
        # slurmd needs.
        spawn "slurmd-$node" nsenter --net="/run/netns/$node-$CTLD_PORT" unshare --uts \
            sh -c "hostname $node && exec slurmd -D -N $node -f $SLURM_CONF"
    done
    wait_up 2 slurmd-stoke-n1 slurmd-stoke-n2
}

case "${1:-}" in
    start) start ;;
    start-two) start_two ;;
    stop) stop ;;
    *) die "usage: $0 start|start-two|stop" ;;
esac
