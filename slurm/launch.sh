# Sourced by the batch scripts in this folder (not submitted itself). Expects EXPERIMENT and the
# cluster settings (ENV_*, module loads, NCCL variables) from the template, and the Hydra overrides
# in "$@". It activates the environment, derives the rendezvous from the allocation, copies a shard
# set to node-local storage with one task per node (stage_data: GF_STAGE, GF_LOCAL_DATA), starts one
# task per GPU with srun, and requeues the job when training stopped for a preemption warning.
# A rank that crashes ends the step at once (slurm/task.sh) and the job fails without a requeue.
#
# Requeues are bounded, so that a job failing the same way after every restart cannot loop:
#   MAX_REQUEUES (environment, default 20): the job is not requeued once SLURM_RESTART_COUNT (its
#     restarts so far, whatever caused them) has reached it;
#   and a job whose newest complete checkpoint is no newer than at its last requeue, STALLED_MAX (2)
#     times in a row, is not requeued either: its runs stop before they save anything new.
# Either way the job ends non-zero with one line naming the step to resume from and what to do; the
# last requeue's step is kept in $RUN_DIR/requeue.state.
#
# Signals: a SIGTERM (or SIGINT) to this script (the time limit, a preemption's grace time ending,
# scancel --batch) does not end it: it passes a SIGTERM on to the ranks through Slurm (they
# checkpoint and exit, and keep asking for the requeue when a preemption warning came first), keeps
# waiting for them, and requeues when they exit 75.
set -uo pipefail

EXIT_REQUEUE=75  # gradientflow_repro/preemption.py: "checkpoint written, run me again"
MAX_REQUEUES=${MAX_REQUEUES:-20}
STALLED_MAX=2    # requeues in a row without a newer checkpoint after which the job stops

# The rendezvous port (the trainer's TCPStore, on the first node) for job id $1: derived from the id,
# so stable across requeues and different for two jobs sharing a node, and below the kernel's
# ephemeral range ($2: the file that holds it, read on the node where the job starts), from which
# every outgoing connection on the node takes its local port: one of those could hold a port inside
# the range, and the job would fail at start-up (address in use). From 20000 up when the range
# leaves room for that (services tend to listen lower down), else from 1025.
master_port() {
  local job_id=$1 range_file=${2:-/proc/sys/net/ipv4/ip_local_port_range} first="" rest low=20000
  read -r first rest 2>/dev/null < "$range_file"
  if ! [[ $first =~ ^[0-9]+$ ]] || [ "$first" -gt 65535 ]; then
    first=32768  # Linux's default range, 32768-60999, where the file cannot be read
  fi
  [ "$first" -gt $((low + 1000)) ] || low=1025
  if [ "$first" -le $((low + 100)) ]; then
    echo "warning: the ephemeral port range starts at $first: no port below it for the rendezvous;" \
         "set MASTER_PORT to a port free on the first node" >&2
    first=32768
  fi
  echo $((low + job_id % (first - low)))
}

# The step of the newest complete checkpoint in run directory $1 (checkpoints/step_<N> holding a
# manifest.json: the trainer renames a checkpoint into place, manifest last, only when it is whole;
# step_<N>.tmp and step_<N>.old are not), or -1 when there is none.
newest_checkpoint_step() {
  local dir name step newest=-1
  for dir in "$1"/checkpoints/step_*; do
    name=${dir##*/step_}
    [[ $name =~ ^[0-9]+$ ]] && [ -f "$dir/manifest.json" ] || continue
    step=$((10#$name))
    [ "$step" -le "$newest" ] || newest=$step
  done
  echo "$newest"
}

# Whether job $2 in run directory $1, restarted $3 times so far, may be requeued once more under the
# bound $4 (MAX_REQUEUES). Yes (status 0): the newest checkpoint's step is recorded in
# $1/requeue.state, with how many requeues in a row found no newer one. No (status 1): one line on
# stderr says why, names the step to resume from and what to do; the record stays as it was.
may_requeue() {
  local run_dir=$1 job_id=$2 restarts=$3 max=$4 state=$1/requeue.state
  local step key value last_job="" last_step="" last_stalled=0 stalled=0 newer resume
  step=$(newest_checkpoint_step "$run_dir")
  if [ -f "$state" ]; then
    while IFS='=' read -r key value; do
      case $key in
        job) last_job=$value ;;
        step) [[ $value =~ ^-?[0-9]+$ ]] && last_step=$value ;;
        stalled) [[ $value =~ ^[0-9]+$ ]] && last_stalled=$value ;;
      esac
    done < "$state"
  fi
  if [ -n "$last_step" ] && [ "$step" -le "$last_step" ]; then
    # nothing newer since the last requeue: count on from that job's count (a new job, resumed in
    # this run directory with run_dir=..., starts its own count from the step it found)
    [ "$last_job" = "$job_id" ] || last_stalled=0
    stalled=$((last_stalled + 1))
  fi
  if [ "$step" -ge 0 ]; then
    newer="no checkpoint newer than step $step"
    resume="resubmit with run_dir=$run_dir to resume from step $step"
  else
    newer="no complete checkpoint"
    resume="resubmit (with no complete checkpoint in $run_dir/checkpoints, from the start)"
  fi
  if [ "$stalled" -ge "$STALLED_MAX" ]; then
    echo "error: job $job_id: not requeued: $newer since $stalled" \
         "requeues in a row (the runs stop before they save anything new: see their lines above," \
         "e.g. a preemption warning earlier than the start-up takes, or a checkpoint that cannot be" \
         "written); fix that, then $resume" >&2
    return 1
  fi
  if [ "$restarts" -ge "$max" ]; then
    echo "error: job $job_id: not requeued: it has restarted $restarts times (MAX_REQUEUES=$max);" \
         "$resume (or submit with a larger MAX_REQUEUES)" >&2
    return 1
  fi
  # replaced whole (rename), so that a reader never sees half a record
  if ! printf 'job=%s\nrestart=%s\nstep=%s\nstalled=%s\n' "$job_id" "$restarts" "$step" "$stalled" \
         > "$state.new" || ! mv -f "$state.new" "$state"; then
    echo "warning: job $job_id: cannot record the requeue in $state: requeues are bounded by" \
         "MAX_REQUEUES=$max only" >&2
  fi
  return 0
}

# The training data, with a shard set staged to node-local storage first. The data is a shard set
# when its folder (a data.root=... override, else $DATA) holds manifest.json (scripts/
# prepare_imagenet.py --shards writes one): the ranks then read it with data=imagenet_shards (unless
# an override names the data config), and, unless GF_STAGE=0, one task per node first copies it to
# $GF_LOCAL_DATA/<the folder's name> (python -m gradientflow_repro.data.stage, with $GF_STAGE_ARGS:
# idempotent, so a requeued job on nodes that still hold the copy copies nothing) and data.root
# points there. Any other folder (ImageNet's class folders, the digits) is read where it is;
# GF_STAGE=1 makes that an error. Sets TRAIN_OVERRIDES: the overrides "$@" and the data's. Status 2
# for a setting that is wrong, 1 when the copy failed (the ranks never start).
stage_data() {
  local mode=${GF_STAGE:-auto} source=${DATA:-} named_config="" arg dest started
  local -a extra=()
  TRAIN_OVERRIDES=()
  case $mode in
    auto|0|1) ;;
    *) echo "error: GF_STAGE=$mode: auto (stage a shard set), 1 (stage, or fail) or 0 (never)" >&2; return 2 ;;
  esac
  for arg in "$@"; do
    case $arg in
      data.root=*) source=${arg#data.root=} ;;  # the user's choice wins, as for run_dir
      data=*) named_config=1 ;;
    esac
  done
  if [ -z "$source" ] || [ ! -f "$source/manifest.json" ]; then
    if [ "$mode" = 1 ]; then
      echo "error: GF_STAGE=1 but the data (${source:-neither DATA nor data.root set}) is no shard set" \
           "(no manifest.json: scripts/prepare_imagenet.py --shards writes one)" >&2
      return 2
    fi
    TRAIN_OVERRIDES=("$@")
    return 0
  fi
  [ -n "$named_config" ] || TRAIN_OVERRIDES+=("data=imagenet_shards")
  for arg in "$@"; do
    case $arg in data.root=*) ;; *) TRAIN_OVERRIDES+=("$arg") ;; esac
  done
  if [ "$mode" = 0 ]; then
    TRAIN_OVERRIDES+=("data.root=$source")
    return 0
  fi
  dest=${GF_LOCAL_DATA:-/tmp/gradientflow-data}/$(basename "$source")
  read -ra extra <<< "${GF_STAGE_ARGS:-}"
  echo "job $SLURM_JOB_ID: staging the shard set $source to $dest on each of $SLURM_JOB_NUM_NODES node(s)" \
       "(GF_STAGE=0 reads it where it is)"
  started=$SECONDS
  # One task per node. The preemption warning (SIGUSR1, to every process of a step) must not kill the
  # copy: ignored, which the stage command inherits through exec. A node whose copy fails ends the
  # step (--kill-on-bad-exit).
  if ! srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \
       --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" --kill-on-bad-exit=1 \
       bash -c 'trap "" USR1; exec "$@"' stage python -m gradientflow_repro.data.stage \
       --manifest "$source/manifest.json" --to "$dest" ${extra[@]+"${extra[@]}"}; then
    echo "error: job $SLURM_JOB_ID: staging $source to $dest failed (above); the ranks were not started." \
         "Set GF_LOCAL_DATA to a node-local folder with room for the set, or GF_STAGE=0 to read it" \
         "where it is" >&2
    return 1
  fi
  echo "job $SLURM_JOB_ID: staged on every node in $((SECONDS - started)) s"
  TRAIN_OVERRIDES+=("data.root=$dest")
}

PROJECT_DIR=${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
if [ ! -d "$PROJECT_DIR/gradientflow_repro" ]; then
  echo "error: PROJECT_DIR=$PROJECT_DIR is not the gradientflow-repro checkout: submit from the" \
       "repository root or set PROJECT_DIR" >&2
  exit 2
fi
cd "$PROJECT_DIR"
if ! [[ $MAX_REQUEUES =~ ^[0-9]+$ ]]; then
  echo "error: MAX_REQUEUES=$MAX_REQUEUES is not a number of restarts" >&2
  exit 2
fi

# --- environment: a conda env (ENV_CONDA) or a virtualenv (ENV_VENV, default .venv) ------------
if [ -n "${ENV_CONDA:-}" ]; then
  # shellcheck disable=SC1091
  source "$(conda info --base)/etc/profile.d/conda.sh" && conda activate "$ENV_CONDA" || {
    echo "error: cannot activate conda env ENV_CONDA=$ENV_CONDA" >&2; exit 2; }
elif [ -f "${ENV_VENV:-.venv}/bin/activate" ]; then
  # shellcheck disable=SC1091
  source "${ENV_VENV:-.venv}/bin/activate"
else
  echo "error: no environment: set ENV_CONDA (conda env from environment.yml) or ENV_VENV" \
       "(default .venv, made by 'make venv')" >&2
  exit 2
fi

# --- rendezvous: first node of the allocation (where this script runs); a port from the job id ----
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-$(master_port "$SLURM_JOB_ID")}
export MASTER_ADDR MASTER_PORT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export WANDB_MODE=${WANDB_MODE:-offline}

# The run directory belongs to the job: a requeued job (same id) resumes from its last checkpoint.
# To continue in a new job, pass run_dir=... of the old one as an override.
RUN_DIR=${RUN_DIR:-results/runs/$EXPERIMENT/slurm-$SLURM_JOB_ID}
for override in "$@"; do
  case $override in run_dir=*) RUN_DIR=${override#run_dir=} ;; esac  # the user's choice wins
done
echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NUM_NODES node(s)" \
     "[$SLURM_JOB_NODELIST], $SLURM_NTASKS tasks; master $MASTER_ADDR:$MASTER_PORT; run_dir $RUN_DIR"

# NCCL's flight recorder (the template enables it with TORCH_NCCL_TRACE_BUFFER_SIZE): each rank's
# dump, on NCCL's timeout or when the trainer's watchdog names a lost rank, goes to the run
# directory (shared by the nodes) rather than to each node's /tmp, one file per rank and attempt.
# Read them with 'python -m torch.distributed.flight_recorder.fr_trace -p <prefix> <run dir>'.
if [ -z "${TORCH_FR_DUMP_TEMP_FILE:-}${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-}" ]; then
  mkdir -p "$RUN_DIR" 2>/dev/null  # the trainer names a run_dir it cannot create
  export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=$RUN_DIR/nccl_trace_$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}_rank_
fi

# --- data: a shard set staged to node-local storage, once per node, before the ranks start -------
# Before the traps below: a stop signal now ends the job (there is nothing to save yet).
stage_data "$@" || exit $?

# --- stop signals to this script -------------------------------------------------------------
# Slurm's time limit (and the end of a preemption's grace time, and a plain scancel) sends SIGTERM
# to this shell and to the ranks, then SIGKILL after KillWait. Without a trap the shell would die at
# once, while the ranks write the checkpoint of a preemption warning, and 'scontrol requeue' below
# would never run: the job would end, and a resubmission would get a new run directory. So the trap
# keeps the shell alive to take the ranks' status. It also passes a SIGTERM on to the ranks, through
# slurmstepd (scancel without --batch/--full signals the job's steps only): a signal to this shell
# alone (scancel --batch) would otherwise never reach the trainer, whose handler stops it with a
# checkpoint. Not through srun: srun turns a SIGTERM of its own into a SIGKILL of its tasks (hence a
# SIGTERM to every process of the job while it runs, scancel --full, kills the ranks unsaved).
stop_signal=""
interrupted=""
ranks_running=""
on_stop_signal() {
  interrupted=1
  [ -z "$stop_signal" ] || return 0
  stop_signal=$1
  if [ -z "$ranks_running" ]; then
    echo "job $SLURM_JOB_ID: SIG$1 to the batch script after the ranks ended: finishing as they asked" >&2
    return 0
  fi
  echo "job $SLURM_JOB_ID: SIG$1 to the batch script (time limit, preemption or scancel): passing" \
       "SIGTERM on to the ranks and waiting for their checkpoint" >&2
  scancel --quiet --signal=TERM "$SLURM_JOB_ID" 2>/dev/null  # fails when Slurm is ending the job: it told them
}
trap 'on_stop_signal TERM' TERM
trap 'on_stop_signal INT' INT

# srun gives each task SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, from which the trainer builds its
# world. --kill-on-bad-exit=0 (also where the cluster's slurm.conf sets KillOnBadExit=1): ranks
# stopping for a requeue exit with 75, a "bad" exit to Slurm, one after another, and must not be
# killed while the others finish. Instead each task runs through slurm/task.sh, which tells 75
# from a crash: a rank that exits otherwise (or is killed) ends the whole step within seconds,
# naming the rank, instead of leaving the others to wait for their watchdog (watchdog_s).
# CPU/GPU binding comes from the template (its '##SBATCH --gpu-bind' and SLURM_CPU_BIND lines).
# In the background, so that a trapped signal runs its trap at once ('wait' returns 128 + the
# signal) instead of after srun; waiting again then gives srun's own status, the ranks'.
srun --kill-on-bad-exit=0 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
  bash "$PROJECT_DIR/slurm/task.sh" python -m gradientflow_repro.train "+experiment=$EXPERIMENT" \
  ${TRAIN_OVERRIDES[@]+"${TRAIN_OVERRIDES[@]}"} "run_dir=$RUN_DIR" &
srun_pid=$!
ranks_running=1
while :; do
  interrupted=""
  wait "$srun_pid"
  status=$?
  if [ -z "$interrupted" ] || [ "$status" -le 128 ]; then break; fi
done
ranks_running=""

if [ $status -eq $EXIT_REQUEUE ]; then
  restarts=${SLURM_RESTART_COUNT:-0}
  if ! may_requeue "$RUN_DIR" "$SLURM_JOB_ID" "$restarts" "$MAX_REQUEUES"; then
    exit 1
  fi
  meanwhile=""
  [ -z "$stop_signal" ] || meanwhile=" (the SIG$stop_signal that came meanwhile does not change that)"
  echo "job $SLURM_JOB_ID: checkpointed after a preemption warning$meanwhile; requeueing" \
       "(restart $((restarts + 1)), at most MAX_REQUEUES=$MAX_REQUEUES)"
  if ! scontrol requeue "$SLURM_JOB_ID"; then
    echo "error: job $SLURM_JOB_ID: scontrol requeue failed (above); unless the job is pending again," \
         "resubmit with run_dir=$RUN_DIR to resume from its last checkpoint" >&2
    exit 1
  fi
  exit 0
fi
if [ $status -ne 0 ]; then
  newest=$(newest_checkpoint_step "$RUN_DIR")
  if [ "$newest" -ge 0 ]; then resume="to resume from step $newest"; else resume="(no checkpoint yet)"; fi
  if [ $status -eq $((128 + 15)) ]; then
    # the trainer's status after a SIGTERM with its checkpoint: a stop that was asked for (time
    # limit, preemption, scancel), which requeues only where Slurm's PreemptMode does it
    why="the ranks stopped after a SIGTERM"
  elif [ -n "$stop_signal" ] && [ $status -eq $((128 + 9)) ]; then
    why="the ranks were killed after the SIG$stop_signal (by srun, which kills its tasks on a SIGTERM"
    why="$why of its own: scancel --full; or by Slurm, when KillWait is shorter than their save)"
  else
    why="the training step failed"
  fi
  echo "job $SLURM_JOB_ID: $why (srun exit status $status), the job ends here: resubmit with" \
       "run_dir=$RUN_DIR $resume" >&2
fi
exit $status
