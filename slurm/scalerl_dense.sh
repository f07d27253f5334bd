#!/usr/bin/env bash
# ScaleRL on the 8B dense model (Llama-3.1-8B architecture): model_configs/llama3_8b.yaml's split.
#
#   MODEL_PATH=/ckpt/Llama-3.1-8B-Instruct sbatch slurm/scalerl_dense.sh
#   MODEL=qwen3_8b MODEL_PATH=/ckpt/Qwen3-8B sbatch slurm/scalerl_dense.sh
#
# MODEL_PATH: the Hugging Face checkpoint RL starts from (model.hf_path), on a file system every node sees.
#
# Site set-up (modules, container, venv): export MRL_SETUP=/path/to/setup.sh before sbatch (see docs/guide.md §1).
#SBATCH --job-name=scalerl-dense
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
export MODEL=${MODEL:-llama3_8b}
export GPUS_PER_NODE=8
exec bash "${SLURM_SUBMIT_DIR:-.}/slurm/bootstrap.sh"
