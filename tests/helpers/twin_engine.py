"""Shared helpers of the twin engine's unit tests: a tiny profile, token ids, driving an
engine to idle, and its decoded KV events."""

from __future__ import annotations

from costmodel.profiles import load_profile
from loadtest.twin.engine import Engine, Request
from router.vllm.kvevents import decode_event

TINY = load_profile("cpu-tiny")
BS = TINY.block_size


def toks(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 3000 + 100 for i in range(n)]


def drive(e: Engine, reqs=(), t: float = 0.0, until_idle: bool = True) -> float:
    for r in reqs:
        e.add(r)
    while e.has_work:
        s = e.schedule(t)
        if s is None:
            nxt = e.next_ready()
            # a load due at or before t that schedule(t) did not reach: the scan stopped short
            assert nxt is not None and nxt > t, "engine stuck with work but nothing schedulable"
            t = max(t, nxt)
            continue
        t += s.duration
        e.complete(s, t)
        if not until_idle:
            break
    return t


def events(e: Engine):
    return [decode_event(x) for x in e.take_events()]


def stored(evs, medium="GPU"):
    return [
        k
        for ev in evs
        if type(ev).__name__ == "BlockStored" and ev.medium == medium
        for k in ev.block_hashes
    ]


def removed(evs, medium="GPU"):
    return [
        k
        for ev in evs
        if type(ev).__name__ == "BlockRemoved" and ev.medium == medium
        for k in ev.block_hashes
    ]


def req(rid, tokens, max_tokens=1, **kw):
    return Request(rid, len(tokens), max_tokens, token_ids=list(tokens), **kw)
