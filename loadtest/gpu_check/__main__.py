"""``make gpu-check``: kernel benchmarks, a real transformer's step times, a measured truth.

    python -m loadtest.gpu_check [--out DIR] [--dry-run] [--budget-s S]   # the whole check
    python -m loadtest.gpu_check fit RAW.json --out DIR                   # refit saved timings
    python -m loadtest.gpu_check install DIR                              # into the twin's truths

The check (docs/gpu-check.md), from a clone's root on a host with torch (and triton for the
kernels; no vLLM, no transformers, no package index needed): (1) the model's step times
(:mod:`loadtest.gpu_check.model`, a subprocess), (2) the kernel benchmarks
(:mod:`loadtest.kernel_tools.bench_all`, one subprocess per section, each cut at the time
left), (3) the fit (:mod:`loadtest.gpu_check.fit`) and a one-screen summary. Everything goes
under ``DIR`` (default ``$OUT``, else ``out/gpu-check``): ``model/raw.json``,
``kernels/<section>/kernels_bench.json``, ``<truth>.json`` + ``<truth>.raw.json``,
``summary.txt``, and each step's output. ``--budget-s`` (default 520) bounds the whole run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("lse_merge", "fused", "decode")


def _run(cmd: list[str], log: Path, timeout: float) -> int:
    """A step as a subprocess (its own CUDA context), its output in ``log``; 124 on timeout."""
    with log.open("w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(
                cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=max(timeout, 1.0)
            ).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[gpu_check] stopped after {timeout:.0f} s\n")
            return 124


def _kernels(out: Path, dry: bool, seconds: float, peak_gbps: float) -> dict[str, Any]:
    """Each bench_all section in turn, with the time left; what each wrote, or why not."""
    res: dict[str, Any] = {}
    end = time.monotonic() + seconds
    for sec in SECTIONS:
        left = end - time.monotonic()
        if left < 10:
            res[sec] = {"rc": None, "why": "no time left"}
            continue
        d = out / "kernels" / sec
        d.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "loadtest.kernel_tools.bench_all",
            "--out",
            str(d),
            "--only",
            sec,
            "--peak-gbps",
            f"{peak_gbps:g}",
        ] + (["--smoke"] if dry else [])
        rc = _run(cmd, d / "bench.txt", left)
        f = d / "kernels_bench.json"
        res[sec] = {"rc": rc, "json": str(f) if f.exists() else None}
        if f.exists():
            data = json.loads(f.read_text())
            res[sec]["rows"] = len(data.get(sec, []))
            res[sec]["goals"] = data.get("goals")
    return res


def _peak_gbps(device: str) -> float:
    from loadtest.gpu_check.fit import DEVICES

    for key, _, figs in DEVICES:
        if key.lower() in device.lower():
            return figs["hbm_bw"] / 1e9
    return 4800.0


def _gpu_name() -> str:
    """The GPU's name (nvidia-smi, else torch in a subprocess: this process holds no CUDA
    context while the steps run); "" when there is none."""
    probes = (
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
        [sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
    )
    for cmd in probes:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if p.returncode == 0 and p.stdout.strip():
            return p.stdout.strip().splitlines()[0]
    return ""


def fit_and_write(raw_path: Path, out: Path, args: argparse.Namespace, kernels: Any) -> int:
    from loadtest.gpu_check.fit import fit_truth

    raw = json.loads(raw_path.read_text())
    figs = None
    if args.peak_tflops or args.peak_hbm_gbps:
        if not (args.peak_tflops and args.peak_hbm_gbps and args.name):
            print("gpu_check: --peak-tflops, --peak-hbm-gbps and --name go together")
            return 2
        figs = {
            "flops": args.peak_tflops * 1e12,
            "hbm_bw": args.peak_hbm_gbps * 1e9,
            "hbm_bytes": 80e9,
        }
    truth = fit_truth(
        raw,
        name=args.name,
        figs=figs,
        engine_overhead_s=args.engine_overhead_ms / 1e3,
        command=shlex.join(["python", "-m", "loadtest.gpu_check", *sys.argv[1:]]),
    )
    out.mkdir(parents=True, exist_ok=True)
    name = truth["name"]
    (out / f"{name}.json").write_text(json.dumps(truth, indent=1) + "\n")
    if raw_path.resolve() != (out / f"{name}.raw.json").resolve():
        shutil.copyfile(raw_path, out / f"{name}.raw.json")
    text = summary(raw, truth, kernels, out)
    (out / "summary.txt").write_text(text + "\n")
    print(text)
    return 0


def summary(raw: dict[str, Any], truth: dict[str, Any], kernels: Any, out: Path) -> str:
    f, fit, host = truth["figures"], truth["fit"], raw["host"]
    pts = raw["points"]
    lines = [
        f"== gpu-check: {host.get('device')} | torch {host.get('torch')} | "
        f"{raw['shape']['name']} ({raw['shape']['params'] / 1e9:.2f}B, {raw.get('dtype')}) "
        f"{'| DRY RUN: times mean nothing' if raw.get('dry_run') else ''}",
        f"steps: {sum('s' in p for p in pts)} measured, {sum('error' in p for p in pts)} failed, "
        f"{len(raw.get('skipped', []))} skipped, {raw.get('seconds')} s; attention "
        f"{raw['attention_check']['prefill_path']}; "
        f"{sum(bool(p.get('graph')) for p in pts)} in CUDA graphs",
        f"ceilings: GEMM {raw['ceilings']['gemm_tflops']} TFLOP/s, copy "
        f"{raw['ceilings']['copy_gbps']} GB/s",
        f"fitted: MFU gemm {f['mfu_gemm']:.3f} attn {f['mfu_attn']:.3f} | HBM eff "
        f"{f['hbm_efficiency']:.3f} | sharpness {f['sharpness']:.2f} | interference "
        f"{f['interference']:.2f} | forward fixed {f['forward_fixed_s'] * 1e3:.2f} ms | per seq "
        f"{f['per_seq_s'] * 1e6:.1f} us",
    ]
    if "host_link_bw" in f:
        lines.append(
            f"host link: {f['host_link_bw'] / 1e9:.1f} GB/s, latency "
            f"{f['host_latency_s'] * 1e6:.0f} us, DMA half-point "
            f"{f['dma_half_bytes'] / 1e3:.1f} kB"
        )
    kinds = " ".join(
        f"{k} {v['rms']:.1%} (max {v['max']:.1%}, n={v['n']})" for k, v in fit["by_kind"].items()
    )
    lines.append(
        f"fit ({fit['solver']}): rms {fit['rms_rel_err']:.1%} max "
        f"{fit['max_rel_err']:.1%} | {kinds}"
    )
    t = truth["truth"]
    lines.append("truth " + truth["name"] + ": " + ", ".join(f"{k} {v:.4g}" for k, v in t.items()))
    if fit["compare"]:
        lines.append(
            f"{'step (reference profile)':28s} {'forward':>9s} {'truth':>9s} {'nominal':>9s}"
        )
        for c in fit["compare"]:
            lines.append(
                f"{c['shape']:28s} {c['fitted_forward_s'] * 1e3:8.1f}m "
                f"{c['measured_truth_s'] * 1e3:8.1f}m {c['nominal_s'] * 1e3:8.1f}m"
            )
    if kernels:
        ks = []
        for sec, r in kernels.items():
            ks.append(f"{sec} rc={r.get('rc')} rows={r.get('rows', 0)}")
        lines.append("kernels: " + "; ".join(ks))
        goals = {
            k: v
            for r in kernels.values()
            for k, v in (r.get("goals") or {}).items()
            if k.endswith("_met") and v is not None
        }
        if goals:
            lines.append("kernel goals: " + json.dumps(goals))
    for w in truth["warnings"]:
        lines.append(f"WARNING: {w}")
    how = (
        "a dry run: nothing to commit"
        if raw.get("dry_run")
        else f"to commit it: python -m loadtest.gpu_check install {out}"
    )
    lines.append(f"wrote {out}/{truth['name']}.json (+ .raw.json, summary.txt); {how}")
    return "\n".join(lines)


def install(src: Path, dest: Path) -> int:
    """Copies a run's measured truth (validated by the twin's own loader) and its raw timings
    into the twin's truths folder."""
    from loadtest.twin.truth import load_measured

    files = [p for p in sorted(src.glob("measured-*.json")) if not p.name.endswith(".raw.json")]
    if len(files) != 1:
        print(f"gpu_check install: expected one measured-*.json in {src}, found {len(files)}")
        return 2
    truth = json.loads(files[0].read_text())
    if truth.get("measured", {}).get("dry_run"):
        print("gpu_check install: a dry run's truth is not a measurement; refused")
        return 2
    load_measured(files[0])  # raises on a malformed file
    raw = files[0].with_name(files[0].name.removesuffix(".json") + ".raw.json")
    if not raw.exists():
        print(f"gpu_check install: {raw} (the raw timings) is missing")
        return 2
    dest.mkdir(parents=True, exist_ok=True)
    for p in (files[0], raw):
        shutil.copyfile(p, dest / p.name)
    print(
        f"gpu_check install: {files[0].name} and {raw.name} -> {dest}; commit them with "
        f"git add {dest}"
    )
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine-overhead-ms",
        type=float,
        default=1.5,
        help="the engine's per-step cost outside the forward pass, not measured "
        "here (scheduler, sampling, process hops; default 1.5)",
    )
    p.add_argument("--name", default=None, help="the truth's name (default: by device)")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="bf16 dense reference for an unknown device (with --peak-hbm-gbps)",
    )
    p.add_argument("--peak-hbm-gbps", type=float, default=None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    default_out = os.environ.get("OUT") or "out/gpu-check"
    if argv[:1] == ["fit"]:
        p = argparse.ArgumentParser(prog="python -m loadtest.gpu_check fit")
        p.add_argument("raw")
        p.add_argument("--out", default=default_out)
        _common(p)
        a = p.parse_args(argv[1:])
        try:
            return fit_and_write(Path(a.raw), Path(a.out), a, None)
        except ValueError as exc:
            print(f"gpu_check fit: {exc}")
            return 2
    if argv[:1] == ["install"]:
        from loadtest.twin.truth import TRUTHS_DIR

        p = argparse.ArgumentParser(prog="python -m loadtest.gpu_check install")
        p.add_argument("dir")
        p.add_argument("--dest", default=str(TRUTHS_DIR))
        a = p.parse_args(argv[1:])
        return install(Path(a.dir), Path(a.dest))
    p = argparse.ArgumentParser(prog="python -m loadtest.gpu_check", description=__doc__)
    p.add_argument("--out", default=default_out)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (a test)")
    p.add_argument("--budget-s", type=float, default=520.0, help="the whole run (default 520)")
    p.add_argument(
        "--model-budget-s",
        type=float,
        default=300.0,
        help="measuring steps (default 300; the model's set-up comes on top)",
    )
    p.add_argument("--skip-kernels", action="store_true")
    _common(p)
    a = p.parse_args(argv)
    t0 = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("torch") is None:
        print(f"gpu_check: torch does not import with {sys.executable} (set GPU_PY=...)")
        return 2
    device = "cpu (dry run)" if a.dry_run else _gpu_name()
    if not a.dry_run and not device:
        print("gpu_check: no GPU (nvidia-smi found none); run with --dry-run to check the script")
        return 2
    model_budget = min(a.model_budget_s, a.budget_s - 60)
    if a.dry_run:
        model_budget = min(model_budget, 60.0)
    cmd = [
        sys.executable,
        "-m",
        "loadtest.gpu_check.model",
        "--out",
        str(out / "model"),
        "--budget-s",
        f"{model_budget:g}",
    ] + (["--dry-run"] if a.dry_run else [])
    (out / "model").mkdir(exist_ok=True)
    rc = _run(cmd, out / "model" / "model.txt", model_budget + 90)
    print(f"gpu_check: model steps rc={rc} ({time.monotonic() - t0:.0f} s)", flush=True)
    kernels = None
    if not a.skip_kernels:
        left = a.budget_s - (time.monotonic() - t0) - 20  # the fit and summary after
        kernels = _kernels(out, a.dry_run, left, _peak_gbps(device))
        print(f"gpu_check: kernels done ({time.monotonic() - t0:.0f} s)", flush=True)
    raw = out / "model" / "raw.json"
    if not raw.exists():
        print(f"gpu_check: the model step wrote no timings (rc={rc}); see {out}/model/model.txt")
        return 1
    try:
        code = fit_and_write(raw, out, a, kernels)
    except ValueError as exc:
        print(f"gpu_check: no truth fitted: {exc}; raw timings kept in {raw}")
        return 1
    print(f"gpu_check: done in {time.monotonic() - t0:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
