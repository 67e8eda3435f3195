#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine for the `slurm` tests (tests/launch/test_slurm.py).
#
#     sudo .ci/start_slurm.sh          # as root; .ci/run calls it before `make test`
#     sudo .ci/start_slurm.sh --stop   # stop the daemons this script started
#
# Installs Debian's slurm-wlm and munge with apt-get when they are missing, writes /etc/slurm/slurm.conf for this
# host (one node, one default partition `debug`), starts munged, slurmctld and slurmd, and waits until `sinfo`
# shows the node idle. Idempotent: a Slurm whose node is already up (idle, or busy with jobs) is left as it is.
#
# Exit status 0: Slurm is up. Exit status 1: it is not, and the last line on stderr says why; the Slurm daemons
# this script started are stopped again (munged may stay: it is harmless alone). The caller decides whether that
# is fatal (.ci/run: it is not, the Slurm tests skip with the reason).
set -uo pipefail

STATE=/var/lib/streakline-slurm      # state, spool, logs and pid files of the daemons started here
CONF=/etc/slurm/slurm.conf
MARK="# written by streakline .ci/start_slurm.sh"
WAIT_S=${SLURM_START_WAIT_S:-90}     # for the node to turn idle once both daemons run

say() { echo "start_slurm: $*"; }
fail() {
    echo "start_slurm: local Slurm unavailable: $*" >&2
    exit 1
}

node_state() { sinfo -h -N -o '%T' 2>/dev/null | head -n 1; }
# A node that takes jobs: idle, or running some (a rerun while tests run must not restart anything).
node_up() { case "$(node_state)" in idle | mixed | allocated | completing) return 0 ;; esac; return 1; }

# A pid that runs (a zombie left by an init that does not reap orphans counts as gone: kill -0 would say alive).
running() { local st; st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) && [ -n "$st" ] && [ "$st" != Z ]; }
pid_alive() { local pid; pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] && running "$pid"; }

stop_daemons() {
    # Only what this script started: the pids it recorded, never daemons found by name.
    local f pid
    for f in "$STATE/slurmd.pid" "$STATE/slurmctld.pid"; do
        pid=$(cat "$f" 2>/dev/null) || continue
        if [ -n "$pid" ] && running "$pid" && kill "$pid" 2>/dev/null; then
            # wait for it to let go of its port, so that a restart right after can bind it
            for _ in $(seq 20); do running "$pid" || break; sleep 0.5; done
            say "stopped pid $pid ($(basename "$f" .pid))"
        fi
        rm -f "$f"
    done
}

if [ "${1:-}" = "--stop" ]; then
    stop_daemons
    exit 0
fi

if command -v sinfo >/dev/null && node_up; then
    say "Slurm already running, node $(node_state)"
    exit 0
fi

[ "$(id -u)" = 0 ] || fail "needs root (apt-get, daemons running as SlurmUser=root)"

# --- packages -------------------------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
    || ! command -v sinfo >/dev/null; then
    command -v apt-get >/dev/null || fail "slurm-wlm/munge are not installed and there is no apt-get"
    say "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    # Package indexes may be empty on a fresh image; a failed update is not fatal if the install still works.
    timeout 300 apt-get update -qq >/dev/null 2>&1 || say "apt-get update failed; trying the install anyway"
    if ! timeout 600 apt-get install -y -qq --no-install-recommends slurm-wlm munge >"/tmp/start_slurm.apt.log" 2>&1
    then
        tail -n 5 /tmp/start_slurm.apt.log >&2
        fail "apt-get install slurm-wlm munge failed (network or package index?); see /tmp/start_slurm.apt.log"
    fi
fi

# --- munge: every Slurm RPC is authenticated with it ------------------------------------------------------------
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
    if [ ! -s /etc/munge/munge.key ]; then
        # The Debian package normally creates it; a clean container image may have skipped the postinst.
        if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
        else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
    fi
    if id munge >/dev/null 2>&1; then
        chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
        chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
        runuser -u munge -- munged || fail "munged did not start (see /var/log/munge/munged.log)"
    else
        chmod 0400 /etc/munge/munge.key
        munged --force || fail "munged did not start (see /var/log/munge/munged.log)"
    fi
    for _ in $(seq 20); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.5; done
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 || fail "munge does not authenticate after starting munged"
    say "munged running"
fi

# --- slurm.conf for this host ---------------------------------------------------------------------------------
host=$(hostname -s)
if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    # Someone else's Slurm: never overwrite it. Its node was not up above, so say what state it is in.
    fail "$CONF exists and was not written by this script; sinfo reports node state '$(node_state)'"
fi
# slurmd -C prints this machine's NodeName line (CPUs, sockets, cores, threads, RealMemory) as slurmd sees it,
# so the configured node always matches the hardware and slurmd does not drain it for "Low RealMemory".
node_line=$(slurmd -C 2>/dev/null | grep '^NodeName=') || fail "slurmd -C could not describe this machine"
mkdir -p "$STATE/ctld" "$STATE/d" "$STATE/log" /etc/slurm
cat >"$CONF.tmp" <<EOF
$MARK: a one-node cluster on $host for the tests.
ClusterName=streakline-ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# No cgroups in CI containers: track processes through /proc, bind nothing to cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
# No slurmdbd, so no sacct: submitit sees a job end only through its result file (the tests also ask scontrol).
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
# A node that was down (e.g. after a restart of this script) comes back on its own once slurmd registers.
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
$node_line State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
mv "$CONF.tmp" "$CONF"

# --- daemons --------------------------------------------------------------------------------------------------
started=0
if pid_alive "$STATE/slurmctld.pid"; then
    scontrol reconfigure >/dev/null 2>&1 || true
else
    slurmctld || { tail -n 5 "$STATE/log/slurmctld.log" >&2; fail "slurmctld did not start"; }
    started=1
fi
if ! pid_alive "$STATE/slurmd.pid"; then
    slurmd || { tail -n 5 "$STATE/log/slurmd.log" >&2; [ $started = 1 ] && stop_daemons; fail "slurmd did not start"; }
fi

say "waiting up to ${WAIT_S}s for node $host to be idle"
state=""
for _ in $(seq "$WAIT_S"); do
    state=$(node_state)
    case "$state" in
    idle) break ;;
    down* | drain* | drained*)
        # e.g. left down by an earlier run of this script with other hardware numbers
        scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 1
done
if [ "$state" != "idle" ]; then
    reason=$(sinfo -h -N -o '%T %E' 2>/dev/null | head -n 1)
    tail -n 5 "$STATE/log/slurmd.log" "$STATE/log/slurmctld.log" >&2 2>/dev/null
    stop_daemons
    fail "node $host did not become idle within ${WAIT_S}s (sinfo: '${reason:-no answer}')"
fi
say "Slurm is up: $(sinfo -h -o '%P %a %D %T' | head -n 1)"
