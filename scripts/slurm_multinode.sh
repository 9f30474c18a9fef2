#!/usr/bin/env bash
# Train a recipe on N nodes x G GPUs with SLURM: one `accelerate launch` per node.
#
#   sbatch --nodes 2 --gpus-per-node 8 scripts/slurm_multinode.sh recipes/unet.py --dataset /shared/carvana
#
# Every node runs the same command; SLURM tells each its rank. output_dir (default runs/<recipe>)
# must be on a shared filesystem: checkpoints are written there by every rank (their RNG state)
# and read back by every rank on --resume.
#SBATCH --job-name=recipe
#SBATCH --ntasks-per-node=1          # one launcher per node; it starts one process per GPU
#SBATCH --cpus-per-task=16
#SBATCH --output=%x-%j.out
set -euo pipefail

GPUS_PER_NODE=${SLURM_GPUS_PER_NODE:-8}
MAIN_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MAIN_PORT=${MAIN_PORT:-29500}
# NCCL: name the network interface if the nodes have several (see docs/multinode.md).
# export NCCL_SOCKET_IFNAME=eth0
# export NCCL_DEBUG=WARN

srun --kill-on-bad-exit=1 bash -c "accelerate launch \
    --config_file accelerate_configs/multinode.yaml \
    --num_machines $SLURM_NNODES \
    --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \
    --machine_rank \$SLURM_NODEID \
    --main_process_ip $MAIN_ADDR \
    --main_process_port $MAIN_PORT \
    $*"
