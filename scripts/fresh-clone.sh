#!/usr/bin/env bash
# Proves that the repository stands alone: copies the tracked files (nothing else: no build
# output, no models, nothing from beside the repository) into an empty folder under /tmp and runs
# the README's main command there for a few steps of the main recipe.
#   bash scripts/fresh-clone.sh          # 3 steps (MOULT_FRESH_STEPS to change)
# The virtualenv and cargo's target directory are shared with this checkout (MOULT_VENV,
# CARGO_TARGET_DIR) when they are set, so the check costs a build of moult, not an install.
set -euo pipefail
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STEPS="${MOULT_FRESH_STEPS:-3}"
# This checkout's virtualenv and build, unless set: the copy is about files, not a cold install.
export MOULT_VENV="${MOULT_VENV:-$SRC/.venv}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$SRC/target}"
# Under /tmp on purpose: where a user clones must not matter (pods mount a volume at /tmp).
WORK="$(mktemp -d /tmp/moult-fresh.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
DEST="$WORK/moult"
mkdir "$DEST"
echo "fresh-clone: copying the tracked files of $SRC to $DEST"
(cd "$SRC" && git ls-files -z | tar --null --ignore-failed-read -T - -cf -) | tar -xf - -C "$DEST"
cd "$DEST"
echo "fresh-clone: bash scripts/demo.sh, $STEPS steps"
MOULT_DEMO_STEPS="$STEPS" bash scripts/demo.sh 2>&1 | tee "$WORK/demo.log"
# The run must have trained and written what the README promises.
OUT="$DEST/runs/successor-demo"
for f in metrics.jsonl reward.svg summary.json moult.log; do
  [ -s "$OUT/$f" ] || { echo "fresh-clone: $OUT/$f is missing or empty" >&2; exit 1; }
done
steps="$(wc -l < "$OUT/metrics.jsonl")"
[ "$steps" -ge "$STEPS" ] || { echo "fresh-clone: $steps steps in metrics.jsonl, wanted $STEPS" >&2; exit 1; }
# The console shows progress and warnings only: INFO lines belong in moult.log.
if grep -P '\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d.*INFO' "$WORK/demo.log"; then
  echo "fresh-clone: the console shows INFO log lines (they belong in moult.log)" >&2
  exit 1
fi
grep -qE ' INFO ' "$OUT/moult.log" || { echo "fresh-clone: $OUT/moult.log has no INFO lines" >&2; exit 1; }
echo "fresh-clone: a copy of the tracked files alone trained $steps steps under $DEST"
# The docs' copy-paste blocks marked runnable, as a user pastes them after that first command.
[ -n "${MOULT_FRESH_SKIP_DOCS:-}" ] || python3 scripts/doc-blocks.py
