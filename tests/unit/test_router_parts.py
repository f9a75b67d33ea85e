"""Router parts without servers: identity, config, session table, breaker, discovery parsing."""

from __future__ import annotations

import json
import time

import orjson
import pytest

from router.config import ConfigError, load_config
from router.replicas import (
    CircuitBreaker,
    ReplicaSet,
    diff,
    endpoints_from_slices,
    next_scrape_at,
    parse_vllm_metrics,
)
from router.sessions import identify, prompt_prefix_text
from router.state import MemoryStore

# --- identity ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers, body, expect",
    [
        ({"x-claude-code-session-id": "S"}, {}, ("S", None, None, "claude-code")),
        (
            {
                "x-claude-code-session-id": "S",
                "x-claude-code-agent-id": "a1",
                "x-claude-code-parent-agent-id": "a0",
            },
            {},
            ("S", "a1", "t/S#a0", "claude-code"),
        ),
        (
            {"x-claude-code-session-id": "S", "x-claude-code-agent-id": "a1"},
            {},
            ("S", "a1", "t/S", "claude-code"),
        ),
        (
            {"X-Dynamo-Session-ID": "D", "X-Dynamo-Parent-Session-ID": "P"},
            {},
            ("D", None, "t/P", "dynamo"),
        ),
        ({"x-session-id": "O", "x-parent-session-id": "P"}, {}, ("O", None, "t/P", "opencode")),
        ({"session-id": "C"}, {}, ("C", None, None, "codex")),
        ({"session_id": "C"}, {}, ("C", None, None, "codex")),
        ({"X-SMG-Routing-Key": "G"}, {}, ("G", None, None, "sglang")),
        ({"x-session-token": "L"}, {}, ("L", None, None, "llm-d")),
        ({"X-Correlation-ID": "X"}, {}, ("X", None, None, "agentx")),
        ({}, {"prompt_cache_key": "K", "user": "U"}, ("K", None, None, "prompt_cache_key")),
        ({}, {"safety_identifier": "Z", "user": "U"}, ("Z", None, None, "safety_identifier")),
        ({}, {"user": "U"}, ("U", None, None, "user")),
        ({}, {"session_id": "V"}, ("V", None, None, "session_id")),
        ({}, {"cache_salt": "salt"}, ("salt", None, None, "cache_salt")),
        # headers beat body fields; an empty header is ignored
        ({"x-session-id": " ", "session-id": "C"}, {"user": "U"}, ("C", None, None, "codex")),
    ],
)
def test_identity_conventions(headers, body, expect):
    from multidict import CIMultiDict

    ident = identify(CIMultiDict(headers), body, tenant="t")
    assert (ident.session, ident.agent, ident.parent, ident.source) == expect
    assert ident.tenant == "t" and ident.key.startswith("t/")


def test_dynamo_final_flag_and_tenant_namespacing():
    a = identify({"x-dynamo-session-id": "s", "x-dynamo-session-final": "true"}, {}, "alpha")
    b = identify({"x-dynamo-session-id": "s"}, {}, "beta")
    assert a.final and not b.final and a.key != b.key


def _turns(shape: str, first: str, n: int, system: str = "be brief") -> dict:
    """Turn ``n`` (0-based) of a conversation opened by ``first``, as each API sends it."""
    if shape == "chat":
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": first}]
        for i in range(n):
            msgs += [{"role": "assistant", "content": f"a{i}"},
                     {"role": "user", "content": f"u{i}"}]  # fmt: skip
        return {"messages": msgs}
    if shape == "anthropic":
        msgs = [{"role": "user", "content": [{"type": "text", "text": first}]}]
        for i in range(n):
            last = {"type": "text", "text": f"u{i}", "cache_control": {"type": "ephemeral"}}
            msgs += [{"role": "assistant", "content": [{"type": "text", "text": f"a{i}"}]},
                     {"role": "user", "content": [last]}]  # fmt: skip
        return {"system": [{"type": "text", "text": system}], "messages": msgs}
    items = [{"role": "developer", "content": "env"}, {"role": "user", "content": first}]
    for i in range(n):
        items += [{"type": "function_call", "name": "ls", "arguments": "{}", "call_id": f"c{i}"},
                  {"type": "function_call_output", "call_id": f"c{i}", "output": f"o{i}"},
                  {"role": "user", "content": [{"type": "input_text", "text": f"u{i}"}]},
                  ]  # fmt: skip
    return {"instructions": system, "input": items}


@pytest.mark.parametrize("shape", ["chat", "anthropic", "responses"])
def test_fallback_keys_a_conversation_on_its_head_not_its_growing_prompt(shape):
    # five turns of one conversation with a short system prompt: one session (the prompt's
    # first 4,096 characters changed every turn: five sessions)
    turns = [identify({}, _turns(shape, "fix the bug", n)) for n in range(5)]
    assert {t.source for t in turns} == {"prefix"}
    assert len({t.session for t in turns}) == 1
    other = identify({}, _turns(shape, "write a test", 3))  # another conversation
    assert other.session != turns[0].session
    # two conversations on one long system prompt (a coding agent's) are two sessions (the
    # first 4,096 characters made them one)
    long = "tools and rules " * 400
    a, b = (identify({}, _turns(shape, f, 2, system=long)) for f in ("fix it", "test it"))
    assert a.session != b.session


def test_fallback_without_turns_keys_on_the_leading_characters():
    a = identify({}, {"prompt": "rules " * 1000 + "one"})
    b = identify({}, {"prompt": "rules " * 1000 + "two"})
    c = identify({}, {"prompt": "other"})
    assert a.source == "prefix" and a.session == b.session != c.session
    # a Responses input that is a bare string is the first user turn
    assert identify({}, {"input": "hi"}).session != identify({}, {"input": "ho"}).session


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]},
        {"system": "hello", "messages": []},  # Anthropic
        {"input": [{"role": "user", "content": "hello"}]},  # Responses API
        {"prompt": "hello"},
    ],
)
def test_prompt_prefix_text_reads_every_api_shape(body):
    assert "hello" in prompt_prefix_text(body, 100)


# --- config -----------------------------------------------------------------------------


def test_config_precedence_flags_over_env_over_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "replicas: [http://a:1]\nport: 1111\nretries: 5\npolicy: least_load\napi_keys: {k1: t1}\n"
    )
    env = {"KVROUTE_PORT": "2222", "KVROUTE_RETRIES": "4", "KVROUTE_API_KEYS": "k2:t2,k3"}
    cfg = load_config(f, env=env, overrides={"port": 3333, "replicas": None})
    assert (cfg.port, cfg.retries, cfg.policy) == (3333, 4, "least_load")
    assert cfg.replicas == ["http://a:1"]
    assert cfg.api_keys["k2"] == "t2" and cfg.api_keys["k3"].startswith("k-")
    assert cfg.auth_enabled


@pytest.mark.parametrize(
    "yaml_text, env, error",
    [
        ("replicas: [http://a:1]\nbogus: 1\n", {}, "unknown config keys"),
        ("replicas: [http://a:1]\n", {"KVROUTE_PORT": "eighty"}, "cannot use"),
        ("port: 1\n", {}, "no replicas"),
        ("replicas: [a:1]\n", {}, "must start with http"),
        ("- a\n", {}, "must hold a mapping"),
        ("replicas: [http://a:1]\n", {"KVROUTE_METRICS_INTERVAL_S": "0"}, "metrics_interval_s >="),
        ("replicas: [http://a:1]\nmetrics_interval_s: 0.005\n", {}, "metrics_interval_s >="),
        ("replicas: [http://a:1]\nhealth_interval_s: 0\n", {}, "health_interval_s > 0"),
    ],
)
def test_config_errors_are_clear(tmp_path, yaml_text, env, error):
    f = tmp_path / "c.yaml"
    f.write_text(yaml_text)
    with pytest.raises(ConfigError, match=error):
        load_config(f, env=env)


def test_load_scrape_interval_goes_down_to_llm_d_s_50_ms(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("replicas: [http://a:1]\n")
    assert load_config(f, env={}).metrics_interval_s == 1.0  # the default
    cfg = load_config(f, env={"KVROUTE_METRICS_INTERVAL_S": "0.05"})
    assert cfg.metrics_interval_s == 0.05


def test_scrape_rounds_keep_a_fixed_rate_and_skip_what_they_overran():
    # a round due at 10.0 that took 30 ms: the next is due 50 ms after 10.0, not after 10.03
    assert next_scrape_at(10.0, 10.03, 0.05) == pytest.approx(10.05)
    # a round that ran 2 s (a replica timing out): the next starts an interval after it ended,
    # not at once and not 40 rounds back to back
    assert next_scrape_at(10.0, 12.0, 0.05) == pytest.approx(12.05)


def test_config_repr_masks_secrets():
    cfg = load_config(
        env={
            "KVROUTE_REPLICAS": "http://a:1",
            "KVROUTE_UPSTREAM_API_KEY": "sk-very-secret",
            "KVROUTE_ADMIN_KEY": "adm-secret",
            "KVROUTE_API_KEYS": "ck-secret:t",
        }
    )
    text = repr(cfg)
    assert "sk-very-secret" not in text and "adm-secret" not in text and "ck-secret" not in text


# --- session table ----------------------------------------------------------------------


async def test_memory_store_lineage_gaps_and_ttl():
    st = MemoryStore(ttl_s=100)
    t0 = time.time()
    parent = identify({"x-claude-code-session-id": "S"}, {})
    child = identify({"x-claude-code-session-id": "S", "x-claude-code-agent-id": "c"}, {})
    await st.begin_call(parent, now=t0 + 0)
    assert await st.claim(parent.key, "r1") == "r1"
    assert await st.claim(parent.key, "r2") == "r1"  # first placement wins
    await st.end_call(parent.key, now=t0 + 2)
    rec = await st.begin_call(parent, now=t0 + 10)
    assert rec.gaps == [8.0] and rec.calls == 2 and rec.replica == "r1"
    await st.end_call(parent.key, now=t0 + 11)
    await st.begin_call(child, now=t0 + 12)
    p = await st.get(parent.key)
    assert p is not None and p.children == {child.key}
    c = await st.get(child.key)
    assert c is not None and c.parent == parent.key
    await st.end_call(child.key, now=t0 + 13)
    assert st.sweep(now=t0 + 200) == 2 and st.active_count() == 0


async def test_memory_store_keeps_sessions_with_calls_in_flight_past_ttl():
    st = MemoryStore(ttl_s=1)
    ident = identify({"x-session-id": "long"}, {})
    await st.begin_call(ident, now=0.0)
    assert st.sweep(now=50.0) == 0  # a 50 s prefill must not lose its session
    await st.end_call(ident.key, now=50.0)
    assert st.sweep(now=52.0) == 1


async def test_memory_store_cap_evicts_oldest():
    st = MemoryStore(max_sessions=3)
    for i in range(5):
        await st.begin_call(identify({"x-session-id": f"s{i}"}, {}), now=float(i))
    assert [r.key for r in st.list()] == ["-/s4", "-/s3", "-/s2"]


# --- breaker, metrics, discovery --------------------------------------------------------


def test_breaker_opens_then_lets_one_probe_through():
    b = CircuitBreaker(failures=2, cooldown_s=10)
    b.on_failure(now=0)
    assert b.state == "closed" and b.allows(now=0)
    b.on_failure(now=1)
    assert b.state == "open" and not b.allows(now=5)
    assert b.allows(now=11)
    b.on_send(now=11)
    assert b.state == "half_open" and not b.allows(now=11)  # one probe at a time
    b.on_failure(now=12)
    assert b.state == "open" and not b.allows(now=15)
    b.on_send(now=23)
    b.on_success()
    assert b.state == "closed" and b.failures == 0 and b.allows(now=23)


def test_parse_vllm_metrics_sums_label_sets_and_ignores_the_rest():
    text = """# HELP vllm:num_requests_running Number of requests
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.375
vllm:num_requests_running_total 99
vllm:time_to_first_token_seconds_bucket{le="0.1"} 7.0
vllm:num_requests_waiting{engine="0"} NaN-garbage
"""
    assert parse_vllm_metrics(text) == {"running": 3.0, "waiting": 4.0, "kv_usage": 0.375}


def test_parse_vllm_metrics_takes_the_host_tier_shares_largest_over_engines():
    from engine_patches.offload import HOST_OCCUPANCY, HOST_RETAINED, PENDING_PREFILL

    text = f"""# TYPE {HOST_OCCUPANCY} gauge
{HOST_OCCUPANCY}{{engine="0",model_name="tiny"}} 0.98
{HOST_OCCUPANCY}{{engine="1",model_name="tiny"}} 0.5
# TYPE {HOST_RETAINED} gauge
{HOST_RETAINED}{{engine="0",model_name="tiny"}} 0.25
# TYPE {PENDING_PREFILL} gauge
{PENDING_PREFILL}{{engine="0",model_name="tiny"}} 3000
{PENDING_PREFILL}{{engine="1",model_name="tiny"}} 500
"""
    # shares: the largest engine's; pending prefill tokens: the replica's total
    assert parse_vllm_metrics(text) == {
        "host_occupancy": 0.98, "host_retained": 0.25, "pending_prefill": 3500.0,
    }  # fmt: skip


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


def test_breaker_probe_abandoned_by_the_client_frees_the_slot():
    b = CircuitBreaker(failures=1, cooldown_s=10)
    b.on_failure(now=0)
    b.on_send(now=11)
    assert not b.allows(now=11)
    b.on_abandon()  # the probing client disconnected: no verdict
    assert b.state == "half_open" and b.allows(now=12)


def test_calls_finished_after_a_scrape_leave_the_engine_count():
    """A stale scrape must not make a finished call look like load, or bounded-load affinity
    places a session away from its home (where its prefix may already be)."""
    from router.replicas import Replica
    from router.scheduling.session_affinity import ring_scores

    reps = [Replica(f"http://r{i}") for i in range(4)]
    for r in reps:
        r.running, r.waiting = 0.0, 0.0
    idle = ring_scores("sess", [r.view() for r in reps], 1.25)
    home = next(r for r in reps if idle.get(r.name) == 1.0)  # where the session is placed
    home.running = 1.0  # scraped while a previous call was running there
    stale = ring_scores("sess", [r.view() for r in reps], 1.25)
    assert stale.get(home.name, 0.0) < 1.0  # the stale count pushes the placement away

    home.finished += 1  # the router saw that call end after the scrape
    assert home.view().running == 0.0 and home.view().load == 0.0
    fresh = ring_scores("sess", [r.view() for r in reps], 1.25)
    assert fresh[home.name] == 1.0

    home.finished_at_scrape = home.finished  # a new scrape starts from the engine's own count
    home.running = 3.0
    assert home.view().running == 3.0


def test_malformed_metrics_never_raise_and_timestamps_are_not_values():
    text = (
        "vllm:num_requests_running 2 1700000000000\n"  # a sample with a timestamp
        'vllm:num_requests_waiting{engine="0"} 1\n'
        "vllm:broken_line_without_value\n"
    )
    got = parse_vllm_metrics(text)  # must not raise
    assert got.get("running") in (2.0, None) and got.get("running") != 1700000000000


def test_redis_password_is_masked_in_repr():
    cfg = load_config(
        env={
            "KVROUTE_REPLICAS": "http://a:1",
            "KVROUTE_REDIS_URL": "redis://app:hunter2@redis:6379/0",
        }
    )
    assert "hunter2" not in repr(cfg) and "redis://app:***@redis:6379/0" in repr(cfg)


def test_only_the_half_open_probe_is_marked_as_the_probe():
    from router.replicas import CircuitBreaker

    b = CircuitBreaker(failures=1, cooldown_s=5.0)
    assert b.on_send(now=0.0) is False  # closed: an ordinary call
    b.on_failure(now=0.0)  # opens
    assert not b.allows(now=1.0)
    assert b.allows(now=6.0) and b.on_send(now=6.0) is True  # the one probe
    assert not b.allows(now=6.1)  # a second call must wait for the probe's verdict


def test_session_record_copy_keeps_every_field_and_owns_its_lists():
    import dataclasses

    from router.state import SessionRecord

    values = {
        "key": "t\x1fs", "tenant": "t", "parent": "p", "agent": "a", "replica": "r",
        "created": 1.0, "last_seen": 2.0, "last_call_end": 3.0, "gaps": [0.5],
        "calls": 4, "inflight": 1, "final": True, "children": {"c"}, "service": 7,
    }  # fmt: skip
    assert set(values) == {f.name for f in dataclasses.fields(SessionRecord)}  # a new field
    rec = SessionRecord(**values)  # must be added to SessionRecord.copy too
    dup = rec.copy()
    assert dup == rec and dup.gaps is not rec.gaps and dup.children is not rec.children


@pytest.mark.parametrize("limit", [0, 1, 4, 5, 6, 4096])
def test_prompt_prefix_text_is_the_joined_text_cut_at_the_limit(limit):
    body = {
        "system": "s" * 5000,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}, "ef"]}],
    }
    whole = "\x1e".join(["s" * 5000, "user", "abcd", "ef"])
    assert prompt_prefix_text(body, limit) == whole[:limit]
    short = {"messages": [{"role": "u", "content": "abcd"}, {"content": "ef"}]}
    assert prompt_prefix_text(short, limit) == "u\x1eabcd\x1eef"[:limit]


def test_non_streamed_calls_have_no_first_byte_deadline_unless_set():
    """vLLM sends a non-streamed answer's head after the whole generation: a default deadline
    would cut and re-run every long generation elsewhere."""
    from router.config import RouterConfig

    cfg = RouterConfig()
    assert cfg.first_byte_deadline_s(streamed=True) == 30.0
    assert cfg.first_byte_deadline_s(streamed=False) == 0.0
    assert RouterConfig(unstreamed_first_byte_timeout_s=None).first_byte_deadline_s(False) == 30.0
    assert RouterConfig(unstreamed_first_byte_timeout_s=120).first_byte_deadline_s(False) == 120


@pytest.mark.parametrize("convention", ["claude", "opencode", "dynamo"])
def test_the_replays_subagent_headers_name_the_parent_the_router_knows(convention):
    """A subagent's headers, as the replay sends them, give the router a parent key equal to
    its parent agent's own key (the lineage kv_cost pins and hints on): for a child of the
    main agent and for a nested one."""
    from loadtest.replay.client import session_headers

    def key(agent, parent=None):
        ident = identify(session_headers(convention, "S", agent, parent), {}, tenant="t")
        return ident.key, ident.parent

    main, no_parent = key("main")
    assert no_parent is None
    child, child_parent = key("explore-1", "main")
    assert child_parent == main and child != main
    nested, nested_parent = key("grep-2", "explore-1")
    assert nested_parent == child and nested not in (main, child)


def test_replica_error_bodies_are_put_in_the_routes_api_shape():
    from router.errors import replica_error_body

    ant, oai = "/v1/messages", "/v1/chat/completions"
    shaped = {"type": "error", "error": {"type": "not_found_error", "message": "gone"}}
    assert replica_error_body(ant, 404, orjson.dumps(shaped)) is None  # already Anthropic's
    openai_err = orjson.dumps({"error": {"message": "m", "type": "BadRequestError", "code": 400}})
    assert replica_error_body(oai, 400, openai_err) is None  # already OpenAI's
    assert orjson.loads(replica_error_body(ant, 400, openai_err)) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "m"}}  # fmt: skip
    old = orjson.dumps({"object": "error", "message": "too long", "type": "x", "code": 400})
    assert replica_error_body(oai, 400, old) is None
    assert orjson.loads(replica_error_body(ant, 400, old))["error"]["message"] == "too long"
    # an empty body says its status; bytes that are not UTF-8 are kept as replacement chars
    assert orjson.loads(replica_error_body(ant, 500, b""))["error"] == {
        "type": "api_error", "message": "internal server error"}  # fmt: skip
    got = orjson.loads(replica_error_body(oai, 502, b"bad \xff gateway"))["error"]
    assert got["message"] == "bad \ufffd gateway" and got["code"] == 502
    # JSON that is no error object we know: its whole text is the message
    assert orjson.loads(replica_error_body(ant, 429, b'["slow down"]'))["error"] == {
        "type": "rate_limit_error", "message": '["slow down"]'}  # fmt: skip
