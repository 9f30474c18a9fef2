#!/usr/bin/env bash
# One Optuna study worked on by a SLURM job array: every array task is a sweep process that takes
# the study's next trial, on the GPUs of its own allocation, until the study has its trials.
#
#   sbatch --array=0-7 --gpus=1 scripts/slurm_sweep.sh unet-lr --param lr=loguniform:1e-4:1e-2 \
#       -- recipes/unet.py --dataset /shared/carvana --epochs 10
#
# The first argument names the study; the rest go to scripts/sweep.py (docs/sweeps.md). The study
# and the trials' folders live under SWEEPS (default runs/sweeps), which must be on a filesystem
# that every node shares, with working file locks: the study is a journal file there, the tasks
# take trials one at a time through a lock there, and a trial cut off by the time limit continues
# from its checkpoint there. With a database server instead, pass --storage postgresql://... .
#SBATCH --job-name=sweep
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --signal=B:TERM@300          # 5 minutes before the limit: the trial stops at a checkpoint
#SBATCH --output=%x-%A_%a.out
set -euo pipefail

STUDY=$1
shift
SWEEPS=${SWEEPS:-runs/sweeps}
CONFIG=${CONFIG:-accelerate_configs/1gpu.yaml}   # 2gpu.yaml with --gpus=2, ...
TRIALS=${TRIALS:-32}                             # all told, over every task of the array

# exec: the sweep gets SLURM's SIGTERM itself, passes it to the running trial, and leaves that
# trial to the next task (or the next sbatch of this same command).
exec python scripts/sweep.py --study "$STUDY" --trials "$TRIALS" --config_file "$CONFIG" \
    --out "$SWEEPS/$STUDY" --storage "$SWEEPS/$STUDY/study.journal" "$@"
