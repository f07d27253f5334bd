#!/usr/bin/env bash
# ScaleRL on Llama-4 Scout (17Bx16 MoE): 64 trainer GPUs + 64 generator GPUs per run
# (model_configs/llama4_scout_17bx16e.yaml: trainer TP 4 with sequence parallel x DP 16, experts EP 16 x expert
# DP 4, full recompute; 8 SGLang engines of TP 8). 16 nodes x 8 GPUs. The paper's 16 trainer GPUs cannot hold
# Scout's weights, fp32 gradients and Adam states (165 GiB per GPU; `megatron-rl plan --model
# llama4_scout_17bx16e` prints the arithmetic).
#
#   MODEL_PATH=/ckpt/Llama-4-Scout-17B-16E-Instruct sbatch slurm/scalerl_moe.sh     # the recipe as it is
#   MODEL_PATH=/ckpt/Llama-4-Scout-17B-16E-Instruct OVERRIDES="rollout.k=4 total_steps=5000" sbatch slurm/scalerl_moe.sh
#
# MODEL_PATH: the Hugging Face checkpoint RL starts from (model.hf_path), on a file system every node sees.
#
# Site set-up (modules, container, venv): export MRL_SETUP=/path/to/setup.sh before sbatch (see docs/guide.md §1).
#SBATCH --job-name=scalerl-moe
#SBATCH --nodes=16
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
