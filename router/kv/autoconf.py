"""Zero-config KV layer: what replicas say about themselves, and what the layer can do with it.

Owns: a replica's facts (:class:`ReplicaFacts`: the served model, its root and context window
from ``GET /v1/models``; block size, hash algorithm and KV capacity from the labels of vLLM's
``vllm:cache_config_info`` gauge on ``GET /metrics``), finding the served model's tokenizer
on this machine (:func:`find_tokenizer`: a local model directory, else the Hugging Face hub
cache; it never downloads), a replica's KV-event endpoint (:func:`events_endpoint`:
``tcp://<replica host>:<port>``, where vLLM's publisher binds ``tcp://*:<port>``) and the
layer's status (:class:`LayerStatus`: ``full`` / ``approximate`` / ``affinity`` / ``off``,
with the reasons). No network I/O: the replica monitor fetches (:mod:`router.replicas`) and
:meth:`router.kv.state.KVState.autoconfigure` applies. See docs/kv-routing.md ("Zero-config").

vLLM 0.32 exports ``vllm:cache_config_info`` with one label per ``CacheConfig`` attribute
(``str()`` of each value) plus ``engine`` (``vllm/v1/metrics/loggers.py``
``log_metrics_info``): among them ``block_size`` (synced from the engine core at start-up),
``prefix_caching_hash_algo``, ``enable_prefix_caching``, ``num_gpu_blocks`` (summed over
data-parallel engines) and ``kv_cache_size_tokens`` (per engine).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("kvroute.kv")

CACHE_INFO = "vllm:cache_config_info"
MODES = ("full", "approximate", "affinity", "off")
# what the hash algorithms need: the xxhash ones draw a random per-process seed in vLLM unless
# PYTHONHASHSEED is set, which no replica reports
SEEDED_ALGOS = ("xxhash", "xxhash_cbor")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ReplicaFacts:
    """What one replica reported (None: not reported)."""

    replica: str
    model: str | None = None  # served model name (the card's id)
    root: str | None = None  # what it was loaded from: a path or a hub repo id
    max_model_len: int | None = None
    block_size: int | None = None
    hash_algo: str | None = None
    gpu_blocks: int | None = None  # num_gpu_blocks
    kv_tokens: int | None = None  # kv_cache_size_tokens (per engine)
    prefix_caching: bool | None = None

    @property
    def kv_capacity_tokens(self) -> int | None:
        """Tokens of KV the replica holds: ``kv_cache_size_tokens``, else blocks × size."""
        if self.kv_tokens:
            return self.kv_tokens
        if self.gpu_blocks and self.block_size:
            return self.gpu_blocks * self.block_size
        return None


def _int(v: Any) -> int | None:
    try:
        n = int(str(v))
    except (TypeError, ValueError):
        return None
    return n if n > 0 else None


def cache_config_labels(text: str) -> dict[str, str] | None:
    """The labels of ``vllm:cache_config_info`` in a ``/metrics`` exposition (engine ``0``'s
    when several engines list one), or None when the replica exports none."""
    from prometheus_client.parser import text_string_to_metric_families

    found: list[dict[str, str]] = []
    try:
        for family in text_string_to_metric_families(text):
            if family.name != CACHE_INFO:
                continue
            found.extend(dict(s.labels) for s in family.samples)
    except (ValueError, TypeError, IndexError) as e:
        log.debug("malformed /metrics while looking for %s: %s", CACHE_INFO, e)
    if not found:
        return None
    return min(found, key=lambda d: d.get("engine", ""))


def replica_facts(
    replica: str, cards: Iterable[Mapping[str, Any]], labels: Mapping[str, str] | None
) -> ReplicaFacts:
    """Facts from a replica's model cards (its first) and cache-config labels."""
    card = next(iter(cards), None) or {}
    labels = labels or {}
    algo = labels.get("prefix_caching_hash_algo")
    pc = labels.get("enable_prefix_caching")
    return ReplicaFacts(
        replica=replica,
        model=str(card["id"]) if card.get("id") is not None else None,
        root=str(card["root"]) if card.get("root") else None,
        max_model_len=_int(card.get("max_model_len")),
        block_size=_int(labels.get("block_size")),
        hash_algo=algo if algo and algo != "None" else None,
        gpu_blocks=_int(labels.get("num_gpu_blocks")),
        kv_tokens=_int(labels.get("kv_cache_size_tokens")),
        prefix_caching=None if pc is None else pc.lower() == "true",
    )


def events_endpoint(replica_url: str, port: int) -> str:
    """``tcp://<host of replica_url>:<port>`` (IPv6 hosts in brackets)."""
    host = urlsplit(replica_url).hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def find_tokenizer(
    candidates: Iterable[str | None], hub_cache: str | Path | None = None
) -> tuple[str | None, str]:
    """The first candidate (a model card's ``root``, then its ``id``) that is a local model
    directory with a ``tokenizer.json``, else the first that the Hugging Face hub cache holds
    (``HF_HOME`` / ``HF_HUB_CACHE``, or ``hub_cache``; nothing is downloaded). Returns
    (directory, how it was found) or (None, why not)."""
    names = [c for c in dict.fromkeys(candidates) if c]
    for c in names:
        d = Path(c).expanduser()
        if d.is_dir() and (d / "tokenizer.json").is_file():
            return str(d), f"local directory {d}"
    for c in names:
        if not _REPO_ID.match(c):
            continue
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:  # pragma: no cover - huggingface_hub comes with tokenizers
            break
        try:
            hit = try_to_load_from_cache(repo_id=c, filename="tokenizer.json", cache_dir=hub_cache)
        except Exception as e:  # an id the hub library refuses: not a cached repo
            log.debug("hub cache lookup for %s failed: %s", c, e)
            continue
        if isinstance(hit, str):
            return str(Path(hit).parent), f"Hugging Face cache ({c})"
    return (
        None,
        f"no tokenizer.json for {names or ['(no model reported)']} locally or in the hub cache",
    )


def tokenize_request(route: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The body of a vLLM ``POST /tokenize`` that gives the token ids a call on ``route``
    prompts (chat fields as vLLM takes them; ``/v1/messages`` and ``/v1/responses`` as the chat
    body vLLM converts them to, :func:`router.vllm.prompt.chat_request` — without a
    local template, inline Anthropic system messages are sent unmerged and ``thinking:
    disabled`` as ``reasoning_effort: none``), or None (token-id prompts)."""
    from router.vllm.chat_template import ChatTemplateError
    from router.vllm.prompt import chat_request

    model = body.get("model")
    out: dict[str, Any] = {"model": model} if isinstance(model, str) else {}
    if route in ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses"):
        try:
            converted = chat_request(None, route, body)
        except ChatTemplateError:
            return None  # an input vLLM rejects too
        if converted is None:
            return None
        body = converted[0]
    if isinstance(body.get("messages"), list):
        out["messages"] = body["messages"]
        for k in ("tools", "add_generation_prompt", "continue_final_message",
                  "chat_template_kwargs", "reasoning_effort", "add_special_tokens"):  # fmt: skip
            if body.get(k) is not None:
                out[k] = body[k]
        return out
    if isinstance(body.get("prompt"), str):
        return {**out, "prompt": body["prompt"]}
    return None


@dataclass
class LayerStatus:
    """How fully the KV layer runs, and why not fully."""

    mode: str  # one of MODES
    reasons: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "reasons": list(self.reasons), **self.facts}

    def line(self) -> str:
        """One log line."""
        if self.mode == "full":
            shown = ", ".join(f"{k} {v}" for k, v in self.facts.items() if k != "event_streams")
            return f"KV layer: full ({shown})"
        return f"KV layer: {self.mode}: " + "; ".join(self.reasons or ["-"])


def no_layer_status(policy_reads_kv: bool) -> LayerStatus:
    """The status when no KV layer is installed: ``affinity`` when the policy would read one
    (``kv_cost`` routes as bounded-load session affinity without it), else ``off``."""
    if policy_reads_kv:
        return LayerStatus(
            "affinity",
            ["no KV layer: the policy's KV scorers route as session affinity "
             "(give --kv-events-port, or kv: settings)"],
        )  # fmt: skip
    return LayerStatus("off", ["the policy reads no KV state"])
