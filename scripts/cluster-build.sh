#!/usr/bin/env bash
# Builds the test control plane from Go modules (tests/cluster/go.mod): kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, etcd, helm and kwok. The binaries go to a
# cache outside the clone, keyed by a hash of go.mod and go.sum, so they are rebuilt only when a
# pin changes. Prints the binary directory on its last line.
#   MOULT_K8S_CACHE  where the keyed binary directories live (default ~/.cache/moult/k8s-bin)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MOD="$ROOT/tests/cluster"
# Go's official tarball installs into /usr/local/go, which not every environment puts on PATH.
command -v go >/dev/null || export PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "cluster-build: go not found (Go 1.26+ is needed to build the test control plane)" >&2; exit 1; }
KEY="$(cat "$MOD/go.mod" "$MOD/go.sum" "$MOD/cmd/etcd/main.go" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)"
CACHE="${MOULT_K8S_CACHE:-$HOME/.cache/moult/k8s-bin}"
BIN="$CACHE/$KEY"
TOOLS=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd helm kwok)
if [ -f "$BIN/.complete" ]; then
  echo "$BIN"
  exit 0
fi
K8S_VERSION="$(cd "$MOD" && go list -m -f '{{.Version}}' k8s.io/kubernetes)"
echo "cluster-build: building ${TOOLS[*]} (Kubernetes $K8S_VERSION) into $BIN; a cold build takes a while" >&2
mkdir -p "$BIN.tmp"
start=$(date +%s)
# The version stamps that release builds set (kubectl and helm compare them with the server's).
VPKG=k8s.io/component-base/version
LDFLAGS="-s -w -X $VPKG.gitVersion=$K8S_VERSION -X $VPKG.gitMajor=1 -X $VPKG.gitMinor=$(echo "$K8S_VERSION" | cut -d. -f2) -X $VPKG.gitTreeState=clean"
LDFLAGS="$LDFLAGS -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
(
  cd "$MOD"
  go build -trimpath -buildvcs=false -ldflags "$LDFLAGS" -o "$BIN.tmp/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl \
    ./cmd/etcd \
    helm.sh/helm/v4/cmd/helm \
    sigs.k8s.io/kwok/cmd/kwok
)
for t in "${TOOLS[@]}"; do [ -x "$BIN.tmp/$t" ] || { echo "cluster-build: $t was not built" >&2; exit 1; }; done
rm -rf "$BIN" && mv "$BIN.tmp" "$BIN"
# Binaries of older pins are not needed any more.
find "$CACHE" -mindepth 1 -maxdepth 1 ! -name "$KEY" -exec rm -rf {} +
echo "built in $(( $(date +%s) - start ))s" > "$BIN/.complete"
echo "cluster-build: done in $(( $(date +%s) - start ))s" >&2
echo "$BIN"
