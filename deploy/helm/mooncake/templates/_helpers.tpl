{{/*
Names, labels and the pieces every component's pod shares.
*/}}

{{- define "mooncake.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or fullnameOverride; at most 50 characters so "-conductor" etc. fit in 63. */}}
{{- define "mooncake.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "mooncake.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "prefill"). */}}
{{- define "mooncake.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mooncake.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component's objects. */}}
{{- define "mooncake.labels" -}}
helm.sh/chart: {{ include "mooncake.chart" .ctx }}
{{ include "mooncake.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: mooncake
{{- end }}

{{- define "mooncake.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{- define "mooncake.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-conductor" (include "mooncake.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Conductor's gRPC address, as every other component dials it. */}}
{{- define "mooncake.conductorAddress" -}}
{{- printf "%s-conductor:%d" (include "mooncake.fullname" .) (int .Values.conductor.port) }}
{{- end }}

{{/* true when the Conductor persists to a Redis (in the release or external). */}}
{{- define "mooncake.redisEnabled" -}}
{{- if or .Values.redis.externalUrlSecret.name .Values.redis.externalUrl .Values.redis.enabled }}true{{ end }}
{{- end }}

{{/* true when the chart runs its own Redis StatefulSet. */}}
{{- define "mooncake.redisInRelease" -}}
{{- if and .Values.redis.enabled (not .Values.redis.externalUrl) (not .Values.redis.externalUrlSecret.name) }}true{{ end }}
{{- end }}

{{/* The env entry MOONCAKE_REDIS_URL (only called when mooncake.redisEnabled). */}}
{{- define "mooncake.redisUrlEnv" -}}
- name: MOONCAKE_REDIS_URL
{{- if .Values.redis.externalUrlSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.externalUrlSecret.name }}
      key: {{ .Values.redis.externalUrlSecret.key }}
{{- else if .Values.redis.externalUrl }}
  value: {{ .Values.redis.externalUrl | quote }}
{{- else }}
  value: {{ printf "redis://%s-redis:%d/0" (include "mooncake.fullname" .) (int .Values.redis.port) | quote }}
{{- end }}
{{- end }}

{{/* The Secret holding the gateway's API key, or "" when none is configured. */}}
{{- define "mooncake.apiKeySecret" -}}
{{- if .Values.gateway.apiKey.existingSecret }}
{{- .Values.gateway.apiKey.existingSecret }}
{{- else if .Values.gateway.apiKey.value }}
{{- printf "%s-gateway" (include "mooncake.fullname" .) }}
{{- end }}
{{- end }}

{{/*
Environment of every mooncake container: the ConfigMap's shared settings plus the pod's
name and IP from the downward API. Workers and pool nodes bind and advertise the pod IP:
the address they register with the Conductor is --host:--port, and peers dial it.
*/}}
{{- define "mooncake.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: HOME
  value: /home/mooncake
{{- if .Values.tls.enabled }}
- name: MOONCAKE_TLS_DIR
  value: /etc/mooncake/tls
{{- end }}
{{- end }}

{{/* The Secret with the components' CA, certificate and key (templates/tls.yaml). */}}
{{- define "mooncake.tlsSecret" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "mooncake.fullname" .)) -}}
{{- end }}

{{/* Its mount in a mooncake container (with mooncake.podEnv's MOONCAKE_TLS_DIR), and its volume. */}}
{{- define "mooncake.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/mooncake/tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "mooncake.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "mooncake.tlsSecret" . }}
    defaultMode: 0400
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- end }}

{{- define "mooncake.envFrom" -}}
- configMapRef:
    name: {{ include "mooncake.fullname" . }}-config
{{- end }}

{{/* Pod annotations that roll the pods when the shared settings change. */}}
{{- define "mooncake.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end }}

{{/*
Resources of a worker container, with nvidia.com/gpu added to requests and limits
when gpus > 0: (dict "resources" .Values.prefill.resources "gpus" .Values.prefill.gpus).
*/}}
{{- define "mooncake.workerResources" -}}
{{- $res := deepCopy (default dict .resources) }}
{{- $req := default dict (get $res "requests") }}
{{- $lim := default dict (get $res "limits") }}
{{- if gt (int .gpus) 0 }}
{{- $_ := set $req "nvidia.com/gpu" (int .gpus) }}
{{- $_ := set $lim "nvidia.com/gpu" (int .gpus) }}
{{- end }}
{{- if and .rdma .rdma.enabled }}
{{- $_ := set $req .rdma.resource (int .rdma.count) }}
{{- $_ := set $lim .rdma.resource (int .rdma.count) }}
{{- end }}
{{- if $req }}{{- $_ := set $res "requests" $req }}{{- end }}
{{- if $lim }}{{- $_ := set $res "limits" $lim }}{{- end }}
{{- toYaml $res }}
{{- end }}

{{/*
A worker's or pool node's container securityContext: the chart's, plus IPC_LOCK with
rdma.enabled (registering memory for RDMA pins it; the capability lifts the memlock limit,
which Kubernetes offers no other way to raise).
*/}}
{{- define "mooncake.workerSecurity" -}}
{{- $sc := deepCopy .Values.securityContext }}
{{- if .Values.rdma.enabled }}
{{- $caps := deepCopy (default dict (get $sc "capabilities")) }}
{{- $_ := set $caps "add" (append (default list (get $caps "add")) "IPC_LOCK") }}
{{- $_ := set $sc "capabilities" $caps }}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{/* The transport flags of a worker or pool node with rdma.enabled: (dict "ctx" $ "flag" "--transfer-backend"). */}}
{{- define "mooncake.rdmaArgs" -}}
{{- $r := .ctx.Values.rdma }}
{{- if $r.enabled }}
- {{ .flag }}=rdma
{{- with $r.device }}
- --rdma-device={{ . }}
{{- end }}
- --rdma-gid-index={{ $r.gidIndex }}
{{- end }}
{{- end }}

{{/* An HTTP probe: (dict "path" "/health" "port" "metrics" "period" 10 "failures" 3). */}}
{{- define "mooncake.httpProbe" -}}
httpGet:
  path: {{ .path }}
  port: {{ .port }}
periodSeconds: {{ .period | default 10 }}
timeoutSeconds: {{ .timeout | default 3 }}
failureThreshold: {{ .failures | default 3 }}
{{- end }}

{{/* "true" when a worker pool asks for a GPU: (index .Values "prefill"); gpus, or a *gpu* resource of its own. */}}
{{- define "mooncake.asksForGpu" -}}
{{- $gpu := gt (int .gpus) 0 }}
{{- range $section := list "requests" "limits" }}
{{- range $name, $_ := (get (default dict $.resources) $section | default dict) }}
{{- if contains "gpu" $name }}{{ $gpu = true }}{{ end }}
{{- end }}
{{- end }}
{{- if $gpu }}true{{ end }}
{{- end }}

{{/*
Fail rendering when the workers' engine could not start: an unknown kind, or vLLM
(engine.kind=vllm) with an image that has none, with a block size its attention refuses
(a multiple of 16 tokens on CUDA, of 32 on the CPU; a pool that asks for no GPU runs vLLM
on the CPU), or with vllmArgs that are not KEY=VALUE strings. The workers refuse the same
at start; failing here saves a rollout of crash-looping pods.
*/}}
{{- define "mooncake.checkEngine" -}}
{{- $e := .Values.engine }}
{{- if not (has $e.kind (list "native" "vllm")) }}
{{- fail (printf "engine.kind must be native or vllm, not %q" (toString $e.kind)) }}
{{- end }}
{{- if not (has .Values.model.kvCacheDtype (list "auto" "fp8" "fp8_e4m3")) }}
{{- fail (printf "model.kvCacheDtype must be auto, fp8 or fp8_e4m3, not %q" (toString .Values.model.kvCacheDtype)) }}
{{- end }}
{{- if not (has .Values.model.poolKvDtype (list "auto" "fp8" "fp8_e4m3")) }}
{{- fail (printf "model.poolKvDtype must be auto, fp8 or fp8_e4m3, not %q" (toString .Values.model.poolKvDtype)) }}
{{- end }}
{{- if and (ne .Values.model.poolKvDtype "auto") (or (ne .Values.model.kvCacheDtype "auto") (ne $e.kind "native")) }}
{{- fail "model.poolKvDtype needs engine.kind native and model.kvCacheDtype auto (an fp8 cache's pool is fp8 already)" }}
{{- end }}
{{- if eq $e.kind "vllm" }}
{{- $blockSize := int .Values.model.blockSize }}
{{- if mod $blockSize 16 }}
{{- fail (printf "model.blockSize (%d) must be a multiple of 16 with engine.kind=vllm: vLLM's attention takes multiples of 16 tokens on CUDA and of 32 on the CPU" $blockSize) }}
{{- end }}
{{- range $pool := list "prefill" "decode" }}
{{- $why := "" }}
{{- if and (not $.Values.image.tag) (eq $.Values.image.variant "vllm-cpu") }}
{{- $why = "image.variant is vllm-cpu" }}
{{- else if not (include "mooncake.asksForGpu" (index $.Values $pool)) }}
{{- $why = printf "%s.gpus is 0" $pool }}
{{- end }}
{{- if and $why (mod $blockSize 32) }}
{{- fail (printf "model.blockSize (%d) must be a multiple of 32 with engine.kind=vllm on the CPU (%s): vLLM's CPU attention works in 32-token blocks" $blockSize $why) }}
{{- end }}
{{- end }}
{{- if and (not .Values.image.tag) (not (hasPrefix "vllm-" .Values.image.variant)) }}
{{- fail (printf "engine.kind=vllm needs an image with vLLM: image.variant vllm-cuda (GPUs) or vllm-cpu, not %q (or an image.tag naming such an image)" .Values.image.variant) }}
{{- end }}
{{- range $e.vllmArgs }}
{{- if or (not (kindIs "string" .)) (not (regexMatch "^[A-Za-z_-][A-Za-z0-9_-]*=" (toString .))) }}
{{- fail (printf "engine.vllmArgs wants KEY=VALUE strings (e.g. enforce_eager=true), got %v" .) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The worker's engine flags: --engine, and each of engine.vllmArgs as --vllm-arg when the engine is vLLM. */}}
{{- define "mooncake.engineArgs" -}}
- --engine=$(MOONCAKE_ENGINE)
{{- if eq .Values.engine.kind "vllm" }}
{{- range .Values.engine.vllmArgs }}
- {{ printf "--vllm-arg=%s" . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Fail rendering when a grace period does not cover the drain it must allow. */}}
{{- define "mooncake.checkGrace" -}}
{{- if le (int .grace) (int .drain) }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%v) must exceed %s.drainTimeoutSeconds (%v)" .who .grace .who .drain) }}
{{- end }}
{{- end }}

{{/* A container's security context: .Values.securityContext, with a read-only root filesystem where the component
allows one (the gateway and the Conductor write nothing but /tmp, an emptyDir): (dict "ctx" $ "readOnly" true). */}}
{{- define "mooncake.containerSecurity" -}}
{{- $sc := deepCopy .ctx.Values.securityContext }}
{{- if .readOnly }}
{{- $_ := set $sc "readOnlyRootFilesystem" true }}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{/*
A pool's replicas: the values' count, except under conductor.planner=act, where the Deployment that exists keeps the
count the planner gave it (an upgrade does not undo its plans; `helm template` sees no cluster and renders the values').
*/}}
{{- define "mooncake.plannedReplicas" -}}
{{- $replicas := .replicas -}}
{{- if and .planned (eq (toString .ctx.Values.conductor.planner) "act") -}}
{{- with lookup "apps/v1" "Deployment" .ctx.Release.Namespace .name -}}
{{- $replicas = .spec.replicas -}}
{{- end -}}
{{- end -}}
{{- $replicas -}}
{{- end -}}
