#!/usr/bin/env bash
# Ray-on-Slurm bootstrap shared by slurm/scalerl_*.sh (and usable directly with sbatch).
#
#   RECIPE=scalerl MODEL=llama3_8b MODEL_PATH=/ckpt/Llama-3.1-8B-Instruct OVERRIDES="rollout.k=4" sbatch slurm/bootstrap.sh
#
# MODEL_PATH is the Hugging Face checkpoint RL starts from (model.hf_path); a GPU run without one is refused by
# the check below.
#
# 1. checks the recipe's GPU split and memory plan against the allocation (`megatron-rl check --allocation`,
#    which runs `megatron-rl plan`: per-GPU memory of every trainer stage and engine), before
#    anything starts;
# 2. starts the Ray head on the first node and a Ray worker on every other node (srun, one task per node),
#    and waits until the cluster has every node;
# 3. runs `megatron-rl train` on the head node, which places the trainer ranks and SGLang engines on the
#    cluster's GPUs through Ray (RAY_ADDRESS);
# 4. on Slurm's pre-timeout signal (#SBATCH --signal=B:USR1@<seconds>) or on scancel's SIGTERM, tells the run
#    to checkpoint at the end of its step and exit, then requeues the job (#SBATCH --requeue): the requeued
#    job resumes from that checkpoint (same run name, same output directory).
#
# Site-specific set-up (modules, containers, virtual environments) goes in a hook: set MRL_SETUP to a file
# that is sourced on every node before anything runs (e.g. `module load cuda/12.4; source ~/mrl/.venv/bin/activate`).
set -euo pipefail

RECIPE=${RECIPE:-scalerl}
MODEL=${MODEL:-}
MODEL_PATH=${MODEL_PATH:-}
OVERRIDES=${OVERRIDES:-}
RUN_NAME=${RUN_NAME:-${RECIPE}-${SLURM_JOB_NAME:-job}}
OUTPUT_DIR=${OUTPUT_DIR:-runs}
MRL=${MRL:-megatron-rl}
RAY_PORT=${RAY_PORT:-6379}

if [ -n "${MRL_SETUP:-}" ]; then
  # shellcheck disable=SC1090
  source "$MRL_SETUP"
fi

model_arg=()
if [ -n "$MODEL" ]; then model_arg=(--model "$MODEL"); fi
# shellcheck disable=SC2206
overrides=($OVERRIDES "name=$RUN_NAME" "output_dir=$OUTPUT_DIR")
if [ -n "$MODEL_PATH" ]; then overrides+=("model.hf_path=$MODEL_PATH"); fi

nodes=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname -s)}")
num_nodes=$(echo "$nodes" | wc -l)
head_node=$(echo "$nodes" | head -n 1)
gpus_per_node=${SLURM_GPUS_ON_NODE:-${GPUS_PER_NODE:-}}
if [ -z "$gpus_per_node" ]; then
  # Nothing says how many GPUs a node has: a CPU recipe still runs (test_slurm.py's job), and the allocation
  # check below refuses a GPU run at once ("0 GPUs per node"), before any Ray process starts.
  echo "[bootstrap] no GPUs in this allocation: neither SLURM_GPUS_ON_NODE (set by sbatch --gpus-per-node=N)" \
    "nor GPUS_PER_NODE is set; only a CPU recipe can run" >&2
  gpus_per_node=0
fi
cpus_per_node=${SLURM_CPUS_ON_NODE:-$(getconf _NPROCESSORS_ONLN)}

echo "[bootstrap] job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}): $num_nodes node(s), $gpus_per_node GPU(s) each; run $RUN_NAME"
"$MRL" check --recipe "$RECIPE" "${model_arg[@]}" --allocation "${num_nodes}x${gpus_per_node}" "${overrides[@]}"

# What every node inherits through srun (the site hook or the caller may set each beforehand):
# - MRL_SOCKET_IFNAME: the network interface gloo and NCCL bootstrap on. Set it on multi-homed nodes (the
#   interface the other nodes reach), where the first one found may be a management or container network.
if [ -n "${MRL_SOCKET_IFNAME:-}" ]; then
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$MRL_SOCKET_IFNAME}
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$MRL_SOCKET_IFNAME}
fi
# - kernel JIT caches on node-local disk: flashinfer and triton compile kernels at first use, and a cache in a
#   shared $HOME is slow to fill and written by every node at once.
export MRL_JIT_CACHE=${MRL_JIT_CACHE:-/tmp/${USER:-mrl}/megatron_rl-jit}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$MRL_JIT_CACHE/flashinfer}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$MRL_JIT_CACHE/triton}

# Every GPU node: its driver runs the image's CUDA and its GPUs are those the run was planned for.
if [ "$gpus_per_node" -gt 0 ]; then
  srun --nodes="$num_nodes" --ntasks-per-node=1 --overlap \
    "$MRL" node-check --recipe "$RECIPE" "${model_arg[@]}" --gpus "$gpus_per_node" "${overrides[@]}"
fi

# One shared token for Ray's authentication: every srun step inherits the environment.
RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$(python -c "import secrets; print(secrets.token_hex(32))")}
export RAY_AUTH_TOKEN RAY_AUTH_MODE=token

# The head's first interface address (what Ray itself would pick; `hostname --ip-address` may give loopback).
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname -I | awk '{print $1}')
export RAY_ADDRESS="$head_ip:$RAY_PORT"
srun --nodes=1 --ntasks=1 -w "$head_node" --overlap \
  ray start --head --node-ip-address="$head_ip" --port="$RAY_PORT" --num-cpus="$cpus_per_node" \
  --num-gpus="$gpus_per_node" --disable-usage-stats --block &
ray_pids=($!)
for node in $(echo "$nodes" | tail -n +2); do
  srun --nodes=1 --ntasks=1 -w "$node" --overlap \
    ray start --address="$RAY_ADDRESS" --num-cpus="$cpus_per_node" --num-gpus="$gpus_per_node" --block &
  ray_pids+=($!)
done
for _ in $(seq 1 120); do
  alive=$(timeout 20 python -c "import ray; ray.init(address='$RAY_ADDRESS', logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))" 2>/dev/null || echo 0)
  if [ "$alive" -ge "$num_nodes" ]; then break; fi
  sleep 2
done
echo "[bootstrap] Ray cluster up at $RAY_ADDRESS with $alive node(s)"

stop_requested=0
forward() {  # checkpoint and exit at the end of the current step, then requeue
  stop_requested=1
  echo "[bootstrap] $1 received: asking the run to checkpoint and stop"
  kill -USR1 "$train_pid" 2>/dev/null || true
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

"$MRL" train --recipe "$RECIPE" "${model_arg[@]}" "${overrides[@]}" &
train_pid=$!
status=0
while kill -0 "$train_pid" 2>/dev/null; do
  wait "$train_pid" || status=$?
done
wait "$train_pid" 2>/dev/null || status=$?

# Stop the Ray this job started, and only it: each `ray start --block` step ends its own node's Ray
# processes when signalled (`ray stop` would end every Ray on the node, other jobs' and users' included).
kill "${ray_pids[@]}" 2>/dev/null || true
for _ in $(seq 60); do
  alive=0
  for pid in "${ray_pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
  [ "$alive" = 0 ] && break
  sleep 1
done
kill -9 "${ray_pids[@]}" 2>/dev/null || true

if [ "$stop_requested" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  echo "[bootstrap] requeueing job $SLURM_JOB_ID to resume from the checkpoint"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
