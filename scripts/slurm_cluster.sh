#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to try the SLURM launcher and to test it
# (docs/scaling.md#try-slurm-on-one-machine):
#   bash scripts/slurm_cluster.sh start    # make slurm: install if needed, configure, start
#   bash scripts/slurm_cluster.sh start --netns-nodes 2   # make slurm NETNS_NODES=2: and 2 nodes
#   bash scripts/slurm_cluster.sh stop     # make slurm-stop: cancel its jobs, stop its daemons
#   bash scripts/slurm_cluster.sh status
# Everything it writes is under SLURM_DIR (default .slurm/ in the checkout): slurm.conf, the
# munge key and socket (but see munge_socket_dir), slurmctld's state, slurmd's spool, logs and pid files. munged,
# slurmctld and slurmd are started by hand (no systemd) and listen on 127.0.0.1 only (but see
# --netns-nodes); `stop` stops the processes their pid files name and nothing else (and the
# namespaces and bridge it made, with what runs there). Two partitions share the node:
# debug (the default) and urgent, whose jobs preempt debug's, which get their --signal at once
# and are requeued. Client commands find the cluster through SLURM_CONF (`start` prints it).
# --netns-nodes N (root; Linux network namespaces) adds N more nodes, efnode1..N, for multi-node
# jobs (partition multi): each a slurmd in its own network, UTS and mount namespaces (hostname
# efnode<i>, an /etc/hosts of the cluster's names bound over the machine's), on a bridge it makes
# (efbr0, NETNS_SUBNET.0/24: the bridge .254, slurmctld's address then, and node i .i). Each has
# one CPU and shares this machine's cores. `start` without the flag keeps the nodes started.
set -euo pipefail
cd "$(dirname "$0")/.."
SLURM_DIR=$(realpath -m "${SLURM_DIR:-.slurm}")
CONF=$SLURM_DIR/slurm.conf

# Whether every directory from / down to $1 lets all users through (o+x): munged refuses a
# socket anywhere else ("Socket is inaccessible: execute permissions for all required").
traversable() {  # dir
    local dir=$1
    while :; do
        [ -d "$dir" ] && [ $((8#$(stat -c %a "$dir") & 1)) -eq 1 ] || return 1
        [ "$dir" = / ] && return 0
        dir=$(dirname "$dir")
    done
}

# munge's socket: in SLURM_DIR where all users can reach it, else (a checkout in a 0700 home, as
# root's is) in a directory of this cluster's own under /tmp (or $TMPDIR), named by SLURM_DIR's
# hash; empty where neither is reachable (start says so).
munge_socket_dir() {
    local tmp
    if traversable "$(dirname "$SLURM_DIR")"; then
        echo "$SLURM_DIR/munge"
        return
    fi
    for tmp in /tmp "${TMPDIR:-/tmp}"; do
        tmp=$(realpath -m "$tmp")
        if traversable "$tmp"; then
            echo "$tmp/eagleforge-munge-$(id -u)-$(echo -n "$SLURM_DIR" | sha256sum | cut -c1-12)"
            return
        fi
    done
}
MUNGE_SOCKET_DIR=$(munge_socket_dir)
MUNGE_SOCKET=$MUNGE_SOCKET_DIR/munge.socket.2
NETNS_SUBNET=${NETNS_SUBNET:-10.77.0}  # the netns nodes' /24, its first three octets
BRIDGE=efbr0
MADE=$SLURM_DIR/run/netns.made  # the namespaces and links `start` made, one "kind name" a line
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
write_conf() {  # number of netns nodes
    local version user preempt_signal nodes host ctld_addr memory_mb i
    version=$(slurm_version)
    user=$(id -un)
    if printf '%s\n' 23.02 "$version" | sort -V -C; then
        preempt_signal=PreemptParameters=send_user_signal
    else
        preempt_signal=SlurmctldParameters=preempt_send_user_signal
    fi
    # CPUs, sockets, cores and memory as slurmd detects them
    nodes="$(slurmd -C | head -n 1) NodeAddr=127.0.0.1 State=UNKNOWN"
    host=$(node_name)
    ctld_addr=127.0.0.1
    if [ "$1" -gt 0 ]; then
        # the netns nodes reach slurmctld on the bridge; this machine's node still on 127.0.0.1
        ctld_addr=$NETNS_SUBNET.254
        memory_mb=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
        memory_mb=$((memory_mb / 2 / $1 < 4096 ? memory_mb / 2 / $1 : 4096))
        for i in $(seq "$1"); do
            nodes+=$'\n'"NodeName=efnode$i NodeAddr=$NETNS_SUBNET.$i CPUs=1 RealMemory=$memory_mb State=UNKNOWN"
        done
        nodes+=$'\n'"PartitionName=multi Nodes=efnode[1-$1] MaxTime=INFINITE State=UP"
    fi
    cat >"$CONF.new" <<EOF
# Written by scripts/slurm_cluster.sh for SLURM $version; it is rewritten by every start.
ClusterName=eagleforge
SlurmctldHost=$host($ctld_addr)
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=30
StateSaveLocation=$SLURM_DIR/state
# %n: the node's name, each slurmd its own (this machine's node: $host)
SlurmdSpoolDir=$SLURM_DIR/spool/%n
SlurmctldPidFile=$SLURM_DIR/run/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/run/slurmd-%n.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_DIR/log/slurmd-%n.log
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
$nodes
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=60
PartitionName=urgent Nodes=$host MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
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
start_daemon() {  # program pid-file log-file command...
    running "$1" "$2" >/dev/null && return
    "${@:4}" || {
        echo "$1 did not start: see $3" >&2
        exit 1
    }
}

# A netns node's slurmd, in the node's network namespace and in UTS and mount namespaces of its
# own: hostname efnode<i>, and the cluster's hosts file over /etc/hosts, so that the node's name
# resolves to its bridge address (srun binds there, NoInAddrAny; a job's ranks rendezvous there).
# nsenter, not `ip netns exec`, whose fresh /sys has no /sys/fs/cgroup: slurmd stops without.
start_netns_slurmd() {  # node
    mkdir -p "$SLURM_DIR/spool/$1"
    start_daemon slurmd "$SLURM_DIR/run/slurmd-$1.pid" "$SLURM_DIR/log/slurmd-$1.log" \
        nsenter --net="/run/netns/$1" unshare --uts --mount sh -c \
        'hostname "$1" && mount --bind "$2" /etc/hosts && exec slurmd -f "$3" -N "$1"' _ \
        "$1" "$SLURM_DIR/hosts" "$CONF"
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

# Every slurmd's pid file (run/slurmd.pid: an earlier version's, one node only).
slurmd_pid_files() {
    compgen -G "$SLURM_DIR/run/slurmd-*.pid" || true
    echo "$SLURM_DIR/run/slurmd.pid"
}

stop_slurmds() {
    local pid_file
    for pid_file in $(slurmd_pid_files); do
        stop_daemon slurmd "$pid_file"
    done
}

# The netns nodes of the cluster started and not stopped since (0 after `stop`).
started_netns_nodes() {
    if [ -s "$MADE" ]; then
        grep -c '^NodeName=efnode' "$CONF" || true
    else
        echo 0
    fi
}

# Made unless there: the bridge, and per node a namespace with one end of a veth pair (eth0)
# whose other end (named as the node) is on the bridge. What it makes goes into MADE.
start_network() {  # nodes
    local i ns said
    if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null || ! command -v nsenter >/dev/null; then
        echo "--netns-nodes needs root and the ip, unshare and nsenter commands (iproute2, util-linux)" >&2
        exit 1
    fi
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        # a subnet this machine already routes would take the nodes' traffic elsewhere
        said=$(ip -4 route show match "$NETNS_SUBNET.1" | grep -v '^default' || true)
        if [ -n "$said" ]; then
            echo "$NETNS_SUBNET.0/24 is in use here ($said): choose another with NETNS_SUBNET=10.78.0" >&2
            exit 1
        fi
        said=$(ip link add "$BRIDGE" type bridge 2>&1) || {
            echo "could not make the bridge $BRIDGE (ip link add $BRIDGE type bridge: $said)" >&2
            exit 1
        }
        echo "link $BRIDGE" >>"$MADE"
        ip addr add "$NETNS_SUBNET.254/24" dev "$BRIDGE"
        ip link set "$BRIDGE" up
    fi
    for i in $(seq "$1"); do
        ns=efnode$i
        [ -e "/run/netns/$ns" ] && continue
        said=$(ip netns add "$ns" 2>&1) || {
            echo "could not make the network namespace $ns (ip netns add $ns: $said)" >&2
            exit 1
        }
        echo "netns $ns" >>"$MADE"
        ip link add "$ns" type veth peer name eth0 netns "$ns"
        ip link set "$ns" master "$BRIDGE" up
        ip -n "$ns" addr add "$NETNS_SUBNET.$i/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
    done
}

# Deleted, newest first: what MADE lists. Processes still in a namespace (its slurmd is stopped
# by then: a job's that outlived its cancel) are killed, or the namespace would live on.
stop_network() {
    local kind name pids i
    [ -s "$MADE" ] || return 0
    while read -r kind name; do
        case $kind in
        netns)
            pids=$(ip netns pids "$name" 2>/dev/null || true)
            # shellcheck disable=SC2086
            [ -n "$pids" ] && kill -KILL $pids
            ip netns delete "$name" 2>/dev/null && echo "deleted network namespace $name"
            # the namespace goes when its last process has: its veth pair with it
            for i in $(seq 50); do
                ip link show "$name" >/dev/null 2>&1 || break
                sleep 0.1
            done
            ;;
        link) ip link delete "$name" 2>/dev/null && echo "deleted bridge $name" ;;
        esac
    done < <(tac "$MADE")
    rm -f "$MADE"
}

stop_all() {
    local jobs i
    if running slurmctld "$SLURM_DIR/run/slurmctld.pid" >/dev/null; then
        # cancelled, so that no job's processes outlive the daemons
        jobs=$(squeue -h -o %A 2>/dev/null | sort -u) || true  # none where it does not answer
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
    stop_slurmds
    stop_daemon slurmctld "$SLURM_DIR/run/slurmctld.pid"
    stop_daemon munged "$SLURM_DIR/munge/munged.pid"
    stop_network
}

# Every node up and taking jobs: idle, mixed or allocated (a node back from a stop may come up
# down or drained, and is resumed).
wait_for_nodes() {  # node...
    local node state i
    for node in "$@"; do
        for i in $(seq 60); do
            state=$(sinfo -h -n "$node" -o %T 2>/dev/null | head -n 1)
            case $state in
            idle | mixed | allocated | completing) continue 2 ;;
            down | drained | draining) scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
            esac
            sleep 0.5
        done
        echo "node $node is not up (state: ${state:-unknown}): see $SLURM_DIR/log/slurmd-$node.log and slurmctld.log" >&2
        exit 1
    done
}

start() {  # netns nodes
    local netns_nodes=$1 host i nodes
    if [ -z "$MUNGE_SOCKET_DIR" ]; then
        echo "make slurm: munged needs its socket in a directory every user can enter (o+x on each parent), and neither $(dirname "$SLURM_DIR") nor /tmp is one: set SLURM_DIR to such a place (e.g. SLURM_DIR=/srv/eagleforge-slurm make slurm) or chmod o+x its parents" >&2
        exit 1
    fi
    mkdir -p "$SLURM_DIR"/{munge,state,spool,run,log} "$MUNGE_SOCKET_DIR"
    chmod 0755 "$SLURM_DIR" "$SLURM_DIR/munge" "$SLURM_DIR/log" "$MUNGE_SOCKET_DIR"
    install_slurm
    host=$(node_name)
    if write_conf "$netns_nodes"; then  # a new configuration: daemons of the old one restarted
        stop_slurmds
        stop_daemon slurmctld "$SLURM_DIR/run/slurmctld.pid"
        [ "$netns_nodes" -eq 0 ] && stop_network
    fi
    start_munged
    munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET" >/dev/null || {
        echo "munged does not answer: see $SLURM_DIR/log/munged.log" >&2
        exit 1
    }
    nodes=("$host")
    if [ "$netns_nodes" -gt 0 ]; then
        start_network "$netns_nodes"  # before slurmctld, which listens on the bridge
        {
            echo "127.0.0.1 localhost"
            echo "$NETNS_SUBNET.254 $host"
            for i in $(seq "$netns_nodes"); do echo "$NETNS_SUBNET.$i efnode$i"; done
        } >"$SLURM_DIR/hosts"  # rewritten in place: the nodes' bind mounts see it
    fi
    mkdir -p "$SLURM_DIR/spool/$host"
    if [ "$netns_nodes" -gt 0 ]; then
        # NoCtldInAddrAny binds slurmctld to its host name's address: the bridge's, in a mount
        # namespace whose /etc/hosts says so (this machine's says 127.0.0.1, unreachable from
        # the nodes)
        start_daemon slurmctld "$SLURM_DIR/run/slurmctld.pid" "$SLURM_DIR/log/slurmctld.log" \
            unshare --mount sh -c 'mount --bind "$1" /etc/hosts && exec slurmctld -f "$2"' _ \
            "$SLURM_DIR/hosts" "$CONF"
    else
        start_daemon slurmctld "$SLURM_DIR/run/slurmctld.pid" "$SLURM_DIR/log/slurmctld.log" \
            slurmctld -f "$CONF"
    fi
    start_daemon slurmd "$SLURM_DIR/run/slurmd-$host.pid" "$SLURM_DIR/log/slurmd-$host.log" \
        slurmd -f "$CONF"
    for i in $(seq "$netns_nodes"); do
        start_netns_slurmd "efnode$i"
        nodes+=("efnode$i")
    done
    wait_for_nodes "${nodes[@]}"
    echo "SLURM $(slurm_version) is up: $(sinfo -h -o '%P %D node(s) %N, %c CPUs, %m MB' | paste -sd ';' | sed 's/;/; /g')"
    echo "point SLURM's commands at it:  export SLURM_CONF=$CONF"
}

# The nodes slurm.conf names (this machine's alone before the first start).
conf_nodes() {
    [ -s "$CONF" ] && sed -n 's/^NodeName=\([^ ]*\).*/\1/p' "$CONF" || node_name
}

status() {
    local pid_file pid name
    for pid_file in "$SLURM_DIR/munge/munged.pid" "$SLURM_DIR/run/slurmctld.pid" \
        $(conf_nodes | sed "s|.*|$SLURM_DIR/run/slurmd-&.pid|"); do
        name=$(basename "$pid_file" .pid)
        if pid=$(running "${name%%-*}" "$pid_file"); then
            echo "$name: running (pid $pid)"
        else
            echo "$name: not running"
        fi
    done
    echo "munge socket: ${MUNGE_SOCKET_DIR:-none reachable}/munge.socket.2"
    [ -s "$MADE" ] && echo "made:" $(cat "$MADE")
    running slurmctld "$SLURM_DIR/run/slurmctld.pid" >/dev/null && sinfo
    return 0
}

usage() {
    echo "usage: $0 start [--netns-nodes N] | stop | status" >&2
    exit 2
}

case ${1:-} in
start)
    netns_nodes=$(started_netns_nodes)
    case ${2:-} in
    "") ;;
    --netns-nodes) netns_nodes=${3:-} ;;
    --netns-nodes=*) netns_nodes=${2#*=} ;;
    *) usage ;;
    esac
    [[ $netns_nodes =~ ^[0-9]{1,2}$ ]] || usage
    start "$((10#$netns_nodes))"
    ;;
stop) stop_all ;;
status) status ;;
*) usage ;;
esac
