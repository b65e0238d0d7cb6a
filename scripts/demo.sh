#!/usr/bin/env bash
# The main job, until the local RL run lands: set up, build, create a tiny random Qwen3 model,
# serve it with the built-in engine and generate from it through vLLM's token-in/token-out API
# (plain, streamed, paused and resumed across a live weight update).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$MOULT_ROOT"
echo "demo: building moult (release)"
cargo build --release --quiet -p moult-runtime
BIN="${CARGO_TARGET_DIR:-$MOULT_ROOT/target}/release/moult"
MODELS="$MOULT_ROOT/models"
if [ ! -f "$MODELS/qwen3-tiny/model.safetensors" ]; then
  echo "demo: creating tiny random Qwen3 models in $MODELS (transformers)"
  "$MOULT_PYTHON" tests/python/make_tiny_models.py "$MODELS" >/dev/null 2>&1
fi
PORT="${MOULT_DEMO_PORT:-8431}"
"$BIN" engine --model "$MODELS/qwen3-tiny" --port "$PORT" &
ENGINE=$!
trap 'kill $ENGINE 2>/dev/null || true' EXIT
"$MOULT_PYTHON" scripts/demo_client.py "http://127.0.0.1:$PORT" "$MODELS/qwen3-tiny"
