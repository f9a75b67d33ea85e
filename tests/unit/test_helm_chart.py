"""The Helm chart, rendered for real (Helm's Go SDK through helm-python-sdk; no helm binary, no
cluster): every example passes the values schema and a strict lint, every rendered object
passes kubernetes-validate in strict mode (ServiceMonitors: the CRD subset schema kept in
tests/unit/data/helm), renders are diffed against goldens, and the behaviour operators rely
on is pinned: the router gets the Redis URL, every worker's engine flags are word for word
what the plugin's own ``kvroute engine flags`` prints for the same settings (so the chart
cannot drift from ``engine_patches.presets``), secrets are referenced and never inlined,
contradictory values fail with a clear message, and the rendered router config loads with
the router's own loader.

Regenerate the goldens after an intended change: ``KVROUTE_UPDATE_GOLDENS=1 pytest
tests/unit/test_helm_chart.py`` (then read the diff).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from router.config import load_config
from router.discovery import endpoints_from_slices
from router.scheduling.registry import build_pipeline

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvroute"
DATA = Path(__file__).parent / "data" / "helm"
KUBE = "1.36.0"  # what helm-python-sdk renders against by default
RELEASE, NS = "kv", "llm"
EXAMPLES = {
    "default": None,
    "cpu-demo": "values-cpu-demo.yaml",
    "h200-70b-tp4": "values-h200-70b-tp4.yaml",
    "external-redis": "values-external-redis.yaml",
}
UPDATE = os.environ.get("KVROUTE_UPDATE_GOLDENS") == "1"


@pytest.fixture(scope="module")
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def example(name: str) -> dict[str, Any]:
    f = EXAMPLES[name]
    return yaml.safe_load((CHART / f).read_text()) if f else {}


def render(chart: helm.Chart, values: dict[str, Any] | None = None) -> dict[str, str]:
    return chart.render(values or {}, name=RELEASE, namespace=NS)


def objects(manifests: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for path in sorted(manifests):
        out += [d for d in yaml.safe_load_all(manifests[path]) if d]
    return out


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(hits) == 1, f"{kind} {name}: {len(hits)} objects"
    return hits[0]


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def flag(args: list[str], name: str) -> str | None:
    for a in args:
        if a == name:
            return ""
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


# ---- every example: schema, lint, strict object validation, golden -------------------------


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_passes_schema_and_strict_lint(chart, name):
    values = example(name)
    chart.validate_schema(chart.merge_values(values))
    report = helm.lint(CHART, values, strict=True, kube_version="v" + KUBE)
    assert report["errors"] == [] and report["messages"] == [], report


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_rendered_object_validates_strictly(chart, name):
    sm_schema = json.loads((DATA / "servicemonitor-v1.schema.json").read_text())
    objs = objects(render(chart, example(name)))
    assert objs
    for obj in objs:
        if obj["kind"] == "ServiceMonitor":
            jsonschema.Draft202012Validator(sm_schema).validate(obj)
        else:
            kubernetes_validate.validate(obj, KUBE, strict=True)
        assert obj["metadata"]["namespace"] == NS or obj["kind"] == "ConfigMap"


def _normalized(manifests: dict[str, str]) -> str:
    """The render as one YAML stream, the generated Redis password masked (random) and the
    dashboard JSON left out (it is the chart's file verbatim, checked below)."""
    out = []
    for path in sorted(manifests):
        text = manifests[path].strip()
        if not text:
            continue
        if path.endswith("dashboard-configmap.yaml"):
            text = text.split("  kvroute.json: |-")[0] + "  kvroute.json: <dashboards/kvroute.json>"
        text = re.sub(r"(redis-password: )\S+", r"\1<random>", text)
        out.append(f"# Source: {path}\n{text}\n")
    return "\n".join(out)


@pytest.mark.parametrize("name", EXAMPLES)
def test_render_matches_golden(chart, name):
    got = _normalized(render(chart, example(name)))
    golden = DATA / f"golden-{name}.yaml"
    if UPDATE or not golden.exists():
        golden.write_text(got)
        if not UPDATE:
            pytest.fail(f"wrote missing golden {golden.name}; check it in")
    assert got == golden.read_text(), f"render differs from {golden.name} (see module docstring)"


def test_every_values_key_is_commented_and_typed(chart):
    """STYLE.md "charts people can read": each key in values.yaml has a comment above it
    (children of free-form maps such as resources, and the example model, excepted), and
    every schema property of a component has a default in values.yaml."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    bare, parents = [], []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)(- +)?([A-Za-z][\w.-]*):", line)
        if not m:
            continue
        depth = len(m.group(1))
        parents = [p for p in parents if p[0] < depth] + [(depth, m.group(3))]
        prev = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
        free = any(p in ("resources", "models") for _d, p in parents[:-1])
        if not prev.startswith("#") and not free:
            bare.append(f"{i + 1}: {line.strip()}")
    assert not bare, bare
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(props: dict[str, Any], vals: dict[str, Any], path: str) -> None:
        for k, sub in props.items():
            if k in ("global", "resources"):  # resources: Kubernetes' own shape
                continue
            assert k in vals, f"{path}{k} is in the schema but has no default in values.yaml"
            if sub.get("type") == "object" and "properties" in sub:
                walk(sub["properties"], vals[k], f"{path}{k}.")

    walk(schema["properties"], defaults, "")


# ---- the router -----------------------------------------------------------------------------


def test_router_gets_the_built_in_redis_url_with_the_password_from_the_secret(chart):
    objs = objects(render(chart))
    env = env_of(container(find(objs, "Deployment", "kv-kvroute-router"), "router"))
    assert env["KVROUTE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "kv-kvroute-redis-auth",
        "key": "redis-password",
    }
    # expanded by the kubelet from the variable above: the value never appears in the spec
    url = env["KVROUTE_REDIS_URL"]["value"]
    assert url == "redis://:$(KVROUTE_REDIS_PASSWORD)@kv-kvroute-redis.llm.svc.cluster.local:6379/0"
    assert list(env).index("KVROUTE_REDIS_PASSWORD") < list(env).index("KVROUTE_REDIS_URL")
    redis = container(find(objs, "StatefulSet", "kv-kvroute-redis"), "redis")
    assert env_of(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == (
        "kv-kvroute-redis-auth"
    )
    assert "requirepass" in redis["args"][0] and "$REDIS_PASSWORD" in redis["args"][0]


def test_router_gets_an_external_redis_url(chart):
    objs = objects(render(chart, example("external-redis")))
    assert not [o for o in objs if o["metadata"]["name"].endswith("-redis")]
    env = env_of(container(find(objs, "Deployment"), "router"))
    assert env["KVROUTE_REDIS_URL"]["value"] == (
        "rediss://:$(KVROUTE_REDIS_PASSWORD)@kvroute-sessions.example.internal:6380/0"
    )
    assert env["KVROUTE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "kvroute-redis-external",
        "key": "password",
    }
    by_secret = {"redis": {"enabled": False, "external": {"urlSecret": {"name": "r", "key": "u"}}}}
    env = env_of(container(find(objects(render(chart, by_secret)), "Deployment"), "router"))
    assert env["KVROUTE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "r", "key": "u"}
    assert "KVROUTE_REDIS_PASSWORD" not in env


@pytest.mark.parametrize("name", EXAMPLES)
def test_rendered_router_config_loads_with_the_router_loader(chart, name, tmp_path):
    objs = objects(render(chart, example(name)))
    cm = find(objs, "ConfigMap", "kv-kvroute-router")
    f = tmp_path / "router.yaml"
    f.write_text(cm["data"]["router.yaml"])
    cfg = load_config(f, env={})
    build_pipeline(cfg.scheduling if cfg.scheduling else cfg.policy)
    assert cfg.host == "0.0.0.0" and cfg.redis_url is None  # the URL comes by env only
    dep = find(objs, "Deployment", "kv-kvroute-router")
    router = container(dep, "router")
    assert router["args"] == ["serve", "--config", "/etc/kvroute/router.yaml"]
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    sleep = int(router["lifecycle"]["preStop"]["exec"]["command"][1])
    assert grace > cfg.drain_timeout_s + sleep  # drain fits in the grace period
    if cfg.kv is not None:  # typed by the router's loader
        kv = cfg.kv
        assert kv.block_size == example(name).get("kvCache", {}).get("blockSize", 16)


def test_kv_event_endpoints_are_keyed_by_the_names_discovery_gives(chart, tmp_path):
    objs = objects(render(chart, example("h200-70b-tp4")))
    f = tmp_path / "router.yaml"
    f.write_text(find(objs, "ConfigMap", "kv-kvroute-router")["data"]["router.yaml"])
    cfg = load_config(f, env={})
    assert cfg.k8s_service == "kv-kvroute-workers" and cfg.k8s_namespace == NS
    sts = find(objs, "StatefulSet", "kv-kvroute-llama-70b")
    assert sts["spec"]["serviceName"] == cfg.k8s_service
    # the EndpointSlice of the governing Service lists each pod with its hostname
    slices = [{
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000}, {"name": "kv-events", "port": 5557}],
        "endpoints": [
            {"addresses": [f"10.0.0.{i}"], "hostname": f"kv-kvroute-llama-70b-{i}",
             "conditions": {"ready": True}}
            for i in range(sts["spec"]["replicas"])
        ],
    }]  # fmt: skip
    suffix = f"{cfg.k8s_service}.{cfg.k8s_namespace}.{cfg.k8s_dns_suffix}"
    names = endpoints_from_slices(slices, cfg.k8s_port_name, host_suffix=suffix)
    assert cfg.kv is not None
    assert set(cfg.kv.events_connect) == names == set(cfg.kv.replay)
    for url, ep in cfg.kv.events_connect.items():
        host = url.removeprefix("http://").rsplit(":", 1)[0]
        assert ep == f"tcp://{host}:5557" and cfg.kv.replay[url] == f"tcp://{host}:5558"


def test_deployment_workers_and_a_router_without_kv_layer(chart):
    values = {"workers": {"defaults": {"kind": "Deployment"}}}
    objs = objects(render(chart, values))
    dep = find(objs, "Deployment", "kv-kvroute-llama-8b")
    assert "serviceName" not in dep["spec"]
    for obj in objs:
        if obj["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(obj, KUBE, strict=True)
    cfg = yaml.safe_load(find(objs, "ConfigMap", "kv-kvroute-router")["data"]["router.yaml"])
    assert "events_connect" not in cfg["kv"]  # no stable pod names: events not wired
    off = objects(render(chart, {"router": {"kv": {"enabled": False}}}))
    cfg = yaml.safe_load(find(off, "ConfigMap", "kv-kvroute-router")["data"]["router.yaml"])
    assert "kv" not in cfg and cfg["policy"] == "kv_cost"  # routes as session_affinity


def test_least_privilege_rbac_and_no_crds_by_default(chart):
    objs = objects(render(chart))
    kinds = {o["kind"] for o in objs}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
    assert "ServiceMonitor" not in kinds
    role = find(objs, "Role")
    assert role["rules"] == [{
        "apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }]  # fmt: skip
    binding = find(objs, "RoleBinding")
    assert binding["subjects"][0]["name"] == find(objs, "ServiceAccount")["metadata"]["name"]
    dns = objects(render(chart, example("external-redis")))
    assert not {"Role", "RoleBinding"} & {o["kind"] for o in dns}
    pod = find(dns, "Deployment")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False  # no API access needed
    for w in [o for o in objs if o["kind"] in ("StatefulSet", "Deployment")]:
        if w["metadata"]["labels"]["app.kubernetes.io/component"] != "router":
            assert w["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_hpa_scales_on_cpu_and_in_flight_calls_and_pdb_keeps_routers(chart):
    objs = objects(render(chart, example("h200-70b-tp4")))
    hpa = find(objs, "HorizontalPodAutoscaler")
    kinds = [m["type"] for m in hpa["spec"]["metrics"]]
    assert kinds == ["Resource", "Pods"]
    assert hpa["spec"]["metrics"][1]["pods"]["metric"]["name"] == "kvroute_router_inflight_requests"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 8)
    assert "replicas" not in find(objs, "Deployment", "kv-kvroute-router")["spec"]  # HPA owns it
    assert find(objs, "PodDisruptionBudget")["spec"]["minAvailable"] == 2
    sms = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert {s["metadata"]["labels"]["release"] for s in sms} == {"kube-prometheus-stack"}
    assert len(sms) == 2


def test_probes_on_health_and_ready(chart):
    router = container(find(objects(render(chart)), "Deployment"), "router")
    assert router["livenessProbe"]["httpGet"]["path"] == "/health"
    assert router["readinessProbe"]["httpGet"]["path"] == "/ready"


# ---- the workers ----------------------------------------------------------------------------


# The chart's own words before the preset's: model, serving and parallelism settings.
CHART_OWN_FLAGS = {
    "--model", "--served-model-name", "--host", "--port", "--block-size", "--dtype",
    "--max-model-len", "--enforce-eager", "--kv-cache-memory-bytes", "--gpu-memory-utilization",
    "--tensor-parallel-size",
}  # fmt: skip


def model_settings(chart: helm.Chart, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each model's settings as the chart's `kvroute.model` merges them: workers.defaults,
    then the model's keys two levels deep, three under plugin and offload."""
    w = chart.merge_values(values)["workers"]
    out = {}
    for model in w["models"]:
        m = json.loads(json.dumps(w["defaults"]))
        for k, v in model.items():
            if isinstance(v, dict) and isinstance(m.get(k), dict):
                for k2, v2 in v.items():
                    if k in ("plugin", "offload") and isinstance(v2, dict):
                        m[k][k2] = {**m[k].get(k2, {}), **v2}
                    else:
                        m[k][k2] = v2
            else:
                m[k] = v
        out[model["name"]] = m
    return out


def num(x: Any) -> str:
    """A number from the merged values as a command-line word (integral floats as ints)."""
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def engine_flags_argv(m: dict[str, Any]) -> list[str]:
    """The `kvroute engine flags` arguments for one model's chart settings (the mapping
    docs/kubernetes.md documents); every option is passed, defaults included."""
    p, o, ev = m["plugin"], m["offload"], m["kvEvents"]
    c, r = p["cadence"], o["retention"]
    argv = ["--preset", p["preset"] if p["enabled"] else "prefix"]
    argv += ["--platform", "cpu" if m["cpu"] else "gpu"]
    if ev["enabled"]:
        argv += ["--kv-events", f"tcp://*:{num(ev['port'])}"]
        argv += ["--kv-events-replay", f"tcp://*:{num(ev['replayPort'])}"]
    argv += ["--host-tier-bytes", num(o["hostBytes"]), "--eviction-policy", o["evictionPolicy"]]
    argv += ["--host-tier-mode", o["mode"]]
    if o["diskDir"]:
        argv += ["--disk-tier-dir", o["diskDir"]]
    if o["pool"]["dir"]:
        argv += ["--pool-dir", o["pool"]["dir"], "--pool-bytes", num(o["pool"]["bytes"])]
    if r["enabled"]:
        argv += ["--retention"]
    argv += ["--retention-ttl-s", num(r["ttlSeconds"]), "--retention-share", num(r["maxShare"])]
    if not c["enabled"]:
        argv += ["--no-cadence"]
    argv += ["--cadence-interval", num(c["interval"]), "--max-defer-steps", num(c["maxDeferSteps"])]
    argv += ["--max-defer-ms", num(c["maxDeferMs"]), "--backlog-scale", num(c["backlogScale"])]
    argv += ["--long-prefill-token-threshold", num(p["longPrefillTokenThreshold"])]
    argv += ["--scheduling-policy", p["schedulingPolicy"]]
    if m["decodeContextParallelSize"] > 1:
        argv += ["--dcp", num(m["decodeContextParallelSize"])]
        argv += ["--dcp-comm-backend", m["dcpCommBackend"]]
    return argv


def kvroute_engine_flags(argv: list[str]) -> list[str]:
    """What `kvroute engine flags --json ARGV` prints (the real command, this venv's python)."""
    cmd = [sys.executable, "-m", "kvroute.cli", "engine", "flags", "--json", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, (argv, done.stdout, done.stderr)
    words: list[str] = json.loads(done.stdout)
    return words


def assert_worker_args_are_the_plugins(chart: helm.Chart, values: dict[str, Any]) -> None:
    """Every worker's args: the chart's own words, then exactly the plugin preset's words for
    the same settings, then extraArgs; nothing of the preset's anywhere else."""
    objs = objects(render(chart, values))
    settings = model_settings(chart, values)
    assert settings
    for name, m in settings.items():
        c = container(find(objs, m["kind"], f"kv-kvroute-{name}"), "vllm")
        args, extra = c["args"], m["extraArgs"]
        words = kvroute_engine_flags(engine_flags_argv(m))
        n_own = len(args) - len(words) - len(extra)
        own = args[:n_own]
        assert args[n_own:] == words + list(extra), name
        assert own[0] == f"--model={m['model']}", own
        assert {a.split("=", 1)[0] for a in own} <= CHART_OWN_FLAGS, own


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_worker_args_are_exactly_the_plugin_preset(chart, name):
    assert_worker_args_are_the_plugins(chart, example(name))


ENGINE_VARIATIONS = {
    "gpu-host-tier-arc-no-cadence": {"workers": {"defaults": {
        "plugin": {"cadence": {"enabled": False}},
        "offload": {"hostBytes": 68719476736, "evictionPolicy": "arc"},
    }}},
    "odd-floats-ports-retention-no-long-prefill": {"workers": {"defaults": {
        "kvEvents": {"port": 6001, "replayPort": 7002},
        "plugin": {"cadence": {"interval": 2, "maxDeferSteps": 0, "maxDeferMs": 62.5,
                               "backlogScale": 0.75},
                   "longPrefillTokenThreshold": 0, "schedulingPolicy": "fcfs"},
        "offload": {"hostBytes": 1000, "diskDir": "/mnt/nvme-0/kv_tier.d",
                    "retention": {"enabled": True, "ttlSeconds": 90.25, "maxShare": 0.0001}},
    }}},
    "write-back-host-tier-cpu": {"workers": {"defaults": {
        "cpu": True, "offload": {"hostBytes": 268435456, "mode": "write-back"},
    }}, "kvCache": {"blockSize": 32}},
    "cluster-pool-below-disk-with-retention": {"workers": {"defaults": {
        "offload": {"hostBytes": 1 << 30, "diskDir": "/mnt/nvme/kv",
                    "pool": {"dir": "/mnt/kv-pool", "bytes": 1 << 40, "claimName": "kv-pool"},
                    "retention": {"enabled": True, "ttlSeconds": 120.5, "maxShare": 0.25}},
    }}},
    "cluster-pool-cpu-unbounded": {"workers": {"defaults": {
        "cpu": True, "offload": {"hostBytes": 4096, "pool": {"dir": "/pool", "claimName": "p"}},
    }}, "kvCache": {"blockSize": 32}},
    "write-back-without-bytes-is-no-tier": {"workers": {"defaults": {
        "offload": {"mode": "write-back"},
    }}},
    "agentic-dcp": {"workers": {"defaults": {
        "tensorParallelSize": 4, "decodeContextParallelSize": 2, "dcpCommBackend": "a2a",
    }}},
    "prefix-preset-dcp": {"workers": {"defaults": {
        "tensorParallelSize": 4, "decodeContextParallelSize": 4, "plugin": {"preset": "prefix"},
    }}},
    "plugin-off-dcp": {"workers": {"defaults": {
        "tensorParallelSize": 2, "decodeContextParallelSize": 2, "plugin": {"enabled": False},
    }}},
    "plugin-and-events-off": {"workers": {"defaults": {
        "plugin": {"enabled": False}, "kvEvents": {"enabled": False},
        "extraArgs": ["--max-num-seqs=64"],
    }}},
    "per-model-overrides": {"workers": {"models": [
        {"name": "a", "model": "m/a", "plugin": {"cadence": {"interval": 2}}},
        {"name": "b", "model": "m/b", "cpu": True, "offload": {"hostBytes": 4096,
         "retention": {"enabled": True}}},
    ], "defaults": {"plugin": {"preset": "agentic"}}}, "kvCache": {"blockSize": 32}},
}  # fmt: skip


@pytest.mark.parametrize("name", ENGINE_VARIATIONS)
def test_worker_args_are_exactly_the_plugin_preset_for_other_settings(chart, name):
    assert_worker_args_are_the_plugins(chart, ENGINE_VARIATIONS[name])


def word_after(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_worker_args_carry_plugin_kv_events_and_tiers(chart):
    objs = objects(render(chart, example("h200-70b-tp4")))
    sts = find(objs, "StatefulSet", "kv-kvroute-llama-70b")
    c = container(sts, "vllm")
    args = c["args"]
    assert word_after(args, "--prefix-caching-hash-algo") == "sha256_cbor"
    assert "--enable-prompt-tokens-details" in args
    assert flag(args, "--block-size") == "16"
    assert flag(args, "--tensor-parallel-size") == "4"
    ev = json.loads(word_after(args, "--kv-events-config"))
    assert ev["enable_kv_cache_events"] is True and ev["publisher"] == "zmq"
    assert ev["endpoint"] == "tcp://*:5557" and ev["replay_endpoint"] == "tcp://*:5558"
    assert word_after(args, "--scheduler-cls") == "engine_patches.scheduler.CadenceAsyncScheduler"
    tc = json.loads(word_after(args, "--kv-transfer-config"))
    assert tc["kv_connector"] == "OffloadingConnector"
    extra = tc["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"]) == (
        "KVRouteTieringSpec",
        "engine_patches.offload",
    )
    assert extra["cpu_bytes_to_use"] == 800_000_000_000
    assert extra["eviction_policy"] == "AgentRetentionPolicy"
    assert extra["secondary_tiers"] == [
        {"type": "fs", "root_dir": "/kv-disk", "enable_kv_events": True}
    ]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
    env = env_of(c)
    # no allowlist (vLLM loads every general plugin, kvroute_engine among them); the plugin
    # reads no preset from the environment: the flags carry everything
    assert "VLLM_PLUGINS" not in env and "KVROUTE_ENGINE_PRESET" not in env
    assert env["PYTHONPATH"]["value"] == "/opt/kvroute-plugin"
    (init,) = sts["spec"]["template"]["spec"]["initContainers"]
    assert init["command"][-1] == "kvroute==0.1.0"  # pinned to the chart: no version drift
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    mounts = {v["name"]: v["mountPath"] for v in c["volumeMounts"]}
    assert mounts["kv-disk"] == "/kv-disk"
    svc = find(objs, "Service", "kv-kvroute-workers")
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in svc["spec"]["ports"]} == {"http", "kv-events", "kv-replay"}
    cfg = yaml.safe_load(find(objs, "ConfigMap", "kv-kvroute-router")["data"]["router.yaml"])
    assert cfg["engine_hints"] is True and cfg["kv"]["hash_algo"] == "sha256_cbor"


def test_cpu_mode_runs_vllm_cpu_on_the_tiny_model(chart):
    objs = objects(render(chart, example("cpu-demo")))
    sts = find(objs, "StatefulSet", "kv-kvroute-tiny")
    c = container(sts, "vllm")
    assert c["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(c["args"], "--enforce-eager") == ""
    assert flag(c["args"], "--kv-cache-memory-bytes") == "256M"
    assert flag(c["args"], "--block-size") == "32"
    assert flag(c["args"], "--tensor-parallel-size") is None
    # the plugin's synchronous scheduler and its host tier, which runs on vLLM-CPU
    assert word_after(c["args"], "--scheduler-cls") == "engine_patches.scheduler.CadenceScheduler"
    tc = json.loads(word_after(c["args"], "--kv-transfer-config"))
    assert tc["kv_connector_extra_config"]["spec_name"] == "KVRouteOffloadingSpec"
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    (init,) = sts["spec"]["template"]["spec"]["initContainers"]
    assert init["command"] == ["kvroute", "model", "build", "--out", "/models/tiny"]
    router = find(objs, "Deployment")["spec"]["template"]["spec"]
    assert router["initContainers"][0]["command"] == init["command"]  # same tokenizer bytes


def test_a_models_cadence_override_keeps_the_other_cadence_defaults(chart):
    values = ENGINE_VARIATIONS["per-model-overrides"]
    c = container(find(objects(render(chart, values)), "StatefulSet", "kv-kvroute-a"), "vllm")
    cadence = json.loads(word_after(c["args"], "--additional-config"))["kvroute"]["cadence"]
    assert cadence == {"interval": 2, "max_defer_steps": 16, "max_defer_ms": 500.0,
                       "backlog_scale": 16.0}  # fmt: skip


def test_engine_command_and_plugin_are_switchable(chart):
    values = {"workers": {"defaults": {
        "command": ["vllm", "serve"], "extraArgs": ["--max-num-seqs=64"],
        "plugin": {"enabled": False}, "kvEvents": {"enabled": False},
    }}}  # fmt: skip
    c = container(
        find(objects(render(chart, values)), "StatefulSet", "kv-kvroute-llama-8b"), "vllm"
    )
    assert c["command"] == ["vllm", "serve"] and c["args"][-1] == "--max-num-seqs=64"
    assert "VLLM_PLUGINS" not in env_of(c) and flag(c["args"], "--kv-events-config") is None
    assert "PYTHONPATH" not in env_of(c) and "--scheduler-cls" not in c["args"]
    over = {"workers": {"models": [{"name": "m", "overrideArgs": ["--model=x", "--port=8000"]}]}}
    c = container(find(objects(render(chart, over)), "StatefulSet", "kv-kvroute-m"), "vllm")
    assert c["args"] == ["--model=x", "--port=8000"]


# ---- secrets --------------------------------------------------------------------------------

SECRETISH = re.compile(r"KEY|PASSWORD|TOKEN|SECRET", re.I)


@pytest.mark.parametrize("name", EXAMPLES)
def test_secrets_are_referenced_never_inlined(chart, name):
    objs = objects(render(chart, example(name)))
    for obj in objs:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = obj["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            for e in c.get("env", []):
                if SECRETISH.search(e["name"]):
                    assert "secretKeyRef" in e.get("valueFrom", {}), (obj["metadata"]["name"], e)
                if "value" in e:  # literal values may only *refer* to secret-backed vars
                    assert "$(KVROUTE_REDIS_PASSWORD)" in e["value"] or not SECRETISH.search(
                        e["value"]
                    ), e
            for a in c.get("args", []) + c.get("command", []):
                assert not re.search(r"--(api-key|requirepass|password)", a), a
    cfg = yaml.safe_load(find(objs, "ConfigMap", "kv-kvroute-router")["data"]["router.yaml"])
    assert not {"api_keys", "admin_key", "upstream_api_key", "redis_url"} & set(cfg)
    if name == "h200-70b-tp4":
        env = env_of(container(find(objs, "Deployment"), "router"))
        assert env["KVROUTE_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "kvroute-client-keys"
        assert env["KVROUTE_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "kvroute-admin"
        assert env["KVROUTE_UPSTREAM_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == (
            "kvroute-upstream"
        )
        assert not [o for o in objs if o["kind"] == "Secret"]  # existing Secrets only


# ---- contradictory values fail at render time, naming the keys ------------------------------

CONTRADICTIONS = [
    ({"redis": {"external": {"url": "redis://r:6379/0"}}}, "either redis.enabled"),
    ({"redis": {"enabled": False}}, "set redis.enabled=true or redis.external.url"),
    (
        {"redis": {"enabled": False, "external": {"url": "redis://u:pw@r:6379"}}},
        "without a password",
    ),
    ({"router": {"pdb": {"minAvailable": 2}}}, "router.pdb.minAvailable (2) must be below"),
    (
        {"router": {"autoscaling": {"minReplicas": 5, "maxReplicas": 3}}},
        "minReplicas (5) is above maxReplicas (3)",
    ),
    ({"router": {"config": {"admin_key": "x"}}}, "router.config.admin_key would put a secret"),
    ({"workers": {"defaults": {"cpu": True}}}, "vLLM-CPU rejects block size 16"),
    (
        {"workers": {"defaults": {"tensorParallelSize": 4, "decodeContextParallelSize": 3}}},
        "decodeContextParallelSize (3) must divide tensorParallelSize (4)",
    ),
    ({"workers": {"defaults": {"offload": {"diskDir": "/d"}}}}, "set offload.hostBytes too"),
    ({"workers": {"defaults": {"gpus": 2, "tensorParallelSize": 4}}}, "gpus (2) is below"),
    (
        {"workers": {"models": [{"name": "a", "model": "x"}, {"name": "a", "model": "y"}]}},
        'name "a" appears twice',
    ),
    ({"workers": {"models": [{"name": "a"}]}}, "workers.models[a].model is required"),
    (
        {"workers": {"defaults": {"plugin": {"enabled": False}, "offload": {"hostBytes": 1}}}},
        "the host/disk tiers are the plugin's",
    ),
    (
        {"workers": {"defaults": {"plugin": {"preset": "prefix"}, "offload": {"hostBytes": 1}}}},
        "set plugin.enabled=true and plugin.preset=agentic",
    ),
    (
        {"workers": {"defaults": {"offload": {"retention": {"enabled": True}}}}},
        "offload.retention holds host-tier KV; set offload.hostBytes too",
    ),
    (
        {
            "workers": {
                "defaults": {"offload": {"hostBytes": 1, "mode": "write-back", "diskDir": "/d"}}
            }
        },
        "the write-back host tier takes no disk tier",
    ),
    (
        {
            "workers": {
                "defaults": {
                    "offload": {
                        "hostBytes": 1,
                        "mode": "write-back",
                        "retention": {"enabled": True},
                    }
                }
            }
        },
        "the write-back host tier is vLLM's LRU block pool and takes no retention",
    ),
    (
        {
            "workers": {
                "defaults": {
                    "offload": {"hostBytes": 1, "mode": "write-back", "evictionPolicy": "arc"}
                }
            }
        },
        "the write-back host tier evicts in LRU order only",
    ),
    (
        {"workers": {"defaults": {"offload": {"pool": {"dir": "/p", "claimName": "c"}}}}},
        "offload.pool sits below the host tier; set offload.hostBytes too",
    ),
    (
        {"workers": {"defaults": {"offload": {"hostBytes": 1, "pool": {"dir": "/p"}}}}},
        "offload.pool needs claimName",
    ),
    (
        {
            "workers": {
                "defaults": {
                    "offload": {
                        "hostBytes": 1,
                        "mode": "write-back",
                        "pool": {"dir": "/p", "claimName": "c"},
                    }
                }
            }
        },
        "the write-back host tier takes no pool",
    ),
    (
        {"workers": {"defaults": {"offload": {"hostBytes": 1, "pool": {"bytes": 5}}}}},
        "bytes and claimName need pool.dir",
    ),
    (
        {"workers": {"defaults": {"extraEnv": [{"name": "VLLM_PLUGINS", "value": "kvroute"}]}}},
        "add kvroute_engine",
    ),
    (
        {"workers": {"defaults": {"cpu": True, "plugin": {"kernels": ["all"]}}}},
        "kvroute's kernels run on CUDA hosts only",
    ),
    (
        {"workers": {"defaults": {"plugin": {"enabled": False, "kernels": ["dcp_lse_merge"]}}}},
        "the kernels are installed by the engine plugin",
    ),
]


def test_plugin_kernels_become_the_workers_kvroute_kernels(chart):
    def workers(values: dict[str, Any]) -> list[dict[str, Any]]:
        objs = objects(render(chart, values))
        found = [
            container(o, "vllm")
            for o in objs
            if o["kind"] in ("StatefulSet", "Deployment")
            and o["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
        ]
        assert found
        return found

    kernels = ["dcp_lse_merge", "fused_add_rmsnorm"]
    for c in workers({"workers": {"defaults": {"plugin": {"kernels": kernels}}}}):
        assert env_of(c)["KVROUTE_KERNELS"]["value"] == "dcp_lse_merge,fused_add_rmsnorm"
    assert all("KVROUTE_KERNELS" not in env_of(c) for c in workers({}))


def test_an_allowlist_naming_the_plugin_renders(chart):
    env = [{"name": "VLLM_PLUGINS", "value": "lora_filesystem_resolver,kvroute_engine"}]
    render(chart, {"workers": {"defaults": {"extraEnv": env}}})


@pytest.mark.parametrize(("values", "message"), CONTRADICTIONS)
def test_contradictory_values_fail_with_a_clear_message(chart, values, message):
    with pytest.raises(helm.HelmError) as e:
        render(chart, values)
    assert message in str(e.value)


def test_schema_rejects_typos_and_bad_types(chart):
    for bad in (
        {"router": {"polcy": "kv_cost"}},
        {"router": {"discovery": {"mode": "poll"}}},
        {"workers": {"defaults": {"kind": "DaemonSet"}}},
        {"kvCache": {"blockSize": "16"}},
        {"workers": {"models": [{"name": "Bad_Name", "model": "x"}]}},
        {"workers": {"defaults": {"plugin": {"preset": "agentic-ish"}}}},
        {"workers": {"defaults": {"offload": {"evictionPolicy": "fifo"}}}},
        {"workers": {"defaults": {"offload": {"diskDir": '/kv"disk'}}}},
        {"workers": {"defaults": {"plugin": {"cadence": {"maxDeferMs": 2e6}}}}},
        {"kvCache": {"hashAlgo": "xxhash"}},  # the presets hash with sha256_cbor only
    ):
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(chart.merge_values(bad))


# ---- the dashboard --------------------------------------------------------------------------


def test_dashboard_ships_as_a_configmap(chart):
    objs = objects(render(chart))
    cm = find(objs, "ConfigMap", "kv-kvroute-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(cm["data"]["kvroute.json"])
    assert shipped == json.loads((CHART / "dashboards" / "kvroute.json").read_text())
    exprs = [t["expr"] for p in shipped["panels"] for t in p.get("targets", [])]
    assert len(exprs) > 20
    for p in shipped["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["description"], p["title"]
    off = objects(render(chart, {"monitoring": {"dashboard": {"enabled": False}}}))
    assert not [o for o in off if o["metadata"]["name"].endswith("-dashboard")]


def test_the_cluster_pool_mounts_one_shared_claim_on_every_worker(chart):
    values = {"workers": {"models": [{"name": "a", "model": "m/a"}, {"name": "b", "model": "m/b"}],
              "defaults": {"replicas": 2, "offload": {"hostBytes": 4096, "pool": {
                  "dir": "/mnt/kv-pool", "bytes": 10, "claimName": "shared-kv"}}}}}  # fmt: skip
    objs = objects(render(chart, values))
    workers = [
        o
        for o in objs
        if o["kind"] in ("StatefulSet", "Deployment")
        and o["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    ]
    assert len(workers) == 2
    for w in workers:
        spec = w["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["kv-pool"]["persistentVolumeClaim"] == {"claimName": "shared-kv"}
        mounts = {m["name"]: m["mountPath"] for m in container(w, "vllm")["volumeMounts"]}
        assert mounts["kv-pool"] == "/mnt/kv-pool"
