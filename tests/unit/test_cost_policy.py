"""kv_cost and the peers' KV policies: tables of cases over fake endpoints and a real KVState."""

from __future__ import annotations

import math

import pytest

from costmodel.profiles import load_profile
from router.kv.config import KVConfig
from router.kv.sessions import ReplicaStat, SessionFootprint
from router.kv.state import KVState
from router.outcome import CallOutcome, Usage, usage_from_tail
from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.kv_cost import KVCost
from router.scheduling.kv_prefix import KVPrefix
from router.scheduling.kv_queue import KVQueue
from router.scheduling.pipeline import Decision
from router.scheduling.registry import build_pipeline
from router.scheduling.sglang_tree import SGLangTree
from router.sessions import SessionIdentity
from router.state import SessionRecord

PROF = load_profile("h200-70b-fp8-offload")
BS = PROF.block_size
N = 2000  # prompt blocks (128k tokens)
KEYS = list(range(1_000_000, 1_000_000 + N))


def ep(name, inflight=0, running=0.0, waiting=0.0, kv=0.1):
    return EndpointView(
        name, name, True, frozenset({"m"}), inflight, running, waiting, kv, "closed"
    )


def ctx_for(session="s", parent=None, keys=KEYS, final=False):
    ident = SessionIdentity("t", session, parent, None, final, "test")
    c = RequestContext("r1", "/v1/chat/completions", "m", ident, {"max_tokens": 300})
    c.block_keys = list(keys)
    c.prompt_tokens = len(keys) * BS
    return c


def state(now=1000.0):
    st = KVState(KVConfig(block_size=BS, profile="h200-70b-fp8-offload"), clock=lambda: now)
    for r in ("A", "B"):
        st.index.add_replica(r)
    return st


def snap(st, eps, sticky=None, session="s"):
    rec = SessionRecord(f"t/{session}", "t", replica=sticky) if sticky else None
    return Snapshot(tuple(eps), rec, 0, {"kv": st.view()})


def outcome(scores=None, replica="A", status="200", **kw):
    """How a call on ``replica`` ended, with the decision's terms from ``scores``."""
    dec = None if scores is None else Decision(ep(replica), [], terms={"kv_cost": scores.terms})
    return CallOutcome(replica, status, decision=dec, **kw)


def pick(st, eps, ctx, sticky=None, scorer=None):
    scorer = scorer or KVCost()
    s = scorer.score(ctx, snap(st, eps, sticky, ctx.identity.session), list(eps))
    return max(s, key=s.get), s


def test_blocks_on_gpu_win():
    st = state()
    st.index.store("A", KEYS)
    winner, s = pick(st, [ep("A"), ep("B")], ctx_for())
    assert winner == "A" and s["B"] < 0.2
    assert s.terms["A"]["tiers"] == {"gpu": N, "cpu": 0, "storage": 0, "pool": 0}
    assert s.terms["A"]["source"] == "events"


def test_dram_blocks_win_when_cheaper_than_recompute_and_lose_when_saturated():
    st = state()
    st.index.store("A", KEYS, "CPU")
    winner, s = pick(st, [ep("A"), ep("B")], ctx_for())
    assert winner == "A"
    a = s.terms["A"]
    assert a["chose"] == {"cpu": "load"} and a["load_s"]["cpu"] < 1.0
    # A saturated: 12 calls of ~100k uncached tokens waiting in its queue
    st.stats["A"] = ReplicaStat(uncached_ewma=100_000, context_ewma=120_000, calls=10)
    st.stats["B"] = ReplicaStat(uncached_ewma=2_000, context_ewma=100_000, calls=10)
    winner, s = pick(st, [ep("A", inflight=12, running=0, waiting=12), ep("B")], ctx_for())
    assert winner == "B"
    assert s.terms["A"]["queue_s"] > s.terms["B"]["total_s"]


@pytest.mark.parametrize(("b_share", "expect"), [(0.9, "B"), (0.2, "A")])
def test_session_prior_with_hysteresis(b_share, expect):
    """The session lives on B. A holds the whole prompt on GPU; B holds ``b_share`` of it.
    The session stays on B while B is close enough and moves when A is far cheaper."""
    st = state()
    st.index.store("A", KEYS)
    st.index.store("B", KEYS[: int(N * b_share)])
    winner, _ = pick(
        st,
        [ep("A"), ep("B")],
        ctx_for(),
        sticky="B",
        scorer=KVCost(hysteresis_s=0.25, hysteresis_frac=0.5),
    )
    assert winner == expect


def test_eviction_harm_keeps_a_new_session_off_a_full_replica():
    st = state()
    full = PROF.gpu_kv_blocks
    other = list(range(5_000_000, 5_000_000 + full))
    st.index.store("A", other)  # A's GPU is full of another session's KV ...
    st.sessions["t/other"] = SessionFootprint(
        "t/other", "A", tokens=full * BS, last_end=995.0, gaps=[18.0]
    )  # ... which will be back soon
    st.index.store("B", list(range(9_000_000, 9_000_000 + 100)))
    winner, s = pick(st, [ep("A"), ep("B")], ctx_for(session="new"))
    assert winner == "B"
    a = s.terms["A"]
    # with a host tier the evicted tail is reloaded (not recomputed): harm is the reload time
    assert a["eviction_harm_s"] > 0.1 and "t/other" in a["evicted_blocks"]
    assert a["reserved_s"] > 0  # the paced agent's next call is expected during this one


def test_parent_waiting_on_children_is_pinned():
    st = state()
    full = PROF.gpu_kv_blocks
    st.index.store("A", list(range(5_000_000, 5_000_000 + full)))
    st.sessions["t/parent"] = SessionFootprint(
        "t/parent", "A", tokens=full * BS, last_end=999.0, children_inflight=2
    )
    c = ctx_for(session="child", parent="t/parent")
    s = pick(st, [ep("A"), ep("B")], c)[1]
    assert s.terms["A"]["eviction_harm_s"] == 0.0  # pinned: not evictable
    assert "evicted_blocks" not in s.terms["A"]


def test_stale_replica_falls_back_to_approximate_mode():
    st = state()
    st.index.store("A", KEYS)  # what events said before the gap: no longer trusted
    st.index.mark_stale("A", "seq gap")
    st.approx.set_capacity("A", 10_000)
    st.approx.record("A", KEYS[:1500])  # what the router itself sent there
    winner, s = pick(st, [ep("A"), ep("B")], ctx_for())
    a = s.terms["A"]
    assert winner == "A" and a["source"] == "approx" and a["match_blocks"] == 1500
    assert s.terms["B"]["source"] == "events"


def test_without_the_kv_layer_it_is_bounded_load_session_affinity():
    from router.scheduling.session_affinity import SessionAffinity

    c = ctx_for()
    eps = [ep("A", inflight=3), ep("B")]
    s = KVCost().score(c, Snapshot(tuple(eps), None, 0, {}), eps)
    assert s == SessionAffinity().score(c, Snapshot(tuple(eps), None, 0, {}), eps)
    assert s["B"] > s.get("A", 0.0)  # A is at capacity (ceil(1.25 * 4 / 2) = 3)
    # the session's replica keeps it when busier, at capacity too (load alone never moves it)
    eps = [ep("A", inflight=3), ep("B")]
    rec = SessionRecord("t/s", "t", replica="A")
    s = KVCost().score(c, Snapshot(tuple(eps), rec, 0, {}), eps)
    assert max(s, key=s.get) == "A"


def test_explain_names_every_term_through_the_pipeline():
    st = state()
    st.index.store("A", KEYS[:10], "STORAGE")
    pipe = build_pipeline("kv_cost")
    c = ctx_for()
    d = pipe.schedule(c, snap(st, [ep("A"), ep("B")]), explain=True)
    assert d.explain["policy"] == "kv_cost"
    cands = {x["replica"]: x for x in d.explain["candidates"]}
    for r in ("A", "B"):
        terms = cands[r]["terms"]["kv_cost"]
        assert {
            "queue_s",
            "fetch_or_recompute_s",
            "decode_s",
            "eviction_harm_s",
            "reserved_s",
            "total_s",
            "missing",
            "session_prior_s",
        } <= set(terms)


@pytest.mark.parametrize(
    ("waiting", "expect"),
    [
        ((0, 0), {"A": 1.0, "B": 1.0}),
        ((4, 0), {"A": 0.0, "B": 1.0}),
        ((2, 4), {"A": 1.0, "B": 0.0}),
    ],
)
def test_llmd_queue_scorer(waiting, expect):
    eps = [ep("A", waiting=waiting[0]), ep("B", waiting=waiting[1])]
    assert KVQueue().score(ctx_for(), snap(state(), eps), eps) == expect


def test_llmd_prefix_scorer_and_policy():
    """llm-d's precise prefix scorer: tier-weighted consecutive prefix (gpu 1.0, cpu 0.8),
    min-max normalised over the pods that hit; a pod without a hit scores 0."""
    st = state()
    for r in ("C", "D"):
        st.index.add_replica(r)
    st.index.store("A", KEYS[: N // 4])  # raw 500
    st.index.store("B", KEYS[: N // 2])  # raw 1000
    st.index.store("C", KEYS[: N // 2], "CPU")  # raw 800: the same depth as B, in DRAM
    eps = [ep("A"), ep("B"), ep("C"), ep("D")]
    s = KVPrefix().score(ctx_for(), snap(st, eps), eps)
    assert s == pytest.approx({"A": 0.0, "B": 1.0, "C": 0.6})
    assert s.get("D", 0.0) == 0.0
    only = KVPrefix().score(ctx_for(), snap(st, eps[:1] + eps[3:]), eps[:1] + eps[3:])
    assert only == {"A": 1.0}  # one pod hit: all-equal among the hits -> 1
    d = build_pipeline("llmd").schedule(ctx_for(), snap(st, eps))
    assert d.endpoint.name == "B"


@pytest.mark.parametrize(
    ("loads", "history", "expect"),
    [
        ((0, 80), {}, "A"),  # imbalanced (> 64 apart and > 1.5x): least loaded wins
        ((0, 64), {"B": N}, "B"),  # 64 apart is not > 64: balanced, B's tree matches
        ((1, 0), {"A": N}, "A"),  # balanced, A's tree matches: cache wins
        ((1, 0), {"A": -10, "B": -50}, "B"),  # no match anywhere: least loaded wins (0.3.2)
        ((0, 0), {"A": -50, "B": -10}, "A"),  # ... at equal load the first replica, always
        ((0, 1), {"A": -100, "B": 601}, "B"),  # rate 601/2000 > 0.3: B's match wins
        ((0, 1), {"A": -100, "B": 600}, "A"),  # rate exactly 0.3 is not > 0.3: least loaded
        ((0, 0), {"A": N, "B": N}, "A"),  # equal matches: the first replica
    ],
)
def test_sglang_tree_rules(loads, history, expect):
    """sglang-router 0.3.2's cache_aware rules, thresholds strict, load = the router's
    in-flight, ties to the first replica (one winner: the picker never draws among equals).
    ``history``: replica -> n blocks of this prompt routed there (n < 0: -n other blocks)."""
    st = state()
    other = list(range(7_000_000, 7_000_000 + 1000))
    for r, n in history.items():
        st.approx.set_capacity(r, 100_000)
        st.approx.record(r, KEYS[:n] if n > 0 else other[:-n])
    eps = [ep("A", inflight=loads[0]), ep("B", inflight=loads[1])]
    s = SGLangTree().score(ctx_for(), snap(st, eps), eps)
    assert max(s, key=s.get) == expect
    assert sorted(s.values()).count(1.0) == 1


def test_sglang_tree_smallest_tree_rule_of_the_older_router():
    """``miss: smallest_tree`` (earlier sgl-router releases): a miss goes to the smallest
    tree, where 0.3.2 takes the least-loaded replica."""
    st = state()
    for r, n in (("A", 50), ("B", 10)):
        st.approx.set_capacity(r, 100_000)
        st.approx.record(r, list(range(7_000_000 + n * 1000, 7_000_000 + n * 1001)))
    eps = [ep("A"), ep("B", inflight=1)]
    s = SGLangTree(miss="smallest_tree").score(ctx_for(), snap(st, eps), eps)
    assert max(s, key=s.get) == "B"
    assert (
        max(SGLangTree().score(ctx_for(), snap(st, eps), eps).items(), key=lambda t: t[1])[0] == "A"
    )
    with pytest.raises(TypeError, match="miss"):
        SGLangTree(miss="random")


def test_kv_config_from_env_and_mapping():
    assert KVConfig.from_env({}) is None
    cfg = KVConfig.from_env(
        {
            "KVROUTE_KV_BLOCK_SIZE": "32",
            "KVROUTE_KV_PROFILE": "cpu-tiny",
            "KVROUTE_KV_TOPICS": "{kv@a: 'http://h:1'}",
        }
    )
    assert (cfg.block_size, cfg.profile, cfg.topics) == (32, "cpu-tiny", {"kv@a": "http://h:1"})
    # booleans parse as booleans ("false" is not a true string), anything else is an error
    env = {"KVROUTE_KV_PENDING_PREFILL_GAUGE": "on", "KVROUTE_KV_ANALYSIS_PROCESS": "False"}
    flags = KVConfig.from_env(env)
    assert flags is not None
    assert (flags.pending_prefill_gauge, flags.analysis_process) == (True, False)
    with pytest.raises(ValueError, match="not a boolean"):
        KVConfig.from_env({"KVROUTE_KV_ANALYSIS_PROCESS": "maybe"})
    with pytest.raises(ValueError, match="unknown kv settings"):
        KVConfig.from_mapping({"blocksize": 3})
    with pytest.raises(ValueError, match="positive"):
        KVConfig(block_size=0)


def test_observer_learns_from_usage_and_releases_final_sessions():
    st = state()
    c = ctx_for(session="obs")
    st.analyze(c)  # no tokenizer, keys given: the footprint is opened and counted in flight
    c.prompt_tokens = 10_000
    tail = (
        b'data: {"choices":[],"usage":{"prompt_tokens":10000,"completion_tokens":120,'
        b'"prompt_tokens_details":{"cached_tokens":9000}}}\n\ndata: [DONE]\n\n'
    )
    st.observe(c, outcome(ttft_s=0.5, duration_s=2.0, events=5, usage=usage_from_tail(tail)))
    assert st.stats["A"].uncached_ewma == 1000  # from the engine's cached_tokens
    fp = st.sessions["t/obs"]
    assert (fp.replica, fp.tokens, fp.outputs) == ("A", 10_120, [120])
    assert "t/obs" in {w.key for w in st.view().warm_and_reserved("A", None)[0]}
    done = ctx_for(session="obs", final=True)
    st.observe(done, outcome())
    assert "t/obs" not in st.sessions  # released after its final call


def test_calibration_loop_converges_to_the_true_factor():
    """Route, observe, refit, repeat: a replica whose real TTFT is 2x the model + 0.1 s must
    end with scale ~2 and offset ~0.1 (fitting the already-calibrated figure would settle
    at sqrt(2))."""
    st = state()
    rng = __import__("random").Random(0)
    for i in range(60):
        keys = KEYS[: rng.randrange(50, N)]
        c = ctx_for(session=f"s{i}", keys=keys)
        c.request_id = f"r{i}"
        s = KVCost().score(c, snap(st, [ep("A"), ep("B")], session=f"s{i}"), [ep("A"), ep("B")])
        st.analyze(c)  # creates the session footprint the observer updates
        raw = s.terms["A"]["model_ttft_s"]
        st.observe(c, outcome(s, ttft_s=2.0 * raw + 0.1))
    cal = st.calibrators["A"].current()
    assert cal.prefill_scale == pytest.approx(2.0, rel=0.05)
    assert cal.ttft_offset_s == pytest.approx(0.1, abs=0.05)


def test_index_and_profile_block_sizes_may_differ():
    """Router hashing 16-token blocks in front of a 64-token-block profile: capacities and
    free space are converted, not mixed."""
    st = KVState(KVConfig(block_size=16, profile="h200-70b-fp8-offload"), clock=lambda: 0.0)
    st.index.add_replica("A")
    st.index.store("A", list(range(4 * 1000)))  # 4,000 16-token blocks = 1,000 64-token ones
    view = st.view()
    assert view.gpu_blocks_used("A") == 1000
    prof = st.profile("A")
    assert st.approx.capacity("A") == prof.gpu_kv_blocks * prof.block_size // 16


def test_host_residence_is_a_full_host_tiers_capacity_over_its_eviction_rate():
    clock = [1000.0]
    st = KVState(KVConfig(block_size=BS, profile="h200-70b-fp8-offload"), clock=lambda: clock[0])
    st.index.add_replica("A")
    cap, a = PROF.cpu_kv_blocks, ep("A")
    st.index.store("A", range(cap // 2), "CPU")
    assert st.view().host_residence(a) is None  # half full: nothing leaves it
    st.index.store("A", range(cap // 2, cap), "CPU")
    assert st.view().host_residence(a) is None  # full, no eviction seen yet
    for i in range(20):  # write-through at 100 blocks/s: as many evicted
        clock[0] += 1.0
        st.index.remove("A", range(i * 100, (i + 1) * 100), "CPU")
        st.index.store("A", range(cap + i * 100, cap + (i + 1) * 100), "CPU")
        view = st.view()
    assert view.host_residence(a) == pytest.approx(cap / 100)
    assert view.replica_load(a, None, N * BS).host_residence_s == pytest.approx(cap / 100)
    # the engine plugin's gauge wins over the index's count (a tier reported half empty)
    assert view.host_residence(a._replace(host_occupancy=0.5)) is None
    assert view.host_residence(a._replace(host_occupancy=0.99)) is not None
    # a quarter of the tier held for paused sessions: the rest turns over in three quarters
    held = a._replace(host_occupancy=0.99, host_retained=0.25)
    assert view.host_residence(held) == pytest.approx(0.75 * cap / 100)
    # without the event stream the turnover is not known
    st.index.mark_stale("A", "test")
    assert st.view().host_residence(a) is None


def test_a_session_without_gaps_returns_like_the_population():
    """One-call sessions (Mooncake-style) must not look certain to return forever: until a
    session shows its own gap, P(return) decays with the gap every session has shown (or
    ``default_gap_s``)."""
    clock = [1000.0]
    st = KVState(KVConfig(block_size=BS, profile="h200-70b-fp8-offload"), clock=lambda: clock[0])
    st.index.add_replica("A")

    def p_of(key):
        warm = st.view().warm_and_reserved("A", None)[0]
        return {w.key: w.p_return for w in warm}[key]

    one = ctx_for(session="one")
    st.analyze(one)
    st.observe(one, outcome(duration_s=1.0))
    assert p_of("t/one") == 1.0  # within the default 18 s gap
    clock[0] += 18 + 5 * 18.0
    assert p_of("t/one") == pytest.approx(math.exp(-5), rel=1e-6)
    # another session shows 60 s gaps: the population prior follows what sessions do
    for _ in range(2):
        c = ctx_for(session="paced")
        st.analyze(c)
        st.observe(c, outcome(duration_s=0.0))
        clock[0] += 60.0
    assert st.gap_ewma == pytest.approx(60.0)
    idle = clock[0] - 1000.0  # "one" ended at t = 1000
    assert p_of("t/one") == pytest.approx(math.exp(-max(0.0, idle - 60.0) / 60.0), rel=1e-6)


def test_calibration_of_sped_up_replicas_is_in_profile_seconds():
    """Replica twins run ``speedup`` times faster than their profile: with time_scale set,
    a twin that matches its profile exactly calibrates to scale 1, not 1/speedup."""
    st = KVState(
        KVConfig(block_size=BS, profile="h200-70b-fp8-offload", time_scale=10.0),
        clock=lambda: 1000.0,
    )
    for r in ("A", "B"):
        st.index.add_replica(r)
    rng = __import__("random").Random(1)
    for i in range(20):
        c = ctx_for(session=f"s{i}", keys=KEYS[: rng.randrange(50, N)])
        c.request_id = f"r{i}"
        s = KVCost().score(c, snap(st, [ep("A"), ep("B")], session=f"s{i}"), [ep("A"), ep("B")])
        st.analyze(c)
        raw = s.terms["A"]["model_ttft_s"]
        st.observe(c, outcome(s, ttft_s=raw / 10.0))
    assert st.calibration("A").prefill_scale == pytest.approx(1.0, rel=0.05)
    with pytest.raises(ValueError, match="time_scale"):
        KVConfig(time_scale=0)


def test_a_cold_prefill_in_flight_is_queued_work_until_its_first_byte():
    """vLLM reports a request in chunked prefill as running, not waiting: the router's own
    record of what it sent is what shows a replica busy with a 128k-token cold prefill. A
    second cold call then goes to the idle replica, and once the first call's first byte has
    come (prefill over) the replica is no longer charged for it."""
    st = state()
    first = ctx_for(session="big")
    first.request_id = "big-1"
    st.decided(first, Decision(ep("A"), []))  # sent to A; no blocks matched there
    assert st.pending_prefill() == {"A": (1, N * BS)}
    # the engine now counts it as running (chunked prefill), nothing waiting
    eps = [ep("A", inflight=1, running=1.0, waiting=0.0), ep("B")]
    view = st.view()
    load_a = view.replica_load(eps[0], None, N * BS)
    assert load_a.queued_prefill_tokens == N * BS and load_a.pending_calls == 1
    other = ctx_for(session="other", keys=range(5_000_000, 5_000_000 + N))
    other.request_id = "other-1"
    winner, s = pick(st, eps, other)
    assert winner == "B" and s["A"] < 0.6  # A's queue is a whole 128k-token prefill
    st.prefill_done(first)  # the first byte came: the prefill is over
    assert st.pending_prefill() == {}
    assert st.view().replica_load(eps[0], None, N * BS).queued_prefill_tokens == 0.0
    # a retry re-decides: the entry follows the call; the call's end always clears it
    st.decided(other, Decision(ep("A"), []))
    st.decided(other, Decision(ep("B"), []))
    assert st.pending_prefill() == {"B": (1, N * BS)}
    st.observe(other, outcome(replica="B", status="502"))
    assert st.pending_prefill() == {}


def test_the_engine_pending_prefill_gauge_adds_what_this_router_cannot_see():
    """With ``pending_prefill_gauge`` on, where the replica exports the engine plugin's
    pending-prefill gauge, the queue is the larger of this router's own count and the engine's
    count as of the scrape, drained at the replica's prefill speed since, plus what this router
    sent there after the scrape: another router's cold calls count on a replica this router
    sent nothing, a gauge below this router's own count lowers nothing, and a stale gauge (the
    scrape failing) is not read. Off (the default), the gauge is not read at all."""

    from costmodel.placement import prefill_throughput

    clock = [1000.0]

    def state(on: bool) -> KVState:
        cfg = KVConfig(block_size=BS, profile="h200-70b-fp8-offload", pending_prefill_gauge=on)
        return KVState(cfg, clock=lambda: clock[0])

    st, off = state(True), state(False)
    thr = prefill_throughput(st.profile_of("A"))
    for s in (st, off):
        big = ctx_for(session="big")
        big.request_id = "big-1"
        s.decided(big, Decision(ep("A"), []))  # a 128k-token cold call, sent at t = 1000
    clock[0] = 1002.0

    def gauged(name, tokens, age, **kw):
        return ep(name, **kw)._replace(pending_prefill=tokens, pending_prefill_age_s=age)

    def queued(s: KVState, e) -> float:
        return s.view().replica_load(e, None, N * BS).queued_prefill_tokens

    # A: the engine counts less than this router's own call (it has chunked part of it): the
    # router's count stands, as it does without the gauge or with one 10 s old
    for e in (gauged("A", 40_000.0, 0.5, inflight=1, running=1.0), ep("A", inflight=1),
              gauged("A", 40_000.0, 10.0, inflight=1)):  # fmt: skip
        assert queued(st, e) == N * BS
    # B: another router's cold calls, nothing of this router's; the gauge shows them
    b = gauged("B", 3 * thr, 1.0)
    assert queued(st, b) == pytest.approx(2 * thr)
    assert queued(off, b) == queued(st, ep("B")) == 0.0
    assert queued(st, gauged("B", 3 * thr, 10.0)) == 0.0  # stale
    # a call this router sends to B after that scrape adds its uncached tokens
    more = ctx_for(session="more", keys=range(7_000_000, 7_000_000 + 100))
    more.request_id = "more-1"
    st.decided(more, Decision(ep("B"), []))
    assert queued(st, b) == pytest.approx(2 * thr + 100 * BS)
    # in front of twins 3x faster than their profile, a second of wall time drains 3 seconds'
    fast = KVState(KVConfig(block_size=BS, profile="h200-70b-fp8-offload", time_scale=3.0,
                            pending_prefill_gauge=True), clock=lambda: clock[0])  # fmt: skip
    assert queued(fast, gauged("B", 4 * thr, 1.0)) == pytest.approx(thr)


def test_a_call_placed_before_its_analysis_is_costed_on_what_is_known():
    """The analysis lane was busy (another call's cold tokenization): no block keys yet. The
    call is sized from its body's characters and its session's context counts as a hit on
    the replica holding it, so it neither leaves its cache for the replica with the fewest
    decoders nor joins a replica busy with a long cold prefill as if it were free."""
    from router.kv.state import KVCall

    st = state()
    warm = ctx_for(session="warm", keys=[])
    warm.prompt_tokens = None
    warm.analysis = KVCall(est_tokens=N * BS)
    st.sessions["t/warm"] = SessionFootprint("t/warm", replica="A", tokens=(N - 50) * BS)
    # B has no decoders at all, A has 8: on decode cost alone the session would move to B
    eps = [ep("A", inflight=8, running=8.0), ep("B")]
    winner, s = pick(st, eps, warm, sticky="A")
    assert winner == "A", s.terms
    assert s.terms["A"]["match_blocks"] == N - 50 and s.terms["B"]["match_blocks"] == 0
    # a cold late call: A is busy with a 128k-token prefill this router sent there
    big = ctx_for(session="big")
    big.request_id = "big-1"
    st.decided(big, Decision(ep("A"), []))
    cold = ctx_for(session="new", keys=[])
    cold.prompt_tokens = None
    cold.request_id = "new-1"
    cold.analysis = KVCall(est_tokens=N * BS)
    eps = [ep("A", inflight=1, running=1.0), ep("B", inflight=1, running=1.0)]
    winner, _ = pick(st, eps, cold)
    assert winner == "B"
    st.decided(cold, Decision(ep("B"), []))  # its estimated prompt is queued work on B now
    assert st.pending_prefill()["B"] == (1, N * BS)


@pytest.mark.parametrize("idle", [0.0, 9.0, 30.0])
def test_a_paced_agent_returns_memorylessly_however_long_it_has_been_idle(idle):
    """The reserved term's P(the agent returns during this call) uses the agent's mean gap as
    the mean time to its return at any idle time: the old ``gap - idle`` read an agent just
    past its mean gap as certain to return at once (p_in = 1), charging every overdue
    neighbour's next prefill in full and moving sessions off their cache."""
    st = state(now=1000.0)
    st.sessions["t/n"] = SessionFootprint(
        "t/n", "A", tokens=100_000, last_end=1000.0 - idle, gaps=[10.0], turn_tokens=5_000
    )
    (res,) = st.view().warm_and_reserved("A", None)[1]
    assert res.expected_return_s == 10.0
    from costmodel.placement import ReplicaLoad, request_prefill_time, reserved_cost

    got = reserved_cost(PROF, 4.0, ReplicaLoad(reserved=[res]))
    full = request_prefill_time(PROF, 5_000, 100_000)
    assert got == pytest.approx(res.p_return * (1 - math.exp(-0.4)) * full)
    assert got < 0.35 * full  # a 4 s call does not meet a 10 s-gap agent's whole next prefill


def test_a_call_whose_analysis_never_landed_leaves_its_engine_prompt_count():
    """A call placed and finished before its tokenization landed still leaves its session's
    context (the engine's prompt_tokens), so the next call is costed as a hit there."""
    st = state()
    c = ctx_for(session="late")
    st.analyze(c)
    c.block_keys, c.prompt_tokens = None, None  # the analysis never landed
    tail = b'data: {"choices":[],"usage":{"prompt_tokens":50000,"completion_tokens":100}}\n\n'
    st.observe(c, outcome(ttft_s=1.0, duration_s=2.0, usage=usage_from_tail(tail)))
    assert st.sessions["t/late"].tokens == 50_100


def _burst_behind_a_call_in_flight(st):
    """A new session's call on a 1,000-block prefix routed to B (no KV event yet), then a
    second new session's call on that prefix plus 20 blocks of its own, scored: (first, its
    explanation)."""
    first = ctx_for(session="a", keys=KEYS[:1000])
    first.request_id = "r-a"
    st.analyze(first)
    st.decided(first, Decision(ep("B"), []))
    second = ctx_for(session="b", keys=KEYS[:1000] + list(range(7_000_000, 7_000_020)))
    second.request_id = "r-b"
    _, s = pick(st, [ep("A"), ep("B")], second)
    return first, s


def test_a_burst_sharing_a_prefix_follows_the_call_in_flight():
    """Two new sessions share a 1,000-block prefix; the first is routed to B and still
    prefilling (no KV event yet): the second sees the prefix coming to B — it would wait for
    that prefill there and then only compute its own 20 blocks — not a cold cluster; a retry
    of the first does not match itself."""
    st = state()
    first, s = _burst_behind_a_call_in_flight(st)
    a, b = s.terms["A"], s.terms["B"]
    assert b["match_blocks"] == 1000 and a["match_blocks"] == 0
    assert b["fetch_or_recompute_s"] < 0.1 * a["fetch_or_recompute_s"]
    assert b["queued_prefill_tokens"] == 1000 * BS  # ... behind the first call's prefill
    _, again = pick(st, [ep("A"), ep("B")], first)  # the first call itself, retried
    assert again.terms["B"]["match_blocks"] == 0
    st.observe(first, outcome(replica="B"))  # finished: its blocks are the index's business
    assert st.routed == {}


def test_a_call_placed_before_its_tokens_matches_the_text_routed_before():
    """A new session whose analysis has not landed (no block keys) still finds the replica
    that was sent its leading text: the text-chunk routing history, as sglang-router's tree."""
    from router.kv.approx import TEXT_CHUNK, text_keys
    from router.kv.state import KVCall

    st = state()
    shared = " ".join(f"word{i}" for i in range(12_000))  # ~100k characters
    prev = ctx_for(session="p", keys=KEYS[:100])
    prev.analysis = KVCall(text_keys=text_keys(shared + " first tail"))
    st.decided(prev, Decision(ep("B"), []))
    blind = ctx_for(session="new", keys=[])
    blind.block_keys, blind.prompt_tokens = None, None
    blind.analysis = KVCall(est_tokens=30_000, text_keys=text_keys(shared + " other tail" * 2000))
    winner, s = pick(st, [ep("A"), ep("B")], blind)
    shared_blocks = (len(shared) // TEXT_CHUNK) * TEXT_CHUNK // 4 // BS  # 4 chars a token
    assert winner == "B" and s.terms["B"]["match_blocks"] == shared_blocks
    assert s.terms["A"]["match_blocks"] == 0


def test_a_call_in_flight_lends_its_prefix_only_where_both_fit():
    """On a replica whose GPU pool is full the later call of a burst would wait for KV space,
    not share the first call's blocks: the prefix in flight does not count there."""
    st = state()
    st.index.store("B", list(range(5_000_000, 5_000_000 + PROF.gpu_kv_blocks)))  # B is full
    _, s = _burst_behind_a_call_in_flight(st)
    assert s.terms["B"]["match_blocks"] == 0


def test_a_call_whose_keys_are_given_is_in_flight_until_it_ends():
    """The simulator gives block keys and has no tokenizer: its calls are counted in flight
    as the live router counts its analysed calls, so a session with a call running is pinned
    and not a paced agent between calls (before, every simulated session looked idle)."""
    st = state()
    st.sessions["t/p"] = SessionFootprint("t/p", "A", tokens=50_000, last_end=990.0, gaps=[5.0])
    c = ctx_for(session="p")
    st.analyze(c)
    fp = st.sessions["t/p"]
    assert fp.inflight == 1 and fp.turn_tokens == N * BS - 50_000
    warm, reserved = st.view().warm_and_reserved("A", None)
    assert [w.pinned for w in warm if w.key == "t/p"] == [True]
    assert "t/p" not in {r.key for r in reserved}
    st.observe(c, outcome(ttft_s=0.5, duration_s=2.0))
    assert fp.inflight == 0
    warm, reserved = st.view().warm_and_reserved("A", None)
    assert [w.pinned for w in warm if w.key == "t/p"] == [False]
    assert "t/p" in {r.key for r in reserved}


def test_a_replica_that_breaks_its_matches_is_costed_on_what_it_delivers():
    """A holds the whole prompt on GPU, B half of it. A wins — until A's last calls got a fifth
    of the prefix its index promised (blocks evicted while they queued): then its match counts
    for a fifth, cut from its tail, and B wins. The explain keeps the raw match, which is what
    the next observation is measured against."""
    st = state()
    st.index.store("A", KEYS)
    st.index.store("B", KEYS[: N // 2])
    eps = [ep("A"), ep("B")]
    assert pick(st, eps, ctx_for(session="x"))[0] == "A"
    for i in range(8):
        c = ctx_for(session=f"q{i}")
        st.analyze(c)
        dec = Decision(ep("A"), [], terms={"kv_cost": {"A": {"match_blocks": N}}})
        usage = Usage(N * BS, 100, N * BS // 5)
        done = CallOutcome("A", "200", ttft_s=1.0, duration_s=2.0, usage=usage, decision=dec)
        st.observe(c, done)
    # the whole prompt was matched: vLLM serves it at most one block short (it recomputes the
    # last token), so that is what was expected of A
    assert st.calibration("A").hit_realization == pytest.approx((N * BS // 5) / ((N - 1) * BS))
    winner, s = pick(st, eps, ctx_for(session="x"))
    assert winner == "B"
    assert s.terms["A"]["match_blocks"] == N
    assert s.terms["A"]["tiers"] == {"gpu": N // 5, "cpu": 0, "storage": 0, "pool": 0}
    assert st.calibration("B").hit_realization == 1.0


def test_next_calls_move_a_session_off_a_replica_that_breaks_its_matches():
    """A delivered a fifth of what it matched (as above) and runs 2 decoders, B delivers all and
    runs 12. The session on A recomputes most of its prompt on either; B's decoders keep it on
    A — unless its next calls count (``horizon_calls``): on A they recompute four fifths again,
    on B nothing. P(next call): 1 for a session that has called before; for a first call, the
    share of the sessions seen that came back."""
    st = state()
    st.index.store("A", KEYS)
    for i in range(8):
        c = ctx_for(session=f"q{i}")
        st.analyze(c)
        dec = Decision(ep("A"), [], terms={"kv_cost": {"A": {"match_blocks": N}}})
        usage = Usage(N * BS, 100, N * BS // 5)
        st.observe(c, CallOutcome("A", "200", ttft_s=1.0, duration_s=2.0, usage=usage,
                                  decision=dec))  # fmt: skip
    assert st.view().p_next_call("t/new") == 0.0  # eight one-call sessions: none came back
    for _ in range(2):
        c = ctx_for(session="s")
        st.analyze(c)
        st.observe(c, outcome(duration_s=1.0))
    view = st.view()
    assert view.p_next_call("t/s") == 1.0 and view.p_next_call("t/new") == pytest.approx(1 / 9)
    eps = [ep("A", inflight=2, running=2), ep("B", inflight=12, running=12)]
    assert pick(st, eps, ctx_for(session="s"), sticky="A")[0] == "A"
    winner, s = pick(st, eps, ctx_for(session="s"), sticky="A", scorer=KVCost(horizon_calls=3))
    assert winner == "B"
    assert s.terms["A"]["next_calls_s"] > 0 and s.terms["B"]["next_calls_s"] == 0.0
    # the default prices no next call
    assert pick(st, eps, ctx_for(session="s"))[1].terms["A"]["next_calls_s"] == 0.0
    with pytest.raises(TypeError):
        KVCost(horizon_calls=-1)


def test_a_hinted_pause_is_priced_as_held_in_the_host_tier_while_the_engine_honours_it():
    """With engine hints on, the call's hint (``ctx.hint``) gives the session's footprint the
    engine plugin's hold (min(return_s × slack, ttl)); the view hands it to the cost model only
    while the replica's retained-share gauge is there and below the cap."""
    clock = [1000.0]
    st = KVState(KVConfig(block_size=BS, profile="h200-70b-fp8-offload"), clock=lambda: clock[0])
    st.index.add_replica("A")

    def held(**gauges):
        e = ep("A")._replace(**gauges)
        load = st.view().replica_load(e, None, N * BS)
        return {w.key: w.hold_s for w in load.warm}

    paused = ctx_for(session="paused")
    paused.hint = {"session": "t/paused", "state": "tool-pause", "return_s": 20.0}
    no_gap = ctx_for(session="first")  # no gap yet: the engine holds for its TTL
    no_gap.hint = {"session": "t/first", "state": "tool-pause"}
    done = ctx_for(session="done")
    done.hint = {"session": "t/done", "state": "done"}
    plain = ctx_for(session="plain")  # hints off: no hint on the call
    for c in (paused, no_gap, done, plain):
        st.analyze(c)
        st.observe(c, outcome(duration_s=1.0))
    assert st.sessions["t/paused"].hold_s == pytest.approx(30.0)  # 20 s × slack 1.5
    assert st.sessions["t/first"].hold_s == pytest.approx(600.0)
    assert st.sessions["t/done"].hold_s == 0.0 and st.sessions["t/plain"].hold_s == 0.0
    got = held(host_retained=0.2)
    assert got == {"t/paused": 30.0, "t/first": 600.0, "t/done": 0.0, "t/plain": 0.0}
    # at the cap the plugin drops the earliest paused sessions' protection: not relied on
    assert set(held(host_retained=0.48).values()) == {0.0}
    # no gauge: no sign that the engine's retention runs, so no hold is assumed
    assert set(held().values()) == {0.0}
    # the next call of the session without a hint (hints turned off) ends the hold
    again = ctx_for(session="paused")
    st.analyze(again)
    st.observe(again, outcome(duration_s=1.0))
    assert st.sessions["t/paused"].hold_s == 0.0


def test_retention_settings_default_to_the_engine_plugins():
    from engine_patches.presets import EngineOptions
    from engine_patches.retention_rule import HOLDING, RetentionConfig
    from router.kv.state import HOLDING as ROUTER_HOLDING

    eng, cfg, opts = RetentionConfig(), KVConfig(), EngineOptions()
    assert (cfg.retention_ttl_s, cfg.retention_return_slack, cfg.retention_share) == (
        eng.ttl_s, eng.return_slack, eng.max_share,
    )  # fmt: skip
    assert (opts.retention_ttl_s, opts.retention_share) == (eng.ttl_s, eng.max_share)
    assert ROUTER_HOLDING == HOLDING  # router/ keeps its own copy: it does not import the plugin
    with pytest.raises(ValueError, match="retention_share"):
        KVConfig(retention_share=1.5)


def test_a_replica_without_enough_samples_borrows_the_fleets_calibration():
    """Until a replica has its own fit, its time scales are the median of its peers' (same
    profile) when that is below 1: else, with a profile far slower than the engines, the first
    replica calibrated looks several times cheaper than the rest and takes every call."""
    from costmodel.calibration import Calibrator

    st = KVState(
        KVConfig(block_size=BS, profile="h200-70b-fp8-offload", profiles={"D": "h200-8b"}),
        clock=lambda: 0.0,
    )
    for name, scale in (("A", 0.3), ("B", 0.32), ("C", 0.28)):
        cal = st.calibrators.setdefault(name, Calibrator())
        for i in range(10):
            cal.observe_ttft(1.0 + i, scale * (1.0 + i))
            cal.observe_itl(0.02, 0.5 * 0.02)
    few = st.calibrators.setdefault("E", Calibrator())
    for _ in range(3):
        few.observe_ttft(1.0, 3.0)
        few.observe_hit(1000, 500)
    assert st.calibration("A").prefill_scale == pytest.approx(0.3, rel=0.01)  # its own
    for cold in ("E", "F"):  # a few samples, or none: the fleet's median
        cal = st.calibration(cold)
        assert cal.prefill_scale == pytest.approx(0.3, rel=0.01)
        assert cal.decode_scale == pytest.approx(0.5, rel=0.01)
    assert st.calibration("E").hit_realization == 1.0  # its own (too few samples: 1)
    assert st.calibration("E").ttft_offset_s == 0.0
    assert st.calibration("D").prefill_scale == 1.0  # another profile: nothing to borrow
    # a fleet slower than its profile is not borrowed: the cold replica looks cheaper, is
    # tried, and measures itself
    for name in ("A", "B", "C"):
        for i in range(10):
            st.calibrators[name].observe_ttft(1.0 + i, 3.0 * (1.0 + i))
            st.calibrators[name].observe_itl(0.02, 0.06)
    assert st.calibration("A").prefill_scale > 1.5
    assert st.calibration("F").prefill_scale == 1.0 and st.calibration("F").decode_scale == 1.0


def test_no_profile_prices_with_the_generic_stand_in():
    st = KVState(KVConfig(block_size=BS, profile="none"), clock=lambda: 0.0)
    assert st.profile_of("A").name == "generic"
    assert st.profile_of("A").block_size == BS


@pytest.mark.parametrize("pool", [False, True])
def test_a_pool_lets_a_call_leave_its_busy_replica_and_fetch_instead_of_recomputing(pool):
    """Issue 43, Build 2: the session's replica A holds its prefix on GPU behind two long
    calls. Without a pool, B would recompute 128k tokens, so the call waits on A; with the
    prefix in the cluster pool, B (a pool member) loads it on the pool's link and wins. A
    replica that never published a pool event gets no pool credit."""
    st = state()
    st.index.add_replica("C")
    st.index.store("A", KEYS)
    if pool:
        st.index.pool_store("A", KEYS)  # A wrote the prefix through to the pool
        st.index.add_pool_member("B")  # B reads it (it published a pool event of its own)
    st.stats["A"] = ReplicaStat(uncached_ewma=100_000, context_ewma=120_000, calls=10)
    for r in ("B", "C"):
        st.stats[r] = ReplicaStat(uncached_ewma=2_000, context_ewma=100_000, calls=10)
    eps = [ep("A", inflight=2, running=0, waiting=2), ep("B"), ep("C")]
    winner, s = pick(st, eps, ctx_for(), sticky="A")
    assert s.terms["C"]["tiers"]["pool"] == 0
    if not pool:
        assert winner == "A"
        assert s.terms["B"]["tiers"]["pool"] == 0
        return
    assert winner == "B"
    b = s.terms["B"]
    assert b["tiers"] == {"gpu": 0, "cpu": 0, "storage": 0, "pool": N}
    assert b["chose"] == {"pool": "load"}
    assert b["total_s"] < s.terms["C"]["total_s"]  # a fetch, not a recompute
    assert s.terms["A"]["tiers"]["gpu"] == N  # A counts its own HBM copy first
