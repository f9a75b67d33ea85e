{{/*
Render-time checks of values that are each valid alone but contradict each other. Every
message names the keys to change. Included from validate.yaml (renders nothing on success).
*/}}
{{- define "kvroute.validate" -}}
{{- $v := .Values -}}
{{- $ext := $v.redis.external -}}
{{- $extSet := or $ext.url $ext.urlSecret.name -}}
{{- if and $v.redis.enabled $extSet -}}
{{- fail "redis: set either redis.enabled (built-in Redis) or redis.external.url / redis.external.urlSecret (an existing Redis), not both" -}}
{{- end -}}
{{- if not (or $v.redis.enabled $extSet) -}}
{{- fail "redis: routers share session state through Redis; set redis.enabled=true or redis.external.url / redis.external.urlSecret.name" -}}
{{- end -}}
{{- if and $ext.url $ext.urlSecret.name -}}
{{- fail "redis.external: give url or urlSecret, not both" -}}
{{- end -}}
{{- if and $ext.url (not (regexMatch "^rediss?://[^@/]+(/[0-9]+)?$" $ext.url)) -}}
{{- fail (printf "redis.external.url %q must be redis://HOST:PORT[/DB] or rediss://..., without a password (put it in redis.external.passwordSecret)" $ext.url) -}}
{{- end -}}
{{- if and $ext.urlSecret.name $ext.passwordSecret.name -}}
{{- fail "redis.external: urlSecret already holds the password; drop redis.external.passwordSecret" -}}
{{- end -}}
{{- range $k := list "api_keys" "admin_key" "upstream_api_key" "redis_url" -}}
{{- if hasKey $v.router.config $k -}}
{{- fail (printf "router.config.%s would put a secret into a ConfigMap; use router.auth.* / redis.* Secret references" $k) -}}
{{- end -}}
{{- end -}}
{{- $r := $v.router -}}
{{- $minPods := ternary $r.autoscaling.minReplicas $r.replicas $r.autoscaling.enabled -}}
{{- if and $r.autoscaling.enabled (gt (int $r.autoscaling.minReplicas) (int $r.autoscaling.maxReplicas)) -}}
{{- fail (printf "router.autoscaling.minReplicas (%d) is above maxReplicas (%d)" (int $r.autoscaling.minReplicas) (int $r.autoscaling.maxReplicas)) -}}
{{- end -}}
{{- if and $r.pdb.enabled (ge (int $r.pdb.minAvailable) (int $minPods)) -}}
{{- fail (printf "router.pdb.minAvailable (%d) must be below the router pod count (%d, router.replicas or router.autoscaling.minReplicas): otherwise no node can ever be drained" (int $r.pdb.minAvailable) (int $minPods)) -}}
{{- end -}}
{{- if and $r.kv.buildTinyModel (or $r.kv.tokenizerVolume $r.kv.tokenizer) -}}
{{- fail "router.kv: buildTinyModel provides the tokenizer itself; leave router.kv.tokenizer and router.kv.tokenizerVolume empty" -}}
{{- end -}}
{{- if and $r.kv.tokenizerVolume (not $r.kv.tokenizer) -}}
{{- fail "router.kv.tokenizerVolume is mounted at the parent of router.kv.tokenizer: set router.kv.tokenizer to the tokenizer directory inside it" -}}
{{- end -}}
{{- if not $v.workers.models -}}
{{- fail "workers.models is empty: name at least one model to serve" -}}
{{- end -}}
{{- $names := dict -}}
{{- range $model := $v.workers.models -}}
{{- $m := fromJson (include "kvroute.model" (dict "root" $ "model" $model)) -}}
{{- $n := toString (default "" $m.name) -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $n) -}}
{{- fail (printf "workers.models: name %q must be a DNS label (lower case letters, digits, '-')" $n) -}}
{{- end -}}
{{- if hasKey $names $n -}}
{{- fail (printf "workers.models: name %q appears twice" $n) -}}
{{- end -}}
{{- $_ := set $names $n true -}}
{{- if gt (len (printf "%s-%s-999" (include "kvroute.fullname" $) $n)) 63 -}}
{{- fail (printf "workers.models[%s]: %s-%s-N is longer than a pod hostname may be (63); shorten the model name or fullnameOverride" $n (include "kvroute.fullname" $) $n) -}}
{{- end -}}
{{- if not (or $m.model $m.overrideArgs) -}}
{{- fail (printf "workers.models[%s].model is required (HF id or a path under /models)" $n) -}}
{{- end -}}
{{- $tp := int $m.tensorParallelSize -}}
{{- $dcp := int $m.decodeContextParallelSize -}}
{{- if or (lt $tp 1) (lt $dcp 1) -}}
{{- fail (printf "workers.models[%s]: tensorParallelSize and decodeContextParallelSize must be >= 1" $n) -}}
{{- end -}}
{{- if ne (mod $tp $dcp) 0 -}}
{{- fail (printf "workers.models[%s]: decodeContextParallelSize (%d) must divide tensorParallelSize (%d)" $n $dcp $tp) -}}
{{- end -}}
{{- if and $m.plugin.kernels (not $m.plugin.enabled) -}}
{{- fail (printf "workers.models[%s].plugin.kernels: the kernels are installed by the engine plugin; set plugin.enabled=true or drop plugin.kernels" $n) -}}
{{- end -}}
{{- if $m.cpu -}}
{{- if $m.plugin.kernels -}}
{{- fail (printf "workers.models[%s].plugin.kernels: kvroute's kernels run on CUDA hosts only (vLLM's CPU platform refuses them); drop plugin.kernels in cpu mode" $n) -}}
{{- end -}}
{{- if lt (int $v.kvCache.blockSize) 32 -}}
{{- fail (printf "workers.models[%s].cpu: vLLM-CPU rejects block size %d; set kvCache.blockSize to 32 or more" $n (int $v.kvCache.blockSize)) -}}
{{- end -}}
{{- if gt $tp 1 -}}
{{- fail (printf "workers.models[%s]: cpu mode runs one process per pod; tensorParallelSize must be 1" $n) -}}
{{- end -}}
{{- if $model.gpus -}}
{{- fail (printf "workers.models[%s]: cpu mode takes no GPUs; drop gpus" $n) -}}
{{- end -}}
{{- else if lt (int $m.gpus) $tp -}}
{{- fail (printf "workers.models[%s]: gpus (%d) is below tensorParallelSize (%d)" $n (int $m.gpus) $tp) -}}
{{- end -}}
{{- if and $m.offload.diskDir (not $m.offload.hostBytes) -}}
{{- fail (printf "workers.models[%s].offload: a disk tier (diskDir) sits below the host tier; set offload.hostBytes too" $n) -}}
{{- end -}}
{{- if and $m.kvEvents.enabled (eq (int $m.kvEvents.port) (int $m.kvEvents.replayPort)) -}}
{{- fail (printf "workers.models[%s].kvEvents: port and replayPort must differ" $n) -}}
{{- end -}}
{{- if and $m.offload.hostBytes (not (and $m.plugin.enabled (eq $m.plugin.preset "agentic"))) -}}
{{- fail (printf "workers.models[%s].offload: the host/disk tiers are the plugin's (KVRouteOffloadingSpec); set plugin.enabled=true and plugin.preset=agentic, or offload.hostBytes=0" $n) -}}
{{- end -}}
{{- $pool := $m.offload.pool | default dict -}}
{{- if $pool.dir -}}
{{- if not $m.offload.hostBytes -}}
{{- fail (printf "workers.models[%s].offload.pool sits below the host tier; set offload.hostBytes too" $n) -}}
{{- end -}}
{{- if not $pool.claimName -}}
{{- fail (printf "workers.models[%s].offload.pool needs claimName: an existing ReadWriteMany PersistentVolumeClaim every worker mounts at pool.dir" $n) -}}
{{- end -}}
{{- if eq $m.offload.mode "write-back" -}}
{{- fail (printf "workers.models[%s].offload: the write-back host tier takes no pool; drop pool.dir or use mode write-through" $n) -}}
{{- end -}}
{{- else if or $pool.bytes $pool.claimName -}}
{{- fail (printf "workers.models[%s].offload.pool: bytes and claimName need pool.dir" $n) -}}
{{- end -}}
{{- if eq $m.offload.mode "write-back" -}}
{{- if $m.offload.diskDir -}}
{{- fail (printf "workers.models[%s].offload: the write-back host tier takes no disk tier (vLLM's disk backend for it is CUDA-only); drop diskDir or use mode write-through" $n) -}}
{{- end -}}
{{- if $m.offload.retention.enabled -}}
{{- fail (printf "workers.models[%s].offload: the write-back host tier is vLLM's LRU block pool and takes no retention; drop retention or use mode write-through" $n) -}}
{{- end -}}
{{- if ne $m.offload.evictionPolicy "lru" -}}
{{- fail (printf "workers.models[%s].offload: the write-back host tier evicts in LRU order only; set evictionPolicy lru or use mode write-through" $n) -}}
{{- end -}}
{{- end -}}
{{- if and $m.offload.retention.enabled (not $m.offload.hostBytes) -}}
{{- fail (printf "workers.models[%s].offload.retention holds host-tier KV; set offload.hostBytes too" $n) -}}
{{- end -}}
{{- if $m.plugin.enabled -}}
{{- range $e := $m.extraEnv -}}
{{- if and (eq (toString $e.name) "VLLM_PLUGINS") (not (has "kvroute_engine" (splitList "," (toString $e.value)))) -}}
{{- fail (printf "workers.models[%s].extraEnv: VLLM_PLUGINS %q is an allowlist of vLLM plugins and leaves out the engine plugin; add kvroute_engine (its entry point name) or drop VLLM_PLUGINS" $n (toString $e.value)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $m.plugin.enabled (not (has $m.plugin.install (list "image" "pip"))) -}}
{{- fail (printf "workers.models[%s].plugin.install must be image or pip" $n) -}}
{{- end -}}
{{- end -}}
{{- end -}}
