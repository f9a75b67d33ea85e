"""A Llama-shaped transformer with random weights, and its engine-step times (GPU; CPU dry-run).

``python -m loadtest.gpu_check.model --out DIR [--dry-run] [--budget-s S]`` writes
``DIR/raw.json``: one record per measured step (rewritten after every point, so a run cut
short keeps what it measured). Only torch is needed (no vLLM, no transformers, no index).

**The model** (:class:`Llama`): RMSNorm, one fused QKV projection, RoPE, the step's new K/V
written into a contiguous per-layer KV cache ``[batch, kv_heads, context, head_dim]``,
attention through ``torch.nn.functional.scaled_dot_product_attention`` (FlashAttention on
CUDA), the output projection, a SwiGLU MLP with a fused gate/up projection, and the LM head
on each sequence's last token only (as vLLM computes logits), then a greedy pick. Weights are
random normals (timing does not depend on their values; zeros would, through the tensor
cores' power draw). Hand-written rather than ``transformers``' ``LlamaForCausalLM`` so the
cache is preallocated at exactly the step's context, the LM head runs on the last token only,
and a decode or short prefill step can be captured in one CUDA graph (vLLM's decode path).

**A step** is what one vLLM engine step runs: ``new`` prefill tokens of one request on top of
``prefix`` cached tokens (attention lower-right causal over ``prefix + new``), ``decodes``
requests of one token each over ``context`` cached tokens, or both in one forward (a mixed
step: one pass through the linear layers over all tokens, the two attentions one after the
other, as vLLM's chunked prefill does). The record carries the truth's step inputs
(``pf_tokens``, ``pf_attended``, ``pf_kv``, ``decodes``, ``dc_kv``; ``pf_attended`` =
``new·(prefix + (new+1)/2)``, the twin engine's definition).

**Timing**: CUDA events around the step; a step whose first (eager) run takes < 50 ms is
captured in a CUDA graph and replayed (launch gaps would otherwise dominate it; vLLM replays
graphs for decode and small batches), longer ones run eagerly. Each point takes the median of
3–20 runs (about 0.3 s of GPU time per point). The dry run (``--dry-run``): tiny shapes on the
CPU in fp32 on one thread with ``time.perf_counter``, the fastest of 3–5 runs (a shared CPU's
spikes) — it checks the plumbing, the attention paths and the fit; its times mean nothing.

**Attention paths** are checked against a plain fp32 reference on small shapes before any
timing, with SDPA limited to its fused kernels on CUDA (no silent math backend): prefill
uses ``causal_lower_right`` with ``enable_gqa`` (FlashAttention's own bottom-right causal),
falling back to K/V expanded to every query head; decode views the
query heads of one KV head as a short query sequence (``[B, Hk, H/Hk, D]``), which every
SDPA backend runs with no mask.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

GRAPH_BELOW_S = 0.05  # eager first run shorter than this: capture a CUDA graph


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped model (the ``model`` of a costmodel profile, plus what it omits)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 500000.0
    profile: str = ""  # the costmodel profile whose model this is (the fit's reference)

    @property
    def params(self) -> int:
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        per_layer = (
            qkv + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate
        )
        return self.layers * per_layer + 2 * self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # bf16


# Llama-3-8B's shape: costmodel's h200-8b profile (8.03e9 parameters, bf16 weights and KV).
LLAMA_8B = Shape("llama-3-8b-shape", 32, 4096, 32, 8, 128, 14336, 128256, profile="h200-8b")
# The dry run's: a few ms per step on a CPU core.
TINY = Shape("tiny-llama-shape", 2, 64, 4, 2, 16, 128, 256, rope_theta=10000.0)


class Llama:
    """The forward pass of one engine step (see the module docstring). No autograd."""

    def __init__(self, shape: Shape, device: str, dtype: torch.dtype, seed: int = 0):
        self.shape = s = shape
        gen = torch.Generator(device=device).manual_seed(seed)

        def w(*dims: int) -> torch.Tensor:
            t = torch.empty(*dims, device=device, dtype=dtype)
            return t.normal_(0.0, 0.02, generator=gen)

        self.embed = w(s.vocab, s.hidden)
        self.lm_head = w(s.vocab, s.hidden)
        self.final_norm = torch.ones(s.hidden, device=device, dtype=dtype)
        qkv_out = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.layers_w = [
            {
                "norm1": torch.ones(s.hidden, device=device, dtype=dtype),
                "qkv": w(qkv_out, s.hidden),
                "o": w(s.hidden, s.heads * s.head_dim),
                "norm2": torch.ones(s.hidden, device=device, dtype=dtype),
                "gate_up": w(2 * s.intermediate, s.hidden),
                "down": w(s.hidden, s.intermediate),
            }
            for _ in range(s.layers)
        ]
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, device=device) / s.head_dim))
        self.inv_freq = inv.float()
        self.device, self.dtype = device, dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] in the model's dtype for these positions (as transformers'
        Llama computes them: both halves share a frequency)."""
        f = torch.outer(positions.float(), self.inv_freq)
        f = torch.cat([f, f], dim=-1).unsqueeze(1)
        return f.cos().to(self.dtype), f.sin().to(self.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, heads, D] (NeoX halves), cos/sin [T, 1, D]: x·cos + rotate_half(x)·sin
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def __call__(self, step: StepInputs) -> torch.Tensor:
        s = self.shape
        x = self.embed[step.tokens]  # [T, hidden]; T = new + decodes
        residual = x
        n_pf = step.new
        for li, lw in enumerate(self.layers_w):
            h = _rms_norm(residual, lw["norm1"])
            qkv = F.linear(h, lw["qkv"])
            q, k, v = qkv.split(
                [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1
            )
            q = self._rotate(q.view(-1, s.heads, s.head_dim), step.cos, step.sin)
            k = self._rotate(k.view(-1, s.kv_heads, s.head_dim), step.cos, step.sin)
            v = v.view(-1, s.kv_heads, s.head_dim)
            outs = []
            if n_pf:
                kc, vc = step.pf_cache[li]  # [1, Hk, prefix + new, D]
                kc[0, :, step.prefix :].copy_(k[:n_pf].transpose(0, 1))
                vc[0, :, step.prefix :].copy_(v[:n_pf].transpose(0, 1))
                qp = q[:n_pf].transpose(0, 1).unsqueeze(0)  # [1, H, new, D]
                outs.append(step.prefill_attn(qp, kc, vc)[0].transpose(0, 1).reshape(n_pf, -1))
            if step.decodes:
                kc, vc = step.dc_cache[li]  # [B, Hk, context + 1, D]
                kc[:, :, step.context].copy_(k[n_pf:])
                vc[:, :, step.context].copy_(v[n_pf:])
                outs.append(decode_attention(q[n_pf:], kc, vc))
            attn = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
            residual = residual + F.linear(attn, lw["o"])
            h = _rms_norm(residual, lw["norm2"])
            gate, up = F.linear(h, lw["gate_up"]).chunk(2, dim=-1)
            residual = residual + F.linear(F.silu(gate) * up, lw["down"])
        last = residual[step.last_rows]  # each sequence's last token
        logits = F.linear(_rms_norm(last, self.final_norm), self.lm_head)
        return logits.float().argmax(dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


# ---- attention paths ---------------------------------------------------------------------------


def prefill_attention_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [1, H, new, D] over k, v [1, Hk, prefix + new, D], lower-right causal, GQA in SDPA."""
    from torch.nn.attention.bias import causal_lower_right

    n, t = q.shape[2], k.shape[2]
    if n == t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(n, t), enable_gqa=True
    )


def prefill_attention_expand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same, K/V expanded to every query head (for a torch whose SDPA lacks GQA)."""
    from torch.nn.attention.bias import causal_lower_right

    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    n, t = q.shape[2], k.shape[2]
    if n == t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, t))


PREFILL_PATHS: dict[str, Callable[..., torch.Tensor]] = {
    "sdpa_lower_right_gqa": prefill_attention_gqa,
    "sdpa_lower_right_expanded_kv": prefill_attention_expand,
}


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, H, D] (one token each) over k, v [B, Hk, L, D] -> [B, H·D]. The G = H/Hk query
    heads of one KV head form a G-long query sequence: plain MHA over Hk heads, no mask."""
    b, h, d = q.shape
    hk = k.shape[1]
    out = F.scaled_dot_product_attention(q.view(b, hk, h // hk, d), k, v)
    return out.reshape(b, h * d)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32, explicit: q [B, H, n, D] over k, v [B, Hk, t, D], query i at position t - n + i."""
    g = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(g, dim=1)
    v = v.float().repeat_interleave(g, dim=1)
    n, t = q.shape[2], k.shape[2]
    scores = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    qpos = torch.arange(n, device=q.device).unsqueeze(1) + (t - n)
    mask = torch.arange(t, device=q.device).unsqueeze(0) <= qpos
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def check_attention(device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Each path against :func:`reference_attention` on small GQA shapes; picks the first
    prefill path that agrees. Raises if none does, or if decode disagrees."""
    torch.manual_seed(0)
    h, hk, d = 8, 2, 64
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    report: dict[str, Any] = {"prefill": {}, "prefill_path": None}
    for name, fn in PREFILL_PATHS.items():
        errs = []
        try:
            for n, t in ((5, 5), (7, 40), (64, 200)):
                q = torch.randn(1, h, n, d, device=device).to(dtype)
                k = torch.randn(1, hk, t, d, device=device).to(dtype)
                v = torch.randn(1, hk, t, d, device=device).to(dtype)
                err = (fn(q, k, v).float() - reference_attention(q, k, v)).abs().max().item()
                errs.append(err)
            ok = max(errs) <= tol
            report["prefill"][name] = {"max_abs_err": max(errs), "ok": ok}
        except Exception as exc:  # a torch without enable_gqa / lower-right support
            report["prefill"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300], "ok": False}
            continue
        if ok and report["prefill_path"] is None:
            report["prefill_path"] = name
    q = torch.randn(3, h, d, device=device).to(dtype)
    k = torch.randn(3, hk, 50, d, device=device).to(dtype)
    v = torch.randn(3, hk, 50, d, device=device).to(dtype)
    ref = reference_attention(q.unsqueeze(2), k, v).squeeze(2).reshape(3, h * d)
    err = (decode_attention(q, k, v).float() - ref).abs().max().item()
    report["decode"] = {"max_abs_err": err, "ok": err <= tol}
    if report["prefill_path"] is None or not report["decode"]["ok"]:
        raise RuntimeError(f"no attention path agrees with the reference: {report}")
    return report


# ---- steps and their timing --------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One step to measure."""

    kind: str  # prefill | decode | mixed
    new: int = 0  # prefill tokens (one request)
    prefix: int = 0  # its cached tokens
    decodes: int = 0  # decoding requests
    context: int = 0  # each decoder's cached tokens

    def truth_inputs(self) -> dict[str, float]:
        """The arguments of ``StepTiming.step`` for this step."""
        att = self.new * (self.prefix + (self.new + 1) / 2.0) if self.new else 0.0
        return {
            "pf_tokens": float(self.new),
            "pf_attended": att,
            "pf_kv": float(self.prefix) if self.new else 0.0,
            "decodes": self.decodes,
            "dc_kv": float(self.decodes * self.context),
        }

    def kv_tokens(self) -> int:
        return (self.prefix + self.new) + self.decodes * (self.context + 1)


class StepInputs:
    """Static tensors of one step (so a CUDA graph can replay it)."""

    def __init__(self, model: Llama, p: Point, prefill_attn: Callable[..., torch.Tensor]):
        s, dev, dt = model.shape, model.device, model.dtype
        self.new, self.prefix, self.decodes, self.context = p.new, p.prefix, p.decodes, p.context
        self.prefill_attn = prefill_attn
        t = p.new + p.decodes
        self.tokens = torch.randint(0, s.vocab, (t,), device=dev)
        pos = [torch.arange(p.prefix, p.prefix + p.new, device=dev)] if p.new else []
        if p.decodes:
            pos.append(torch.full((p.decodes,), p.context, device=dev))
        self.cos, self.sin = model.rope(torch.cat(pos))
        rows = ([p.new - 1] if p.new else []) + [p.new + i for i in range(p.decodes)]
        self.last_rows = torch.tensor(rows, device=dev)

        def cache(b: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            def one() -> torch.Tensor:
                return torch.empty(
                    b, s.kv_heads, length, s.head_dim, device=dev, dtype=dt
                ).normal_()

            return [(one(), one()) for _ in range(s.layers)]

        self.pf_cache = cache(1, p.prefix + p.new) if p.new else []
        self.dc_cache = cache(p.decodes, p.context + 1) if p.decodes else []


class Timer:
    """Median seconds of a step: CUDA events (and a graph for short steps) on a GPU, the
    wall clock on a CPU."""

    def __init__(self, device: str, target_s: float = 0.3, max_reps: int = 20):
        self.cuda = device.startswith("cuda")
        self.target_s, self.max_reps = target_s, max_reps

    def _eager(self, fn: Callable[[], Any], reps: int) -> list[float]:
        out = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return out

    def measure(self, fn: Callable[[], Any]) -> dict[str, Any]:
        first = self._eager(fn, 1)[0]  # warm-up (allocations, kernel selection)
        if first < 0.2:
            first = min(first, self._eager(fn, 1)[0])
        reps = max(3, min(self.max_reps, math.ceil(self.target_s / max(first, 1e-6))))
        rec: dict[str, Any] = {"graph": False}
        times: list[float] | None = None
        if self.cuda and first < GRAPH_BELOW_S:
            try:
                times = self._graph(fn, reps)
                rec["graph"] = True
            except Exception as exc:  # capture unsupported here: eager timing, said so
                rec["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
        if times is None:
            times = self._eager(fn, reps)
        rec.update(
            # a GPU's spread is small: the median; a shared CPU's (the dry run) is not: the min
            s=statistics.median(times) if self.cuda else min(times),
            min_s=min(times),
            max_s=max(times),
            reps=len(times),
            first_eager_s=first,
        )
        return rec

    def _graph(self, fn: Callable[[], Any], reps: int) -> list[float]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        try:
            return self._eager(graph.replay, reps)
        finally:
            del graph


# prefill contexts (cached prefix + new tokens), in k tokens: 1k-128k
CONTEXTS_K = (1, 2, 4, 8, 16, 32, 64, 128)
# decode (batch, context in k tokens): at most 256k cached tokens (32 GiB of bf16 KV)
DECODE_GRID = tuple(
    [(b, c) for b in (1, 4, 16, 64, 256) for c in (1, 4, 16, 64, 128) if b * c <= 256] + [(128, 2)]
)


def grid(dry: bool) -> list[Point]:
    """The points; the cheap ones of every kind first, so a run cut short keeps a spread."""
    k = 1024
    if dry:
        pts = [Point("prefill", n, c - n) for n in (8, 32, 96) for c in (32, 128, 256) if c >= n]
        pts += [Point("decode", decodes=b, context=c) for b in (1, 4, 16) for c in (32, 256)]
        pts += [Point("mixed", 32, 64, 4, 128), Point("mixed", 96, 64, 8, 64)]
        pts += [Point("decode", decodes=4, context=128), Point("decode", decodes=8, context=64)]
        pts += [Point("prefill", 32, 64), Point("prefill", 96, 64)]
        return pts
    pts = [Point("decode", decodes=b, context=c * k) for b, c in DECODE_GRID]
    pts += [Point("prefill", 128, p) for p in (0, 4 * k, 32 * k, 128 * k - 128)]
    pts += [Point("prefill", n, c * k - n) for n in (512, 2 * k) for c in CONTEXTS_K if c * k > n]
    # mixed: a chunk beside decoders, and each half alone (what mixing adds)
    for n in (512, 2 * k):
        pts += [Point("mixed", n, 4 * k, d, 8 * k) for d in (8, 32)]
        pts.append(Point("prefill", n, 4 * k))
    pts += [Point("decode", decodes=d, context=8 * k) for d in (8, 32)]
    # the long ones last: 8k chunks up to 128k of context, one cold 16k prefill
    pts += [Point("prefill", 8 * k, c * k - 8 * k) for c in CONTEXTS_K if c >= 8]
    pts.append(Point("prefill", 16 * k, 0))
    return pts


def _device_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=torch.cuda.get_device_name(0),
            memory_gib=round(props.total_memory / 2**30, 1),
            sms=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
    else:
        info["device"] = f"cpu ({platform.processor() or platform.machine()}), dry run"
    return info


def ceilings(device: str, dtype: torch.dtype, timer: Timer, dry: bool) -> dict[str, Any]:
    """What this device reaches on one big GEMM and one big copy (for the summary)."""
    n = 256 if dry else 8192
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    gemm = timer.measure(lambda: a @ b)
    size = (1 << 20) if dry else (2 << 30)
    x = torch.empty(size // 2, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy = timer.measure(lambda: y.copy_(x))
    return {
        "gemm_tflops": round(2 * n**3 / gemm["s"] / 1e12, 2),
        "gemm_shape": n,
        "copy_gbps": round(2 * size / copy["s"] / 1e9, 1),  # read + write
        "copy_bytes": size,
    }


def host_link(device: str, dry: bool) -> list[dict[str, Any]]:
    """Pinned host -> device copies: ``k`` separate copies of ``s`` bytes each (one per
    KV block and layer, as a tier load issues them), timed with one sync at the end."""
    sizes: tuple[int, ...]
    if not device.startswith("cuda"):
        sizes, counts = (4096, 65536), (4, 16)
        pin = False
    else:
        sizes, counts = (4096, 16384, 65536, 262144, 1 << 20), (32, 256)
        pin = True
    rows = []
    for s in sizes:
        for k in counts:
            src = torch.empty(k, s, dtype=torch.uint8, pin_memory=pin)
            dst = torch.empty(k, s, dtype=torch.uint8, device=device)
            times = []
            for _ in range(5):
                if pin:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(k):
                    dst[i].copy_(src[i], non_blocking=pin)
                if pin:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            rows.append({"bytes": s, "copies": k, "s": statistics.median(times[1:])})
    return rows


def run(out: Path, dry: bool, budget_s: float, shape: Shape | None = None) -> dict[str, Any]:
    t_start = time.time()
    device = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        raise SystemExit("gpu_check.model: no CUDA device (use --dry-run on a CPU)")
    # bf16 on the GPU; the dry run's CPU runs fp32 (oneDNN builds a bf16 kernel per new shape)
    # on one thread (a shared CPU's spinning OpenMP barriers made tiny steps 1000x slower)
    dtype = torch.float32 if dry else torch.bfloat16
    if dry:
        torch.set_num_threads(1)
    shape = shape or (TINY if dry else LLAMA_8B)
    torch.manual_seed(0)
    raw: dict[str, Any] = {
        "format": 1,
        "dry_run": dry,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": _device_info(device),
        "shape": asdict(shape) | {"params": shape.params},
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache": "contiguous [batch, kv_heads, context, head_dim] per layer, bf16",
        "points": [],
        "skipped": [],
    }
    path = out / "raw.json"
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        raw["seconds"] = round(time.time() - t_start, 1)
        path.write_text(json.dumps(raw, indent=1))

    with _fused_attention_only(device):  # a step never silently falls to the math backend
        _measure(raw, device, dtype, shape, dry, budget_s, t_start, save)
    save()
    return raw


def _measure(
    raw: dict[str, Any],
    device: str,
    dtype: torch.dtype,
    shape: Shape,
    dry: bool,
    budget_s: float,
    t_start: float,
    save: Callable[[], None],
) -> None:
    raw["attention_check"] = check_attention(device, dtype)
    attn = PREFILL_PATHS[raw["attention_check"]["prefill_path"]]
    timer = Timer(device, target_s=0.005, max_reps=5) if dry else Timer(device)
    model = Llama(shape, device, dtype)
    raw["ceilings"] = ceilings(device, dtype, timer, dry)
    raw["host_link"] = host_link(device, dry)
    save()
    with torch.inference_mode():
        for p in grid(dry):
            left = budget_s - (time.time() - t_start)
            if left < 5.0:
                raw["skipped"].append(asdict(p) | {"why": "budget"})
                continue
            rec: dict[str, Any] = asdict(p) | {"inputs": p.truth_inputs()}
            try:
                rec.update(timer.measure(functools.partial(model, StepInputs(model, p, attn))))
            except Exception as exc:  # out of memory, an unsupported shape: said, and on
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            raw["points"].append(rec)
            save()


def _fused_attention_only(device: str) -> contextlib.AbstractContextManager[Any]:
    """On CUDA, SDPA limited to its fused kernels (FlashAttention, memory-efficient, cuDNN):
    a path that would need the math backend (a materialised mask, ~100 GB at 8k x 128k)
    fails the attention check instead and the next path is taken."""
    if not device.startswith("cuda"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
    return sdpa_kernel([getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)])


def _iter_lines(raw: dict[str, Any]) -> Iterator[str]:
    for r in raw["points"]:
        what = (
            f"{r['kind']:7s} new={r['new']:>6} prefix={r['prefix']:>6} "
            f"B={r['decodes']:>3} ctx={r['context']:>6}"
        )
        yield f"{what}  " + (f"{r['s'] * 1e3:9.2f} ms" if "s" in r else r.get("error", "?"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop measuring after this")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    raw = run(Path(args.out), args.dry_run, args.budget_s)
    if not args.quiet:
        for line in _iter_lines(raw):
            print(line)
    print(
        f"gpu_check.model: {len(raw['points'])} points, {len(raw['skipped'])} skipped, "
        f"{raw['seconds']} s -> {Path(args.out) / 'raw.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
