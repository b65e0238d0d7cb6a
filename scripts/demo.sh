#!/usr/bin/env bash
# The main job: a local RL run. Sets up (idempotent), builds moult, makes the main recipe's base
# model (examples/successor: a tiny Qwen3 that answers in the task's format but at chance), and
# runs `moult run examples/successor/rlrun.yaml`: built-in engine, router, Python Env agents,
# rollout pool, trainer and weight sync in one process, on CPU. The reward climbs from chance
# (~0.1) to above 0.9; metrics, the reward plot, checkpoints and the log land in
# runs/successor-demo. MOULT_DEMO_STEPS=N stops after N steps (scripts/fresh-clone.sh uses it).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$MOULT_ROOT"
echo "demo: building moult (release)"
cargo build --release --quiet -p moult-runtime
BIN="${CARGO_TARGET_DIR:-$MOULT_ROOT/target}/release/moult"
echo "demo: making the recipe's base model (transformers; skipped when current)"
"$MOULT_PYTHON" examples/successor/make_model.py examples/successor/model
OUT=runs/successor-demo
rm -rf "$OUT"   # a fresh run each time (moult run resumes from the checkpoints in --out)
# The Env agent runs under this Python (the recipe's command is `python env.py`).
STEPS=()
[ -n "${MOULT_DEMO_STEPS:-}" ] && STEPS=(--steps "$MOULT_DEMO_STEPS")
PATH="$(dirname "$MOULT_PYTHON"):$PATH" "$BIN" run examples/successor/rlrun.yaml --out "$OUT" "${STEPS[@]}"
echo "demo: the reward curve is $OUT/reward.svg; every step's metrics are in $OUT/metrics.jsonl"
echo "      (see docs/run.md). The tour of the parts: bash scripts/tour.sh"
