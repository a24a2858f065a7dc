{{/*
Where the model comes from (model.source) and how a pod gets it. Every pod that runs the model or reads its
files (the prefill workers and their pool nodes, the decode workers, the gateways) is given --model with
mooncake.modelDir and, unless the model is in the image, mounts the volume read-only at /model:

  image     model.dir inside the image (the Dockerfile pulls SmolLM2-135M to /models)
  pvc       an existing PersistentVolumeClaim (model.pvc.claimName; model.pvc.subPath inside it)
  hostPath  a directory on the node (model.hostPath.path)
  hub       an emptyDir the init container "model-download" fills from the Hugging Face hub
            (model.hub.id at model.hub.revision, the token from model.hub.tokenSecret when named)

The pool nodes size their blocks from the model, as the workers' engine lays it out (kvstore --model with the
workers' block size, dtype and engine): nobody works out block bytes by hand.
*/}}

{{/* Fail rendering on model values no pod could start with. */}}
{{- define "mooncake.checkModel" -}}
{{- $m := .Values.model }}
{{- if not (has $m.source (list "image" "pvc" "hostPath" "hub")) }}
{{- fail (printf "model.source must be image, pvc, hostPath or hub, not %q" (toString $m.source)) }}
{{- end }}
{{- if and (eq $m.source "image") (not $m.dir) }}{{ fail "model.source=image needs model.dir (the model's directory inside the image)" }}{{ end }}
{{- if and (eq $m.source "pvc") (not $m.pvc.claimName) }}{{ fail "model.source=pvc needs model.pvc.claimName" }}{{ end }}
{{- if and (eq $m.source "hostPath") (not $m.hostPath.path) }}{{ fail "model.source=hostPath needs model.hostPath.path" }}{{ end }}
{{- if eq $m.source "hub" }}
{{- if not $m.hub.id }}{{ fail "model.source=hub needs model.hub.id (a Hugging Face hub repository, e.g. HuggingFaceTB/SmolLM2-135M-Instruct)" }}{{ end }}
{{- if and $m.hub.tokenSecret.name (not $m.hub.tokenSecret.key) }}{{ fail "model.hub.tokenSecret.key is empty: the token's key inside the Secret" }}{{ end }}
{{- end }}
{{- if hasKey $m "blockBytes" }}
{{- fail "model.blockBytes is no longer a value: the pool nodes work the block bytes out from the model, model.blockSize, model.dtype and engine.kind (remove it)" }}
{{- end }}
{{- range $pool := list "prefill" "decode" }}
{{- $device := toString (index $.Values $pool).device }}
{{- if not (regexMatch "^(cpu|cuda(:[0-9]+)?)$" $device) }}
{{- fail (printf "%s.device must be cpu or cuda[:N], not %q" $pool $device) }}
{{- end }}
{{- if and (hasPrefix "cuda" $device) (not (include "mooncake.asksForGpu" (index $.Values $pool))) }}
{{- fail (printf "%s.device is %s but the pool asks for no GPU: set %s.gpus (or a GPU resource)" $pool $device $pool) }}
{{- end }}
{{- $tp := int (default 1 (index $.Values $pool).tensorParallelSize) }}
{{- if lt $tp 1 }}
{{- fail (printf "%s.tensorParallelSize must be 1 or more, not %d" $pool $tp) }}
{{- end }}
{{- if and (gt $tp 1) (hasPrefix "cuda" $device) (lt (int (index $.Values $pool).gpus) $tp) }}
{{- fail (printf "%s.tensorParallelSize is %d on %s: a GPU a rank, so %s.gpus must be %d at least" $pool $tp $device $pool $tp) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The model directory every component is given as --model (the ConfigMap's MOONCAKE_MODEL_DIR). */}}
{{- define "mooncake.modelDir" -}}
{{- if eq .Values.model.source "image" }}{{ .Values.model.dir }}{{ else }}/model{{ end -}}
{{- end }}

{{/* The model's read-only mount in a container that reads it (none when the model is in the image). */}}
{{- define "mooncake.modelMount" -}}
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: /model
  readOnly: true
  {{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end }}

{{/* The pod volumes the model needs: the model's own, and with model.source=hub the downloader's cache. */}}
{{- define "mooncake.modelVolumes" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath.path }}
    type: Directory
{{- else if eq $m.source "hub" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.hub.sizeLimit }}
# The hub client's own files (its chunk cache, temporary files): the download container's only.
- name: model-download-home
  emptyDir: {}
{{- end }}
{{- end }}

{{/*
With model.source=hub, the init container that fills the pod's model volume before any other container starts
(the pool node sidecar included): the project's image, running huggingface_hub.snapshot_download. It resumes a
partial download and skips files already there, and fails (the pod then restarts it) when the repository has no
config.json at the top: nothing the workers could load.
*/}}
{{- define "mooncake.modelInit" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "hub" }}
- name: model-download
  image: {{ include "mooncake.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import os, sys
      from huggingface_hub import snapshot_download
      repo, revision, target, *patterns = sys.argv[1:]
      path = snapshot_download(repo, revision=revision, local_dir=target, allow_patterns=patterns or None)
      if not os.path.isfile(os.path.join(path, "config.json")):
          sys.exit(f"{repo}@{revision} has no config.json at its top: not a Hugging Face layout model")
      print(f"{repo}@{revision} in {path}")
  args:
    - {{ $m.hub.id | quote }}
    - {{ $m.hub.revision | default "main" | quote }}
    - /model
    {{- range $m.hub.allowPatterns }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: HF_HOME
      value: /var/cache/huggingface
    - name: TMPDIR
      value: /var/cache/huggingface
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    {{- if $m.hub.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $m.hub.tokenSecret.name }}
          key: {{ $m.hub.tokenSecret.key }}
    {{- end }}
  resources:
    {{- toYaml $m.hub.resources | nindent 4 }}
  securityContext:
    {{- include "mooncake.containerSecurity" (dict "ctx" . "readOnly" true) | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: /model
    - name: model-download-home
      mountPath: /var/cache/huggingface
{{- end }}
{{- end }}

{{/* A worker's --device when its pool runs on a GPU ((dict "ctx" $ "pool" "prefill")); cpu is the workers' default. And its
--tensor-parallel-size when its engine is split over more than one rank. */}}
{{- define "mooncake.deviceArgs" -}}
{{- $device := toString (index .ctx.Values .pool).device }}
{{- if ne $device "cpu" }}
- --device={{ $device }}
{{- end }}
{{- $tp := int (default 1 (index .ctx.Values .pool).tensorParallelSize) }}
{{- if gt $tp 1 }}
- --tensor-parallel-size={{ $tp }}
{{- end }}
{{- end }}

{{/* A split worker's /dev/shm ((dict "ctx" $ "pool" "prefill")): its ranks talk through shared memory (vLLM's queues,
NCCL's buffers, vLLM's shared copy of the cache in the pool layout), more than a container's 64 MiB default. Its
mount, then its volume. */}}
{{- define "mooncake.rankShmMount" -}}
{{- if gt (int (default 1 (index .ctx.Values .pool).tensorParallelSize)) 1 }}
- name: rank-shm
  mountPath: /dev/shm
{{- end }}
{{- end }}
{{- define "mooncake.rankShmVolume" -}}
{{- if gt (int (default 1 (index .ctx.Values .pool).tensorParallelSize)) 1 }}
- name: rank-shm
  emptyDir:
    medium: Memory
{{- end }}
{{- end }}
