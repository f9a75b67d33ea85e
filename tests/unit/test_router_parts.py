"""Router parts without servers: identity (router.sessions), config, error bodies.

The replica set, discovery, monitor, vLLM metrics and session table have their own files:
test_replicas.py, test_discovery.py, test_monitor.py, test_vllm_metrics.py, test_state.py."""

from __future__ import annotations

import orjson
import pytest

from router.config import ConfigError, load_config
from router.sessions import identify, prompt_prefix_text

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


# --- more -------------------------------------------------------------------------------


def test_redis_password_is_masked_in_repr():
    cfg = load_config(
        env={
            "KVROUTE_REPLICAS": "http://a:1",
            "KVROUTE_REDIS_URL": "redis://app:hunter2@redis:6379/0",
        }
    )
    assert "hunter2" not in repr(cfg) and "redis://app:***@redis:6379/0" in repr(cfg)


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
