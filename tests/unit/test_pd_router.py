"""P/D disaggregation, the router's pure parts: roles from config, the decode pick, the
legs' bodies and the per-call verdict without a KV layer (router.disagg)."""

from __future__ import annotations

import pytest

from router import disagg
from router.config import ConfigError, load_config
from router.replicas import ReplicaSet
from router.urls import split_role
from tests.unit.test_router_scheduling import ctx, ep


def test_roles_ride_on_the_replica_url():
    assert split_role("http://a:1#role=prefill") == ("http://a:1", "prefill")
    assert split_role("http://a:1") == ("http://a:1", "both")
    with pytest.raises(ValueError, match="mixer"):
        split_role("http://a:1#role=mixer")
    # any other fragment is not a role: the URL check refuses it (a '#' in a password)
    assert split_role("http://a:1#x=prefill") == ("http://a:1#x=prefill", "both")
    for bad in ("http://a:1#role=pre", "http://a:1#x=prefill", "http://a:1#role"):
        with pytest.raises(ConfigError):
            load_config(env={}, overrides={"replicas": [bad]})
    with pytest.raises(ConfigError, match="pd_mode"):
        load_config(env={}, overrides={"replicas": ["http://a:1"], "pd_mode": "sometimes"})
    ok = load_config(env={}, overrides={"replicas": ["http://a:1#role=decode"]})
    assert ok.replicas == ["http://a:1#role=decode"]
    rs = ReplicaSet()
    rs.set_source(
        "static", ["http://u:p@a:1/#role=prefill", "http://b:2#role=decode", "http://c:3"]
    )
    roles = {v.name: v.role for v in rs.views()}
    # the fragment and the credentials never reach the replica's name (metrics, logs, URLs)
    assert roles == {"http://a:1": "prefill", "http://b:2": "decode", "http://c:3": "both"}
    assert rs.get("http://a:1").auth is not None
    assert rs.get("http://a:1").to_json()["role"] == "prefill"
    # a role change from the same source applies
    rs.set_source("static", ["http://a:1#role=decode"])
    assert rs.get("http://a:1").role == "decode"


def test_role_sets():
    vs = [ep("p")._replace(role="prefill"), ep("d")._replace(role="decode"), ep("b")]
    assert disagg.pd_enabled(vs) and not disagg.pd_enabled([ep("x"), ep("y")])
    assert disagg.not_prefill(vs) == {"d"}
    assert disagg.not_decode(vs) == {"p"}


def test_decode_pick_by_load_then_kv_room():
    c = ctx(model="m")
    d = [
        ep("busy", inflight=5, kv=0.1)._replace(role="decode"),
        ep("full", inflight=0, kv=0.97)._replace(role="decode"),
        ep("roomy", inflight=1, kv=0.2)._replace(role="decode"),
        ep("tight", inflight=1, kv=0.6)._replace(role="decode"),
        ep("pre", inflight=0, kv=0.0)._replace(role="prefill"),
        ep("down", healthy=False)._replace(role="decode"),
        ep("other", models=("n",))._replace(role="decode"),
    ]
    assert disagg.pick_decode(c, d).name == "roomy"  # full: only when none has room
    assert disagg.pick_decode(c, d, frozenset({"roomy"})).name == "tight"
    assert disagg.pick_decode(c, d, frozenset({"roomy", "tight", "busy"})).name == "full"
    assert disagg.pick_decode(c, [d[4], d[5], d[6]]) is None


def test_leg_bodies():
    hint = {"session": "s", "state": "paused"}
    body = {"model": "m", "messages": [], "stream": True, "max_tokens": 300,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 300,
            "kv_transfer_params": {"kvroute": hint}}  # fmt: skip
    pre = disagg.prefill_body(body)
    assert pre["max_tokens"] == pre["max_completion_tokens"] == 1 and pre["stream"] is False
    assert "stream_options" not in pre and pre["kv_transfer_params"]["do_remote_decode"] is True
    assert pre["kv_transfer_params"]["kvroute"] == hint  # the retention hint rides along
    assert body["max_tokens"] == 300  # the client's body is untouched
    params = {"do_remote_prefill": True, "remote_block_ids": [[4]]}
    dec = disagg.decode_body(body, params)
    assert dec["kv_transfer_params"] == {**params, "kvroute": hint} and dec["stream"] is True
    plain = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    assert disagg.decode_body(plain, params)["kv_transfer_params"] == params
    assert "kv_transfer_params" not in disagg.decode_body(plain, None)


def test_verdict_without_kv_layer_is_the_size_threshold():
    c = ctx()
    p, d = ep("p")._replace(role="prefill"), ep("d")._replace(role="decode")
    small = disagg.plan(c, p, d, None, min_prompt_tokens=512, body_bytes=400)
    big = disagg.plan(c, p, d, None, min_prompt_tokens=512, body_bytes=40_000)
    assert not small.disaggregate and small.reason == "short_prompt"
    assert big.disaggregate
    assert disagg.plan(c, p, d, None, mode="always") is None
    same = disagg.plan(c, p, p, None)
    assert not same.disaggregate and same.reason == "same_replica"


class FakeKV:
    """The KV layer's view as :func:`router.disagg.plan` reads it."""

    block_size = 64

    def __init__(self, prof, matches, loads):
        self.prof, self.matches, self.loads = prof, matches, loads

    def match(self, keys, names):
        return {n: self.matches[n] for n in names if n in self.matches}

    def estimate(self, c):
        return 0, {}

    def profile(self, name):
        return self.prof

    def replica_load(self, e, exclude, prior):
        return self.loads[e.name]


def test_verdict_with_kv_layer_is_the_cost_function():
    from costmodel.disagg import disagg_cost
    from costmodel.placement import ReplicaLoad, queue_time
    from costmodel.profiles import load_profile
    from router.kv.index import TierDepth

    prof = load_profile("h200-70b-fp8-tp4")
    p, d = ep("p")._replace(role="prefill"), ep("d")._replace(role="decode")
    c = ctx(block_keys=list(range(1000)))  # 64k tokens
    c.prompt_tokens = 64_000

    def load(batch, ctxt, queued=0.0):
        return ReplicaLoad(decode_batch=batch, decode_context_tokens=ctxt,
                           queued_prefill_tokens=queued)  # fmt: skip

    busy = FakeKV(prof, {"p": TierDepth(900, gpu=900), "d": TierDepth(10, gpu=10)},
                  {"p": load(0, 0.0), "d": load(48, 48 * 40_000.0)})  # fmt: skip
    v = disagg.plan(c, p, d, busy)
    want = disagg_cost(prof, 64_000, prefill_cached_tokens=900 * 64, decode_cached_tokens=640,
                       decode_batch=48, decode_context_tokens=48 * 40_000.0,
                       prefill_queue_s=queue_time(prof, 0.0) or 0.0)  # fmt: skip
    assert v == want and v.disaggregate
    # the same call with an idle, warm decode replica: colocated
    warm = FakeKV(prof, {"p": TierDepth(900, gpu=900), "d": TierDepth(990, gpu=990)},
                  {"p": load(0, 0.0), "d": load(0, 0.0)})  # fmt: skip
    assert not disagg.plan(c, p, d, warm).disaggregate


async def test_dns_discovered_replicas_keep_their_role():
    import aiohttp

    from router.config import RouterConfig
    from router.monitor import ReplicaMonitor

    cfg = RouterConfig(replica_dns=["http://localhost:1#role=decode"], health_timeout_s=0.2)
    rs = ReplicaSet()
    async with aiohttp.ClientSession() as http:
        await ReplicaMonitor(rs, http, cfg).discovery.resolve_dns()
    views = rs.views()
    assert views and all(v.role == "decode" and "#" not in v.name for v in views)
