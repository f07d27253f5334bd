#!/usr/bin/env bash
# ScaleRL on Llama-4 Scout (17Bx16 MoE): the paper's split, 64 generator GPUs + 16 trainer GPUs per run
# (model_configs/llama4_scout_17bx16e.yaml: trainer TP 4 x EP 8 with sequence parallel on 16 GPUs; 16 SGLang
# engines of TP 4). 10 nodes x 8 GPUs.
#
#   sbatch slurm/scalerl_moe.sh                                     # the recipe as it is
#   OVERRIDES="rollout.k=4 total_steps=5000" sbatch slurm/scalerl_moe.sh
#
# Site set-up (modules, container, venv): export MRL_SETUP=/path/to/setup.sh before sbatch (see README).
#SBATCH --job-name=scalerl-moe
#SBATCH --nodes=10
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@900
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
export RECIPE=${RECIPE:-scalerl}
export MODEL=${MODEL:-llama4_scout_17bx16e}
export GPUS_PER_NODE=8
exec bash "${SLURM_SUBMIT_DIR:-.}/slurm/bootstrap.sh"
