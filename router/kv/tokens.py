"""Prompt tokens and block keys as the replicas compute them — incrementally per session.

Owns: a per-session cache (:class:`SessionTokenizer`) that, for a session's next call,
reuses the tokens and chained block hashes of the longest text prefix shared with its
previous call and tokenizes only the new tail. Loading the tokenizer and rendering the chat
template as vLLM does live in :mod:`router.vllm.tokenizer`, :mod:`router.vllm.chat_template` and
:mod:`router.vllm.prompt`.

Must not import transformers, torch or vllm (only ``tokenizers`` and ``jinja2``).

Incremental tokenization is exact, not approximate. The cut is placed at a *pre-token
boundary* well inside the shared text: a position ``c`` with a plain space at ``text[c]``,
non-whitespace on both sides, ``c + MARGIN <= shared prefix length``, and a token boundary of
the previous call at ``c``. For the regex pre-tokenizers of byte-level BPE models (GPT-2,
Llama-3, Qwen: a space before a letter, digit or symbol always starts a new pre-token, and a
pre-token's BPE depends only on its own text) the tokens before ``c`` and the tokens of
``text[c:]`` tokenized alone are exactly the full tokenization. The tail's first tokens are
then checked against the previous call's tokens over the shared stretch; any mismatch (e.g. a
SentencePiece ``prepend_scheme`` tokenizer) falls back to full tokenization, so the result is
always the full tokenization — property-tested against it.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from router.vllm.hashing import MASK64, BlockHasher
from router.vllm.tokenizer import ModelTokenizer

MARGIN = 8  # chars between the cut and the end of the shared text

# ---- incremental, per session ---------------------------------------------------------------


class _Rope:
    """Token ids and their end offsets as a list of array chunks: a session's next call keeps
    a prefix by reference (numpy views) and appends its tail, with no copy of the history."""

    __slots__ = ("ends", "ids", "n", "starts")

    def __init__(self, ids: list[np.ndarray], ends: list[np.ndarray]):
        if len(ids) > 32:  # compact now and then: one copy every 32 calls
            ids, ends = [np.concatenate(ids)], [np.concatenate(ends)]
        self.ids, self.ends = ids, ends
        self.starts: list[int] = []
        n = 0
        for c in ids:
            self.starts.append(n)
            n += len(c)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def prefix(self, j: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        k = bisect_right(self.starts, j) - 1 if j < self.n else len(self.ids) - 1
        if k < 0:
            return [], []
        cut = j - self.starts[k]
        return [*self.ids[:k], self.ids[k][:cut]], [*self.ends[:k], self.ends[k][:cut]]

    def count_ends_le(self, c: int) -> int:
        """How many tokens end at or before char ``c`` (ends are non-decreasing)."""
        lasts = [int(e[-1]) if len(e) else -1 for e in self.ends]
        k = bisect_right(lasts, c)
        if k == len(self.ends):
            return self.n
        return self.starts[k] + int(np.searchsorted(self.ends[k], c, side="right"))

    def end_at(self, i: int) -> int:
        k = bisect_right(self.starts, i) - 1
        return int(self.ends[k][i - self.starts[k]])

    def window(self, j: int, m: int, which: str) -> np.ndarray:
        src = self.ids if which == "ids" else self.ends
        parts, i = [], j
        while i < min(j + m, self.n):
            k = bisect_right(self.starts, i) - 1
            off = i - self.starts[k]
            take = min(len(src[k]) - off, j + m - i)
            parts.append(src[k][off : off + take])
            i += take
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def array(self) -> np.ndarray:
        return np.concatenate(self.ids) if self.ids else np.zeros(0, dtype=np.int64)


class TokenizedPrompt:
    """A prompt's token ids and block keys; ``reused_tokens`` came from the session cache.

    ``token_ids`` is assembled on first use (the router itself needs only the keys and the
    count)."""

    __slots__ = ("_arr", "_parts", "keys", "n_tokens", "reused_tokens", "tokenize_s")

    def __init__(
        self,
        parts: list[np.ndarray],
        keys: list[int],
        reused_tokens: int = 0,
        tokenize_s: float = 0.0,
    ):
        self._parts = parts
        self._arr: np.ndarray | None = None
        self.n_tokens = sum(len(p) for p in parts)
        self.keys = keys
        self.reused_tokens = reused_tokens
        self.tokenize_s = tokenize_s

    @property
    def token_ids(self) -> np.ndarray:
        if self._arr is None:
            self._arr = np.concatenate(self._parts) if self._parts else np.zeros(0, dtype=np.int64)
        return self._arr

    def tokens(self) -> list[int]:
        return self.token_ids.tolist()


@dataclass(slots=True)
class _SessionEntry:
    text: str
    prefix: tuple[int, ...]
    body: _Rope  # body tokens and the end char offset of each
    digests: list[bytes]
    keys: list[int]
    salt_lora: tuple[Any, ...] = field(default=())


def common_prefix_len(a: str, b: str, chunk: int = 1 << 15) -> int:
    """Length of the longest common prefix of two strings (memcmp-speed in chunks)."""
    n = min(len(a), len(b))
    if b.startswith(a) if len(a) <= len(b) else a.startswith(b):  # no copies
        return n
    i = 0
    while i < n and a[i : i + chunk] == b[i : i + chunk]:
        i += chunk
    lo, hi = i, min(i + chunk, n)  # the first difference is in [lo, hi)
    while hi - lo > 64:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


def _is_space_boundary(text: str, c: int) -> bool:
    return (
        0 < c < len(text) - 1
        and text[c] == " "
        and not text[c - 1].isspace()
        and not text[c + 1].isspace()
    )


class SessionTokenizer:
    """Tokens + block keys per call, reusing each session's previous call.

    Bounded: keeps at most ``max_sessions`` sessions and ``max_tokens`` cached tokens in total
    (least recently used dropped first).
    """

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        hasher: BlockHasher,
        *,
        max_sessions: int = 4096,
        max_tokens: int = 16_000_000,
    ):
        self.tokenizer = tokenizer
        self.hasher = hasher
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self._sessions: OrderedDict[str, _SessionEntry] = OrderedDict()
        self._tokens = 0
        self.stats = {"calls": 0, "incremental": 0, "full": 0, "fallback": 0}

    def forget(self, session: str) -> None:
        e = self._sessions.pop(session, None)
        if e is not None:
            self._tokens -= len(e.body)

    def __len__(self) -> int:
        return len(self._sessions)

    def knows(self, session: str) -> bool:
        """Whether ``session``'s previous call is cached (its next call is incremental)."""
        return session in self._sessions

    def prompt(
        self,
        text: str,
        *,
        session: str | None = None,
        add_special_tokens: bool = False,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> TokenizedPrompt:
        """Tokens and block keys of ``text`` (a rendered chat prompt or a completion prompt)."""
        t0 = time.perf_counter()
        self.stats["calls"] += 1
        prefix = tuple(self.tokenizer.special_prefix) if add_special_tokens else ()
        suffix = list(self.tokenizer.special_suffix) if add_special_tokens else []
        tag = (add_special_tokens, cache_salt, lora)
        prev = self._sessions.get(session) if session is not None else None
        reused = 0
        body: _Rope | None = None
        keep_blocks = 0
        digests: list[bytes] = []
        keys: list[int] = []
        if prev is not None and prev.salt_lora == tag and prev.prefix == prefix:
            cut = self._reuse(prev, text)
            if cut is not None:
                j, tail_ids, tail_ends = cut
                ids_parts, ends_parts = prev.body.prefix(j)
                body = _Rope([*ids_parts, tail_ids], [*ends_parts, tail_ends])
                reused = j + len(prefix)
                keep_blocks = min(reused // self.hasher.block_size, len(prev.digests))
                digests = prev.digests[:keep_blocks]
                keys = prev.keys[:keep_blocks]
                self.stats["incremental"] += 1
            else:
                self.stats["fallback"] += 1
        if body is None:
            ids, ends = self.tokenizer.encode_body(text)
            body = _Rope([ids], [ends])
            self.stats["full"] += 1
        parts = list(body.ids)
        if prefix:
            parts.insert(0, np.asarray(prefix, dtype=np.int64))
        if suffix:
            parts.append(np.asarray(suffix, dtype=np.int64))
        bs = self.hasher.block_size
        start = keep_blocks * bs
        # the tokens from the first block to (re)hash on: only the tail of the parts
        need, acc = [], 0
        for p in reversed(parts):
            need.append(p)
            acc += len(p)
            if acc >= sum(len(q) for q in parts) - start:
                break
        total = sum(len(q) for q in parts)
        tail_tokens = (
            np.concatenate(need[::-1])[-(total - start) :]
            if total > start
            else np.zeros(0, dtype=np.int64)
        )
        new_digests = self.hasher.hash_blocks(
            tail_tokens.tolist(),
            parent=digests[-1] if digests else None,
            start_block=keep_blocks,
            cache_salt=cache_salt,
            lora=lora,
        )
        digests = digests + new_digests
        keys = keys + [int.from_bytes(d, "big") & MASK64 for d in new_digests]
        if session is not None:
            self._remember(session, _SessionEntry(text, prefix, body, digests, keys, tag))
        return TokenizedPrompt(parts, keys, reused, time.perf_counter() - t0)

    def _reuse(self, prev: _SessionEntry, text: str) -> tuple[int, np.ndarray, np.ndarray] | None:
        """(tokens kept, tail ids, tail ends) or ``None`` when nothing safe can be reused."""
        shared = common_prefix_len(prev.text, text)
        limit = shared - MARGIN
        body = prev.body
        if limit <= 0 or len(body) == 0:
            return None
        # walk back over spaces to one that is a pre-token boundary and a token boundary
        j = 0
        c = prev.text.rfind(" ", 0, limit + 1)
        while c > 0:
            if _is_space_boundary(prev.text, c):
                j = body.count_ends_le(c)
                if j > 0 and body.end_at(j - 1) == c:
                    break
            c = prev.text.rfind(" ", 0, c)
        if c <= 0:
            return None
        tail_ids, tail_ends = self.tokenizer.encode_body(text[c:])
        tail_ends = tail_ends + c
        # check: over the shared stretch the tail agrees with the previous call's tokens
        m = min(body.count_ends_le(limit) - j, len(tail_ids))
        if m > 0 and not (
            np.array_equal(tail_ids[:m], body.window(j, m, "ids"))
            and np.array_equal(tail_ends[:m], body.window(j, m, "ends"))
        ):
            return None
        return j, tail_ids, tail_ends

    def _remember(self, session: str, e: _SessionEntry) -> None:
        old = self._sessions.pop(session, None)
        if old is not None:
            self._tokens -= len(old.body)
        self._sessions[session] = e
        self._tokens += len(e.body)
        while self._sessions and (
            len(self._sessions) > self.max_sessions or self._tokens > self.max_tokens
        ):
            _, dropped = self._sessions.popitem(last=False)
            self._tokens -= len(dropped.body)


__all__ = [
    "SessionTokenizer",
    "TokenizedPrompt",
    "common_prefix_len",
]


# ---- long encodes in a worker process ----------------------------------------------------------

_WORKER: ModelTokenizer | None = None


def _worker_init(tokenizer_json: str) -> None:
    global _WORKER
    from tokenizers import Tokenizer

    _WORKER = ModelTokenizer(Tokenizer.from_str(tokenizer_json), None)


def _worker_encode(text: str) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER is not None
    return _WORKER.encode_body(text)


class ProcessEncoder:
    """A :class:`router.vllm.tokenizer.ModelTokenizer` whose ``encode_body`` of long texts
    runs in one worker process (``spawn``; the tokenizer travels as its JSON).

    Why: the Hugging Face ``encode`` and the conversion of its ids and offsets to Python hold
    the GIL for tens of milliseconds at a time on a 100k-token text, so even on a separate
    thread a cold prompt stalls the event loop (measured: docs/reliability.md). In a process
    the caller's thread only waits (GIL released). Texts under ``min_chars`` are encoded in
    place (the round trip would cost more). Everything else is the wrapped tokenizer's."""

    def __init__(self, inner: ModelTokenizer, min_chars: int = 20_000):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.inner = inner
        self.min_chars = min_chars
        self.pool = ProcessPoolExecutor(
            1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
            initargs=(inner.tok.to_str(),),
        )

    def encode_body(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        if len(text) < self.min_chars:
            return self.inner.encode_body(text)
        return self.pool.submit(_worker_encode, text).result()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
