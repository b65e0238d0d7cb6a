#!/usr/bin/env bash
# Keeps a long-lived cargo target directory (CI's, in the home directory) from filling the disk:
#   - when Cargo.toml's build profiles changed since the last run, nothing built before can be
#     reused, so the old builds go at once (a stamp in the target dir remembers the profiles);
#   - incremental caches go (CI builds each commit once);
#   - of each test or binary executable built several times (each feature set or source change
#     leaves one more, large with libtorch linked), the newest stays;
#   - if the directory is still over MOULT_TARGET_MAX_GB (default 60), it goes whole.
# Cargo rebuilds whatever it finds missing, so none of this can break a build.
# Usage: bash scripts/prune-target.sh [TARGET_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET="${1:-${CARGO_TARGET_DIR:-$ROOT/target}}"
[ -d "$TARGET" ] || exit 0
before=$(du -sm "$TARGET" | cut -f1)
profiles=$(awk '/^\[/ { p = /^\[profile/ } p' "$ROOT/Cargo.toml" | sha256sum | cut -c1-16)
stamp="$TARGET/.moult-profiles"
if [ "$(cat "$stamp" 2>/dev/null)" != "$profiles" ]; then
  echo "prune-target: build profiles changed: removing the old builds"
  rm -rf "$TARGET/debug" "$TARGET/release"
fi
echo "$profiles" >"$stamp"
rm -rf "$TARGET"/*/incremental
for deps in "$TARGET"/*/deps; do
  [ -d "$deps" ] || continue
  find "$deps" -maxdepth 1 -type f -perm -u+x -regextype posix-extended -regex '.*-[0-9a-f]{16}' \
    -printf '%T@ %p\n' | sort -rn | awk '{ name = $2; sub(/-[0-9a-f]+$/, "", name); if (seen[name]++) print $2 }' \
    | xargs -r rm -f
done
if [ "$(du -sm "$TARGET" | cut -f1)" -gt $((${MOULT_TARGET_MAX_GB:-60} * 1024)) ]; then
  echo "prune-target: still over ${MOULT_TARGET_MAX_GB:-60} GB: removing every build"
  rm -rf "$TARGET/debug" "$TARGET/release"
fi
after=$(du -sm "$TARGET" | cut -f1)
echo "prune-target: $TARGET from ${before} MB to ${after} MB"
