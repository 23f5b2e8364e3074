#!/usr/bin/env bash
# A two-node Slurm cluster on this one machine, from Debian's slurm-wlm and munge: one slurmctld and two slurmd
# (n1, n2) sharing this host on their own ports, for trying relaxsync under srun/sbatch and for its tests.
#
#   sudo apt-get install slurm-wlm munge       # once
#   scripts/local-slurm.sh start               # ~10 s; prints the SLURM_CONF line to export
#   export SLURM_CONF=/tmp/relaxsync-slurm/slurm.conf
#   srun -N2 -n2 hostname
#   scripts/local-slurm.sh stop
#
# Needs root (munged, slurmd, and n1/n2 added to /etc/hosts so a task can resolve the job's first node).
# RELAXSYNC_SLURM_DIR (default /tmp/relaxsync-slurm) holds the config, state, spool and logs.
set -euo pipefail

DIR="${RELAXSYNC_SLURM_DIR:-/tmp/relaxsync-slurm}"
CONF="$DIR/slurm.conf"
HOST="$(hostname -s)"
CPUS="${RELAXSYNC_SLURM_CPUS:-$(nproc)}"

die() { echo "local-slurm: $*" >&2; exit 1; }

write_conf() {
    mkdir -p "$DIR"/{state,log,run} "$DIR"/spool/n1 "$DIR"/spool/n2
    cat > "$CONF" <<EOF
# written by scripts/local-slurm.sh: two nodes on one host
ClusterName=relaxsync
SlurmctldHost=$HOST
SlurmctldPort=16817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdTimeout=30
KillWait=30
InactiveLimit=0
MinJobAge=300
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17001 CPUs=$CPUS State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17002 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

start() {
    [ "$(id -u)" -eq 0 ] || die "needs root (munged, slurmd, /etc/hosts)"
    command -v slurmctld >/dev/null && command -v munged >/dev/null || die "install Debian's slurm-wlm and munge"
    grep -qE '^[^#]*[[:space:]]n1([[:space:]]|$)' /etc/hosts || echo "127.0.0.1 n1 n2" >> /etc/hosts
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    if ! munge -n >/dev/null 2>&1; then
        [ -s /etc/munge/munge.key ] || mungekey --create --force
        su -s /bin/sh munge -c "munged" 2>/dev/null || munged --force
    fi
    munge -n | unmunge >/dev/null || die "munged does not answer"
    write_conf
    export SLURM_CONF="$CONF"
    slurmctld -f "$CONF"
    slurmd -f "$CONF" -N n1
    slurmd -f "$CONF" -N n2
    for _ in $(seq 1 60); do
        if [ "$(sinfo -h -o '%t' 2>/dev/null | sort -u | tr -d '\n')" = "idle" ]; then
            echo "local-slurm: nodes n1 n2 idle; export SLURM_CONF=$CONF"
            return 0
        fi
        sleep 0.5
    done
    sinfo || true
    die "nodes not idle after 30 s (logs in $DIR/log)"
}

stop() {
    for pid in "$DIR"/run/*.pid; do
        [ -e "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
    done
    pkill -f "slurmd -f $CONF" 2>/dev/null || true
    pkill -f "slurmctld -f $CONF" 2>/dev/null || true
    rm -rf "$DIR"/state/* "$DIR"/run/*
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
