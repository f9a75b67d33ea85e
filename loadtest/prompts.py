"""Exact-token prompts: each trace hash id becomes a deterministic block of text.

Owns: :class:`PromptBuilder`, which turns a trace call (its ``hash_ids`` and
``input_tokens``) into chat messages whose tokens — after the model's chat template — are
known exactly, so prefix sharing in the replay is exact at token level and the harness can
predict ``prompt_tokens`` and the unlimited-cache bound without asking the server.

How a block is made: the tokenizer's vocabulary is scanned for single-token ``" word"``
pieces (a space then ASCII letters, encoding to exactly one token on its own). A block of
``block_size`` tokens is ``block_size`` such words drawn by an RNG seeded with a digest of the
block's key, so two equal keys give equal text and unequal keys differ (collision odds
~``len(words) ** -block_size``). A byte-level BPE pre-tokenizer splits text before every
``" word"``, so no merge crosses words or blocks; every block is re-encoded once and checked.

Block keys: ``(namespace, hash_id, j)`` for the ``j``-th replica block of trace block
``hash_id``. The namespace is the session and play for session-local ids (WEKA), or the
trace and play for trace-wide ids (Mooncake), so a recycled play (``play`` > 0) never hits
the cache warmed by an earlier play. With ``shared_prefix``, the leading ``prefix_blocks``
ids of each call (the agent's tools+system prompt) use ``shared/<prefix_group>`` instead,
so every session of the same agent type shares that prefix.

Rescaling (trace block size ``B_t`` vs replica block size ``B_r``): each trace id becomes
``tokens_per_id`` tokens, a multiple of ``B_r``. The default ``tokens_per_id = B_t`` keeps
token counts (a 64-token WEKA block becomes two 32-token blocks); a smaller value (down to
``B_r``) shrinks every context by ``tokens_per_id / B_t`` while keeping the block structure:
which calls share which prefix, and for how many blocks, is unchanged. The content length of
a call is ``input_tokens * tokens_per_id / B_t`` rounded, kept within its last id's block; the
chat template adds a fixed header/footer around it (reported as ``template_tokens``).
``max_prompt_tokens`` truncates longer prompts from the end (prefixes survive).

Must not import the router (it runs in the replay client) or HTTP clients.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.traces.model import Call

SENTINEL = "\u2063KVROUTE-CONTENT\u2063"


class PromptError(ValueError):
    pass


@dataclass(frozen=True)
class Prompt:
    messages: list[dict[str, Any]]
    token_ids: list[int]  # what the server will tokenize the rendered chat into
    content_tokens: int

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def single_token_words(tokenizer: Any, limit: int = 4096) -> list[str]:
    """``" word"`` pieces of the vocabulary that encode to exactly one token each."""
    vocab = tokenizer.get_vocab()
    cands = sorted(
        t[1:] for t in vocab if t.startswith("\u0120") and t[1:].isascii() and t[1:].isalpha()
    )
    words = []
    for w in cands:
        if len(tokenizer.encode(" " + w, add_special_tokens=False).ids) == 1:
            words.append(" " + w)
            if len(words) >= limit:
                break
    return words


def load_tokenizer(model_dir: str | Path) -> tuple[Any, str | None, str | None]:
    """(tokenizers.Tokenizer, chat template, bos token) from a Hugging Face model folder."""
    from tokenizers import Tokenizer

    d = Path(model_dir)
    tj = d / "tokenizer.json"
    if not tj.exists():
        raise PromptError(f"{d}: no tokenizer.json")
    tok = Tokenizer.from_file(str(tj))
    template = bos = None
    cfg = d / "tokenizer_config.json"
    if cfg.exists():
        c = json.loads(cfg.read_text())
        template = c.get("chat_template")
        b = c.get("bos_token")
        bos = b.get("content") if isinstance(b, dict) else b
    return tok, template, bos


def render_chat(template: str, messages: list[dict[str, Any]], bos: str | None) -> str:
    """Render a chat template the way transformers does (sandboxed Jinja2, trim/lstrip)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    return env.from_string(template).render(
        messages=messages,
        bos_token=bos or "",
        eos_token="",
        add_generation_prompt=True,
        tools=None,
    )


class PromptBuilder:
    """Deterministic exact-token prompts for trace calls (see the module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        block_size: int,
        trace_block_size: int,
        tokens_per_id: int | None = None,
        shared_prefix: bool = False,
        max_prompt_tokens: int | None = None,
    ):
        self.tokenizer, template, bos = load_tokenizer(model_dir)
        self.block_size = block_size
        self.trace_block_size = trace_block_size
        tpi = trace_block_size if tokens_per_id is None else tokens_per_id
        if tpi <= 0 or tpi % block_size:
            raise PromptError(
                f"tokens_per_id={tpi} must be a positive multiple of the replica block size "
                f"{block_size}"
            )
        self.tokens_per_id = tpi
        self.blocks_per_id = tpi // block_size
        self.scale = tpi / trace_block_size
        self.shared_prefix = shared_prefix
        self.max_prompt_tokens = max_prompt_tokens
        self.words = single_token_words(self.tokenizer)
        if len(self.words) < 64:
            raise PromptError(
                f"tokenizer has only {len(self.words)} single-token ' word' pieces; need 64+"
            )
        self._blocks: dict[tuple[str, int, int], tuple[str, list[int]]] = {}
        if template is None:
            raise PromptError(f"{model_dir}: no chat_template in tokenizer_config.json")
        rendered = render_chat(template, [{"role": "user", "content": SENTINEL}], bos)
        head, sep, tail = rendered.partition(SENTINEL)
        if not sep:
            raise PromptError("chat template dropped the message content")
        self._head_ids = self.tokenizer.encode(head, add_special_tokens=False).ids
        self._tail_ids = self.tokenizer.encode(tail, add_special_tokens=False).ids
        self.template_tokens = len(self._head_ids) + len(self._tail_ids)

    # -- blocks -----------------------------------------------------------------------

    def block(self, namespace: str, hash_id: int, j: int = 0) -> tuple[str, list[int]]:
        """Text and token ids of replica block ``j`` of trace id ``hash_id``."""
        key = (namespace, hash_id, j)
        got = self._blocks.get(key)
        if got is not None:
            return got
        seed = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "big")
        rng = random.Random(seed)
        text = "".join(rng.choice(self.words) for _ in range(self.block_size))
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) != self.block_size:  # the property the whole harness relies on
            raise PromptError(f"block {key} encodes to {len(ids)} tokens, not {self.block_size}")
        self._blocks[key] = (text, ids)
        return text, ids

    def namespace(self, call: Call, index: int, session_ns: str, play: int) -> str:
        if self.shared_prefix and index < call.prefix_blocks:
            return f"shared/{call.prefix_group}"
        return f"{session_ns}#{play}"

    def content_tokens(self, call: Call) -> int:
        n = len(call.hash_ids)
        want = round(call.input_tokens * self.scale)
        lo, hi = (n - 1) * self.tokens_per_id + 1, n * self.tokens_per_id
        return min(max(want, lo), hi)

    # -- prompts ----------------------------------------------------------------------

    def build(self, call: Call, session_ns: str, play: int = 0) -> Prompt:
        """Messages for ``call`` and the exact token ids the server will see."""
        n_content = self.content_tokens(call)
        if self.max_prompt_tokens is not None:
            n_content = min(n_content, self.max_prompt_tokens - self.template_tokens)
            if n_content <= 0:
                raise PromptError(
                    f"max_prompt_tokens={self.max_prompt_tokens} leaves no room for content"
                )
        texts: list[str] = []
        ids: list[int] = list(self._head_ids)
        left = n_content
        for i, h in enumerate(call.hash_ids):
            ns = self.namespace(call, i, session_ns, play)
            for j in range(self.blocks_per_id):
                if left <= 0:
                    break
                text, bids = self.block(ns, h, j)
                if left >= self.block_size:
                    texts.append(text)
                    ids.extend(bids)
                    left -= self.block_size
                else:  # partial last block: whole words, one token each
                    words = self._split_words(text)[:left]
                    texts.append("".join(words))
                    ids.extend(bids[:left])
                    left = 0
            if left <= 0:
                break
        ids.extend(self._tail_ids)
        content = "".join(texts)
        return Prompt(
            messages=[{"role": "user", "content": content}], token_ids=ids, content_tokens=n_content
        )

    @staticmethod
    def _split_words(text: str) -> list[str]:
        return [" " + w for w in text.split(" ")[1:]]
