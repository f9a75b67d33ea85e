"""Tokenization for the twin: the model dir's real tokenizer and chat template.

Owns: turning completion prompts and chat messages into the token ids a vLLM replica serving
the same model directory would compute (``tokenizers`` + jinja2, no ``transformers``), and
token ids back into text. Must not import aiohttp, zmq, torch or vllm.

vLLM behaviour mirrored (0.32.0, checked against the bed): completion prompts are encoded
with special tokens (the tokenizer's post-processor adds BOS); chat prompts are rendered with
the template (which writes ``bos_token`` itself) and encoded without special tokens. Templates
are compiled like Hugging Face does (sandboxed, ``trim_blocks`` and ``lstrip_blocks``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The chat template failed to render the given messages."""


def _raise(msg: str) -> None:
    raise TemplateError(msg)


def _tojson(x: Any, indent: int | None = None) -> str:
    return json.dumps(x, ensure_ascii=False, indent=indent)


class ModelTokenizer:
    """A model directory's tokenizer and chat template."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        d = Path(model_dir)
        if not (d / "tokenizer.json").exists():
            raise FileNotFoundError(f"no tokenizer.json in {d}")
        self.model_dir = d
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        model_cfg_path = d / "config.json"
        model_cfg = json.loads(model_cfg_path.read_text()) if model_cfg_path.exists() else {}
        self.bos_token = _tok_str(cfg.get("bos_token"))
        self.eos_token = _tok_str(cfg.get("eos_token"))
        self.max_position_embeddings = int(model_cfg.get("max_position_embeddings") or 0)
        self.vocab_size = self.tok.get_vocab_size()
        tpl = cfg.get("chat_template")
        if isinstance(tpl, list):  # named templates: take "default"
            tpl = next((t["template"] for t in tpl if t.get("name") == "default"), None)
        self.template = None
        if tpl:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            self.template = env.from_string(tpl)
        specials = set(self.tok.get_added_tokens_decoder())  # id -> AddedToken
        self._first_plain = max(specials, default=-1) + 1

    def encode(self, text: str) -> list[int]:
        """A completion prompt, with special tokens (BOS) as vLLM adds them."""
        return list(self.tok.encode(text, add_special_tokens=True).ids)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        if self.template is None:
            raise TemplateError("the model directory has no chat template")
        try:
            return self.template.render(
                messages=list(messages), tools=tools, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **kwargs,
            )  # fmt: skip
        except TemplateError:
            raise
        except Exception as e:
            raise TemplateError(f"chat template failed: {e}") from e

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        text = self.render_chat(messages, tools, add_generation_prompt)
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def plain_token(self, seed: int) -> int:
        """A non-special token id chosen by ``seed`` (the twin's stand-in for sampling)."""
        span = max(1, self.vocab_size - self._first_plain)
        return self._first_plain + seed % span


def _tok_str(t: Any) -> str:
    if isinstance(t, dict):
        return str(t.get("content", ""))
    return str(t or "")
