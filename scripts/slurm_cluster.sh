#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to try the SLURM launcher and to test it
# (docs/scaling.md#try-slurm-on-one-machine):
#   bash scripts/slurm_cluster.sh start    # make slurm: install if needed, configure, start
#   bash scripts/slurm_cluster.sh stop     # make slurm-stop: cancel its jobs, stop its daemons
#   bash scripts/slurm_cluster.sh status
# Everything it writes is under SLURM_DIR (default .slurm/ in the checkout): slurm.conf, the
# munge key and socket, slurmctld's state, slurmd's spool, logs and pid files. munged,
# slurmctld and slurmd are started by hand (no systemd) and listen on 127.0.0.1 only; `stop`
# stops the processes their pid files name and nothing else. Two partitions share the node:
# debug (the default) and urgent, whose jobs preempt debug's, which get their --signal at once
# and are requeued. Client commands find the cluster through SLURM_CONF (`start` prints it).
set -euo pipefail
cd "$(dirname "$0")/.."
SLURM_DIR=$(realpath -m "${SLURM_DIR:-.slurm}")
CONF=$SLURM_DIR/slurm.conf
MUNGE_SOCKET=$SLURM_DIR/munge/munge.socket.2
export SLURM_CONF=$CONF

# The pid a daemon's pid file names, where that process still runs that program.
running() {  # program pid-file
    local pid
    pid=$(cat "$2" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] || return 1
    echo "$pid"
}

install_slurm() {
    local missing=0 program
    for program in munged mungekey slurmctld slurmd sbatch; do
        command -v "$program" >/dev/null || missing=1
    done
    [ "$missing" -eq 0 ] && return
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
        echo "make slurm needs SLURM and munge: install them as root (Debian/Ubuntu: apt-get install slurm-wlm munge), then run it again" >&2
        exit 1
    fi
    echo "installing slurm-wlm and munge with apt-get (log: $SLURM_DIR/apt.log) ..."
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends
        slurm-wlm munge)
    # package lists may be missing or stale: update them only when the install needs it
    if ! "${apt[@]}" >"$SLURM_DIR/apt.log" 2>&1; then
        apt-get update -q >>"$SLURM_DIR/apt.log" 2>&1 && "${apt[@]}" >>"$SLURM_DIR/apt.log" 2>&1 || {
            echo "apt-get could not install slurm-wlm and munge: see $SLURM_DIR/apt.log" >&2
            exit 1
        }
    fi
}

slurm_version() { slurmctld -V | awk '{print $2}'; }  # "slurm-wlm 22.05.8" -> 22.05.8

node_name() { slurmd -C | sed -n 's/^NodeName=\([^ ]*\).*/\1/p'; }

# slurm.conf for this machine; returns 1 where it is the one already there. The user signal at
# preemption (submitit's SIGUSR2, so the run saves before it is requeued) is a
# SlurmctldParameters flag up to 22.05 and a PreemptParameters one from 23.02, and is sent only
# with a GraceTime on the preempted partition (without one, 22.05 sends SIGTERM alone).
# cred_expire (default 120 s) is also how long a requeued job waits before it may start again.
write_conf() {
    local version user preempt_signal node
    version=$(slurm_version)
    user=$(id -un)
    if printf '%s\n' 23.02 "$version" | sort -V -C; then
        preempt_signal=PreemptParameters=send_user_signal
    else
        preempt_signal=SlurmctldParameters=preempt_send_user_signal
    fi
    # CPUs, sockets, cores and memory as slurmd detects them
    node="$(slurmd -C | head -n 1) NodeAddr=127.0.0.1 State=UNKNOWN"
    cat >"$CONF.new" <<EOF
# Written by scripts/slurm_cluster.sh for SLURM $version; it is rewritten by every start.
ClusterName=eagleforge
SlurmctldHost=$(node_name)(127.0.0.1)
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=30
StateSaveLocation=$SLURM_DIR/state
SlurmdSpoolDir=$SLURM_DIR/spool
SlurmctldPidFile=$SLURM_DIR/run/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/run/slurmd.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
# no mail from this cluster
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# pending jobs looked at every 5 s (default 60 s and 30 s): a requeued job starts soon after
# its cred_expire wait, not up to a minute later
SchedulerParameters=sched_interval=5,bf_interval=5
JobRequeue=1
# no accounting: sacct has nothing to read (eagleforge's launcher asks squeue instead)
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
$preempt_signal
$node
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=60
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
    if cmp -s "$CONF.new" "$CONF"; then
        rm "$CONF.new"
        return 1
    fi
    mv "$CONF.new" "$CONF"
}

start_munged() {
    local dir=$SLURM_DIR/munge
    running munged "$dir/munged.pid" >/dev/null && return
    [ -s "$dir/munge.key" ] || mungekey --create --keyfile="$dir/munge.key"
    chmod 0600 "$dir/munge.key"
    munged --key-file="$dir/munge.key" --socket="$MUNGE_SOCKET" --pid-file="$dir/munged.pid" \
        --seed-file="$dir/munged.seed" --log-file="$SLURM_DIR/log/munged.log"
}

# Started unless its pid file names a live one; a daemon that fails says why in its log.
start_daemon() {  # program
    running "$1" "$SLURM_DIR/run/$1.pid" >/dev/null && return
    "$1" -f "$CONF" || {
        echo "$1 did not start: see $SLURM_DIR/log/$1.log" >&2
        exit 1
    }
}

# TERM, then KILL after 10 s; the pid file goes either way.
stop_daemon() {  # program pid-file
    local pid i
    if pid=$(running "$1" "$2"); then
        kill -TERM "$pid"
        for i in $(seq 50); do
            [ -d "/proc/$pid" ] || break
            sleep 0.2
        done
        [ -d "/proc/$pid" ] && kill -KILL "$pid"
        echo "stopped $1 (pid $pid)"
    fi
    rm -f "$2"
}

stop_all() {
    local jobs i
    if running slurmctld "$SLURM_DIR/run/slurmctld.pid" >/dev/null; then
        # cancelled, so that no job's processes outlive the daemons
        jobs=$(squeue -h -o %A 2>/dev/null | sort -u)
        if [ -n "$jobs" ]; then
            echo "cancelling jobs" $jobs
            # shellcheck disable=SC2086
            scancel $jobs
            for i in $(seq 40); do
                [ -z "$(squeue -h -t running,completing,suspended -o %A 2>/dev/null)" ] && break
                sleep 1
            done
        fi
    fi
    stop_daemon slurmd "$SLURM_DIR/run/slurmd.pid"
    stop_daemon slurmctld "$SLURM_DIR/run/slurmctld.pid"
    stop_daemon munged "$SLURM_DIR/munge/munged.pid"
}

# The node up and taking jobs: idle, mixed or allocated (a node back from a stop may come up
# down or drained, and is resumed).
wait_for_node() {
    local node state i
    node=$(node_name)
    for i in $(seq 60); do
        state=$(sinfo -h -n "$node" -o %T 2>/dev/null | head -n 1)
        case $state in
        idle | mixed | allocated | completing) return 0 ;;
        down | drained | draining) scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.5
    done
    echo "node $node is not up (state: ${state:-unknown}): see $SLURM_DIR/log/slurmd.log and slurmctld.log" >&2
    exit 1
}

start() {
    mkdir -p "$SLURM_DIR"/{munge,state,spool,run,log}
    chmod 0755 "$SLURM_DIR" "$SLURM_DIR/munge" "$SLURM_DIR/log"
    install_slurm
    if write_conf; then  # a new configuration: daemons of the old one are restarted
        stop_daemon slurmd "$SLURM_DIR/run/slurmd.pid"
        stop_daemon slurmctld "$SLURM_DIR/run/slurmctld.pid"
    fi
    start_munged
    munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET" >/dev/null || {
        echo "munged does not answer: see $SLURM_DIR/log/munged.log" >&2
        exit 1
    }
    start_daemon slurmctld
    start_daemon slurmd
    wait_for_node
    echo "SLURM $(slurm_version) is up on 127.0.0.1: $(sinfo -h -o '%P %D node, %c CPUs, %m MB' | paste -sd ';' | sed 's/;/; /g')"
    echo "point SLURM's commands at it:  export SLURM_CONF=$CONF"
}

status() {
    local program pid_file pid
    for program in munged slurmctld slurmd; do
        pid_file=$SLURM_DIR/run/$program.pid
        [ "$program" = munged ] && pid_file=$SLURM_DIR/munge/munged.pid
        if pid=$(running "$program" "$pid_file"); then
            echo "$program: running (pid $pid)"
        else
            echo "$program: not running"
        fi
    done
    running slurmctld "$SLURM_DIR/run/slurmctld.pid" >/dev/null && sinfo
    return 0
}

case ${1:-} in
start) start ;;
stop) stop_all ;;
status) status ;;
*)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
