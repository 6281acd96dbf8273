# Sourced by the batch scripts in this folder (not submitted itself). Expects EXPERIMENT and the
# cluster settings (ENV_*, module loads, NCCL variables) from the template, and the Hydra overrides
# in "$@". It activates the environment, derives the rendezvous from the allocation, starts one
# task per GPU with srun, and requeues the job when training stopped for a preemption warning.
# A rank that crashes ends the step at once (slurm/task.sh) and the job fails without a requeue.
set -uo pipefail

EXIT_REQUEUE=75  # gradientflow_repro/preemption.py: "checkpoint written, run me again"

PROJECT_DIR=${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
if [ ! -d "$PROJECT_DIR/gradientflow_repro" ]; then
  echo "error: PROJECT_DIR=$PROJECT_DIR is not the gradientflow-repro checkout: submit from the" \
       "repository root or set PROJECT_DIR" >&2
  exit 2
fi
cd "$PROJECT_DIR"

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

# --- rendezvous: first node of the allocation; a port derived from the job id (stable across
# requeues, different for two jobs sharing a node) -------------------------------------------------
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
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

# srun gives each task SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, from which the trainer builds its
# world. --kill-on-bad-exit=0 (also where the cluster's slurm.conf sets KillOnBadExit=1): ranks
# stopping for a requeue exit with 75, a "bad" exit to Slurm, one after another, and must not be
# killed while the others finish. Instead each task runs through slurm/task.sh, which tells 75
# from a crash: a rank that exits otherwise (or is killed) ends the whole step within seconds,
# naming the rank, instead of leaving the others to wait for their watchdog (watchdog_s).
# CPU/GPU binding comes from the template (its '##SBATCH --gpu-bind' and SLURM_CPU_BIND lines).
srun --kill-on-bad-exit=0 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
  bash "$PROJECT_DIR/slurm/task.sh" python -m gradientflow_repro.train "+experiment=$EXPERIMENT" "$@" "run_dir=$RUN_DIR"
status=$?

if [ $status -eq $EXIT_REQUEUE ]; then
  echo "job $SLURM_JOB_ID: checkpointed after a preemption warning; requeueing"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
if [ $status -ne 0 ]; then
  echo "job $SLURM_JOB_ID: the training step failed (srun exit status $status), the job ends here:" \
       "resubmit with run_dir=$RUN_DIR to resume from its last checkpoint" >&2
fi
exit $status
