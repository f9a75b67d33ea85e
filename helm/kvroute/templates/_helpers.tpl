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
One model's settings: workers.defaults, then the model's own keys (two levels deep, so a model
may set a falsy value such as kvEvents.enabled: false). Use with fromJson.
(dict "root" $ "model" $model)
*/}}
{{- define "kvroute.model" -}}
{{- $m := deepCopy .root.Values.workers.defaults -}}
{{- range $k, $v := .model -}}
{{- if and (kindIs "map" $v) (kindIs "map" (get $m $k)) -}}
{{- $inner := deepCopy (get $m $k) -}}
{{- range $k2, $v2 := $v -}}
{{- $_ := set $inner $k2 $v2 -}}
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
