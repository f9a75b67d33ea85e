"""Tokenization for the twin: the model dir's real tokenizer and chat template.

Owns: the twin's adapter over :class:`router.kv.tokens.ModelTokenizer` — the router's own
vLLM-parity rendering (vLLM 0.32's message and tool normalization, transformers' sandboxed
jinja environment; checked against real vLLM's ``/tokenize`` in the vllm tier) — plus what
only a simulated replica needs: decoding its stand-in output tokens and picking them. Using
the router's code means the router, the twin and a real vLLM agree on every token id, so
their block hashes agree. Must not import aiohttp, zmq, torch or vllm.

vLLM behaviour mirrored (0.32.0, checked against the bed): completion prompts are encoded
with special tokens (the tokenizer's post-processor adds BOS); chat prompts are rendered with
the template (which writes ``bos_token`` itself) and encoded without special tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from router.kv.tokens import SessionTokenizer
from router.vllm.chat_template import ChatTemplateError
from router.vllm.hashing import BlockHasher
from router.vllm.prompt import request_prompt
from router.vllm.tokenizer import ModelTokenizer as RouterTokenizer
from router.vllm.tokenizer import TokenizerLoadError

PREFIX_KEY_CHARS = 512  # prompts without a session id share a cache entry by their head


class TemplateError(ValueError):
    """The chat request cannot be rendered (no template, bad messages, template error)."""


class ModelTokenizer:
    """A model directory's tokenizer and chat template, as a vLLM replica would use them.

    Prompts go through the router's :class:`router.kv.tokens.SessionTokenizer`: a session's
    next call re-tokenizes only its new tail (exact: it falls back to a full tokenization
    whenever reuse could differ). The key is the request's session id, else the first
    ``PREFIX_KEY_CHARS`` characters of the prompt. A 100k-token agent prompt costs ~0.25 s
    to tokenize from scratch — at ``--speedup`` 100 that alone would add 25 model seconds.
    """

    def __init__(self, model_dir: str | Path, block_size: int = 64):
        d = Path(model_dir)
        try:
            self.inner = RouterTokenizer.from_dir(d)
        except TokenizerLoadError as e:
            raise FileNotFoundError(str(e)) from e
        self.model_dir = d
        self.tok = self.inner.tok
        self.vocab_size = self.tok.get_vocab_size()
        specials = set(self.tok.get_added_tokens_decoder())  # id -> AddedToken
        self._first_plain = max(specials, default=-1) + 1
        self.sessions = SessionTokenizer(
            self.inner, BlockHasher(block_size), max_sessions=1024, max_tokens=8_000_000
        )

    def _tokens(self, text: str, session: str | None, special: bool) -> list[int]:
        key = (
            f"s:{session}" if session is not None else f"p:{int(special)}:{text[:PREFIX_KEY_CHARS]}"
        )
        return self.sessions.prompt(text, session=key, add_special_tokens=special).tokens()

    def encode(self, text: str, session: str | None = None) -> list[int]:
        """A completion prompt, with special tokens (BOS) as vLLM adds them."""
        return self._tokens(text, session, special=True)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        session: str | None = None,
    ) -> list[int]:
        """Chat ``messages`` (and ``tools``) as a chat request with vLLM's defaults."""
        body: dict[str, Any] = {"messages": messages}
        if tools is not None:
            body["tools"] = tools
        return self.encode_body(body, session)

    def encode_body(
        self,
        body: Mapping[str, Any],
        session: str | None = None,
        route: str = "/v1/chat/completions",
    ) -> list[int]:
        """A chat (``/v1/messages``, ``/v1/responses``) request body's prompt tokens, rendered
        as the router renders it (:func:`router.vllm.prompt.request_prompt`: the same
        fields, the same template, the same special-token rule)."""
        try:
            prompt = request_prompt(self.inner, route, body)
        except (ChatTemplateError, TypeError, KeyError, AttributeError) as e:
            raise TemplateError(str(e)) from e
        if prompt is None:
            raise TemplateError("the request has no messages")
        return self._tokens(prompt.text, session, special=prompt.add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=True))

    def plain_token(self, seed: int) -> int:
        """A non-special token id chosen by ``seed`` (the twin's stand-in for sampling)."""
        span = max(1, self.vocab_size - self._first_plain)
        return self._first_plain + seed % span
