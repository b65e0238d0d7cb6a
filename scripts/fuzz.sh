#!/usr/bin/env bash
# The fuzz targets (docs/security.md, "Fuzzing"), each run for SECONDS (default 60) on fresh
# random seeds: the runtime's (runtime/tests/fuzz.rs) and, where it exists, the operator's
# (operator/tests/fuzz.rs). Each prints `target | executions | failures` and, for a failure, the
# shrunk input. Extra arguments select targets by name. `cargo test` runs the same targets
# briefly with fixed seeds.
#
#   bash scripts/fuzz.sh 400            # every target for 400 s
#   bash scripts/fuzz.sh 60 sampling    # one target for a minute
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MOULT_ROOT"
export MOULT_FUZZ_SECONDS="${1:-60}"
shift || true
status=0
echo "fuzz: runtime targets, ${MOULT_FUZZ_SECONDS}s each"
cargo test -p moult-runtime --test fuzz -- --nocapture "$@" || status=1
if [ -f operator/tests/fuzz.rs ]; then
  echo "fuzz: operator targets, ${MOULT_FUZZ_SECONDS}s each"
  cargo test -p moult-operator --test fuzz -- --nocapture "$@" || status=1
fi
exit "$status"
