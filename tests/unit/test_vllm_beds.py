"""The vllm tier's bed pool (tests/vllm/conftest.py) without vLLM: one bed per flag set, the
next beds of the run started with the first within the replica budgets, each stopped after its
last test, leaks recorded, a stopped bed never handed out again."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest

from tests.vllm import conftest as beds

# the tier's beds in the order its modules first use them
ORDER = ["plain", "cadence", "pool", "retention", "signals", "tiers", "writeback", "replay",
         "ft-lru", "ft-retention", "ft-disk", "ft-write-back"]  # fmt: skip


class FakeBed:
    stopped: ClassVar[list[str]] = []

    def __init__(self, configs):
        self.replicas = configs
        self.bed_id = configs[0].name

    def __iter__(self):
        return iter(self.replicas)

    def stop(self) -> None:
        FakeBed.stopped.append(self.bed_id)


@pytest.fixture()
def pool(monkeypatch, tmp_path):
    started: list[list[str]] = []
    monkeypatch.setattr(beds, "VllmBed", FakeBed)
    monkeypatch.setattr(
        beds, "start_beds", lambda bs: started.append([r.name for b in bs for r in b])
    )
    monkeypatch.setattr(beds, "install_plugin", lambda: started.append(["plugin"]))
    monkeypatch.setattr(beds, "processes_with_marker", lambda bed_id: [])
    FakeBed.stopped = []
    n = iter(range(1000))

    def mktemp(name: str) -> Path:
        d = tmp_path / f"{name}{next(n)}"
        d.mkdir()
        return d

    ctx = beds.BedContext(Path("/model"), "tcp://127.0.0.1:1", mktemp)
    return beds.BedPool(ctx, ORDER, {k: f"t::{k}" for k in ORDER}), started


def test_every_flag_set_is_named_once_with_distinct_replica_names(tmp_path):
    ctx = beds.BedContext(Path("/model"), "tcp://127.0.0.1:1", lambda n: tmp_path)
    names = [c.name for build, _ in beds.BEDS.values() for c in build(ctx)[0]]
    assert len(names) == len(set(names))  # one event topic and log folder each
    assert set(beds.FIXTURE_KEYS.values()) | {f"ft-{m}" for m in beds.TIERS_MODES} == set(beds.BEDS)


def test_beds_start_in_batches_within_the_budgets_and_stop_after_their_last_test(pool):
    p, started = pool
    plain = p.get("plain")
    assert started == [["plugin"], ["a", "b", "cad"]]  # the pool's two would pass 4 at once
    assert p.get("plain") is plain and p.get("cadence").key == "cadence"
    assert len(started) == 2  # nothing started twice
    p.release("cadence")
    p.get("pool")
    assert started[-1] == ["p1", "p2", "ret", "sig"]
    for k in ("pool", "retention", "signals"):
        p.release(k)
    p.get("tiers")
    assert started[-1] == ["tier", "wb", "wt", "wbf"]
    assert sum(len(b.replicas) for b in p.live.values()) == beds.LIVE_REPLICAS
    for k in ("tiers", "writeback"):
        p.release(k)
    p.get("replay")  # and three of the fidelity beds, idle until the tier's last module
    assert started[-1] == ["r", "ft-lru", "ft-retention", "ft-disk"]
    for k in ("replay", "plain", "ft-lru", "ft-retention", "ft-disk"):
        p.release(k)
    p.get("ft-write-back")
    assert started[-1] == ["ft-write-back"]
    assert FakeBed.stopped == ["cad", "p1", "ret", "sig", "tier", "wb", "r", "a", "ft-lru",
                               "ft-retention", "ft-disk"]  # fmt: skip
    with pytest.raises(RuntimeError, match="stopped after its last test"):
        p.get("plain")
    p.close()
    assert len(FakeBed.stopped) == 12 and not p.live


def test_a_bed_with_processes_left_is_reported(pool, monkeypatch):
    p, _ = pool
    p.get("replay")
    monkeypatch.setattr(beds, "LEAK_GRACE_S", 0.3)
    monkeypatch.setattr(beds, "processes_with_marker", lambda bed_id: [4242])
    p.release("replay")
    assert p.leaks == {"replay": [4242]}


def test_a_process_still_exiting_when_its_bed_stops_is_no_leak(pool, monkeypatch):
    p, _ = pool
    p.get("replay")
    seen = iter([[4242], [4242], []])  # SIGKILLed, gone two reads later
    monkeypatch.setattr(beds, "processes_with_marker", lambda bed_id: next(seen))
    p.release("replay")
    assert p.leaks == {}


def test_item_keys_read_the_bed_fixtures_and_the_tiers_mode():
    from types import SimpleNamespace

    item = SimpleNamespace(fixturenames=["client", "vllm_bed", "tiered_bed", "replay_bed"],
                           callspec=SimpleNamespace(params={"tiered_bed": "disk"}))  # fmt: skip
    assert beds.item_keys(item) == ["plain", "replay", "ft-disk"]
