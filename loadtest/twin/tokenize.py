"""Tokenization for the twin: the model dir's real tokenizer and chat template.

Owns: the twin's adapter over :class:`router.tokens.ModelTokenizer` — the router's own
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

from router.hashing import BlockHasher
from router.tokens import ChatTemplateError, SessionTokenizer, TokenizerLoadError
from router.tokens import ModelTokenizer as RouterTokenizer

PREFIX_KEY_CHARS = 512  # prompts without a session id share a cache entry by their head


class TemplateError(ValueError):
    """The chat request cannot be rendered (no template, bad messages, template error)."""


class ModelTokenizer:
    """A model directory's tokenizer and chat template, as a vLLM replica would use them.

    Prompts go through the router's :class:`router.tokens.SessionTokenizer`: a session's
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
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        session: str | None = None,
    ) -> list[int]:
        try:
            text = self.inner.render(
                messages, tools=tools, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )  # fmt: skip
        except (ChatTemplateError, TypeError, KeyError, AttributeError) as e:
            raise TemplateError(str(e)) from e
        return self._tokens(text, session, special=False)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=True))

    def plain_token(self, seed: int) -> int:
        """A non-special token id chosen by ``seed`` (the twin's stand-in for sampling)."""
        span = max(1, self.vocab_size - self._first_plain)
        return self._first_plain + seed % span
