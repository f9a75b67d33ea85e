"""Fitting a twin truth to measured step times (no torch; numpy, and scipy where installed).

:func:`fit_truth` takes ``raw.json`` (:mod:`loadtest.gpu_check.model`) and returns the
measured truth's file contents (the format :func:`loadtest.twin.truth.load_measured` reads):
the figures of :class:`loadtest.twin.truth.Truth` that make
:class:`~loadtest.twin.truth.TruthTiming`, on a *reference profile* of the measured model and
device, reproduce the measured step times — least squares on ``log(fitted / measured)`` (each
step's relative error counts the same, 5 ms decodes as much as 2 s prefills).

**Fitted** (from the step times): ``gemm`` and ``attn`` (the linear layers' and prefill
attention's MFU, as multiples of the profile's ``prefill_mfu``), ``hbm`` (HBM efficiency ×
the profile's), ``sharpness`` (the smooth roofline's p), ``interference`` (only when mixed
steps were measured), the forward pass's fixed cost per step and ``per_seq_s``. **Fitted**
(from the pinned host -> device copies): ``link_bw``, ``link_latency``, ``link_half_bytes``
(``t = latency + copies · (bytes + half) / bw``, linear least squares).

**Not measured** (said so in the file's ``assumed``): the engine's own per-step cost outside
the forward pass (scheduler, sampling, detokenizing, process hops; ``--engine-overhead-ms``,
added to the forward's fixed cost to make ``overhead``), and the tensor-parallel all-reduce
(one GPU: ``allreduce`` and ``interconnect`` stay 1, the profile's figures).

**The reference profile** is costmodel's profile of the measured model (``h200-8b`` for the
Llama-3-8B shape) with the device's data-sheet figures (:data:`DEVICES`), so the multipliers
are in the same units as the profiles the twins run (``prefill_mfu`` 0.45, ``hbm_efficiency``
0.85, ``step_overhead_s`` 4 ms, host link 50 GB/s and 50 µs) and carry over to them. The
profile gives units only: no figure of the fit comes from costmodel's formulas.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from costmodel.profiles import HardwareProfile, ModelProfile, ReplicaProfile, load_profile
from loadtest.twin.truth import MEASURED_FORMAT, NOMINAL, TRUTHS, Truth, TruthTiming

# Data-sheet figures by device name (substring, first match). flops: dense bf16, on the same
# basis as costmodel's hardware.yaml (its h200 entry: 7.9e14, "~790 TFLOP/s measured", i.e.
# 0.8 of the 989 TFLOP/s data sheet); the same fraction of each card's data sheet here.
DEVICES: tuple[tuple[str, str, dict[str, float]], ...] = (
    (
        "H100 PCIe",
        "measured-h100-pcie",
        {"flops": 0.8 * 756e12, "hbm_bw": 2.0e12, "hbm_bytes": 80e9},
    ),
    ("H100 NVL", "measured-h100-nvl", {"flops": 0.8 * 835e12, "hbm_bw": 3.9e12, "hbm_bytes": 94e9}),
    ("H100", "measured-h100", {"flops": 7.9e14, "hbm_bw": 3.35e12, "hbm_bytes": 80e9}),
    ("H200", "measured-h200", {"flops": 7.9e14, "hbm_bw": 4.8e12, "hbm_bytes": 141e9}),
)
# The dry run's stand-in (a CPU core: the figures only set the units of a truth nobody runs).
DRY_DEVICE = ("measured-dry", {"flops": 1e11, "hbm_bw": 1e10, "hbm_bytes": 8e9})

PARAMS = ("gemm", "attn", "hbm", "sharpness", "interference", "forward_fixed_s", "per_seq_s")


def device_reference(device: str, dry: bool) -> tuple[str, dict[str, float]]:
    """(truth name, data-sheet figures) for a device name; ValueError when unknown."""
    if dry:
        return DRY_DEVICE
    for key, name, figs in DEVICES:
        if key.lower() in device.lower():
            return name, figs
    known = ", ".join(k for k, _, _ in DEVICES)
    raise ValueError(
        f"no data-sheet figures for {device!r} (known: {known}); pass --name, --peak-tflops "
        "and --peak-hbm-gbps"
    )


def reference_profile(raw: Mapping[str, Any], figs: Mapping[str, float]) -> ReplicaProfile:
    """The measured model and device as a costmodel profile (see the module docstring)."""
    shape = raw["shape"]
    base = load_profile(shape.get("profile") or "h200-8b")
    params = float(shape["params"])
    model = ModelProfile(
        name=shape["name"],
        params=params,
        layers=int(shape["layers"]),
        hidden=int(shape["hidden"]),
        heads=int(shape["heads"]),
        kv_heads=int(shape["kv_heads"]),
        head_dim=int(shape["head_dim"]),
        kv_dtype_bytes=2.0,
        weight_bytes=2.0 * params,
        max_model_len=1 << 17,
        compute_dtype="bf16",
    )
    hw: HardwareProfile = dataclasses.replace(
        base.hardware,
        name=str(raw["host"].get("device", "?")),
        compute_dtype="bf16",
        flops=float(figs["flops"]),
        hbm_bw=float(figs["hbm_bw"]),
        hbm_bytes=float(figs["hbm_bytes"]),
    )
    return base.replace(
        name=f"reference:{model.name}", hardware=hw, model=model, tensor_parallel_size=1, source={}
    )


# ---- the step fit ------------------------------------------------------------------------------


def _unpack(theta: np.ndarray, fixed: Mapping[str, float]) -> dict[str, float]:
    """Unconstrained theta -> figures (positive; sharpness >= 1); ``fixed`` ones held."""
    vals: dict[str, float] = {}
    it = iter(theta)
    for name in PARAMS:
        if name in fixed:
            vals[name] = fixed[name]
            continue
        x = math.exp(min(max(float(next(it)), -40.0), 40.0))
        vals[name] = 1.0 + x if name == "sharpness" else x
    return vals


def _pack(vals: Mapping[str, float], fixed: Mapping[str, float]) -> np.ndarray:
    out = []
    for name in PARAMS:
        if name in fixed:
            continue
        v = vals[name] - 1.0 if name == "sharpness" else vals[name]
        out.append(math.log(max(v, 1e-12)))
    return np.array(out)


def predict(
    profile: ReplicaProfile, vals: Mapping[str, float], points: Sequence[Mapping[str, Any]]
) -> np.ndarray:
    """Step times of ``points`` under the truth these figures make (the forward pass only:
    ``forward_fixed_s`` is the whole fixed cost)."""
    truth = _truth(profile, vals, 0.0, {})
    t = TruthTiming(profile, truth)
    return np.array([t.step(**p["inputs"]) for p in points])


def _truth(
    profile: ReplicaProfile,
    vals: Mapping[str, float],
    engine_overhead_s: float,
    link: Mapping[str, float],
    name: str = "fit",
    summary: str = "",
) -> Truth:
    fixed = vals["forward_fixed_s"] + engine_overhead_s
    nominal = TRUTHS[NOMINAL]
    return Truth(
        name=name,
        summary=summary,
        gemm=vals["gemm"],
        attn=vals["attn"],
        hbm=vals["hbm"],
        sharpness=vals["sharpness"],
        interference=vals["interference"],
        overhead=fixed / profile.hardware.step_overhead_s,
        per_seq_s=vals["per_seq_s"],
        allreduce=nominal.allreduce,
        interconnect=nominal.interconnect,
        link_bw=link.get("link_bw", nominal.link_bw),
        link_latency=link.get("link_latency", nominal.link_latency),
        link_half_bytes=link.get("link_half_bytes", nominal.link_half_bytes),
    )


def _lm(fun: Callable[[np.ndarray], np.ndarray], x0: np.ndarray, iters: int = 200) -> np.ndarray:
    """Levenberg-Marquardt with a forward-difference Jacobian (when scipy is not installed:
    the GPU host need not have it)."""
    x, lam = x0.astype(float), 1e-2
    r = fun(x)
    cost = float(r @ r)
    for _ in range(iters):
        jac = np.empty((r.size, x.size))
        for j in range(x.size):
            h = 1e-6 * max(1.0, abs(x[j]))
            xj = x.copy()
            xj[j] += h
            jac[:, j] = (fun(xj) - r) / h
        jtj, g = jac.T @ jac, jac.T @ r
        improved = done = False
        while lam < 1e10:
            step = np.linalg.solve(jtj + lam * np.diag(np.diag(jtj) + 1e-12), -g)
            r_new = fun(x + step)
            c_new = float(r_new @ r_new)
            if c_new < cost:
                x, r, lam, improved = x + step, r_new, max(lam / 3, 1e-12), True
                done = cost - c_new < 1e-12 * max(cost, 1e-30)
                cost = c_new
                break
            lam *= 4
        if not improved or done:
            break
    return x


def _solve(fun: Callable[[np.ndarray], np.ndarray], x0: np.ndarray, solver: str) -> np.ndarray:
    if solver == "scipy":
        from scipy.optimize import least_squares

        return np.asarray(least_squares(fun, x0, method="lm").x)
    return _lm(fun, x0)


def default_solver() -> str:
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        return "numpy"
    return "scipy"


def fit_steps(
    profile: ReplicaProfile, points: Sequence[Mapping[str, Any]], solver: str | None = None
) -> dict[str, Any]:
    """The step figures (:data:`PARAMS`) that fit ``points`` (each with ``inputs`` and ``s``)
    best, from a few starting sharpnesses; ``interference`` only when a mixed step is among
    them (held at nominal's otherwise, and said so)."""
    solver = solver or default_solver()
    pts = [p for p in points if p.get("s", 0) > 0]
    if len(pts) < len(PARAMS) + 2:
        raise ValueError(f"{len(pts)} measured steps: too few to fit {len(PARAMS)} figures")
    meas = np.log(np.array([p["s"] for p in pts]))
    fixed: dict[str, float] = {}
    if not any(p["inputs"]["pf_tokens"] and p["inputs"]["decodes"] for p in pts):
        fixed["interference"] = TRUTHS[NOMINAL].interference

    def resid(theta: np.ndarray) -> np.ndarray:
        pred = predict(profile, _unpack(theta, fixed), pts)
        return np.log(np.maximum(pred, 1e-12)) - meas

    best: tuple[float, np.ndarray] | None = None
    fastest = min(p["s"] for p in pts)
    for p0 in (1.5, 4.0, 12.0):
        start = {
            "gemm": 1.1,
            "attn": 0.85,
            "hbm": 1.0,
            "sharpness": p0,
            "interference": 0.3,
            "forward_fixed_s": 0.2 * fastest,
            "per_seq_s": 10e-6,
        } | fixed
        theta = _solve(resid, _pack(start, fixed), solver)
        r = resid(theta)
        if best is None or float(r @ r) < best[0]:
            best = (float(r @ r), theta)
    assert best is not None
    vals = _unpack(best[1], fixed)
    rel = np.exp(resid(best[1])) - 1.0
    return {"figures": vals, "held": dict(fixed), "rel_err": rel.tolist(), "solver": solver}


# ---- the host link -----------------------------------------------------------------------------


def fit_link(rows: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    """latency, bw and half-bytes from timed batches of copies (``t = lat + k·(s + half)/bw``;
    linear least squares, each row by its relative error). None when the fit is unphysical."""
    rows = [r for r in rows if r.get("s", 0) > 0]
    if len(rows) < 3:
        return None
    t = np.array([r["s"] for r in rows])
    k = np.array([r["copies"] for r in rows], dtype=float)
    s = np.array([r["bytes"] for r in rows], dtype=float)
    a = np.stack([np.ones_like(t), k, k * s], axis=1) / t[:, None]
    (lat, per_copy, per_byte), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if per_byte <= 0:
        return None
    bw = 1.0 / per_byte
    return {"latency_s": max(lat, 0.0), "bw": bw, "half_bytes": max(per_copy * bw, 0.0)}


# ---- the file ----------------------------------------------------------------------------------


def representative(k: int = 1024) -> list[tuple[str, dict[str, Any]]]:
    """Step shapes the summary compares truths on."""

    def pf(n: int, c: int) -> dict[str, Any]:
        return {
            "pf_tokens": n,
            "pf_attended": n * (c + (n + 1) / 2),
            "pf_kv": c,
            "decodes": 0,
            "dc_kv": 0.0,
        }

    def dc(b: int, c: int) -> dict[str, Any]:
        return {"pf_tokens": 0, "pf_attended": 0.0, "pf_kv": 0.0, "decodes": b, "dc_kv": b * c}

    return [
        ("prefill 8k cold", pf(8 * k, 0)),
        ("prefill 8k on 120k", pf(8 * k, 120 * k)),
        ("prefill 512 on 32k", pf(512, 32 * k)),
        ("decode 1 x 1k", dc(1, k)),
        ("decode 16 x 16k", dc(16, 16 * k)),
        ("decode 64 x 4k", dc(64, 4 * k)),
        ("mixed 2k on 4k + 32 x 8k", pf(2 * k, 4 * k) | {"decodes": 32, "dc_kv": 32 * 8 * k}),
    ]


def fit_truth(
    raw: Mapping[str, Any],
    *,
    name: str | None = None,
    figs: Mapping[str, float] | None = None,
    engine_overhead_s: float = 1.5e-3,
    solver: str | None = None,
    command: str = "",
) -> dict[str, Any]:
    """The measured truth file's contents (format :data:`MEASURED_FORMAT`) for ``raw``."""
    dry = bool(raw.get("dry_run"))
    device = str(raw["host"].get("device", "?"))
    auto_name, auto_figs = device_reference(device, dry) if figs is None else ("", {})
    name = name or auto_name
    figs = figs or auto_figs
    if not name.startswith("measured-"):
        raise ValueError(f"a measured truth's name starts with 'measured-', got {name!r}")
    profile = reference_profile(raw, figs)
    steps = fit_steps(profile, raw["points"], solver)
    vals = steps["figures"]
    warnings: list[str] = []
    link_rows = raw.get("host_link") or []
    lf = fit_link(link_rows)
    hw = profile.hardware
    link: dict[str, float] = {}
    if lf is None:
        warnings.append("host link: no physical fit from the copies; the nominal link is kept")
    else:
        link = {
            "link_bw": lf["bw"] / hw.host_load_bw,
            "link_latency": lf["latency_s"] / hw.host_latency_s,
            "link_half_bytes": lf["half_bytes"],
        }
    pts = [p for p in raw["points"] if p.get("s", 0) > 0]
    rel = np.array(steps["rel_err"])
    by_kind = {}
    for kind in ("prefill", "decode", "mixed"):
        sel = np.array([p["kind"] == kind for p in pts])
        if sel.any():
            by_kind[kind] = {
                "n": int(sel.sum()),
                "rms": float(np.sqrt(np.mean(rel[sel] ** 2))),
                "max": float(np.max(np.abs(rel[sel]))),
            }
    rms = float(np.sqrt(np.mean(rel**2)))
    figures = {
        "mfu_gemm": vals["gemm"] * profile.prefill_mfu,
        "mfu_attn": vals["attn"] * profile.prefill_mfu,
        "hbm_efficiency": vals["hbm"] * profile.hbm_efficiency,
        "sharpness": vals["sharpness"],
        "interference": vals["interference"],
        "forward_fixed_s": vals["forward_fixed_s"],
        "per_seq_s": vals["per_seq_s"],
    }
    if lf:
        figures |= {
            "host_link_bw": lf["bw"],
            "host_latency_s": lf["latency_s"],
            "dma_half_bytes": lf["half_bytes"],
        }
    errors = [p for p in raw["points"] if "error" in p]
    if errors:
        warnings.append(f"{len(errors)} step(s) failed (see raw: 'error')")
    if raw.get("skipped"):
        warnings.append(f"{len(raw['skipped'])} step(s) skipped for time")
    if "interference" in steps["held"]:
        warnings.append("no mixed step measured: interference held at nominal's")
    if rms > 0.15:
        warnings.append(f"fit rms relative error {rms:.1%} > 15%: the truth's model fits poorly")
    if not dry:
        for key, lo, hi in (
            ("mfu_gemm", 0.1, 1.0),
            ("mfu_attn", 0.05, 1.0),
            ("hbm_efficiency", 0.3, 1.05),
        ):
            if not lo <= figures[key] <= hi:
                warnings.append(f"{key} {figures[key]:.3f} outside [{lo}, {hi}]: check the run")
        short = [p for p in pts if p["s"] < 0.05 and not p.get("graph")]
        if short:
            warnings.append(f"{len(short)} short step(s) timed eagerly (no CUDA graph)")
    when = str(raw.get("measured_at", ""))
    model = raw["shape"]["name"]
    summary = (
        f"fitted by `make gpu-check` to {len(pts)} step times of a {model} model (bf16, random "
        f"weights) on {device}{' ' + when if when else ''}; fit rms {rms:.1%}; engine overhead "
        f"outside the forward assumed {engine_overhead_s * 1e3:g} ms; TP all-reduce: nominal's"
    )
    truth = _truth(profile, vals, engine_overhead_s, link, name, summary)
    ref_nominal = TruthTiming(profile, TRUTHS[NOMINAL])
    fitted = TruthTiming(profile, _truth(profile, vals, 0.0, link))
    compare = (
        [
            {
                "shape": label,
                "fitted_forward_s": fitted.step(**inp),
                "measured_truth_s": TruthTiming(profile, truth).step(**inp),
                "nominal_s": ref_nominal.step(**inp),
            }
            for label, inp in representative()
        ]
        if not dry
        else []
    )
    return {
        "format": MEASURED_FORMAT,
        "name": name,
        "summary": summary,
        "truth": {k: v for k, v in truth.as_dict().items() if k not in ("name", "summary")},
        "measured": {
            "device": device,
            "at": when,
            "host": raw["host"],
            "model": raw["shape"],
            "points": len(pts),
            "raw": f"{name}.raw.json",
            "dry_run": dry,
            "command": command,
        },
        "figures": figures,
        "assumed": {
            "engine_overhead_s": engine_overhead_s,
            "engine_overhead_why": "the engine's per-step cost outside the forward pass "
            "(scheduler, sampling, detokenize, process hops) is not measured without vLLM; "
            "added to the measured forward fixed cost (--engine-overhead-ms)",
            "allreduce": "not measured (one GPU): the profile's latency and bus bandwidth",
        },
        "reference": {
            "profile": raw["shape"].get("profile") or "h200-8b",
            "flops": hw.flops,
            "hbm_bw": hw.hbm_bw,
            "prefill_mfu": profile.prefill_mfu,
            "hbm_efficiency": profile.hbm_efficiency,
            "step_overhead_s": hw.step_overhead_s,
            "host_load_bw": hw.host_load_bw,
            "host_latency_s": hw.host_latency_s,
        },
        "fit": {
            "solver": steps["solver"],
            "held": steps["held"],
            "rms_rel_err": rms,
            "max_rel_err": float(np.max(np.abs(rel))),
            "by_kind": by_kind,
            "points": [
                {
                    "kind": p["kind"],
                    "new": p["new"],
                    "prefix": p["prefix"],
                    "decodes": p["decodes"],
                    "context": p["context"],
                    "measured_s": p["s"],
                    "fitted_s": p["s"] * (1.0 + e),
                }
                for p, e in zip(pts, rel, strict=True)
            ],
            "compare": compare,
        },
        "warnings": warnings,
    }
