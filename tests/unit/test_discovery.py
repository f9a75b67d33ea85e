"""router.discovery: EndpointSlice parsing, discovery diffs, sources of the replica set.

The watch against a fake API server: tests/integration/test_k8s_watch.py."""

from __future__ import annotations

import json

from router.discovery import diff, endpoints_from_slices
from router.replicas import ReplicaSet

# Recorded shape of `GET /apis/discovery.k8s.io/v1/namespaces/llm/endpointslices
# ?labelSelector=kubernetes.io/service-name=vllm` (two slices, one IPv6).
SLICES = json.loads("""
{"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
 "metadata": {"resourceVersion": "48211"},
 "items": [
  {"metadata": {"name": "vllm-abc12", "namespace": "llm",
                "labels": {"kubernetes.io/service-name": "vllm"}},
   "addressType": "IPv4",
   "endpoints": [
     {"addresses": ["10.1.0.5"], "conditions": {"ready": true, "serving": true,
      "terminating": false}, "targetRef": {"kind": "Pod", "name": "vllm-0"}},
     {"addresses": ["10.1.0.6"], "conditions": {"ready": false, "serving": false,
      "terminating": false}, "targetRef": {"kind": "Pod", "name": "vllm-1"}},
     {"addresses": ["10.1.0.7"], "conditions": {"ready": true, "serving": true,
      "terminating": true}, "targetRef": {"kind": "Pod", "name": "vllm-2"}},
     {"addresses": ["10.1.0.8"], "conditions": {}, "targetRef": {"kind": "Pod",
      "name": "vllm-3"}}],
   "ports": [{"name": "metrics", "port": 9100, "protocol": "TCP"},
             {"name": "http", "port": 8000, "protocol": "TCP"}]},
  {"metadata": {"name": "vllm-def34", "namespace": "llm"},
   "addressType": "IPv6",
   "endpoints": [{"addresses": ["fd00::9"], "conditions": {"ready": true}}],
   "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]}]}
""")


def test_endpoint_slices_parse_ready_endpoints_on_the_named_port():
    assert endpoints_from_slices(SLICES, "http") == {
        "http://10.1.0.5:8000",
        "http://10.1.0.8:8000",
        "http://[fd00::9]:8000",
    }
    assert "http://10.1.0.5:9100" in endpoints_from_slices(SLICES["items"])  # first port
    assert endpoints_from_slices({"items": []}) == set()


def test_discovery_diff_and_replica_set_sources():
    old = endpoints_from_slices(SLICES, "http")
    SLICES["items"][0]["endpoints"][1]["conditions"]["ready"] = True  # vllm-1 became ready
    new = endpoints_from_slices(SLICES, "http") - {"http://[fd00::9]:8000"}
    assert diff(old, new) == ({"http://10.1.0.6:8000"}, {"http://[fd00::9]:8000"})
    rs = ReplicaSet()
    rs.set_source("static", ["http://s:1/"])
    assert rs.set_source("k8s", old) == (old, set())
    added, removed = rs.set_source("k8s", new)
    assert (added, removed) == ({"http://10.1.0.6:8000"}, {"http://[fd00::9]:8000"})
    assert {r.url for r in rs} == new | {"http://s:1"}  # other sources untouched


async def test_dns_discovery_writes_its_own_source_and_checks_what_it_added():
    """ReplicaDiscovery replaces only its ``dns:<i>`` source and hands each replica it added
    (and only those) to the monitor's health check."""
    import aiohttp

    from router.config import RouterConfig
    from router.discovery import ReplicaDiscovery

    cfg = RouterConfig(replica_dns=["http://localhost:1"], health_timeout_s=0.2)
    rs = ReplicaSet()
    rs.set_source("static", ["http://s:1"])
    checked: list[str] = []

    async def check(r) -> None:
        checked.append(r.name)

    async with aiohttp.ClientSession() as http:
        disc = ReplicaDiscovery(rs, http, cfg, check)
        await disc.resolve_dns()
        found = {r.name for r in rs if "dns:0" in rs.sources(r.name)}
        assert found and all(n.endswith(":1") for n in found)
        assert sorted(checked) == sorted(found)  # the static one is not re-checked
        checked.clear()
        await disc.resolve_dns()  # the same answer: nothing added, nothing checked
        assert checked == [] and rs.get("http://s:1") is not None
