#!/usr/bin/env bash
# The test command: set up (idempotent), check formatting and lints, run every test, then the
# operator's cluster tests on a real control plane (built from Go modules once, then cached).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$MOULT_ROOT"
echo "test: cargo fmt --check"
cargo fmt --all -- --check
echo "test: cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "test: cargo clippy, runtime with the cuda feature (NCCL weight sync; builds without CUDA)"
cargo clippy -p moult-runtime --features cuda --all-targets --quiet -- -D warnings
echo "test: cargo test"
cargo test --workspace
echo "test: operator cluster tests (etcd, kube-apiserver, controller-manager, scheduler, KWOK)"
bash scripts/test-cluster.sh up >/dev/null
trap 'bash scripts/test-cluster.sh down' EXIT
cargo test -p moult-operator --test cluster -- --ignored
echo "test: cluster mode end to end (the operator's pods run as local processes of moult)"
cargo build -p moult-operator --bin moult-operator
cargo test -p moult-runtime --test cluster_kubelet --test cluster_run -- --ignored
