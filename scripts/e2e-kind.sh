#!/usr/bin/env bash
# Optional end to end run on a real cluster (kind or k3d), for users; CI on the
# project's machines cannot run a cluster and does not run this.
#
# Needs: docker, kind (or an existing kubectl context), kubectl, helm.
# It builds the image, loads it into kind, runs a DynamoDB-compatible store in
# the cluster (`tether local-store`), installs the chart, applies a sample
# stream against an in-cluster test upstream, and waits until it is Connected.
#
#   scripts/e2e-kind.sh            # creates a kind cluster named tether-e2e
#   KEEP=1 scripts/e2e-kind.sh     # leave the cluster running afterwards
set -euo pipefail
cd "$(dirname "$0")/.."
cluster=${CLUSTER:-tether-e2e}
ns=tether-system
image=tether:e2e

if ! kind get clusters | grep -qx "$cluster"; then
  kind create cluster --name "$cluster"
fi
docker build -t "$image" .
kind load docker-image "$image" --name "$cluster"
kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f -

# A DynamoDB-compatible store and the test upstream, both from the same image.
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
          args: ["test-upstream", "--listen", "0.0.0.0:9001"]
          ports: [{containerPort: 9001}]
---
apiVersion: v1
kind: Service
metadata: {name: upstream}
spec: {selector: {app: upstream}, ports: [{port: 9001}]}
YAML
kubectl -n "$ns" rollout status deploy/store deploy/upstream --timeout=120s

endpoint="http://store.$ns.svc:8000"
kubectl -n "$ns" run table-create --rm -i --restart=Never --image="$image" \
  --env=AWS_ENDPOINT_URL_DYNAMODB="$endpoint" --env=AWS_ACCESS_KEY_ID=x --env=AWS_SECRET_ACCESS_KEY=x \
  -- table create

helm upgrade --install tether charts/tether -n "$ns" \
  --set image.repository=tether --set image.tag=e2e --set image.pullPolicy=Never \
  --set table.endpoint="$endpoint" \
  --set extraEnv[0].name=AWS_ACCESS_KEY_ID --set extraEnv[0].value=x \
  --set extraEnv[1].name=AWS_SECRET_ACCESS_KEY --set extraEnv[1].value=x \
  --wait --timeout 180s

kubectl apply -f - <<YAML
apiVersion: tether.dev/v1alpha1
kind: StreamConnection
metadata: {name: e2e, namespace: default}
spec:
  url: "ws://upstream.$ns.svc:9001/e2e?after={last_seq}"
  sequence: {pointer: /seq}
  sink: {log: {}}
YAML
for _ in $(seq 1 60); do
  phase=$(kubectl get sconn e2e -o jsonpath='{.status.phase}' 2>/dev/null || true)
  [ "$phase" = "Connected" ] && break
  sleep 2
done
kubectl get sconn e2e -o wide
[ "$phase" = "Connected" ] || { echo "stream did not connect"; exit 1; }
echo "e2e: StreamConnection is Connected"
if [ -z "${KEEP:-}" ]; then kind delete cluster --name "$cluster"; fi
