# MRL_SETUP hook for running megatron_rl from its Apptainer image on Slurm. slurm/bootstrap.sh sources it before
# anything runs; afterwards `python`, `ray` and `megatron-rl` are env/bin/in-image, which runs the image's
# programs, and srun hands PATH and these variables on to the steps on the other nodes.
#
#   apptainer build megatron_rl.sif env/megatron_rl.def          # once (or from env/Dockerfile's image)
#   export MRL_IMAGE=$PWD/megatron_rl.sif MRL_SETUP=$PWD/env/mrl_setup_apptainer.sh
#   sbatch slurm/scalerl_moe.sh
#
# Optional: MRL_SRC=$PWD runs this checkout's code instead of the copy inside the image (no rebuild after a code
# change; a dependency change needs a new image); MRL_BINDS=/data,/scratch binds more host paths (the submit
# directory, $HOME and /tmp are bound already: the run's outputs, the Hugging Face cache, Ray's session files).
# The image, the checkout and this directory must be on a file system every node sees.
# shellcheck shell=bash

if [ -z "${MRL_IMAGE:-}" ]; then
  echo "mrl_setup_apptainer.sh: set MRL_IMAGE to the image (.sif) before sbatch" >&2
  return 1
fi
if ! command -v "${MRL_APPTAINER:-apptainer}" >/dev/null; then
  # Many sites provide Apptainer as a module.
  module load apptainer 2>/dev/null || true
fi
MRL_IMAGE=$(realpath "$MRL_IMAGE")
export MRL_IMAGE
if [ -n "${MRL_SRC:-}" ]; then
  MRL_SRC=$(realpath "$MRL_SRC")
  export MRL_SRC
fi
export MRL_BINDS=${MRL_BINDS:-}
PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/bin:$PATH"
export PATH
