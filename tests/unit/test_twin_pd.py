"""The twin's P/D decode side: a remote prefill's KV arrives over the link (engine model)."""

from __future__ import annotations

import dataclasses

import pytest

from costmodel.disagg import kv_transfer_time
from costmodel.profiles import load_profile
from loadtest.twin.engine import LOADING, Engine, Request
from router.vllm.hashing import BlockHasher
from tests.helpers.twin_engine import drive, events, stored, toks

TINY = load_profile("cpu-tiny")
BS = TINY.block_size


def req(rid, tokens, max_tokens=4, remote=0):
    r = Request(rid, len(tokens), max_tokens, token_ids=list(tokens))
    r.remote_tokens = remote
    return r


def test_remote_prefill_waits_the_transfer_then_allocates_and_stores_the_blocks():
    h = BlockHasher(BS)
    e = Engine(TINY, hasher=h)
    p = toks(2001, 11)
    r = req("d", p, remote=len(p))
    e.add(r)
    assert e.schedule(0.0) is None  # nothing to compute yet: the KV is on its way
    assert r.status == LOADING
    n_blocks = (len(p) - 1) // BS
    assert len(r.blocks) == n_blocks  # allocated on arrival of the request
    assert e.next_ready() == pytest.approx(kv_transfer_time(TINY, n_blocks * BS))
    drive(e, [], t=0.0)
    assert r.finished and r.num_output == 4
    assert r.cached_tokens == n_blocks * BS  # counted as vLLM counts external tokens
    assert e.remote_blocks == n_blocks
    # the transferred blocks are stored on the decode replica: KV events say so
    assert h.hash_keys(p)[:n_blocks] == stored(events(e))[:n_blocks]


def test_remote_prefill_skips_the_compute_a_local_prefill_pays():
    p = toks(3000, 12)
    local = Engine(TINY, hasher=BlockHasher(BS))
    a = req("a", p)
    drive(local, [a])
    remote = Engine(TINY, hasher=BlockHasher(BS))
    b = req("b", p, remote=len(p))
    drive(remote, [b])
    transfer = kv_transfer_time(TINY, (len(p) - 1) // BS * BS)
    assert b.first_token_time < a.first_token_time
    assert b.first_token_time >= transfer
    # a slow link makes the transfer the larger cost
    slow_hw = dataclasses.replace(TINY.hardware, kv_transfer_bw=1e3)
    slow = Engine(dataclasses.replace(TINY, hardware=slow_hw), hasher=BlockHasher(BS))
    c = req("c", p, remote=len(p))
    drive(slow, [c])
    assert c.first_token_time > a.first_token_time


def test_decode_replica_hit_is_not_transferred_again():
    h = BlockHasher(BS)
    e = Engine(TINY, hasher=h)
    p = toks(1000, 13)
    t = drive(e, [req("warm", p[:640])])
    r = req("d", p, remote=len(p))
    e.add(r)
    assert e.schedule(t) is None
    # 640 tokens = 20 blocks already here: only the rest comes over the link
    assert len(r.load_blocks) == (len(p) - 1) // BS - 640 // BS
    drive(e, [], t)
    assert r.finished


def test_aborted_transfer_frees_its_blocks():
    e = Engine(TINY, hasher=BlockHasher(BS))
    free = e.pool.num_free
    r = req("d", toks(2000, 14), remote=2000)
    e.add(r)
    assert e.schedule(0.0) is None and e.pool.num_free < free
    assert e.abort("d")
    assert e.pool.num_free == free
