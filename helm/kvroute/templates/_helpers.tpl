{{/* Names, labels and small shared pieces. */}}

{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvroute.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvroute
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* selector labels: (dict "root" $ "component" "router") */}}
{{- define "kvroute.selector" -}}
app.kubernetes.io/name: {{ include "kvroute.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvroute.router.name" -}}{{ include "kvroute.fullname" . }}-router{{- end -}}
{{- define "kvroute.redis.name" -}}{{ include "kvroute.fullname" . }}-redis{{- end -}}
{{- define "kvroute.workers.service" -}}{{ include "kvroute.fullname" . }}-workers{{- end -}}

{{- define "kvroute.router.serviceAccount" -}}
{{- default (include "kvroute.router.name" .) .Values.router.serviceAccount.name -}}
{{- end -}}

{{- define "kvroute.router.image" -}}
{{- printf "%s:%s" .Values.router.image.repository (default .Chart.AppVersion .Values.router.image.tag) -}}
{{- end -}}

{{/* The Secret holding the built-in Redis password. */}}
{{- define "kvroute.redis.secretName" -}}
{{- default (printf "%s-auth" (include "kvroute.redis.name" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/*
One model's settings: workers.defaults, then the model's own keys (key by key, so a model
may set a falsy value such as kvEvents.enabled: false). Two levels deep, three for the
chart's own settings maps (plugin.cadence, offload.retention); below free-form Kubernetes maps
(resources, modelVolume, affinity, ...) a model's value replaces the default. Use with fromJson.
(dict "root" $ "model" $model)
*/}}
{{- define "kvroute.model" -}}
{{- $m := deepCopy .root.Values.workers.defaults -}}
{{- range $k, $v := .model -}}
{{- if and (kindIs "map" $v) (kindIs "map" (get $m $k)) -}}
{{- $inner := deepCopy (get $m $k) -}}
{{- range $k2, $v2 := $v -}}
{{- if and (has $k (list "plugin" "offload")) (kindIs "map" $v2) (kindIs "map" (get $inner $k2)) -}}
{{- $deep := deepCopy (get $inner $k2) -}}
{{- range $k3, $v3 := $v2 -}}
{{- $_ := set $deep $k3 $v3 -}}
{{- end -}}
{{- $_ := set $inner $k2 $deep -}}
{{- else -}}
{{- $_ := set $inner $k2 $v2 -}}
{{- end -}}
{{- end -}}
{{- $_ := set $m $k $inner -}}
{{- else -}}
{{- $_ := set $m $k $v -}}
{{- end -}}
{{- end -}}
{{- if not $m.servedModelName -}}
{{- $_ := set $m "servedModelName" $m.model -}}
{{- end -}}
{{- if not $m.gpus -}}
{{- $_ := set $m "gpus" $m.tensorParallelSize -}}
{{- end -}}
{{- toJson $m -}}
{{- end -}}

{{- define "kvroute.worker.name" -}}
{{- printf "%s-%s" (include "kvroute.fullname" .root) .model.name -}}
{{- end -}}

{{/* Stable URL of worker pod i of a StatefulSet model: (dict "root" $ "model" $m "i" 0) */}}
{{- define "kvroute.worker.host" -}}
{{- printf "%s-%d.%s.%s.svc.%s" (include "kvroute.worker.name" .) (int .i) (include "kvroute.workers.service" .root) .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{/* the Redis URL without a password (the router adds it from an env var) */}}
{{- define "kvroute.redis.url" -}}
{{- if .Values.redis.enabled -}}
{{- $auth := ternary ":$(KVROUTE_REDIS_PASSWORD)@" "" .Values.redis.auth.enabled -}}
{{- printf "redis://%s%s.%s.svc.%s:%d/%d" $auth (include "kvroute.redis.name" .) .Release.Namespace .Values.clusterDomain (int .Values.redis.port) (int .Values.redis.db) -}}
{{- else if .Values.redis.external.url -}}
{{- $u := .Values.redis.external.url -}}
{{- if .Values.redis.external.passwordSecret.name -}}
{{- $parts := splitList "://" $u -}}
{{- printf "%s://:$(KVROUTE_REDIS_PASSWORD)@%s" (index $parts 0) (index $parts 1) -}}
{{- else -}}
{{- $u -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* a secretKeyRef env var: (dict "name" "ENV" "ref" $ref) */}}
{{- define "kvroute.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .ref.name }}
      key: {{ .ref.key }}
{{- end -}}

{{/*
A number as Python's json.dumps writes a float (500 -> 500.0, 0.5 -> 0.5). Exact for the
ranges values.schema.json allows (below 1e6); used for the plugin's float settings.
*/}}
{{- define "kvroute.pyfloat" -}}
{{- $f := float64 . -}}
{{- if eq $f (float64 (int64 $f)) -}}
{{- printf "%d.0" (int64 $f) -}}
{{- else -}}
{{- printf "%v" $f -}}
{{- end -}}
{{- end -}}

{{/*
One model's engine flags: the words engine_patches.presets.flags() produces for the same
settings (what `kvroute engine flags --json --preset P --platform cpu|gpu --kv-events
tcp://*:PORT --kv-events-replay tcp://*:REPLAY --host-tier-bytes N ...` prints; docs/engine.md),
word for word and in its order, JSON keys in its order. tests/unit/test_helm_chart.py renders
every example (and variations) and compares these words with the plugin's own output, so the
chart cannot drift from the plugin. plugin.enabled false renders the `prefix` preset (no
plugin code: prefix caching, prompt-token details, KV events). Both presets end with DCP
(decodeContextParallelSize > 1), as the plugin's presets do.
A JSON list; use with fromJsonArray. (dict "model" $m)
*/}}
{{- define "kvroute.engineFlags" -}}
{{- $m := .model -}}
{{- $p := $m.plugin -}}
{{- $o := $m.offload -}}
{{- $preset := ternary $p.preset "prefix" $p.enabled -}}
{{- $out := list "--enable-prefix-caching" "--prefix-caching-hash-algo" "sha256_cbor" "--enable-prompt-tokens-details" -}}
{{- if $m.kvEvents.enabled -}}
{{- $ev := printf `{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:%d","replay_endpoint":"tcp://*:%d","topic":"kv"}` (int $m.kvEvents.port) (int $m.kvEvents.replayPort) -}}
{{- $out = concat $out (list "--kv-events-config" $ev) -}}
{{- end -}}
{{- if eq $preset "agentic" -}}
{{- if $p.cadence.enabled -}}
{{- $c := $p.cadence -}}
{{- $cls := ternary "engine_patches.scheduler.CadenceScheduler" "engine_patches.scheduler.CadenceAsyncScheduler" $m.cpu -}}
{{- $cc := printf `{"kvroute":{"cadence":{"interval":%d,"max_defer_steps":%d,"max_defer_ms":%s,"backlog_scale":%s}}}` (int64 $c.interval) (int64 $c.maxDeferSteps) (include "kvroute.pyfloat" $c.maxDeferMs) (include "kvroute.pyfloat" $c.backlogScale) -}}
{{- $out = concat $out (list "--scheduler-cls" $cls "--additional-config" $cc) -}}
{{- end -}}
{{- if gt (int64 $p.longPrefillTokenThreshold) 0 -}}
{{- $out = concat $out (list "--long-prefill-token-threshold" (printf "%d" (int64 $p.longPrefillTokenThreshold))) -}}
{{- end -}}
{{- if eq (default "priority" $p.schedulingPolicy) "priority" -}}
{{- $out = concat $out (list "--scheduling-policy" "priority") -}}
{{- end -}}
{{- if and (gt (int64 $o.hostBytes) 0) (eq $o.mode "write-back") -}}
{{- $out = concat $out (list "--kv-transfer-config" (printf `{"kv_connector":"KVRouteWriteBackConnector","kv_connector_module_path":"engine_patches.writeback","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":%d,"lazy_offload":true}}` (int64 $o.hostBytes))) -}}
{{- else if gt (int64 $o.hostBytes) 0 -}}
{{- $pool := $o.pool | default dict -}}
{{- $spec := ternary "KVRouteTieringSpec" "KVRouteOffloadingSpec" (or (ne $o.diskDir "") (ne ($pool.dir | default "") "")) -}}
{{- $x := printf `"spec_name":"%s","spec_module_path":"engine_patches.offload","cpu_bytes_to_use":%d` $spec (int64 $o.hostBytes) -}}
{{- if $o.retention.enabled -}}
{{- $x = printf `%s,"eviction_policy":"AgentRetentionPolicy","cache_policy_module_path":"engine_patches.retention","retention":{"ttl_s":%s,"max_share":%s}` $x (include "kvroute.pyfloat" $o.retention.ttlSeconds) (include "kvroute.pyfloat" $o.retention.maxShare) -}}
{{- else -}}
{{- $x = printf `%s,"eviction_policy":"%s"` $x $o.evictionPolicy -}}
{{- end -}}
{{- $tiers := list -}}
{{- if $o.diskDir -}}
{{- $tiers = append $tiers (printf `{"type":"fs","root_dir":%s,"enable_kv_events":true}` (toJson $o.diskDir)) -}}
{{- end -}}
{{- if $pool.dir -}}
{{- $tiers = append $tiers (printf `{"type":"KVRoutePoolTier","module_path":"engine_patches.pool","root_dir":%s,"pool_bytes":%d,"retention":{"ttl_s":%s,"max_share":%s},"enable_kv_events":true,"locality":"REMOTE"}` (toJson $pool.dir) (int64 ($pool.bytes | default 0)) (include "kvroute.pyfloat" $o.retention.ttlSeconds) (include "kvroute.pyfloat" $o.retention.maxShare)) -}}
{{- end -}}
{{- if $tiers -}}
{{- $x = printf `%s,"secondary_tiers":[%s]` $x (join "," $tiers) -}}
{{- end -}}
{{- $fail := ternary `,"kv_load_failure_policy":"recompute"` "" (ne ($pool.dir | default "") "") -}}
{{- $out = concat $out (list "--kv-transfer-config" (printf `{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{%s}%s}` $x $fail)) -}}
{{- end -}}
{{- end -}}
{{- if gt (int $m.decodeContextParallelSize) 1 -}}
{{- $out = concat $out (list "--decode-context-parallel-size" (printf "%d" (int $m.decodeContextParallelSize)) "--dcp-comm-backend" $m.dcpCommBackend) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}
