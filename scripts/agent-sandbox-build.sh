#!/usr/bin/env bash
# Builds kubernetes-sigs/agent-sandbox's controller from its Go module, with its CRDs beside it,
# for the test control plane (scripts/test-cluster.sh starts them). Cached outside the clone by
# version; prints the folder on its last line.
#   MOULT_AGENT_SANDBOX_CACHE  where the versioned folders live (default ~/.cache/moult/agent-sandbox)
set -euo pipefail
VERSION=v1.0.1
command -v go >/dev/null || export PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "agent-sandbox-build: go not found (Go 1.26+ is needed)" >&2; exit 1; }
CACHE="${MOULT_AGENT_SANDBOX_CACHE:-$HOME/.cache/moult/agent-sandbox}"
BIN="$CACHE/$VERSION"
if [ -f "$BIN/.complete" ]; then
  echo "$BIN"
  exit 0
fi
echo "agent-sandbox-build: building sigs.k8s.io/agent-sandbox $VERSION into $BIN" >&2
start=$(date +%s)
rm -rf "$BIN.tmp" && mkdir -p "$BIN.tmp/crds"
# `go install pkg@version` builds with the module's own go.mod, checked against the checksum
# database like any dependency.
GOBIN="$BIN.tmp" go install -trimpath "sigs.k8s.io/agent-sandbox/cmd/agent-sandbox-controller@$VERSION"
SRC="$(go env GOMODCACHE)/sigs.k8s.io/agent-sandbox@$VERSION"
cp "$SRC"/k8s/crds/*.yaml "$BIN.tmp/crds/"
chmod -R u+w "$BIN.tmp"
rm -rf "$BIN" && mv "$BIN.tmp" "$BIN"
echo "built in $(( $(date +%s) - start ))s" > "$BIN/.complete"
echo "$BIN"
