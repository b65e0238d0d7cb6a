#!/usr/bin/env bash
# A real Kubernetes control plane on loopback for the operator's cluster tests: etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler and KWOK (fake nodes whose pods run),
# all built from Go modules by scripts/cluster-build.sh, and kubernetes-sigs/agent-sandbox's and
# Kueue's controllers and CRDs (scripts/controller-build.sh). No docker, no kubelet. Kueue runs
# without its webhooks (the API server cannot reach them), and needs root like the pod network:
# its manager reads a metrics certificate from /etc/kueue/metrics/certs.
#
#   bash scripts/test-cluster.sh up     # build if needed, start, wait until nodes are Ready
#   bash scripts/test-cluster.sh down   # stop everything this script started
#   bash scripts/test-cluster.sh env    # print the exports (KUBECONFIG, PATH) for a shell
#
# State (certificates, etcd data, logs, kubeconfig, pids) lives in MOULT_CLUSTER_DIR (default
# ~/.cache/moult/test-cluster); `up` starts from a fresh etcd. Ports: MOULT_CLUSTER_PORT (the
# apiserver, default 26443) and the four after it (etcd client and peer, Kueue's health and
# webhook servers).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${MOULT_CLUSTER_DIR:-$HOME/.cache/moult/test-cluster}"
PORT="${MOULT_CLUSTER_PORT:-26443}"
ETCD_PORT=$((PORT + 1))
ETCD_PEER_PORT=$((PORT + 2))
COMPONENTS=(kueue agent-sandbox-controller kwok kube-scheduler kube-controller-manager kube-apiserver etcd)

log() { echo "test-cluster: $*" >&2; }

stop() {
  for c in "${COMPONENTS[@]}"; do
    local f="$DIR/$c.pid"
    [ -f "$f" ] || continue
    local pid; pid="$(cat "$f")"
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
  done
}

certs() {
  local d="$DIR/pki"
  [ -f "$d/admin.crt" ] && return 0
  command -v openssl >/dev/null || { log "openssl is needed to make the cluster's certificates (apt-get install openssl)"; exit 1; }
  mkdir -p "$d"
  (
    cd "$d"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -keyout ca.key -out ca.crt -subj "/CN=moult-test-ca" 2>/dev/null
    cat > apiserver.ext <<EOF
subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
extendedKeyUsage=serverAuth
EOF
    openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver" 2>/dev/null
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -extfile apiserver.ext -out apiserver.crt 2>/dev/null
    echo "extendedKeyUsage=clientAuth" > client.ext
    openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr -subj "/O=system:masters/CN=moult-test-admin" 2>/dev/null
    openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -extfile client.ext -out admin.crt 2>/dev/null
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  )
}

kubeconfig() {
  local d="$DIR/pki"
  cat > "$DIR/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: moult-test
  cluster:
    server: https://127.0.0.1:$PORT
    certificate-authority: $d/ca.crt
users:
- name: admin
  user:
    client-certificate: $d/admin.crt
    client-key: $d/admin.key
contexts:
- name: moult-test
  context: {cluster: moult-test, user: admin}
current-context: moult-test
EOF
}

launch() {
  local name="$1"; shift
  local bin="$BIN"
  [ "$name" = agent-sandbox-controller ] && bin="$SANDBOX_BIN"
  [ "$name" = kueue ] && bin="$KUEUE_BIN"
  "$bin/$name" "$@" >"$DIR/$name.log" 2>&1 &
  echo $! > "$DIR/$name.pid"
}

wait_for() {
  local what="$1" tries="$2"; shift 2
  for _ in $(seq "$tries"); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  log "timed out waiting for $what; the logs are in $DIR"
  for c in "${COMPONENTS[@]}"; do [ -f "$DIR/$c.log" ] && { echo "--- $c.log (tail)" >&2; tail -n 15 "$DIR/$c.log" >&2; }; done
  return 1
}

# KWOK's pod IPs (--cidr below) made local addresses of this machine, so that the cluster
# end-to-end test can run pods' containers as processes bound to their pod IPs, and the
# EndpointSlices the API server holds point at them. Needs root (CAP_NET_ADMIN); without it
# only that test cannot run.
POD_CIDR=10.244.0.0/16
pod_network() {
  if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing iproute2 (the ip command)"
    apt-get install -y -qq iproute2 >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq iproute2 >/dev/null 2>&1; } || true
  fi
  ip route show table local 2>/dev/null | grep -q "^local $POD_CIDR " && return 0
  if ! ip route add local "$POD_CIDR" dev lo 2>/dev/null; then
    log "could not route $POD_CIDR to loopback (needs root): the runtime's cluster end-to-end test will fail"
  fi
}

up() {
  BIN="$(bash "$ROOT/scripts/cluster-build.sh" | tail -n 1)"
  SANDBOX_BIN="$(bash "$ROOT/scripts/controller-build.sh" agent-sandbox | tail -n 1)"
  KUEUE_BIN="$(bash "$ROOT/scripts/controller-build.sh" kueue | tail -n 1)"
  mkdir -p "$DIR"
  stop
  for p in "$PORT" "$ETCD_PORT" "$ETCD_PEER_PORT"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
      log "port $p is in use; set MOULT_CLUSTER_PORT to another base port"; exit 1
    fi
  done
  certs
  kubeconfig
  rm -rf "$DIR/etcd"
  local start; start=$(date +%s)
  local d="$DIR/pki"
  launch etcd --name moult-test --data-dir "$DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "moult-test=http://127.0.0.1:$ETCD_PEER_PORT" \
    --unsafe-no-fsync --quota-backend-bytes 2147483648 --log-level warn
  launch kube-apiserver --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$PORT" \
    --tls-cert-file "$d/apiserver.crt" --tls-private-key-file "$d/apiserver.key" --client-ca-file "$d/ca.crt" \
    --service-account-issuer https://kubernetes.default.svc --service-account-key-file "$d/sa.pub" \
    --service-account-signing-key-file "$d/sa.key" --service-cluster-ip-range 10.96.0.0/16 \
    --authorization-mode Node,RBAC --allow-privileged --endpoint-reconciler-type none \
    --enable-priority-and-fairness=false --profiling=false --v 1
  wait_for "kube-apiserver" 240 "$BIN/kubectl" --kubeconfig "$DIR/kubeconfig" get --raw /readyz
  launch kube-controller-manager --kubeconfig "$DIR/kubeconfig" --authentication-kubeconfig "$DIR/kubeconfig" \
    --authorization-kubeconfig "$DIR/kubeconfig" --leader-elect=false --secure-port 0 \
    --service-account-private-key-file "$d/sa.key" --root-ca-file "$d/ca.crt" \
    --use-service-account-credentials=false --controllers '*' \
    --concurrent-gc-syncs 10 --v 1
  launch kube-scheduler --kubeconfig "$DIR/kubeconfig" --authentication-kubeconfig "$DIR/kubeconfig" \
    --authorization-kubeconfig "$DIR/kubeconfig" --leader-elect=false --secure-port 0 --v 1
  launch kwok --kubeconfig "$DIR/kubeconfig" --config "$ROOT/tests/cluster/kwok-stages.yaml" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
    --cidr "$POD_CIDR" --node-ip 10.240.0.1 --node-lease-duration-seconds 40
  pod_network
  local k=("$BIN/kubectl" --kubeconfig "$DIR/kubeconfig")
  "${k[@]}" apply -f "$ROOT/tests/cluster/nodes.yaml" >/dev/null
  wait_for "nodes Ready" 240 "${k[@]}" wait --for=condition=Ready node --all --timeout=1s
  # Pods need their namespace's default ServiceAccount, which the controller-manager creates.
  wait_for "the default ServiceAccount" 240 "${k[@]}" get serviceaccount default -n default
  # kubernetes-sigs/agent-sandbox, for runs with spec.agent.sandbox: its CRDs and its controller
  # with the extensions (SandboxTemplate, SandboxClaim, SandboxWarmPool).
  "${k[@]}" apply --server-side -f "$SANDBOX_BIN/crds" >/dev/null
  "${k[@]}" wait --for condition=established --timeout=60s -f "$SANDBOX_BIN/crds" >/dev/null
  KUBECONFIG="$DIR/kubeconfig" launch agent-sandbox-controller --extensions --leader-elect=false \
    --metrics-bind-address 0 --health-probe-bind-address 0
  start_kueue "${k[@]}"
  log "up in $(( $(date +%s) - start ))s: $("${k[@]}" get nodes --no-headers | wc -l) nodes Ready; KUBECONFIG=$DIR/kubeconfig"
  print_env
}

# Whether http://127.0.0.1:PORT/PATH answers 200 (bash alone: no curl needed).
http_ok() {
  exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
  printf 'GET %s HTTP/1.0\r\n\r\n' "$2" >&3
  head -n 1 <&3 | grep -q ' 200 '
}

# Kueue, for runs with a queue: its CRDs and its manager, with no webhooks registered (nothing
# calls them), its certificates self-signed, leader election and the visibility server off.
start_kueue() {
  "$@" apply --server-side -f "$KUEUE_BIN/crds" >/dev/null
  "$@" wait --for condition=established --timeout=60s -f "$KUEUE_BIN/crds" >/dev/null
  "$@" create namespace kueue-system >/dev/null 2>&1 || true
  local certs="$DIR/kueue-certs"
  if [ ! -f "$certs/tls.crt" ]; then
    mkdir -p "$certs"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -keyout "$certs/tls.key" \
      -out "$certs/tls.crt" -subj "/CN=kueue" 2>/dev/null
  fi
  if ! mkdir -p /etc/kueue/metrics/certs 2>/dev/null || ! cp "$certs"/tls.* /etc/kueue/metrics/certs/ 2>/dev/null; then
    log "could not write /etc/kueue/metrics/certs (needs root): Kueue does not start, and the Kueue test cannot run"
    return 0
  fi
  printf '%s\n' "apiVersion: config.kueue.x-k8s.io/v1beta2" "kind: Configuration" \
    "namespace: kueue-system" "manageJobsWithoutQueueName: false" \
    "internalCertManagement: {enable: false}" "leaderElection: {leaderElect: false}" \
    "health: {healthProbeBindAddress: \"127.0.0.1:$((PORT + 3))\"}" "metrics: {bindAddress: \"0\"}" \
    "webhook: {port: $((PORT + 4)), host: 127.0.0.1, certDir: $certs}" \
    "integrations: {frameworks: [batch/job]}" > "$DIR/kueue.yaml"
  KUBECONFIG="$DIR/kubeconfig" launch kueue --config "$DIR/kueue.yaml" --feature-gates VisibilityOnDemand=false
  wait_for "Kueue" 120 http_ok "$((PORT + 3))" /readyz
}

print_env() {
  BIN="${BIN:-$(bash "$ROOT/scripts/cluster-build.sh" | tail -n 1)}"
  echo "export KUBECONFIG=$DIR/kubeconfig"
  echo "export MOULT_K8S_BIN=$BIN"
  echo "export PATH=$BIN:\$PATH"
}

case "${1:-}" in
  up) up ;;
  down) stop; log "stopped" ;;
  env) print_env ;;
  *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
