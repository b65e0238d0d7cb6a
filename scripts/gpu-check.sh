#!/usr/bin/env bash
# The GPU checks, in one script, for a machine with an NVIDIA GPU (docs/weight-sync.md):
#   1. the NCCL data plane against stand-in engines (runtime/tests/gpu_nccl_weight_sync.rs);
#   2. the NCCL path to a real vLLM on one GPU: two updates through the router, vLLM's own
#      /weight_checker against a vLLM that loaded the same weights from disk, a generation after
#      (runtime/tests/gpu_vllm_nccl.rs);
#   3. the trainer ranks over NCCL, one per GPU (runtime/tests/libtorch_trainer_ranks.rs; 4 GPUs).
# Needs: this repository set up (bash scripts/setup.sh), libnccl on LD_LIBRARY_PATH (the
# nvidia-nccl-cu12 wheel's lib/), and MOULT_VLLM_PYTHON naming a python with vLLM 0.32.0's CUDA
# build (PyPI `vllm==0.32.0`). Each check fails with its reason when something is missing.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MOULT_ROOT"
nvidia-smi -L
: "${MOULT_VLLM_PYTHON:?set MOULT_VLLM_PYTHON to a python with vLLM 0.32.0 (CUDA build)}"
echo "gpu-check: NCCL data plane (stand-in engines)"
cargo test -p moult-runtime --features cuda --test gpu_nccl_weight_sync -- --ignored --nocapture
echo "gpu-check: NCCL to a real vLLM on one GPU"
cargo test -p moult-runtime --features cuda --test gpu_vllm_nccl -- --ignored --nocapture
# 3. The sharded trainer's ranks on GPUs (docs/distributed.md): rank r on GPU r, collectives over
#    c10d's NCCL, against one CPU rank. NCCL takes one rank per GPU, and the test runs up to 4.
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -ge 4 ]; then
  echo "gpu-check: trainer ranks on $gpus GPUs over NCCL"
  MOULT_TEST_RANK_DEVICE=cuda cargo test -p moult-runtime --features cuda --test libtorch_trainer_ranks -- --nocapture
else
  echo "gpu-check: trainer ranks over NCCL skipped: they need 4 GPUs, this machine has $gpus"
fi
