#!/usr/bin/env bash
# The test command: set up (idempotent), check formatting and lints, run every test.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$MOULT_ROOT"
echo "test: cargo fmt --check"
cargo fmt --all -- --check
echo "test: cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "test: cargo test"
cargo test --workspace
