{{/* Chart name, overridable. */}}
{{- define "tether.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified name: release-chart, unless the release already contains it. */}}
{{- define "tether.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels on every object except the pods (see "tether.podLabels"). */}}
{{- define "tether.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tether.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the pods (never change them after install). */}}
{{- define "tether.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tether.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Labels of the pod template: only labels that stay put across chart releases.
A chart-version label here would change the pod template on every chart
bump, restart every worker and reconnect every stream.
*/}}
{{- define "tether.podLabels" -}}
{{ include "tether.selectorLabels" . }}
{{- with .Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The image: the chart's appVersion unless image.tag is set. */}}
{{- define "tether.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/*
A value as an environment variable's text. Integral numbers print without an
exponent (YAML numbers reach templates as float64: 1000000 would be 1e+06).
*/}}
{{- define "tether.envValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}
{{- int64 . }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/*
Seconds in a duration as the binary parses it: a number and one unit of ms,
s, m or h ("1500ms", "10s", "1.5m"). Prints a float; fails on anything else.
*/}}
{{- define "tether.durationSeconds" -}}
{{- $duration := toString . }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $duration }}
{{- $unit := trimPrefix $number $duration }}
{{- $unitSeconds := dict "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0 }}
{{- if or (not $number) (not (hasKey $unitSeconds $unit)) }}
{{- fail (printf "%q is not a duration: use a number and one of ms, s, m, h (e.g. 1500ms, 10s, 1m)" $duration) }}
{{- end }}
{{- mulf $number (get $unitSeconds $unit) }}
{{- end }}

{{/* The binary's default --drain-timeout (src/config.rs, DEFAULT_DRAIN_TIMEOUT). */}}
{{- define "tether.defaultDrainTimeout" -}}
10s
{{- end }}

{{/*
Seconds a pod needs after its drain: the final audit releases what the drain
left and the worker marks itself as having left the fleet, each a DynamoDB
write bounded by the store call deadline. terminationGracePeriodSeconds must
exceed the drain timeout plus this margin, or Kubernetes kills the pod before
those writes and its streams wait a whole leaseDuration for a new owner.
*/}}
{{- define "tether.drainMarginSeconds" -}}
5
{{- end }}

{{/*
spec.replicas of this release's Deployment as it runs in the cluster, or
nothing: `helm template`, `--dry-run` and a first install see no Deployment.
*/}}
{{- define "tether.runningReplicas" -}}
{{- $running := lookup "apps/v1" "Deployment" .Release.Namespace (include "tether.fullname" .) }}
{{- dig "spec" "replicas" "" $running }}
{{- end }}

{{/* Service account name. */}}
{{/*
Name of cluster-scoped objects (and of objects in other namespaces): the
release namespace is part of it, so the same release name installed in two
namespaces never claims the other's ClusterRoles or Roles.
*/}}
{{- define "tether.clusterName" -}}
{{- printf "%s-%s" (include "tether.fullname" .) .Release.Namespace | trunc 200 | trimSuffix "-" }}
{{- end }}

{{/* The leader-election Lease of this installation (as the controller names it). */}}
{{- define "tether.leaderLease" -}}
{{- if .Values.controller.installation }}tether-controller-{{ .Values.controller.installation }}{{ else }}tether-controller{{ end }}
{{- end }}

{{- define "tether.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tether.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Fail on contradictory settings. */}}
{{- define "tether.validate" -}}
{{- if and (not .Values.serviceAccount.create) (not .Values.serviceAccount.name) }}
{{- fail "serviceAccount.create=false needs serviceAccount.name: binding tether's rights to the namespace's default account would give them to every pod that runs as it" }}
{{- end }}
{{- if and .Values.autoscaling.hpa.enabled .Values.autoscaling.keda.enabled }}
{{- fail "autoscaling.hpa.enabled and autoscaling.keda.enabled are mutually exclusive: KEDA creates its own HPA; enable one of them" }}
{{- end }}
{{- if and .Values.rbac.secrets.clusterWide (gt (len .Values.rbac.secrets.namespaces) 0) }}
{{- fail "rbac.secrets.clusterWide already grants every namespace; leave rbac.secrets.namespaces empty" }}
{{- end }}
{{- /* SIGKILL before the drain and its last writes end strands streams for a lease. */}}
{{- $drainTimeout := .Values.worker.drainTimeout | default (printf "%s, the binary's default" (include "tether.defaultDrainTimeout" .)) }}
{{- $drainSeconds := include "tether.durationSeconds" (.Values.worker.drainTimeout | default (include "tether.defaultDrainTimeout" .)) | float64 }}
{{- $needed := addf $drainSeconds (include "tether.drainMarginSeconds" . | float64) }}
{{- if le (float64 .Values.terminationGracePeriodSeconds) $needed }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed worker.drainTimeout (%s) plus %s s for the writes after the drain (releasing what is left, leaving the fleet): set it above %v or shorten worker.drainTimeout" .Values.terminationGracePeriodSeconds $drainTimeout (include "tether.drainMarginSeconds" .) $needed) }}
{{- end }}
{{- end }}

{{- /* The rules of watching and managing StreamConnections. With
controller.watchNamespaces they are granted in those namespaces only (a Role
each), not cluster-wide. */}}
{{- define "tether.streamRules" }}
  # Watch StreamConnections and manage the finalizer that cleans up the stream's item in the table.
  - apiGroups: ["tether.dev"]
    resources: ["streamconnections"]
    verbs: ["get", "list", "watch", "patch"]
  - apiGroups: ["tether.dev"]
    resources: ["streamconnections/status"]
    verbs: ["patch"]
  - apiGroups: ["tether.dev"]
    resources: ["streamconnections/finalizers"]
    verbs: ["update"]
  # Events for ownership changes and failures.
  - apiGroups: ["events.k8s.io"]
    resources: ["events"]
    verbs: ["create", "patch"]
{{- end }}

{{/*
A regular expression (RE2, case-insensitive) that a URL matches when its host
is allowed by a list of host patterns, as the workers read them: an exact name
or address, or `*.suffix` for the names under it. Anchored on the scheme and
on the end of the host, so `feeds.example.com.evil.io` or a path that merely
contains an allowed name does not pass.
*/}}
{{- define "tether.hostRegex" -}}
{{- $alternatives := list -}}
{{- range . -}}
{{- if hasPrefix "*." . -}}
{{- $alternatives = append $alternatives (printf "[^/?#@:\\[\\]]+%s" (regexQuoteMeta (trimPrefix "*" .))) -}}
{{- else -}}
{{- $alternatives = append $alternatives (regexQuoteMeta .) -}}
{{- end -}}
{{- end -}}
{{- printf "(?i)^[a-z][a-z0-9+.-]*://(%s)(:[0-9]+)?([/?#]|$)" (join "|" $alternatives) -}}
{{- end }}

{{/*
A ServiceMonitor endpoint's or PodMonitor endpoint's scrape options, from
metrics.serviceMonitor or metrics.podMonitor (the same keys).
*/}}
{{- define "tether.scrapeOptions" -}}
path: /metrics
interval: {{ .interval }}
{{- with .scrapeTimeout }}
scrapeTimeout: {{ . }}
{{- end }}
{{- if .honorLabels }}
honorLabels: true
{{- end }}
{{- with .relabelings }}
relabelings:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .metricRelabelings }}
metricRelabelings:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
