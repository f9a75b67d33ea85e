"""The decision log (router/decisionlog.py): one line per placement, with the cost terms."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from costmodel.profiles import load_profile
from loadtest import tinymodel
from loadtest.twin.cluster import start_cluster
from router.app import build_app, start_site
from router.config import RouterConfig
from router.kv.config import KVConfig
from router.kv.state import KVState
from router.vllm.tokenizer import ModelTokenizer

pytestmark = pytest.mark.timeout(60)
PROF = load_profile("cpu-tiny")
WORDS = tinymodel._WORDS


async def test_every_placement_is_logged_with_its_session_and_cost_terms(tmp_path):
    path = tmp_path / "decisions.jsonl"
    st = KVState(KVConfig(block_size=PROF.block_size, profile="cpu-tiny"),
                 tokenizer=ModelTokenizer.from_dir(tinymodel.ensure()), profile=PROF)  # fmt: skip
    async with start_cluster(2, PROF) as c:
        cfg = RouterConfig(replicas=c.urls, policy="kv_cost", health_interval_s=30,
                           decision_log=str(path))  # fmt: skip
        runner, url = await start_site(build_app(cfg, kv=st))
        history = [{"role": "user", "content": " ".join(WORDS[i % len(WORDS)] for i in range(600))}]
        try:
            async with aiohttp.ClientSession(headers={"x-session-id": "s-log"}) as http:
                for turn in range(2):
                    body = {"model": "tiny", "messages": history, "max_tokens": 4}
                    async with http.post(url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200
                        text = (await r.json())["choices"][0]["message"]["content"]
                    history += [{"role": "assistant", "content": text},
                                {"role": "user", "content": f"turn {turn} again"}]  # fmt: skip
        finally:
            await runner.cleanup()
            await st.close()
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert first["session"].endswith("s-log") and first["session_replica"] is None
    # the second call saw the session on the replica the first one went to
    assert second["session_replica"] == first["winner"]
    assert len(second["candidates"]) == 2 and second["winner"] in second["candidates"]
    terms = second["candidates"][second["winner"]]["kv_cost"]
    assert terms["match_blocks"] > 0 and terms["session_prior_s"] > 0
    assert terms["effective_s"] < terms["total_s"]
    other = next(n for n in second["candidates"] if n != second["session_replica"])
    assert second["candidates"][other]["kv_cost"]["match_blocks"] == 0
    assert second["analysed"] and second["prompt_tokens"] > 600


def test_a_call_placed_before_its_analysis_is_logged_as_not_analysed(tmp_path):
    """``analysed`` says whether the prompt analysis landed before the pick, not whether the
    prompt had a full block: a one-word prompt is analysed (no block keys: ``[]``), a call
    placed on what is known before its tokens is not (``None``)."""
    from router.decisionlog import DecisionLog
    from router.replicas import EndpointView
    from router.scheduling import RequestContext
    from router.scheduling.pipeline import Decision
    from router.sessions import SessionIdentity

    log = DecisionLog(str(tmp_path / "d.jsonl"))
    ident = SessionIdentity("t", "s", None, None, False, "test")
    ep = EndpointView("r0", "r0", True, frozenset({"m"}), 0, 0.0, 0.0, 0.1, "closed")
    for keys, n in (([], 3), (None, None), ([7, 8], 64)):
        ctx = RequestContext("r", "/v1/completions", "m", ident, {})
        ctx.block_keys, ctx.prompt_tokens = keys, n
        if n == 64:  # priority: session set the call's priority before the pick
            ctx.priority, ctx.priority_level = 17_000_000_123, 3
        log(ctx, Decision(ep, [(ep, 1.0)]))
    log.close()
    lines = [orjson.loads(x) for x in (tmp_path / "d.jsonl").read_bytes().splitlines()]
    assert [(x["analysed"], x["prompt_tokens"]) for x in lines] == [
        (True, 3), (False, None), (True, 64),
    ]  # fmt: skip
    # the priority sent upstream and its level are on the line only when one was set
    assert "priority" not in lines[0] and "priority_level" not in lines[1]
    assert (lines[2]["priority"], lines[2]["priority_level"]) == (17_000_000_123, 3)


def test_an_unwritable_decision_log_is_a_configuration_error(tmp_path, capsys):
    import argparse

    from router.serve import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--replica", "http://127.0.0.1:1",
                         "--decision-log", str(tmp_path / "no-such-dir" / "d.jsonl")])  # fmt: skip
    assert run(args) == 2  # before binding: no traceback, no port taken
    assert "no-such-dir" in capsys.readouterr().err
