"""A model's tokenizer and chat template, loaded from the directory the replicas serve.

Owns: :class:`ModelTokenizer` — ``tokenizer.json`` (fast tokenizers only) plus the chat
template from ``tokenizer_config.json``, ``chat_template.jinja`` or ``chat_template.json``, and
the special tokens the template sees; rendering (:mod:`router.vllm.chat_template`) and
encoding as vLLM does (chat: ``add_special_tokens=False``; completions: ``True``). Must not
import transformers, torch or vllm (only ``tokenizers`` and ``jinja2``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from router.vllm.chat_template import (
    ChatTemplateError,
    compile_template,
    detect_content_format,
    normalize_messages,
    normalize_tools,
)


class TokenizerLoadError(ValueError):
    pass


# ---- tokenizer ------------------------------------------------------------------------------


def _special(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class ModelTokenizer:
    """A model's tokenizer and chat template, loaded from its directory."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        special_tokens: dict[str, str] | None = None,
    ):
        self.tok = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self._template = compile_template(chat_template) if chat_template else None
        self.content_format = detect_content_format(chat_template) if chat_template else "string"
        self.developer_ok = chat_template is not None and (
            '"developer"' in chat_template or "'developer'" in chat_template
        )
        probe = "kvroute probe"
        with_sp = tokenizer.encode(probe, add_special_tokens=True).ids
        without = tokenizer.encode(probe, add_special_tokens=False).ids
        for i in range(len(with_sp) - len(without) + 1):
            if with_sp[i : i + len(without)] == without:
                self.special_prefix = with_sp[:i]
                self.special_suffix = with_sp[i + len(without) :]
                break
        else:  # pragma: no cover - a post-processor that rewrites the body
            raise TokenizerLoadError("post-processor changes the body tokens; unsupported")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelTokenizer:
        from tokenizers import Tokenizer

        d = Path(model_dir)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerLoadError(
                f"no tokenizer.json in {d} (only fast tokenizers are supported)"
            )
        tok = Tokenizer.from_file(str(tj))
        cfg: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        elif template is None and (d / "chat_template.json").is_file():
            template = json.loads((d / "chat_template.json").read_text()).get("chat_template")
        specials = {}
        for k in (
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ):
            v = _special(cfg.get(k))
            if v is not None:
                specials[k] = v
        return cls(tok, template, specials)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text vLLM's chat endpoints build from ``messages``."""
        if self._template is None:
            raise ChatTemplateError("the model has no chat template")
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError(
                "add_generation_prompt and continue_final_message exclude each other"
            )
        conv = normalize_messages(messages, self.content_format, self.developer_ok)
        kw = {**self.special_tokens, **(chat_template_kwargs or {})}
        try:
            text = self._template.render(
                messages=conv,
                tools=normalize_tools(tools),
                add_generation_prompt=add_generation_prompt,
                **kw,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        if continue_final_message and conv:
            last = conv[-1]["content"]
            last_text = (
                last
                if isinstance(last, str)
                else "".join(p["text"] for p in last if isinstance(p, dict))
            )
            idx = text.rfind(last_text.strip())
            if idx >= 0:
                text = text[: idx + len(last_text.strip())]
        return text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_body(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Body tokens (no special tokens added) and each token's end char offset."""
        enc = self.tok.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        ends = np.fromiter((o[1] for o in enc.offsets), dtype=np.int64, count=len(ids))
        return ids, ends
