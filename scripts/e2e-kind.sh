#!/usr/bin/env bash
# Optional end to end run on a kind cluster, for users; CI on the project's
# machines cannot run a cluster and does not run this (scripts/check-deploy
# lints it and validates the manifests below against Kubernetes' schemas and
# the CRD's).
#
# Needs: docker (with BuildKit, the default builder), kind, kubectl, helm.
# It builds the image, loads it into kind, runs a DynamoDB-compatible store
# (`tether local-store`) and a replaying demo feed (`tether demo feed`) in the
# cluster, creates the table, installs the chart, applies a stream that reads
# the feed, and waits until the stream is Ready.
#
#   scripts/e2e-kind.sh            # creates a kind cluster named tether-e2e
#   CLUSTER=dev scripts/e2e-kind.sh  # uses kind cluster "dev", creating it if needed
#   KEEP=1 scripts/e2e-kind.sh     # keep a cluster it created (one that
#                                  # existed before is always kept)
set -euo pipefail
cd "$(dirname "$0")/.."
cluster=${CLUSTER:-tether-e2e}
ns=tether-system
image=tether:e2e
# The feed's in-cluster name, exactly as the stream's URL spells it. It
# resolves to a Service address inside the chart's default worker.denyCidrs,
# which a worker dials only for a host listed by this exact name in
# worker.allowHosts (a pattern such as "*" is not enough).
upstream_host=upstream.$ns.svc

# Every call goes to this cluster, whatever the current kubectl context is.
context=kind-$cluster
kubectl() { command kubectl --context "$context" "$@"; }
helm() { command helm --kube-context "$context" "$@"; }

created=""
if ! kind get clusters | grep -qx "$cluster"; then
  kind create cluster --name "$cluster"
  created=1
fi
finish() {
  status=$?
  if [ "$status" -ne 0 ]; then
    echo "e2e failed; the operator's last log lines:" >&2
    kubectl -n "$ns" logs deploy/tether --tail=50 >&2 || true
    kubectl get sconn -A -o wide >&2 || true
  fi
  if [ -n "$created" ] && [ -z "${KEEP:-}" ]; then
    kind delete cluster --name "$cluster"
  fi
}
trap finish EXIT

DOCKER_BUILDKIT=1 docker build -t "$image" --build-arg REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)" .
kind load docker-image "$image" --name "$cluster"
kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f -

# A DynamoDB-compatible store and the demo feed, both from the same image.
kubectl -n "$ns" apply -f - <<YAML
apiVersion: apps/v1
kind: Deployment
metadata: {name: store}
spec:
  selector: {matchLabels: {app: store}}
  template:
    metadata: {labels: {app: store}}
    spec:
      containers:
        - name: store
          image: $image
          args: ["local-store", "--listen", "0.0.0.0:8000"]
          ports: [{containerPort: 8000}]
---
apiVersion: v1
kind: Service
metadata: {name: store}
spec: {selector: {app: store}, ports: [{port: 8000}]}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: upstream}
spec:
  selector: {matchLabels: {app: upstream}}
  template:
    metadata: {labels: {app: upstream}}
    spec:
      containers:
        - name: upstream
          image: $image
          args: ["demo", "feed", "--listen", "0.0.0.0:9001"]
          ports: [{containerPort: 9001}]
---
apiVersion: v1
kind: Service
metadata: {name: upstream}
spec: {selector: {app: upstream}, ports: [{port: 9001}]}
YAML
kubectl -n "$ns" rollout status deploy/store --timeout=120s
kubectl -n "$ns" rollout status deploy/upstream --timeout=120s

endpoint="http://store.$ns.svc:8000"
kubectl -n "$ns" run table-create --rm -i --restart=Never --image="$image" \
  --env=AWS_ENDPOINT_URL_DYNAMODB="$endpoint" --env=AWS_ACCESS_KEY_ID=x --env=AWS_SECRET_ACCESS_KEY=x \
  -- table create

helm upgrade --install tether charts/tether -n "$ns" \
  --set image.repository=tether --set image.tag=e2e --set image.pullPolicy=Never \
  --set table.endpoint="$endpoint" \
  --set "worker.allowHosts={$upstream_host}" \
  --set extraEnv[0].name=AWS_ACCESS_KEY_ID --set extraEnv[0].value=x \
  --set extraEnv[1].name=AWS_SECRET_ACCESS_KEY --set extraEnv[1].value=x \
  --wait --timeout 180s

kubectl apply -f - <<YAML
apiVersion: tether.dev/v1alpha1
kind: StreamConnection
metadata: {name: e2e, namespace: default}
spec:
  url: "ws://$upstream_host:9001/e2e?after={last_seq}"
  sequence: {pointer: /seq}
  sink: {log: {}}
YAML
kubectl wait --for=condition=Ready sconn/e2e --timeout=120s
# Messages flow and are checkpointed: the status reports a sequence number
# (the feed numbers messages from 1).
for _ in $(seq 1 30); do
  last_seq=$(kubectl get sconn e2e -o jsonpath='{.status.lastSeq}' 2>/dev/null || true)
  [ "${last_seq:-0}" -gt 0 ] && break
  sleep 2
done
kubectl get sconn e2e -o wide
[ "${last_seq:-0}" -gt 0 ] || { echo "the stream is Ready but reported no checkpoint"; exit 1; }
echo "e2e: StreamConnection is Ready, checkpointed at seq $last_seq"
