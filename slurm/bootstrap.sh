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
# 2. starts the Ray head on the first node and a Ray worker on every other node (srun, one task per node holding
#    all the job's CPUs there), and waits until the cluster has every node;
# 3. runs `megatron-rl train` on the head node, which places the trainer ranks and SGLang engines on the
#    cluster's GPUs through Ray (RAY_ADDRESS);
# 4. on Slurm's pre-timeout signal (#SBATCH --signal=B:USR1@<seconds>) or a SIGTERM sent to a running job
#    (`scancel --signal=TERM --batch JOB`), tells the run to checkpoint at the end of its step and exit, then
#    requeues the job (#SBATCH --requeue): the requeued job resumes from that checkpoint (same run name, same
#    output directory); so does the time limit's SIGTERM, for a job submitted without the pre-timeout signal.
#    A cancelled job (`scancel JOB`: COMPLETING when its steps get TERM) checkpoints within KillWait and ends,
#    unrequeued: a cancel is not undone by a requeue.
#
# A step that fails ends the job at once with one line, `[bootstrap] <step> failed (exit code N)`, and the
# step's exit code as the job's; the Ray processes already started are stopped.
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
RAY_START_TIMEOUT_S=${RAY_START_TIMEOUT_S:-300}  # for every node's Ray to join the head

if [ -n "${MRL_SETUP:-}" ]; then
  # shellcheck disable=SC1090
  source "$MRL_SETUP"
fi

stop_requested=0
cancelled=0
train_pid=""
job_cancelled() {  # scancel JOB: COMPLETING before its steps get TERM (so is a time limit, with its reason)
  local job
  [ -n "${SLURM_JOB_ID:-}" ] && job=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null) || return 1
  [[ $job == *"JobState=COMPLETING"* && $job != *"Reason=TimeLimit"* ]]
}
forward() {  # checkpoint and exit at the end of the current step, then requeue unless the job was cancelled
  stop_requested=1
  if [ "$1" = TERM ] && job_cancelled; then cancelled=1; fi
  if [ -n "$train_pid" ]; then
    echo "[bootstrap] $1 received: asking the run to checkpoint and stop"
    kill -USR1 "$train_pid" 2>/dev/null || true
  else
    echo "[bootstrap] $1 received before the run started: stopping"
  fi
}
# From the start: Slurm's pre-timeout signal may come while the Ray nodes start (a requeued job's late start), and
# USR1's default action would end the job unrequeued. A foreground step (the checks) finishes before its trap runs.
trap 'forward USR1' USR1
trap 'forward TERM' TERM

ray_pids=()
ray_steps=()
stop_ray() {
  # Stop the Ray this job started, and only it: each `ray start --block` step ends its own node's Ray
  # processes when signalled (`ray stop` would end every Ray on the node, other jobs' and users' included).
  [ "${#ray_pids[@]}" -gt 0 ] || return 0
  kill "${ray_pids[@]}" 2>/dev/null || true
  local pid alive
  for _ in $(seq 60); do
    alive=0
    for pid in "${ray_pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 1
  done
  kill -9 "${ray_pids[@]}" 2>/dev/null || true
}

requeue_if_stopped() {  # after a stop signal: stop Ray and requeue; the requeued job resumes from the checkpoint
  [ "$stop_requested" = 1 ] || return 0
  stop_ray
  if [ "$cancelled" = 1 ]; then
    echo "[bootstrap] job $SLURM_JOB_ID was cancelled (scancel): not requeued"
  elif [ -n "${SLURM_JOB_ID:-}" ]; then
    echo "[bootstrap] requeueing job $SLURM_JOB_ID: it resumes from the run's last checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  exit 0
}

fail() {  # fail STEP CODE [WHY]: the job ends here, with the step's exit code (1 for a step that ended without one)
  echo "[bootstrap] $1 failed (${3:-exit code $2})" >&2
  stop_ray
  exit "$(($2 == 0 ? 1 : $2))"
}

model_arg=()
if [ -n "$MODEL" ]; then model_arg=(--model "$MODEL"); fi
# shellcheck disable=SC2206
overrides=($OVERRIDES "name=$RUN_NAME" "output_dir=$OUTPUT_DIR")
if [ -n "$MODEL_PATH" ]; then overrides+=("model.hf_path=$MODEL_PATH"); fi

mapfile -t nodes < <(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname -s)}")
num_nodes=${#nodes[@]}
# The CPUs the job holds on each node, in the node list's order: SLURM_JOB_CPUS_PER_NODE reads "96(x15),64".
# Every srun step asks for them explicitly: since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task,
# and on clusters that bind tasks to CPUs a step's task would otherwise be bound to one core (or one socket), so
# the Ray node on it would run the trainer ranks, SGLang schedulers, kernel JIT compiles and sandboxes there.
node_cpus=()
for item in $(echo "${SLURM_JOB_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-$(getconf _NPROCESSORS_ONLN)}}" | tr , ' '); do
  count=${item%%(*}
  repeat=1
  if [[ $item == *"(x"* ]]; then repeat=${item#*(x}; repeat=${repeat%)}; fi
  for _ in $(seq "$repeat"); do node_cpus+=("$count"); done
done
if [ "${#node_cpus[@]}" = 1 ] && [ "$num_nodes" -gt 1 ]; then  # one count outside Slurm: the same on every node
  for _ in $(seq 2 "$num_nodes"); do node_cpus+=("${node_cpus[0]}"); done
fi
if [ "${#node_cpus[@]}" != "$num_nodes" ]; then
  fail "reading the CPUs per node" 1 "SLURM_JOB_CPUS_PER_NODE=${SLURM_JOB_CPUS_PER_NODE:-} counts ${#node_cpus[@]} node(s), the node list $num_nodes"
fi
min_cpus=$(printf '%s\n' "${node_cpus[@]}" | sort -n | head -n 1)

on_node() {  # on_node I COMMAND...: COMMAND as one task on node I holding all the job's CPUs and memory there
  local i=$1
  shift
  # --overlap: the Ray steps run side by side until the end. --mem=0: the job's memory on the node (an explicit
  # --cpus-per-task implies --exact, which would otherwise give the step only a default share).
  srun --nodes=1 --ntasks=1 -w "${nodes[$i]}" --cpus-per-task="${node_cpus[$i]}" --mem=0 --overlap "$@"
}

gpus_per_node=${SLURM_GPUS_ON_NODE:-${GPUS_PER_NODE:-}}
if [ -z "$gpus_per_node" ]; then
  # Nothing says how many GPUs a node has: a CPU recipe still runs (test_slurm.py's job), and the allocation
  # check below refuses a GPU run at once ("0 GPUs per node"), before any Ray process starts.
  echo "[bootstrap] no GPUs in this allocation: neither SLURM_GPUS_ON_NODE (set by sbatch --gpus-per-node=N)" \
    "nor GPUS_PER_NODE is set; only a CPU recipe can run" >&2
  gpus_per_node=0
fi

echo "[bootstrap] job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}): $num_nodes node(s)," \
  "$gpus_per_node GPU(s) and ${node_cpus[0]} CPU(s) each; run $RUN_NAME"
"$MRL" check --recipe "$RECIPE" "${model_arg[@]}" --allocation "${num_nodes}x${gpus_per_node}" "${overrides[@]}" ||
  fail "the allocation check (megatron-rl check)" $?
requeue_if_stopped

# What every node inherits through srun (the site hook or the caller may set each beforehand):
# - MRL_SOCKET_IFNAME: the network interface gloo and NCCL bootstrap on, and the Ray head's address. Set it on
#   multi-homed nodes (the interface the other nodes reach), where the first one found may be a management or
#   container network.
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
  srun --nodes="$num_nodes" --ntasks-per-node=1 --cpus-per-task="$min_cpus" --mem=0 --overlap \
    "$MRL" node-check --recipe "$RECIPE" "${model_arg[@]}" --gpus "$gpus_per_node" "${overrides[@]}" ||
    fail "the node check (megatron-rl node-check)" $?
fi
requeue_if_stopped

# One shared token for Ray's authentication: every srun step inherits the environment.
RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$(python -c "import secrets; print(secrets.token_hex(32))")}
export RAY_AUTH_TOKEN RAY_AUTH_MODE=token

# The head's address: on MRL_SOCKET_IFNAME's interface when it is set (the network the other nodes reach), else
# its first interface address (what Ray itself would pick; `hostname --ip-address` may give loopback).
if [ -n "${MRL_SOCKET_IFNAME:-}" ]; then
  addresses=$(on_node 0 ip -o -4 addr show dev "$MRL_SOCKET_IFNAME") ||
    fail "reading the address of MRL_SOCKET_IFNAME=$MRL_SOCKET_IFNAME on ${nodes[0]} (ip addr)" $?
  head_ip=$(echo "$addresses" | awk '{split($4, a, "/"); print a[1]; exit}')
  if [ -z "$head_ip" ]; then
    fail "reading the address of MRL_SOCKET_IFNAME=$MRL_SOCKET_IFNAME on ${nodes[0]}" 1 "it has no IPv4 address"
  fi
else
  addresses=$(on_node 0 hostname -I) || fail "reading the address of ${nodes[0]} (hostname -I)" $?
  head_ip=$(echo "$addresses" | awk '{print $1}')
fi
export RAY_ADDRESS="$head_ip:$RAY_PORT"

on_node 0 ray start --head --node-ip-address="$head_ip" --port="$RAY_PORT" --num-cpus="${node_cpus[0]}" \
  --num-gpus="$gpus_per_node" --disable-usage-stats --block &
ray_pids+=($!)
ray_steps+=("the Ray head start on ${nodes[0]}")
for i in $(seq 1 $((num_nodes - 1))); do
  on_node "$i" ray start --address="$RAY_ADDRESS" --num-cpus="${node_cpus[$i]}" --num-gpus="$gpus_per_node" --block &
  ray_pids+=($!)
  ray_steps+=("the Ray worker start on ${nodes[$i]}")
done

ended_step=""
ended_code=0
ray_ended() {  # whether a Ray step has ended (each runs until the job stops it): sets ended_step, ended_code
  local j
  for j in "${!ray_pids[@]}"; do
    if ! kill -0 "${ray_pids[$j]}" 2>/dev/null; then
      ended_step=${ray_steps[$j]}
      ended_code=0
      wait "${ray_pids[$j]}" || ended_code=$?
      return 0
    fi
  done
  return 1
}

# Until every node has joined: the nodes the head counts alive, asked as a driver would, once a second or so; a
# Ray step that ends meanwhile (its `ray start` failed) ends the job at once, not at the deadline.
count_nodes="import ray; ray.init(address='$RAY_ADDRESS', logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))"
counted=$(mktemp)
deadline=$((SECONDS + RAY_START_TIMEOUT_S))
alive=0
late() { fail "waiting for the Ray nodes" 1 "$alive of $num_nodes joined in $RAY_START_TIMEOUT_S s"; }
while :; do
  timeout 20 python -c "$count_nodes" >"$counted" 2>/dev/null &
  probe=$!
  while sleep 1; do
    requeue_if_stopped
    if ray_ended; then fail "$ended_step" "$ended_code"; fi
    kill -0 "$probe" 2>/dev/null || break
    [ "$SECONDS" -lt "$deadline" ] || late
  done
  wait "$probe" || true
  alive=$(cat "$counted")
  [[ $alive =~ ^[0-9]+$ ]] || alive=0
  [ "$alive" -lt "$num_nodes" ] || break
  [ "$SECONDS" -lt "$deadline" ] || late
done
rm -f "$counted"
echo "[bootstrap] Ray cluster up at $RAY_ADDRESS with $alive node(s)"
requeue_if_stopped

"$MRL" train --recipe "$RECIPE" "${model_arg[@]}" "${overrides[@]}" &
train_pid=$!
while kill -0 "$train_pid" 2>/dev/null; do
  wait "$train_pid" || true  # returns early when a signal's trap runs; the run goes on
done
status=0
wait "$train_pid" || status=$?

# A Ray step that ended during the run (a node lost): said before the run's own exit is, as its likely cause.
if ray_ended; then echo "[bootstrap] $ended_step ended during the run (exit code $ended_code)" >&2; fi
if [ -n "${SLURM_JOB_ID:-}" ]; then requeue_if_stopped; fi
stop_ray
if [ "$status" != 0 ]; then fail "the run (megatron-rl train)" "$status"; fi
