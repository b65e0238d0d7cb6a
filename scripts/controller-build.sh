#!/usr/bin/env bash
# Builds a controller that the test control plane runs beside Kubernetes, from its Go module, with
# its CRDs beside it (scripts/test-cluster.sh starts them):
#   agent-sandbox  kubernetes-sigs/agent-sandbox, for runs with spec.agent.sandbox
#   kueue          Kueue, for runs with a queue (docs/operator.md#kueue)
# Cached outside the clone by name and version; prints the folder on its last line.
#   bash scripts/controller-build.sh agent-sandbox|kueue
#   MOULT_CONTROLLER_CACHE  where the folders live (default ~/.cache/moult)
set -euo pipefail
NAME="${1:-}"
case "$NAME" in
  agent-sandbox) MODULE=sigs.k8s.io/agent-sandbox VERSION=v1.0.1 CMD=cmd/agent-sandbox-controller CRDS=k8s/crds ;;
  kueue) MODULE=sigs.k8s.io/kueue VERSION=v0.17.0 CMD=cmd/kueue CRDS=config/components/crd/bases ;;
  *) echo "usage: $0 agent-sandbox|kueue" >&2; exit 2 ;;
esac
command -v go >/dev/null || export PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "controller-build: go not found (Go 1.26+ is needed)" >&2; exit 1; }
BIN="${MOULT_CONTROLLER_CACHE:-$HOME/.cache/moult}/$NAME/$VERSION"
if [ -f "$BIN/.complete" ]; then
  echo "$BIN"
  exit 0
fi
echo "controller-build: building $MODULE $VERSION into $BIN" >&2
start=$(date +%s)
rm -rf "$BIN.tmp" && mkdir -p "$BIN.tmp/crds"
# `go install pkg@version` builds with the module's own go.mod, checked against the checksum
# database like any dependency.
GOBIN="$BIN.tmp" go install -trimpath "$MODULE/$CMD@$VERSION"
SRC="$(go env GOMODCACHE)/$MODULE@$VERSION"
cp "$SRC/$CRDS"/*.yaml "$BIN.tmp/crds/"
chmod -R u+w "$BIN.tmp"
rm -rf "$BIN" && mv "$BIN.tmp" "$BIN"
echo "built in $(( $(date +%s) - start ))s" > "$BIN/.complete"
echo "$BIN"
