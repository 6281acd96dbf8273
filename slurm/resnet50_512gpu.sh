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
# The time limit's own SIGTERM, arriving while they save, does not undo the requeue. Requeues are
# bounded (slurm/launch.sh): at most MAX_REQUEUES restarts per job (default 20), and none after 2
# requeues in a row that found no newer checkpoint; the job then fails with one line naming the
# step to resume from.
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
##SBATCH --gpu-bind=closest
#   (binding, for an admin who knows the nodes: each task on the GPUs closest to its CPUs, and with
#    SLURM_CPU_BIND=cores below each task on its own cores, so that DALI's threads and the GPU's
#    copies share a NUMA node. Each task then sees every GPU of its NUMA domain (4 of 8 on a
#    two-socket node), shared with the node's other tasks there; each rank takes the one at its
#    place among them, whichever way Slurm spread the tasks over the sockets (gpu_index in
#    gradientflow_repro/distributed/world.py). Off by default, since where Slurm's view of the sockets is
#    wrong a bad binding is slower than none: check 'nvidia-smi topo -m' against the job's rank lines)
#   (one task per GPU; 12 CPUs per task feed DALI; the warning comes 3 min before the limit, as
#    Slurm may send it up to a minute late; remove one '#' from a '##SBATCH' line to use it)
# module load cuda/13.0   # usually unnecessary: the pip wheels bring their own CUDA 13 runtime and
#                          # NCCL; only the node's NVIDIA driver matters (>= 580, see docs/clusters.md)
ENV_CONDA=${ENV_CONDA:-}              # conda env created from environment.yml: gradientflow-repro
ENV_VENV=${ENV_VENV:-.venv}           # otherwise this virtualenv ('make venv')
export DATA=${DATA:-/datasets/imagenet}   # ImageNet: train/ and val/ class folders, or a shard set (below)
# ImageNet from shards (docs/clusters.md): when DATA (or a data.root=... override) is a shard set
# (its folder holds manifest.json, from scripts/prepare_imagenet.py --shards), one task per node
# copies it to node-local storage before the ranks start, and the ranks read it there
# (data=imagenet_shards, data.root=the copy); class folders are read where they are. How long: the
# train shards are ~140 GB (+ 6.4 GB val): at 1 GB/s per node about 2.5 min, every node at once, so
# the shared file system serves a copy per node (64 nodes: 9.4 TB) and its aggregate bandwidth
# decides (64 GB/s keeps 1 GB/s per node; at 20 GB/s 64 copies take ~8 min); inside --time, before
# MLPerf's clock starts. A requeued job on nodes that still hold a whole copy copies nothing.
# export GF_STAGE=0                    # auto (default): stage a shard set; 0: never (a parallel file
#                                      # system fast enough for the training's reads); 1: stage or fail
# export GF_LOCAL_DATA=/local/scratch  # node-local folder with room for the set (default
#                                      # /tmp/gradientflow-data: check that /tmp is a local disk, not RAM)
# export GF_STAGE_ARGS="--workers 16 --verify"   # for python -m gradientflow_repro.data.stage
# export NCCL_SOCKET_IFNAME=ib0       # the interface NCCL bootstraps over
# export NCCL_IB_HCA=mlx5             # InfiniBand adapters NCCL may use
# export NCCL_DEBUG=WARN
# export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET   # a first run on new nodes (docs/clusters.md)
# NCCL's flight recorder: the last 2000 collectives of each communicator, dumped (to the run
# directory, see launch.sh) when NCCL times out or the watchdog names a lost rank; costs little.
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
# export SLURM_CPU_BIND=cores          # srun's --cpu-bind=cores (see the binding note above)
# export MAX_REQUEUES=20              # restarts per job before launch.sh stops requeueing it
# ------------------------------------------------------------------------------------------------

EXPERIMENT=resnet50_512gpu
# shellcheck source=launch.sh
source "${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh" "$@"
