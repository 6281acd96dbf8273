#!/bin/bash
# ResNet-50 on ImageNet, 90 epochs, 512 GPUs (64 nodes x 8), fp16 (the paper's second model).
#
#   sbatch slurm/resnet50_512gpu.sh [Hydra overrides]      (from the repository root)
#   sbatch slurm/resnet50_512gpu.sh comm=allreduce         the naive baseline (the default is comm=gradientflow,
#                                                    the paper's full stack, two-level ring across nodes)
#   sbatch --nodes=8 slurm/resnet50_512gpu.sh              64 GPUs: sbatch options override #SBATCH
#
# Before the time limit Slurm sends SIGUSR1; the ranks agree to stop after the same step, write a
# checkpoint and the job requeues itself; the restarted job resumes in the same run directory
# (results/runs/resnet50_512gpu/slurm-JOBID) and the same wandb run. Logs: slurm/logs/.
#
# ---- cluster settings: what an admin edits ----------------------------------------------------
#SBATCH --job-name=gf-resnet50-512
#SBATCH --nodes=64
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=04:00:00
#SBATCH --signal=USR1@180
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm/logs/%x-%j.out
##SBATCH --partition=gpu
##SBATCH --account=my-project
##SBATCH --exclusive
#   (one task per GPU; 12 CPUs per task feed DALI; the warning comes 3 min before the limit, as
#    Slurm may send it up to a minute late; remove one '#' from a '##SBATCH' line to use it)
# module load cuda/13.0   # usually unnecessary: the pip wheels bring their own CUDA 13 runtime and
#                          # NCCL; only the node's NVIDIA driver matters (>= 580, see README)
ENV_CONDA=${ENV_CONDA:-}              # conda env created from environment.yml, e.g. gradientflow
ENV_VENV=${ENV_VENV:-.venv}           # otherwise this virtualenv ('make venv')
export DATA=${DATA:-/datasets/imagenet}   # ImageNet with train/ and val/ class folders
# export NCCL_SOCKET_IFNAME=ib0       # the interface NCCL bootstraps over
# export NCCL_IB_HCA=mlx5             # InfiniBand adapters NCCL may use
# export NCCL_DEBUG=WARN
# ------------------------------------------------------------------------------------------------

EXPERIMENT=resnet50_512gpu
# shellcheck source=launch.sh
source "${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh" "$@"
