"""Zero-config KV layer pieces: reading vLLM's cache_config_info and model cards, finding the
served model's tokenizer, events endpoints by replica host, the layer's status, and the
``kvroute serve`` flags that turn it on (every flag with a help text)."""

from __future__ import annotations

import argparse
import shutil

import pytest

from loadtest import tinymodel
from router.kv.autoconf import (
    ReplicaFacts,
    cache_config_labels,
    events_endpoint,
    find_tokenizer,
    replica_facts,
)
from router.kv.config import KVConfig
from router.kv.state import KVState
from router.serve import add_arguments, config_from_args, kv_layer

# what vLLM 0.32's /metrics holds for the gauge (labels: every CacheConfig attribute + engine)
LABELS = (
    'block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="{e}",'
    'gpu_memory_utilization="0.92",hash_block_size="None",kv_cache_size_tokens="{t}",'
    'num_cpu_blocks="None",num_gpu_blocks="512",prefix_caching_hash_algo="{a}"'
)
VLLM_METRICS = (
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n'
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    "vllm:cache_config_info{" + LABELS.format(e=1, t=4096, a="xxhash_cbor") + "} 1.0\n"
    "vllm:cache_config_info{" + LABELS.format(e=0, t=8192, a="sha256_cbor") + "} 1.0\n"
)


def test_cache_config_labels_take_engine_zero_and_none_when_absent():
    labels = cache_config_labels(VLLM_METRICS)
    assert labels is not None and labels["engine"] == "0"
    assert labels["prefix_caching_hash_algo"] == "sha256_cbor"
    assert cache_config_labels("vllm:num_requests_running 1.0\n") is None
    assert cache_config_labels("garbage {{{") is None


def test_replica_facts_from_cards_and_labels():
    cards = [{"id": "tiny", "root": "/models/tiny", "max_model_len": 4096}]
    f = replica_facts("http://a:8000", cards, cache_config_labels(VLLM_METRICS))
    assert (f.model, f.root, f.max_model_len) == ("tiny", "/models/tiny", 4096)
    assert (f.block_size, f.hash_algo, f.gpu_blocks) == (32, "sha256_cbor", 512)
    assert f.prefix_caching is True
    assert f.kv_capacity_tokens == 8192  # kv_cache_size_tokens wins over blocks x size
    bare = replica_facts("http://a:8000", [], None)
    assert bare.model is None and bare.block_size is None and bare.kv_capacity_tokens is None
    assert ReplicaFacts("r", gpu_blocks=10, block_size=16).kv_capacity_tokens == 160


@pytest.mark.parametrize(
    ("url", "ep"),
    [
        ("http://10.0.0.7:8000", "tcp://10.0.0.7:5557"),
        (
            "http://user:pw@vllm-0.vllm.ns.svc.cluster.local:8000/",
            "tcp://vllm-0.vllm.ns.svc.cluster.local:5557",
        ),
        ("http://[fd00::7]:8000", "tcp://[fd00::7]:5557"),
    ],
)
def test_events_endpoint_is_the_replica_host_at_the_port(url, ep):
    assert events_endpoint(url, 5557) == ep


def test_find_tokenizer_local_dir_then_hub_cache(tmp_path):
    model = tinymodel.ensure()
    path, how = find_tokenizer(["/nonexistent", str(model)])
    assert path == str(model) and how.startswith("local directory")
    # a hub cache laid out as huggingface_hub keeps it
    repo = tmp_path / "models--acme--tiny"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / name, snap / name)
    path, how = find_tokenizer(["/models/elsewhere", "acme/tiny"], hub_cache=tmp_path)
    assert path == str(snap) and "acme/tiny" in how
    path, how = find_tokenizer(["acme/other", None], hub_cache=tmp_path)
    assert path is None and "acme/other" in how


def facts(**kw) -> ReplicaFacts:
    base = dict(replica="http://a:1", model="tiny", root=str(tinymodel.ensure()),
                max_model_len=4096, block_size=32, hash_algo="sha256_cbor",
                gpu_blocks=256, prefix_caching=True)  # fmt: skip
    return ReplicaFacts(**{**base, **kw})


def test_autoconfigure_applies_the_replicas_facts():
    st = KVState(KVConfig(discover=True, profile="none", events_port=5557))
    assert st.status().mode == "approximate"  # nothing reported yet
    assert not st.autoconfigure([ReplicaFacts("http://a:1")])  # no model card: not yet
    assert st.autoconfigure([facts(), facts(replica="http://b:1")])
    assert st.cfg.block_size == 32 and st.hasher.block_size == 32
    assert st.tokens is not None and st.cfg.tokenizer == str(tinymodel.ensure())
    p = st.profile_of("http://a:1")
    assert p.name == "generic" and p.gpu_kv_blocks * p.block_size == 256 * 32
    status = st.status(["http://a:1"])
    assert status.mode == "full", status
    assert status.facts["event_streams"] == {"http://a:1": "waiting"}
    assert st.autoconfigure([facts(block_size=64)]) and st.cfg.block_size == 32  # once


def test_autoconfigure_notes_what_it_could_not_do():
    st = KVState(KVConfig(discover=True, profile="none", events_port=5557))
    st.autoconfigure(
        [
            facts(block_size=None, hash_algo=None, root="/nope", model="acme/none"),
            facts(replica="http://b:1", model="other", block_size=None),
        ]
    )
    status = st.status()
    why = " ".join(status.reasons)
    assert status.mode == "approximate"
    assert "no tokenizer" in why and "block_size" in why and "prefix_caching_hash_algo" in why
    assert "disagree on model" in why
    st2 = KVState(KVConfig(discover=True, events_port=5557))
    st2.autoconfigure([facts(hash_algo="xxhash")])
    assert "xxhash without hash_seed" in " ".join(st2.status().reasons)
    assert st2.profile_of("x").name == "h200-70b-fp8"  # a named profile is kept


class FakeSub:
    def __init__(self):
        self.calls: list[tuple] = []

    def expect_replica(self, name, replay=None):
        self.calls.append(("expect", name))

    def connect(self, ep, name, replay=None, *, fresh=True):
        self.calls.append(("connect", ep, name, fresh))

    def remove_replica(self, name):
        self.calls.append(("remove", name))

    def disconnect(self, name):
        self.calls.append(("disconnect", name))


def test_events_follow_the_replica_set_by_host():
    st = KVState(
        KVConfig(
            events_port=5557,
            forget_after_s=0,
            events_connect={"http://c:8000": "tcp://elsewhere:9"},
        )
    )
    st.subscriber = sub = FakeSub()
    st.replicas_changed(frozenset({"http://10.1.2.3:8000", "http://c:8000"}), frozenset())
    assert ("connect", "tcp://10.1.2.3:5557", "http://10.1.2.3:8000", False) in sub.calls
    assert not any(c[0] == "connect" and c[2] == "http://c:8000" for c in sub.calls)
    sub.calls.clear()
    st.replicas_changed(frozenset(), frozenset({"http://10.1.2.3:8000"}))
    assert ("disconnect", "http://10.1.2.3:8000") in sub.calls
    sub.calls.clear()
    st.replicas_changed(frozenset({"http://10.1.2.3:8000"}), frozenset())  # back: again
    assert ("connect", "tcp://10.1.2.3:5557", "http://10.1.2.3:8000", False) in sub.calls


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def test_every_serve_flag_has_a_help_text_and_choices_are_listed():
    p = parser()
    missing = [a.option_strings for a in p._actions if a.option_strings and not a.help]
    assert not missing, missing
    by_dest = {a.dest: a for a in p._actions}
    assert "kv_cost" in by_dest["policy"].choices and "round_robin" in by_dest["policy"].choices
    assert "debug" in by_dest["log_level"].choices
    with pytest.raises(SystemExit):
        p.parse_args(["--policy", "nope"])
    assert p.parse_args(["--log-level", "WARNING"]).log_level == "warning"  # kvroute bench


def test_kv_events_port_flag_and_the_layer_it_builds():
    args = parser().parse_args(["--replica=http://a:1", "--kv-events-port=5557"])
    cfg = config_from_args(args, env={})
    assert cfg.kv is not None and cfg.kv.events_port == 5557 and cfg.kv.is_bare()
    kv = kv_layer(cfg)
    assert kv.cfg.discover and kv.cfg.profile == "none" and kv.cfg.events_port == 5557
    # env alone does the same; a kv: section that names a tokenizer is not completed
    cfg = config_from_args(parser().parse_args(["--replica=http://a:1"]),
                           env={"KVROUTE_KV_EVENTS_PORT": "6000"})  # fmt: skip
    assert kv_layer(cfg).cfg.events_port == 6000
    env = {"KVROUTE_KV_TOKENIZER": str(tinymodel.ensure()), "KVROUTE_KV_BLOCK_SIZE": "32"}
    cfg = config_from_args(parser().parse_args(["--replica=http://a:1"]), env=env)
    assert not kv_layer(cfg).cfg.discover
    # a policy that reads no KV state gets no layer; kv_cost without a port still gets one
    cfg = config_from_args(parser().parse_args(["--replica=http://a:1", "--policy=round_robin"]),
                           env={})  # fmt: skip
    assert kv_layer(cfg) is None
    cfg = config_from_args(parser().parse_args(["--replica=http://a:1"]), env={})
    assert kv_layer(cfg).cfg.events_port is None
    with pytest.raises(ValueError, match="events_port"):
        config_from_args(parser().parse_args(["--replica=http://a:1", "--kv-events-port=0"]),
                         env={})  # fmt: skip


def test_workers_refuse_a_bound_events_socket():
    """Only one process can bind ``kv.events_bind``: with ``--workers 2`` the second worker's
    bind failed and it was restarted for ever; refused at start-up with what to use instead."""
    env = {"KVROUTE_KV_EVENTS_BIND": "tcp://127.0.0.1:5599"}
    args = ["--replica=http://a:1", "--workers=2"]
    with pytest.raises(ValueError, match="only one process can bind it"):
        config_from_args(parser().parse_args(args), env=env)
    assert config_from_args(parser().parse_args(args[:1]), env=env).kv.events_bind
    assert config_from_args(parser().parse_args([*args, "--kv-events-port=5557"]), env={})


def test_boolean_flags_parse_false():
    """``--engine-hints false`` (and KVROUTE_ENGINE_HINTS=false) used to be the truthy string."""
    for argv, env, want in (
        (["--engine-hints", "false"], {}, False),
        (["--engine-hints", "true"], {}, True),
        ([], {"KVROUTE_ENGINE_HINTS": "0"}, False),
        ([], {"KVROUTE_ENGINE_HINTS": "on"}, True),
    ):
        args = parser().parse_args(["--replica=http://a:1", *argv])
        assert config_from_args(args, env=env).engine_hints is want, (argv, env)


def test_tuning_settings_keep_zero_config_wiring_settings_end_it():
    assert KVConfig(time_scale=20.0, events_port=5557, hash_seed="0").is_bare()
    assert not KVConfig(block_size=32).is_bare()
    assert not KVConfig(events_bind="tcp://0.0.0.0:5557").is_bare()
    cfg = config_from_args(parser().parse_args(["--replica=http://a:1"]),
                           env={"KVROUTE_KV_TIME_SCALE": "20"})  # fmt: skip
    kv = kv_layer(cfg)
    assert kv.cfg.discover and kv.cfg.time_scale == 20.0


async def test_subscriber_connects_without_an_entry_and_disconnects():
    from router.kv.events import KVEventSubscriber
    from router.kv.index import BlockIndex

    ix = BlockIndex()
    sub = KVEventSubscriber(ix)
    try:
        sub.connect("tcp://127.0.0.1:9", "http://127.0.0.1:8000", fresh=False)
        sub.connect("tcp://[::1]:9", "http://[::1]:8000", fresh=False)
        assert ix.state("http://127.0.0.1:8000") is None  # approximate until a first batch
        assert len(sub._socks) == 2
        sub.disconnect("http://127.0.0.1:8000")
        sub.disconnect("http://nobody:1")  # nothing connected: nothing to do
        assert len(sub._socks) == 1 and len(sub._tasks) == 1
    finally:
        await sub.close()
