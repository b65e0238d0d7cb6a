#!/usr/bin/env bash
# The five-minute tour of the parts (scripts/demo.sh runs the main job, a local RL run): set up,
# build, create a tiny random Qwen3 model, serve it with the built-in engine and generate from it
# through vLLM's token-in/token-out API (plain, streamed, paused and resumed); then run an agent
# written against the openai SDK, with a tool call, through the loopback server on a tiny chat model.
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
kill $ENGINE 2>/dev/null || true

if [ ! -f "$MODELS/qwen3-tiny-chat/model.safetensors" ]; then
  echo "demo: training a tiny Qwen3 chat model to say scripted turns (transformers, ~1 min)"
  "$MOULT_PYTHON" tests/python/make_chat_model.py "$MODELS" >/dev/null 2>&1
fi
"$BIN" engine --model "$MODELS/qwen3-tiny-chat" --port "$PORT" 2>/dev/null &
ENGINE=$!
"$MOULT_PYTHON" - "$PORT" <<'PY'
import sys, time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1)
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("the engine did not come up")
PY
echo
echo "demo: moult agents runs examples/agents/openai_weather.py (the openai SDK, a tool call) twice"
EPISODES="$(mktemp)"
"$BIN" agents --engine "http://127.0.0.1:$PORT" --model "$MODELS/qwen3-tiny-chat" \
  --agent examples/agents/openai_weather.py --tasks examples/agents/weather_tasks.jsonl \
  --python "$MOULT_PYTHON" --out "$EPISODES"
"$MOULT_PYTHON" - "$EPISODES" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    ep = json.loads(line)
    seg = ep["segments"][0]
    print(f"episode {ep['index']}: {ep['status']}, reward {ep['reward']}, answer {ep['info'].get('answer')!r}")
    print(f"  one segment of {len(seg['token_ids'])} tokens over {seg['turns']} turns: "
          f"{sum(seg['loss_mask'])} sampled (loss mask 1, with logprobs and policy versions), "
          f"{len(seg['loss_mask']) - sum(seg['loss_mask'])} rendered by the chat template (mask 0)")
print("See docs/loopback.md and docs/agents.md.")
PY
rm -f "$EPISODES"
