"""Admission at the router (router.admission): calls wait while every replica is full, are
released in key (priority) order as room appears, and are refused past the bounds."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import AdmissionGate, AdmissionLimits, AdmissionRefused, is_full
from router.replicas import EndpointView

LIM = AdmissionLimits(max_waiting=4, max_kv_usage=0.9, timeout_s=5.0, max_queued=3)


def view(name="a", waiting=0.0, kv=0.1, healthy=True, accepting=True):
    return EndpointView(name, f"http://{name}", healthy, frozenset({"m"}), 0, 1.0, waiting, kv,
                        "closed", accepting)  # fmt: skip


def test_a_replica_is_full_past_its_queue_or_kv_limit_or_when_it_takes_nothing():
    assert not is_full(view(waiting=3, kv=0.89), LIM)
    assert is_full(view(waiting=4), LIM) and is_full(view(kv=0.9), LIM)
    assert is_full(view(healthy=False), LIM) and is_full(view(accepting=False), LIM)
    assert not is_full(view(waiting=None, kv=None), LIM)  # nothing scraped yet: not full


async def test_calls_wait_while_every_replica_is_full_and_go_in_priority_order():
    views = [view("a", waiting=9), view("b", kv=0.95)]
    gate = AdmissionGate(LIM, lambda: views)
    order: list[int] = []

    async def call(key):
        await gate.admit(key)
        order.append(key)

    tasks = [asyncio.create_task(call(k)) for k in (30, 10, 20)]
    await asyncio.sleep(0.01)
    assert order == [] and gate.waiting == 3
    with pytest.raises(AdmissionRefused) as e:  # max_queued: refused at once
        await gate.admit(0)
    assert e.value.status == 429
    views[0] = view("a", waiting=0)  # one replica has room: one waiter per pump
    assert gate.pump() == 1
    await asyncio.sleep(0.01)
    assert order == [10]
    gate.pump()
    gate.pump()
    await asyncio.gather(*tasks)
    assert order == [10, 20, 30] and gate.waiting == 0


async def test_a_call_goes_at_once_when_nobody_waits_and_a_replica_has_room():
    gate = AdmissionGate(LIM, lambda: [view("a", waiting=9), view("b")])
    assert await gate.admit(99) == 0.0
    # no healthy replica: not the gate's case (scheduling answers it)
    assert await AdmissionGate(LIM, lambda: [view(healthy=False)]).admit(1) == 0.0


async def test_the_wait_is_bounded_and_a_waiter_that_gave_up_is_skipped():
    lim = AdmissionLimits(max_waiting=1, timeout_s=0.05, max_queued=10)
    views = [view(waiting=5)]
    gate = AdmissionGate(lim, lambda: views)
    with pytest.raises(AdmissionRefused) as e:
        await gate.admit(1)
    assert e.value.status == 503 and e.value.retry_after_s == 0.05 and gate.waiting == 0
    late = asyncio.create_task(gate.admit(2))
    await asyncio.sleep(0.01)
    views[0] = view(waiting=0)
    assert gate.pump() == 1  # the timed-out waiter (key 1) is gone; key 2 goes
    assert await late >= 0.0


def test_limits_are_checked():
    with pytest.raises(ValueError):
        AdmissionLimits(max_kv_usage=1.5)
    with pytest.raises(ValueError):
        AdmissionLimits(timeout_s=0)
