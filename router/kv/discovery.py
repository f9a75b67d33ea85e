"""Zero-config for the KV layer: :class:`KVSettingsDiscovery`, the part of
:class:`router.kv.state.KVState` that discovers the layer's settings (block size, hash
algorithm, tokenizer, KV capacity) from what the replicas report
(:meth:`KVSettingsDiscovery.autoconfigure`) and says how fully the layer runs
(:meth:`KVSettingsDiscovery.status`). Finding the tokenizer and reading the replicas' facts
live in :mod:`router.kv.autoconf`. Must not import aiohttp, the proxy, torch or vllm.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from costmodel.profiles import ReplicaProfile, router_profile
from router.kv.autoconf import SEEDED_ALGOS, LayerStatus, ReplicaFacts, find_tokenizer
from router.kv.config import KVConfig
from router.kv.index import BlockIndex
from router.kv.tokens import SessionTokenizer
from router.vllm.hashing import BlockHasher
from router.vllm.tokenizer import ModelTokenizer


class KVSettingsDiscovery:
    """Zero-config: the KV layer's settings discovered from the replicas' reports (a mixin of
    :class:`router.kv.state.KVState`, whose ``__init__`` sets the attributes declared here)."""

    cfg: KVConfig
    index: BlockIndex
    hasher: BlockHasher
    tokenizer: ModelTokenizer | None
    tokens: SessionTokenizer | None
    facts: list[ReplicaFacts]
    discovered: bool
    discovery_notes: list[str]
    tokenizer_source: str | None
    tokenizer_note: str | None
    remote_tokens: Any
    _auto_profile: ReplicaProfile | None
    _profiles: dict[str, ReplicaProfile]

    def autoconfigure(self, facts: list[ReplicaFacts]) -> bool:
        """Complete a ``discover`` layer from what the replicas reported (``facts``: one per
        replica that answered ``/v1/models``): the tokenizer (unless configured) found from the
        served model (:func:`router.kv.autoconf.find_tokenizer`), the block size and hash
        algorithm from vLLM's ``vllm:cache_config_info``, and — with profile ``none`` — the
        generic stand-in sized to the replica's reported KV capacity. Applied once, from the
        first replica that reported a model (replicas that disagree are noted in
        :meth:`status`); returns whether it has been applied. Call before the first analysis
        (``build_app``'s KV context does, before traffic)."""
        if not self.cfg.discover or self.discovered:
            return self.discovered
        cards = [f for f in facts if f.model is not None]
        if not cards:
            return False
        self.facts = list(facts)
        ref = next((f for f in cards if f.block_size is not None), cards[0])
        notes: list[str] = []
        cfg = self.cfg
        changes: dict[str, Any] = {}
        if ref.block_size is not None:
            changes["block_size"] = ref.block_size
        else:
            notes.append(
                f"{ref.replica} reports no vllm:cache_config_info block_size on /metrics: "
                f"block keys use {cfg.block_size} tokens and may not match its KV events"
            )
        if ref.hash_algo is not None:
            changes["hash_algo"] = ref.hash_algo
        else:
            notes.append(
                f"{ref.replica} reports no prefix_caching_hash_algo: assuming {cfg.hash_algo}"
            )
        for f in cards:
            if f is ref:
                continue
            for attr in ("model", "block_size", "hash_algo"):
                mine, theirs = getattr(ref, attr), getattr(f, attr)
                if theirs is not None and mine is not None and theirs != mine:
                    notes.append(
                        f"replicas disagree on {attr}: {ref.replica} {mine}, {f.replica} {theirs}"
                        f" (using {mine})"
                    )
        if ref.prefix_caching is False:
            notes.append(f"{ref.replica} runs with prefix caching off: nothing is reused there")
        if changes:
            cfg = self.cfg = replace(cfg, **changes)
            try:
                self.hasher = BlockHasher(cfg.block_size, cfg.hash_algo, cfg.hash_seed)
            except ValueError as e:  # xxhash without the engines' seed, or no xxhash package
                notes.append(f"block keys cannot match the replicas' events: {e}")
                self.hasher = BlockHasher(cfg.block_size, "sha256_cbor", cfg.hash_seed)
        tokenizer = self.tokenizer
        if tokenizer is None:
            path, how = find_tokenizer([ref.root, ref.model])
            if path is not None:
                try:
                    tokenizer = ModelTokenizer.from_dir(path)
                except Exception as e:  # a broken model dir: degrade, never crash
                    self.tokenizer_note = f"{path} failed to load: {e}"
                else:
                    self.cfg = replace(self.cfg, tokenizer=path)
                    self.tokenizer_source = how
            else:
                self.tokenizer_note = how
        self.tokenizer = tokenizer
        self.tokens = (
            SessionTokenizer(tokenizer, self.hasher, max_tokens=self.cfg.max_cached_tokens)
            if tokenizer is not None
            else None
        )
        cap = ref.kv_capacity_tokens
        if self.cfg.profile == "none" and cap:
            base = router_profile("none")
            bs = self.cfg.block_size
            self._auto_profile = base.replace(block_size=bs, gpu_kv_blocks=max(cap // bs, 1))
            self._profiles.clear()
        self.discovery_notes = notes
        self.discovered = True
        return True

    def status(self, replicas: list[str] | None = None) -> LayerStatus:
        """How fully the layer runs: ``full`` (tokens and block keys matching the replicas'
        KV events), else ``approximate`` with the reasons (no tokenizer: placed on prompt
        text and session context; no events: the index is this router's routing history;
        block size or hash unknown: keys may not match the events). ``replicas`` (names)
        adds each one's event stream state: ``fresh``, ``stale`` or ``waiting`` (no batch
        yet: approximate mode for that replica)."""
        cfg = self.cfg
        reasons: list[str] = []
        if cfg.discover and not self.discovered:
            reasons.append("no replica has reported its model (/v1/models) yet")
        if self.tokens is None:
            if not (cfg.discover and not self.discovered):
                why = f" ({self.tokenizer_note})" if self.tokenizer_note else ""
                first = (
                    "a session's first call is tokenized by a replica's /tokenize, later "
                    if self.remote_tokens is not None
                    else ""
                )
                reasons.append(
                    f"no tokenizer{why}: {first}calls are placed on their prompt text and "
                    "session context (give kv.tokenizer, or the model directory on this machine)"
                )
        has_events = bool(cfg.events_bind or cfg.events_connect or cfg.events_port)
        if not has_events:
            reasons.append(
                "no KV events (--kv-events-port): the index is this router's routing history"
            )
        if cfg.hash_algo in SEEDED_ALGOS and cfg.hash_seed is None:
            reasons.append(
                f"hash algorithm {cfg.hash_algo} without hash_seed: block keys cannot match "
                "the replicas' events"
            )
        reasons.extend(self.discovery_notes)
        facts: dict[str, Any] = {
            "block_size": cfg.block_size,
            "hash_algo": cfg.hash_algo,
            "tokenizer": self.tokenizer_source,
            "profile": self._auto_profile.name + " (sized from the replicas)"
            if self._auto_profile is not None
            else cfg.profile,
            "events": f"tcp://<replica host>:{cfg.events_port}"
            if cfg.events_port
            else cfg.events_bind or ("connect" if cfg.events_connect else None),
        }
        if self.facts:
            ref = next((f for f in self.facts if f.model), None)
            if ref is not None:
                facts["model"] = ref.model
                facts["max_model_len"] = ref.max_model_len
        if replicas is not None and has_events:
            streams = {}
            for r in replicas:
                st = self.index.state(r)
                streams[r] = "waiting" if st is None else "stale" if st.stale else "fresh"
            facts["event_streams"] = streams
        return LayerStatus("full" if not reasons else "approximate", reasons, facts)
