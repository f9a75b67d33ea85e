"""Prompt tokens and block keys as the replicas compute them — incrementally per session.

Owns: loading a model's tokenizer (``tokenizer.json``) and chat template (from
``tokenizer_config.json`` or ``chat_template.jinja``) out of the directory the replicas serve
(``--tokenizer DIR``); rendering chat messages as vLLM 0.32 does (its message normalization +
transformers' sandboxed jinja environment) and tokenizing the result as vLLM does (chat:
``add_special_tokens=False``; completions: ``True``); and a per-session cache that, for a
session's next call, reuses the tokens and chained block hashes of the longest text prefix
shared with its previous call and tokenizes only the new tail.

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

import copy
import json
import time
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.hashing import MASK64, BlockHasher

MARGIN = 8  # chars between the cut and the end of the shared text
CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM drops this system line


class TokenizerLoadError(ValueError):
    pass


class ChatTemplateError(ValueError):
    pass


# ---- chat template (as transformers compiles it for vLLM) --------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (as transformers does)."""

    tags = {"generation"}  # noqa: RUF012 - jinja's API

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def detect_content_format(source: str) -> str:
    """``"openai"`` when the template loops over a message's content parts, else ``"string"``
    (the rule vLLM's ``_detect_content_format`` applies, without its macro tracking)."""
    env = jinja2.Environment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    try:
        ast = env.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        if isinstance(it, jinja2.nodes.Name) and it.name == "content":
            return "openai"
        if (
            isinstance(it, jinja2.nodes.Getitem)
            and isinstance(it.arg, jinja2.nodes.Const)
            and it.arg.value == "content"
        ):
            return "openai"
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return "openai"
    return "string"


def _text_parts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ChatTemplateError(
            f"message content must be a string or a list, not {type(content).__name__}"
        )
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
            out.append(str(part.get("text", "")))
        elif isinstance(part, dict) and "text" in part and "type" not in part:
            out.append(str(part["text"]))
        # images/audio: the router cannot hash multimodal inputs; they are skipped here
    return out


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], content_format: str, developer_ok: bool
) -> list[dict[str, Any]]:
    """OpenAI chat messages to the conversation vLLM hands the template."""
    conv: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m:
            raise ChatTemplateError("each message needs a role")
        role = m["role"]
        texts = _text_parts(m.get("content"))
        if role == "system":
            kept = []
            for t in texts:
                if t.startswith(CLAUDE_CODE_BILLING_HEADER):
                    rest = t.partition("\n")[2]
                    if rest:
                        kept.append(rest)
                else:
                    kept.append(t)
            texts = kept
        msg: dict[str, Any] = {"role": role}
        if content_format == "openai":
            msg["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            msg["content"] = "\n".join(texts)
        if role == "assistant":
            calls = m.get("tool_calls")
            if isinstance(calls, list) and calls:
                msg["tool_calls"] = [_parse_call(c) for c in calls]
            if m.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        elif role == "tool":
            if "tool_call_id" in m:
                msg["tool_call_id"] = m["tool_call_id"]
            if isinstance(msg["content"], list):
                msg["content"] = "\n".join(texts)
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "developer":
            if developer_ok:
                msg["tools"] = m.get("tools")
            else:
                msg["role"] = "system"
        conv.append(msg)
    return conv


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as vLLM hands them to the template (``ChatCompletionToolsParam.model_dump()``:
    unknown keys dropped, ``description``/``parameters`` always present, ``strict`` and
    ``defer_loading`` only when set)."""
    if tools is None:
        return None
    out = []
    for t in tools:
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ChatTemplateError("each tool needs a function with a name")
        f: dict[str, Any] = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        defer = fn.get("defer_loading", t.get("defer_loading"))
        for k, v in (("strict", fn.get("strict")), ("defer_loading", defer)):
            if v is not None:
                f[k] = v
        tool: dict[str, Any] = {"type": t.get("type", "function"), "function": f}
        if t.get("defer_loading") is not None:
            tool["defer_loading"] = t["defer_loading"]
        out.append(tool)
    return out


def _parse_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ChatTemplateError("assistant tool_calls entries must be function objects")
    call = copy.deepcopy(call)
    args = call["function"].get("arguments")
    if args and isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = {}
        call["function"]["arguments"] = parsed if isinstance(parsed, dict) else {}
    elif not args:
        call["function"]["arguments"] = {}
    return call


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
    "ChatTemplateError",
    "ModelTokenizer",
    "SessionTokenizer",
    "TokenizedPrompt",
    "TokenizerLoadError",
    "common_prefix_len",
]
