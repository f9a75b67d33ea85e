"""The KV layer's read-only interface (router/kv/view.py) and its parts with no other test
file: ``KVView`` is a Protocol the state's view implements and the only KV module policies
import; ``TierChurn`` (router/kv/churn.py) measures a host tier's turnover."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from router.kv.churn import TierChurn
from router.kv.config import KVConfig
from router.kv.snapshot import StateView
from router.kv.state import KVState
from router.kv.view import KVView

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_the_state_view_implements_the_protocol_and_policies_import_only_it() -> None:
    view = KVState(KVConfig()).view()
    assert isinstance(view, StateView) and isinstance(view, KVView)
    members = {n for n in dir(KVView) if not n.startswith("_")} | set(KVView.__annotations__)
    assert all(hasattr(view, n) for n in members)
    # nothing in the interface changes the layer: no member named like a mutation
    assert not {n for n in members if n.startswith(("set", "add", "remove", "record", "clear"))}
    for path in (ROOT / "router" / "scheduling").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("router.kv"):
                assert node.module in ("router.kv.view", "router.kv.index"), (path, node.module)


def test_a_stub_without_the_state_serves_kv_cost() -> None:
    """A policy reads the interface only: a stub that is not the KV state (here: the state's
    view with the state itself out of reach) places a call."""
    from router.replicas import EndpointView
    from router.scheduling import RequestContext, Snapshot
    from router.scheduling.kv_cost import KVCost
    from router.sessions import SessionIdentity

    inner = KVState(KVConfig(block_size=16)).view()

    class Stub:
        def __getattr__(self, name: str) -> object:
            if name.startswith("_"):
                raise AttributeError(name)
            return getattr(inner, name)

    stub = Stub()
    eps = [EndpointView(n, n, True, frozenset({"m"}), 0, 0.0, 0.0, 0.1, "closed") for n in "ab"]
    ident = SessionIdentity("t", "s", None, None, False, "test")
    ctx = RequestContext("r", "/v1/chat/completions", "m", ident, {"max_tokens": 8})
    ctx.block_keys, ctx.prompt_tokens = [1, 2, 3], 48
    scores = KVCost().score(ctx, Snapshot(tuple(eps), None, 0, {"kv": stub}), eps)
    assert set(scores) == {"a", "b"} and max(scores.values()) == 1.0


def test_tier_churn_rate_over_its_window() -> None:
    c = TierChurn(window_s=60.0, min_span_s=5.0)
    c.sample("r", 0.0, 0)
    c.sample("r", 0.5, 50)  # within a second of the last sample: not taken
    assert c.rate("r") is None  # spans less than min_span_s
    for t in range(1, 11):
        c.sample("r", float(t), 100 * t)
    assert c.rate("r") == pytest.approx(100.0)
    for t in range(11, 100):  # the window slides: only the last minute counts
        c.sample("r", float(t), 1000 + 10 * t)
    assert c.rate("r") == pytest.approx(10.0)
    c.sample("r", 100.0, 5)  # the count went down: the replica's index was rebuilt
    assert c.rate("r") is None
    c.forget("r")
    assert c.rate("r") is None and c.rate("other") is None
