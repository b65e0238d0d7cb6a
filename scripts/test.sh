#!/usr/bin/env bash
# The test command: set up (idempotent), check formatting and lints, run every test, then the
# operator's cluster tests on a real control plane (built from Go modules once, then cached), and
# last the main job in a copy of the tracked files alone (scripts/fresh-clone.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$MOULT_ROOT"
# A real vLLM (CPU build, its own virtualenv) for the tests that judge moult against it.
MOULT_VLLM_PYTHON="$(bash scripts/setup-vllm.sh | tail -n 1)"
export MOULT_VLLM_PYTHON
echo "test: cargo fmt --check"
cargo fmt --all -- --check
echo "test: cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "test: cargo clippy, runtime with the cuda feature (NCCL weight sync; builds without CUDA)"
cargo clippy -p moult-runtime --features cuda --all-targets --quiet -- -D warnings
echo "test: the agent-pod build of moult (no libtorch: what the init image copies into agent pods)"
cargo clippy -p moult-runtime --no-default-features --lib --bins --quiet -- -D warnings
cargo build -p moult-runtime --no-default-features --bin moult --quiet
# Kept apart: the default build below writes the same path. The cluster test runs agent pods on it.
TARGET="${CARGO_TARGET_DIR:-$MOULT_ROOT/target}"
cp "$TARGET/debug/moult" "$TARGET/moult-no-torch"
export MOULT_AGENT_BIN="$TARGET/moult-no-torch"
echo "test: cargo test"
cargo test --workspace
echo "test: operator cluster tests (etcd, kube-apiserver, controller-manager, scheduler, KWOK)"
bash scripts/test-cluster.sh up >/dev/null
trap 'bash scripts/test-cluster.sh down' EXIT
cargo test -p moult-operator --test cluster --test cluster_security -- --ignored
echo "test: cluster mode end to end (the operator's pods run as local processes of moult)"
cargo build -p moult-operator --bin moult-operator
cargo test -p moult-runtime --test cluster_kubelet --test cluster_run -- --ignored --test-threads 1
echo "test: a copy of the tracked files alone runs the main job (README's first command)"
bash scripts/fresh-clone.sh
