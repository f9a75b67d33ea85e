"""A deterministic tiny Llama model, built locally (no model hub), for the test bed and the twin.

Owns: writing a complete Hugging Face model directory — ``config.json``, random
``model.safetensors``, a byte-level BPE ``tokenizer.json`` trained here on generated text, a
Llama-3-style chat template — that real vLLM serves and the router/twin tokenize with.

Everything is a pure function of :data:`SPEC` and the builder version: two machines build
byte-identical files, so block hashes computed anywhere agree. Weights are numpy (no torch).
Must not import torch, vllm or the router.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

BUILDER_VERSION = 1

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
SPECIAL_TOKENS = [BOS, EOS, START_HEADER, END_HEADER, EOT, "<|pad|>"]

# Llama-3-style template. Tools are rendered into the prompt so that, as with real agents,
# the tools+system prefix is part of what prefix caching shares across calls.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "<|start_header_id|>system<|end_header_id|>\n\nTools:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|eot_id|>"
    "{%- endif %}"
    "{%- for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- elif message['content'] is iterable %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{ part['text'] }}"
    "{%- endif %}{%- endfor %}"
    "{%- endif %}<|eot_id|>"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 16384
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    seed: int = 0


SPEC = TinySpec()

_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not "
    "which but all were when we there can more if will one about would their what so up out "
    "them into has time some could other than then now only its also two first new like "
    "because any these most made over did down way after well back use where just those "
    "session agent tool call cache block replica router prefill decode token request file "
    "function return value error test import class def self none true false string list dict "
    "read write edit search grep bash python rust memory latency throughput queue batch "
    "kernel model prompt context history subagent result output input system user assistant"
).split()
_CODE = [
    "def {w}({a}):\n    return {a} + {n}\n",
    "for {a} in range({n}):\n    {w}.append({a})\n",
    "if {w} is None:\n    raise ValueError('{w} missing')\n",
    "import {w}\nfrom {w}.{a} import {b}\n",
    "{w} = {{'{a}': {n}, '{b}': [{n}, {n}]}}\n",
    "class {W}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n",
    '{{"type": "tool_use", "name": "{w}", "input": {{"{a}": "{b}"}}}}\n',
]


def _corpus(n_docs: int = 6000, seed: int = 0) -> list[str]:
    """Generated English-ish prose and code, a pure function of ``seed``."""
    rng = random.Random(seed)
    docs = []
    for i in range(n_docs):
        if i % 3 == 0:
            tpl = rng.choice(_CODE)
            w, a, b = rng.choice(_WORDS), rng.choice(_WORDS), rng.choice(_WORDS)
            docs.append(tpl.format(w=w, W=w.capitalize(), a=a, b=b, n=rng.randint(0, 9999)))
        else:
            k = rng.randint(5, 40)
            words = [rng.choice(_WORDS) for _ in range(k)]
            if rng.random() < 0.3:
                words.insert(rng.randrange(k), str(rng.randint(0, 10**6)))
            docs.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ";"]))
    return docs


def build_tokenizer(spec: TinySpec = SPEC):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed=spec.seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def _weights(spec: TinySpec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    h, inter, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    head_dim = h // spec.num_attention_heads
    kv = spec.num_key_value_heads * head_dim

    def lin(out_f: int, in_f: int) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f)) * (1.0 / np.sqrt(in_f))).astype(np.float32)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": lin(v, h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = lin(h, h)
        w[p + "self_attn.k_proj.weight"] = lin(kv, h)
        w[p + "self_attn.v_proj.weight"] = lin(kv, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, h)
        w[p + "mlp.gate_proj.weight"] = lin(inter, h)
        w[p + "mlp.up_proj.weight"] = lin(inter, h)
        w[p + "mlp.down_proj.weight"] = lin(h, inter)
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    w["model.norm.weight"] = np.ones(h, np.float32)
    w["lm_head.weight"] = lin(v, h)
    return w


def _config(spec: TinySpec, tok) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(EOT)],
        "pad_token_id": tok.token_to_id("<|pad|>"),
        "kvroute_tiny": {"builder_version": BUILDER_VERSION, **asdict(spec)},
    }


def fingerprint(spec: TinySpec = SPEC) -> str:
    """Short key naming a build: changes whenever the spec or the builder changes."""
    blob = json.dumps({"v": BUILDER_VERSION, **asdict(spec)}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def build(out_dir: str | os.PathLike[str], spec: TinySpec = SPEC) -> Path:
    """Write the model directory at ``out_dir`` (atomically: built aside, then renamed)."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        tok = build_tokenizer(spec)
        tok.save(str(tmp / "tokenizer.json"))
        cfg = _config(spec, tok)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        (tmp / "generation_config.json").write_text(
            json.dumps(
                {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]},
                indent=2,
            )
        )
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": BOS,
                    "eos_token": EOT,
                    "pad_token": "<|pad|>",
                    "model_max_length": spec.max_position_embeddings,
                    "clean_up_tokenization_spaces": False,
                    "chat_template": CHAT_TEMPLATE,
                },
                indent=2,
                sort_keys=True,
            )
        )
        (tmp / "special_tokens_map.json").write_text(
            json.dumps({"bos_token": BOS, "eos_token": EOT, "pad_token": "<|pad|>"}, indent=2)
        )
        save_file(_weights(spec), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_dir() -> Path:
    cache = Path(os.environ.get("KVROUTE_CACHE", Path.home() / ".cache" / "kvroute"))
    return cache / "models" / f"kvroute-tiny-{fingerprint()}"


def ensure(path: str | os.PathLike[str] | None = None) -> Path:
    """The tiny model's directory, built on first use (``KVROUTE_MODEL`` overrides)."""
    p = Path(path or os.environ.get("KVROUTE_MODEL") or default_dir())
    if not (p / "model.safetensors").exists():
        build(p)
    return p
