"""The cluster pool's own logic (engine_patches.pool) without vLLM: which files a sweep
deletes, how a file name maps back to its block, and the directory scan."""

from __future__ import annotations

import os

from engine_patches import pool


def test_eviction_deletes_least_recently_used_down_to_the_low_water_mark():
    files = [("old", 1.0, 100), ("new", 9.0, 100), ("mid", 5.0, 100), ("mid2", 6.0, 100)]
    doomed, left = pool.plan_eviction(files, bound=250, low_water=0.8)  # target 200
    assert doomed == ["old", "mid"] and left == 200
    assert pool.plan_eviction(files, bound=400) == ([], 400)  # within the bound: nothing
    assert pool.plan_eviction(files, bound=0) == ([], 400)  # 0: unbounded


def test_a_pool_file_name_gives_back_its_block_hash_and_group():
    h = bytes(range(32))
    path = f"/pool/tiny_abc_r0/{h.hex()[:3]}/{h.hex()[3:5]}_g2/{h.hex()}.bin"
    assert pool.key_of_path(path) == (h, 2)
    assert pool.key_of_path("/pool/x/ab_g0/zz.bin") is None  # not hex
    assert pool.key_of_path("/pool/x/ab_g0/abcd.bin.tmp123") is None  # being written


def test_the_scan_sees_block_files_only(tmp_path):
    d = tmp_path / "m_r0" / "abc" / "de_g0"
    d.mkdir(parents=True)
    (d / "abcde0.bin").write_bytes(b"x" * 10)
    (d / "abcde1.bin.tmp9").write_bytes(b"x" * 5)  # a write in flight
    (tmp_path / "m_r0" / "config.json").write_text("{}")
    os.utime(d / "abcde0.bin", (5, 5))
    got = list(pool.pool_files(str(tmp_path)))
    assert got == [(str(d / "abcde0.bin"), 5.0, 10)]
    assert list(pool.pool_files(str(tmp_path / "missing"))) == []


def test_held_files_go_after_every_other_and_the_earliest_hold_first():
    now = 100.0
    files = [
        ("cold-old", 10.0, 100),
        ("held-long", 900.0, 100),  # a paused session's, held until 900
        ("cold-new", 90.0, 100),
        ("held-short", 200.0, 100),
    ]
    # 400 bytes, bound 300, down to 270 (low water 0.9): two files go, the cold ones
    doomed, left = pool.plan_eviction(files, bound=300, now=now)
    assert doomed == ["cold-old", "cold-new"] and left == 200
    # tighter: the hold ending first goes next
    doomed, _ = pool.plan_eviction(files, bound=120, low_water=0.9, now=now)
    assert doomed == ["cold-old", "cold-new", "held-short"]
    # held bytes beyond max_held_share of the bound lose protection, the holds ending first,
    # ordered as if used now: after the cold files, before the holds that keep it
    doomed, _ = pool.plan_eviction(files, bound=300, low_water=0.5, now=now, max_held_share=0.4)
    assert doomed == ["cold-old", "cold-new", "held-short"]


def test_a_hold_lasts_as_the_retention_rule_says():
    from engine_patches.retention_rule import Hint, RetentionConfig

    cfg = RetentionConfig(ttl_s=600, return_slack=1.5)
    assert pool.hold_until(Hint("s", "tool-pause", 30.0), cfg, 1000.0) == 1045.0
    assert pool.hold_until(Hint("s", "waiting-on-children"), cfg, 1000.0) == 1600.0  # the TTL
    assert pool.hold_until(Hint("s", "tool-pause", 1e6), cfg, 0.0) == 600.0  # never past it
    assert pool.hold_until(Hint("s", "done"), cfg, 0.0) is None
    assert pool.hold_until(Hint("s", "running"), cfg, 0.0) is None
    assert pool.hold_until(None, cfg, 0.0) is None


def test_a_store_completed_during_a_scan_stays_in_the_estimate():
    est = pool.PoolEstimate()
    est.add(100)
    est.scan_started()
    est.add(30)  # completes while the sweep scans: not in the scan's total
    assert est.scanned(left=90) == 30
    assert est.bytes == 120  # the scan's 90 plus the 30 it could not see
    est.scan_started()
    assert est.scanned(left=110) == 0 and est.bytes == 110
