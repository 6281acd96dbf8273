#!/usr/bin/env bash
# A real Slurm (controller, one or two compute daemons, munge) on this one machine, for the tests
# and for trying the templates by hand. Needs root and Debian/Ubuntu packages (installed if missing).
#
#   scripts/local_slurm.sh start [--nodes 1|2]   install if needed, configure, start, wait for nodes
#   scripts/local_slurm.sh stop                  stop every daemon it started (by PID), clean up
#   scripts/local_slurm.sh status                sinfo, or a line saying it is not running
#   scripts/local_slurm.sh env                   the export line for clients (SLURM_CONF)
#
# Everything lives under $LOCAL_SLURM_DIR (default /tmp/gradientflow-slurm): slurm.conf, state,
# logs, PID files. /etc/slurm is not touched: daemons and clients find the configuration through
# SLURM_CONF, which jobs inherit. The node claims 16 CPUs and 8 GPUs (fake character devices) so
# that the 512-GPU templates' per-node requests can be scaled down on the sbatch command line;
# EnforcePartLimits=ALL makes Slurm refuse what the cluster cannot run instead of leaving it
# pending. With --nodes 2, two slurmd named node1 and node2 run side by side; their names are
# added to /etc/hosts (and removed on stop) so that jobs can reach the first node by name.
set -euo pipefail

DIR=${LOCAL_SLURM_DIR:-/tmp/gradientflow-slurm}
CONF=$DIR/slurm.conf
HOSTS_MARK="# gradientflow-local-slurm"
CPUS=${LOCAL_SLURM_CPUS:-16}

die() { echo "local_slurm: $*" >&2; exit 1; }

install_if_missing() {
  if [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] \
     && command -v sbatch >/dev/null; then
    return
  fi
  command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get to install it"
  echo "local_slurm: installing slurmctld, slurmd, slurm-client and munge with apt-get" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
}

write_conf() {
  local nodes=$1
  mkdir -p "$DIR/state" "$DIR/spool"
  for i in 0 1 2 3 4 5 6 7; do [ -e "$DIR/fakegpu$i" ] || mknod "$DIR/fakegpu$i" c 1 3; done
  local node_spec="CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=8000 Gres=gpu:8"
  {
    echo "ClusterName=local"
    echo "SlurmctldHost=localhost"
    echo "SlurmUser=root"
    echo "AuthType=auth/munge"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "MpiDefault=none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "EnforcePartLimits=ALL"
    echo "SlurmdParameters=config_overrides"
    echo "GresTypes=gpu"
    echo "ReturnToService=2"
    echo "KillWait=10"
    # sbatch --wait polls after 2, 8, 32, 32... s, quadrupling only while its poll is below half of
    # MinJobAge (so that an ended job is not purged unseen): with the default 300 a 10 s job returned
    # after 42 s. Ended jobs are kept 5 s here (5/2 is 2 in Slurm's integer arithmetic), so sbatch
    # polls every 2 s and the tests' 0.5 s polls of a job's state still see it ended
    echo "MinJobAge=5"
    # Credentials live 10 s instead of 120: Slurm holds a requeued job that long (the preemption
    # test waits for it). Starting it sooner by hand fails it with "Job credential revoked".
    echo "AuthInfo=cred_expire=10"
    echo "StateSaveLocation=$DIR/state"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/slurmd-%n.pid"
    echo "SlurmctldLogFile=$DIR/slurmctld.log"
    echo "SlurmdLogFile=$DIR/slurmd-%n.log"
    if [ "$nodes" = 1 ]; then
      echo "NodeName=localhost NodeAddr=127.0.0.1 $node_spec"
    else
      echo "NodeName=node1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001 $node_spec"
      echo "NodeName=node2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17002 $node_spec"
    fi
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } > "$CONF"
  echo "Name=gpu File=$DIR/fakegpu[0-7]" > "$DIR/gres.conf"
}

node_names() { [ "$(cat "$DIR/nodes")" = 1 ] && echo localhost || echo "node1 node2"; }

start() {
  local nodes=1
  while [ $# -gt 0 ]; do
    case $1 in
      --nodes) nodes=$2; shift 2 ;;
      *) die "unknown option $1" ;;
    esac
  done
  [ "$nodes" = 1 ] || [ "$nodes" = 2 ] || die "--nodes must be 1 or 2"
  [ "$(id -u)" = 0 ] || die "needs root (it starts munge, slurmctld and slurmd)"
  if [ -e "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
    die "already running (scripts/local_slurm.sh stop first)"
  fi
  install_if_missing
  rm -rf "$DIR/state" "$DIR/spool"  # fresh job ids and no jobs left from an earlier run
  write_conf "$nodes"
  echo "$nodes" > "$DIR/nodes"
  export SLURM_CONF=$CONF
  if [ ! -e /run/munge/munged.pid ] || ! kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; then
    mkdir -p /run/munge && chown munge:munge /run/munge
    runuser -u munge -- /usr/sbin/munged
    cp /run/munge/munged.pid "$DIR/munged.pid"  # ours to stop; a munged already running is not
  fi
  if [ "$nodes" = 2 ] && ! grep -q "$HOSTS_MARK" /etc/hosts; then
    echo "127.0.0.1 node1 node2 $HOSTS_MARK" >> /etc/hosts
  fi
  /usr/sbin/slurmctld
  for node in $(node_names); do /usr/sbin/slurmd -N "$node"; done
  local waited=0
  until [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" -ge "$nodes" ]; do
    sleep 0.2; waited=$((waited + 1))
    if [ $waited -gt 150 ]; then
      sinfo -N >&2 || true; tail -n 20 "$DIR"/slurm*.log >&2 || true
      stop; die "nodes did not become idle within 30 s (logs above)"
    fi
  done
  echo "local_slurm: $nodes node(s) idle; clients need: export SLURM_CONF=$CONF" >&2
}

stop_pid_file() {
  local file=$1 pid
  [ -e "$file" ] || return 0
  pid=$(cat "$file")
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

stop() {
  export SLURM_CONF=$CONF
  scancel --full --quiet --state=RUNNING,PENDING,REQUEUED 2>/dev/null || true
  for file in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid" "$DIR/munged.pid"; do stop_pid_file "$file"; done
  if grep -q "$HOSTS_MARK" /etc/hosts 2>/dev/null; then
    # /etc/hosts may be a bind mount (containers): rewrite it in place rather than replace it
    grep -v "$HOSTS_MARK" /etc/hosts > "$DIR/hosts.new" && cat "$DIR/hosts.new" > /etc/hosts
    rm -f "$DIR/hosts.new"
  fi
}

case ${1:-} in
  start) shift; start "$@" ;;
  stop) stop ;;
  status)
    if [ -e "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
      SLURM_CONF=$CONF sinfo -N
    else
      echo "local Slurm is not running"; exit 3
    fi ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
