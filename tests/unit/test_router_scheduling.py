"""Scheduling pipeline and baseline plugins: tables of cases over fake endpoints."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.config import ConfigError
from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.pipeline import NoCandidates
from router.scheduling.registry import build_pipeline, names, register
from router.sessions import identify
from router.state import SessionRecord


def ep(
    name: str,
    inflight: int = 0,
    healthy: bool = True,
    models: tuple[str, ...] = (),
    accepting: bool = True,
    waiting: float | None = None,
    kv: float | None = None,
) -> EndpointView:
    return EndpointView(
        name,
        f"http://{name}",
        healthy,
        frozenset(models),
        inflight,
        None,
        waiting,
        kv,
        "closed" if accepting else "open",
        accepting,
    )


def ctx(
    session: str = "s",
    model: str | None = "m",
    body: dict[str, Any] | None = None,
    block_keys: list[int] | None = None,
) -> RequestContext:
    body = body if body is not None else {"model": model, "messages": []}
    c = RequestContext(
        "rid", "/v1/chat/completions", model, identify({"x-session-id": session}, body), body
    )
    c.block_keys = block_keys
    return c


def snap(
    eps: list[EndpointView],
    session: SessionRecord | None = None,
    seq: int = 0,
    states: Mapping[str, Any] | None = None,
) -> Snapshot:
    return Snapshot(tuple(eps), session, seq, states or {})


def test_registry_lists_the_baselines():
    assert {"round_robin", "least_load", "session_affinity", "prefix_hash"} <= set(names("policy"))
    assert {"healthy", "serves_model"} <= set(names("filter"))


@pytest.mark.parametrize(
    "spec, error",
    [
        ({"scorers": [{"type": "least_load"}]}, "has no weight"),
        ({"scorers": [{"type": "least_load", "weight": -1}]}, "weight must be"),
        ({"scorers": [{"type": "nope", "weight": 1}]}, "unknown scorer"),
        ({"scorers": []}, "at least one scorer"),
        ({"scorers": [{"type": "least_load", "weight": 1, "params": {"bogus": 1}}]}, "bad params"),
        ({"scorers": [{"type": "least_load", "weight": 1}], "filterz": []}, "unknown scheduling"),
        ({"filters": ["nope"], "scorers": [{"type": "least_load", "weight": 1}]}, "unknown filter"),
    ],
)
def test_bad_pipeline_specs_are_config_errors(spec, error):
    with pytest.raises(ConfigError, match=error):
        build_pipeline(spec)


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown policy"):
        build_pipeline("fastest")


def test_filters_remove_unhealthy_open_breaker_and_wrong_model():
    p = build_pipeline("least_load")
    eps = [
        ep("a", healthy=False),
        ep("b", accepting=False),
        ep("c", models=("other",)),
        ep("d", models=("m",)),
        ep("e"),
    ]
    d = p.schedule(ctx(), snap(eps), explain=True)
    assert {e.name for e, _ in d.ranked} == {"d", "e"}
    assert d.explain["filtered_out"] == {"a": "healthy", "b": "healthy", "c": "serves_model"}
    with pytest.raises(NoCandidates) as ei:
        p.schedule(ctx(), snap([ep("a", healthy=False)]))
    assert ei.value.removed_by == {"a": "healthy"}


def pooled(name: str, inflight: int, connections: int | None = 4) -> EndpointView:
    return ep(name, inflight)._replace(connections=connections)


def test_pool_room_keeps_the_replicas_with_the_fewest_rounds_to_wait_for_a_connection():
    """The 2,000-stream bench's case: session affinity's bound (1.25 × the mean) let a new
    session land on a replica whose calls past its connection limit already wait a second
    round while another replica had a free connection."""
    p = build_pipeline("session_affinity")
    assert [type(f).__name__ for f in p.filters] == ["Healthy", "ServesModel", "PoolRoom"]
    eps = [pooled("a", 3), pooled("b", 4), pooled("c", 5), pooled("d", 9)]  # rounds 0, 1, 1, 2
    homes = {p.schedule(ctx(f"n{i}"), snap(eps)).endpoint.name for i in range(40)}
    assert homes == {"a"}
    d = p.schedule(ctx("n0"), snap(eps), explain=True)
    assert d.explain["filtered_out"] == {"b": "pool_room", "c": "pool_room", "d": "pool_room"}
    # every replica past its limit: the ones in the earliest round take new sessions
    busy = [pooled("a", 8), pooled("b", 7), pooled("c", 5), pooled("d", 4)]  # 2, 1, 1, 1
    homes = {p.schedule(ctx(f"n{i}"), snap(busy)).endpoint.name for i in range(40)}
    assert homes == {"b", "c", "d"}
    # a known session keeps its replica in play whatever its round
    rec = SessionRecord("-/s", "-", replica="d")
    assert p.schedule(ctx("s"), snap(eps, rec)).endpoint.name == "d"
    # without a limit (max_connections_per_replica 0) the filter keeps everyone
    free = [pooled("a", 5, None), pooled("b", 9, None)]
    assert p.filters[2].filter(ctx(), snap(free), free) == free
    homes = {p.schedule(ctx(f"n{i}"), snap(free)).endpoint.name for i in range(40)}
    assert homes == {"a", "b"}


def test_a_spec_with_its_own_filters_goes_without_pool_room():
    p = build_pipeline({"filters": ["healthy"], "scorers": [{"type": "least_load", "weight": 1}]})
    assert [type(f).__name__ for f in p.filters] == ["Healthy"]


def test_excluded_replicas_are_not_retried():
    p = build_pipeline("round_robin")
    c = ctx()
    c.excluded = frozenset({"a"})
    assert {
        p.schedule(
            c,
            snap([ep("a"), ep("b")]),
        ).endpoint.name
    } == {"b"}


def test_round_robin_rotates_with_recorded_picks():
    p = build_pipeline("round_robin")
    eps = [ep("a"), ep("b"), ep("c")]
    picks = []
    for _ in range(6):
        d = p.schedule(ctx(), snap(eps, seq=p.seq))
        p.record(d)
        picks.append(d.endpoint.name)
    assert picks == ["a", "b", "c", "a", "b", "c"]


@pytest.mark.parametrize(
    "loads, expected",
    [
        ({"a": 5, "b": 1, "c": 3}, "b"),
        ({"a": 0, "b": 2}, "a"),
    ],
)
def test_least_load_prefers_the_least_loaded(loads, expected):
    p = build_pipeline("least_load")
    d = p.schedule(ctx(), snap([ep(n, inflight=v) for n, v in loads.items()]))
    assert d.endpoint.name == expected


def test_least_load_counts_engine_queue_from_scraped_metrics():
    p = build_pipeline("least_load")
    d = p.schedule(ctx(), snap([ep("a", inflight=1, waiting=9), ep("b", inflight=3)]))
    assert d.endpoint.name == "b"


def test_session_affinity_is_stable_and_spreads_sessions():
    p = build_pipeline("session_affinity")
    eps = [ep(n) for n in "abcd"]
    homes = {f"s{i}": p.schedule(ctx(f"s{i}"), snap(eps)).endpoint.name for i in range(200)}
    again = {s: p.schedule(ctx(s), snap(eps)).endpoint.name for s in homes}
    assert homes == again
    counts = Counter(homes.values())
    assert len(counts) == 4 and min(counts.values()) > 20
    # removing one replica moves only the sessions that lived on it (consistent hashing)
    moved = {
        s
        for s in homes
        if p.schedule(ctx(s), snap([e for e in eps if e.name != "d"])).endpoint.name != homes[s]
    }
    assert moved == {s for s, h in homes.items() if h == "d"}


def test_session_affinity_keeps_a_known_session_whatever_the_load_and_bounds_new_ones():
    p = build_pipeline(
        {"scorers": [{"type": "session_affinity", "weight": 1, "params": {"load_factor": 1.25}}]}
    )
    rec = SessionRecord("-/s", "-", replica="c")
    eps = [ep("a", 1), ep("b", 1), ep("c", 1)]
    assert p.schedule(ctx("s"), snap(eps, rec)).endpoint.name == "c"
    # c holds 10 of 12 requests (capacity ceil(1.25 * 13 / 3) = 6): the known session stays
    # (moving it recomputes its whole context elsewhere), a new session is placed elsewhere
    hot = [ep("a", 1), ep("b", 1), ep("c", 10)]
    d = p.schedule(ctx("s"), snap(hot, rec))
    assert d.endpoint.name == "c" and d.move_reason is None
    homes = {p.schedule(ctx(f"n{i}"), snap(hot)).endpoint.name for i in range(40)}
    assert homes == {"a", "b"}


def test_a_move_says_why():
    rec = SessionRecord("-/s", "-", replica="c")
    p = build_pipeline("session_affinity")
    eps = [ep("a"), ep("b"), ep("c")]
    retry = ctx("s")
    retry.excluded = frozenset({"c"})  # c failed this call before its first byte
    assert p.schedule(retry, snap(eps, rec)).move_reason == "retry"
    gone = p.schedule(ctx("s"), snap(eps[:2], rec))
    assert gone.move_reason == "unavailable" and gone.session_replica == "c"
    down = p.schedule(ctx("s"), snap([*eps[:2], ep("c")._replace(healthy=False)], rec))
    assert down.move_reason == "unavailable"
    # another scorer outranks the session's replica: a score move
    lb = build_pipeline({"scorers": [{"type": "session_affinity", "weight": 1},
                                     {"type": "least_load", "weight": 5}]})  # fmt: skip
    busy = [ep("a"), ep("b"), ep("c", 9)]
    d = lb.schedule(ctx("s"), snap(busy, rec), explain=True)
    assert d.endpoint.name != "c" and d.move_reason == d.explain["move_reason"] == "score"
    assert p.schedule(ctx("s"), snap(eps, rec)).move_reason is None  # kept
    assert p.schedule(ctx("s"), snap(eps)).move_reason is None  # new


def test_prefix_hash_uses_block_keys_when_the_analyzer_gave_them():
    p = build_pipeline("prefix_hash")
    eps = [ep(n) for n in "abcdefgh"]
    same = {
        p.schedule(ctx(f"s{i}", block_keys=[11, 22, 33, 44, i]), snap(eps)).endpoint.name
        for i in range(20)
    }  # only the 5th block differs: the first 4 decide
    assert len(same) == 1
    spread = {
        p.schedule(ctx("s", block_keys=[i, 2, 3, 4]), snap(eps)).endpoint.name for i in range(40)
    }
    assert len(spread) >= 4


def test_prefix_hash_falls_back_to_prompt_text():
    p = build_pipeline("prefix_hash")
    eps = [ep(n) for n in "abcdefgh"]
    system = {"role": "system", "content": "tools " * 400}
    picks = {
        p.schedule(
            ctx(f"s{i}", body={"messages": [system, {"role": "user", "content": str(i)}]}),
            snap(eps),
        ).endpoint.name
        for i in range(10)
    }
    assert len(picks) == 1


def test_weighted_sum_clamps_and_explains():
    @register("scorer", "test_const")
    def _const(value: float = 0.0, target: str = "a") -> Any:
        class Const:
            name = "test_const"

            def score(self, ctx, snap, endpoints):
                return {target: value}

        return Const()

    p = build_pipeline(
        {
            "scorers": [
                {"type": "test_const", "weight": 3.0, "params": {"value": 7.0, "target": "b"}},
                {"type": "least_load", "weight": 1.0},
            ]
        }
    )
    d = p.schedule(ctx(), snap([ep("a", 0), ep("b", 4)]), explain=True)
    assert d.endpoint.name == "b"  # 3 * clamp(7) = 3 beats least_load's 1
    cand = {c["replica"]: c for c in d.explain["candidates"]}
    assert cand["b"]["total"] == 3.0 and cand["b"]["scores"] == {
        "test_const": 1.0,
        "least_load": 0.0,
    }
    assert cand["a"]["total"] == 1.0


def test_scorers_read_named_state_snapshots():
    seen = {}

    @register("scorer", "test_state_reader")
    def _reader() -> Any:
        class Reader:
            name = "test_state_reader"

            def score(self, ctx, snap, endpoints):
                idx = snap.state("block_index")
                seen["idx"], seen["missing"] = idx, snap.state("nothing")
                return {e.name: idx.get(e.name, 0.0) for e in endpoints}

        return Reader()

    p = build_pipeline({"scorers": [{"type": "test_state_reader", "weight": 1}]})
    d = p.schedule(ctx(), snap([ep("a"), ep("b")], states={"block_index": {"b": 0.9}}))
    assert d.endpoint.name == "b" and seen == {"idx": {"b": 0.9}, "missing": None}


def test_policies_do_not_change_the_snapshot():
    p = build_pipeline("session_affinity")
    rec = SessionRecord("-/s", "-", replica=None)
    s = snap([ep("a"), ep("b")], rec)
    before = (s.endpoints, rec.copy())
    p.schedule(ctx("s"), s, explain=True)
    assert (s.endpoints, rec) == before


def test_docs_config_example_builds():
    doc = Path(__file__).parents[2] / "docs" / "router.md"
    text = doc.read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg = yaml.safe_load(block)
    assert build_pipeline(cfg["scheduling"]).name == "custom"


def test_a_broken_optional_plugin_is_reported_not_fatal(tmp_path, monkeypatch):
    from router.scheduling import registry

    (tmp_path / "kvroute_broken_plugin.py").write_text("raise RuntimeError('half-written')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "IMPORT_ERRORS", {})
    assert registry._optional_import("kvroute_broken_plugin") is None
    assert registry._optional_import("kvroute_absent_plugin") is None  # absent: silent
    assert list(registry.IMPORT_ERRORS) == ["kvroute_broken_plugin"]
    with pytest.raises(ConfigError, match="half-written"):
        build_pipeline({"scorers": [{"type": "from_the_broken_module", "weight": 1}]})
    assert build_pipeline("least_load").name == "least_load"  # the rest still works
