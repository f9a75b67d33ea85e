"""``make gpu-check`` (loadtest/gpu_check) and the measured truths it gives the twins.

The GPU run itself needs a device; here: its CPU dry run end to end (tiny shapes; the times
mean nothing, the plumbing, attention paths, fit and files are checked), the fit recovering a
known truth from noisy step times on the GPU grid (both solvers), the host-link fit, the
measuring and fitting code importing with only torch/numpy/yaml (the GPU host has no scipy,
vLLM or index), and the twin's loader: ``--truth measured-h100`` says it has not been
measured until its file exists, then runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from costmodel.profiles import load_profile
from loadtest.twin import truth as truth_mod
from loadtest.twin.truth import (
    MEASURED,
    TRUTH_NAMES,
    NotMeasuredError,
    TruthTiming,
    check,
    describe,
    load_measured,
    timing,
)

pytestmark = pytest.mark.unit
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"
KNOWN = {
    "gemm": 1.3,
    "attn": 0.7,
    "hbm": 0.9,
    "sharpness": 3.0,
    "interference": 0.6,
    "forward_fixed_s": 0.8e-3,
    "per_seq_s": 20e-6,
}


def _synthetic_raw(noise: float, seed: int = 1, link: bool = True) -> dict:
    """The GPU grid's points timed by a known truth (x (1 + noise·N(0,1))), as raw.json."""
    from loadtest.gpu_check.fit import DEVICES, predict, reference_profile
    from loadtest.gpu_check.model import LLAMA_8B, grid

    raw = {
        "format": 1,
        "dry_run": False,
        "measured_at": "2026-12-06T00:00:00Z",
        "host": {"device": H100, "torch": "x"},
        "shape": asdict(LLAMA_8B) | {"params": LLAMA_8B.params},
        "attention_check": {"prefill_path": "sdpa_lower_right_gqa"},
        "ceilings": {"gemm_tflops": 700.0, "copy_gbps": 3000.0},
        "skipped": [],
    }
    prof = reference_profile(raw, DEVICES[2][2])
    pts = grid(False)
    times = predict(prof, KNOWN, [{"inputs": p.truth_inputs()} for p in pts])
    rng = np.random.default_rng(seed)
    raw["points"] = [
        asdict(p)
        | {
            "inputs": p.truth_inputs(),
            "s": float(t * (1 + noise * rng.normal())),
            "graph": True,
        }
        for p, t in zip(pts, times, strict=True)
    ]
    # 25 GB/s, 30 us per batch, 6 kB half-point
    raw["host_link"] = (
        [
            {"bytes": s, "copies": k, "s": 30e-6 + k * (s + 6e3) / 25e9}
            for s in (4096, 16384, 65536, 262144, 1 << 20)
            for k in (32, 256)
        ]
        if link
        else []
    )
    return raw


@pytest.mark.parametrize("solver", ["scipy", "numpy"])
def test_the_fit_recovers_a_known_truth_from_noisy_step_times(solver: str) -> None:
    pytest.importorskip("scipy") if solver == "scipy" else None
    from loadtest.gpu_check.fit import DEVICES, fit_steps, reference_profile

    raw = _synthetic_raw(noise=0.02)
    res = fit_steps(reference_profile(raw, DEVICES[2][2]), raw["points"], solver)
    got = res["figures"]
    for key in ("gemm", "attn", "hbm", "forward_fixed_s"):
        assert got[key] == pytest.approx(KNOWN[key], rel=0.05), key
    assert got["sharpness"] == pytest.approx(KNOWN["sharpness"], rel=0.15)
    assert got["interference"] == pytest.approx(KNOWN["interference"], rel=0.25)
    assert got["per_seq_s"] == pytest.approx(KNOWN["per_seq_s"], rel=0.5)
    assert np.sqrt(np.mean(np.square(res["rel_err"]))) < 0.03  # the noise, no more
    assert res["held"] == {}


def test_the_fitted_truth_file_loads_and_reproduces_the_measurement(tmp_path: Path) -> None:
    from loadtest.gpu_check.fit import DEVICES, fit_truth, reference_profile

    raw = _synthetic_raw(noise=0.0)
    data = fit_truth(raw, engine_overhead_s=1.5e-3)
    assert data["name"] == "measured-h100" and data["warnings"] == []
    f = data["figures"]
    assert f["mfu_gemm"] == pytest.approx(1.3 * 0.45, rel=0.01)
    assert f["host_link_bw"] == pytest.approx(25e9, rel=0.01)
    assert f["dma_half_bytes"] == pytest.approx(6e3, rel=0.02)
    assert f["host_latency_s"] == pytest.approx(30e-6, rel=0.05)
    path = tmp_path / "measured-h100.json"
    path.write_text(json.dumps(data))
    truth = load_measured(path)
    # the file's truth, on the reference profile, is the measured forward + the engine's 1.5 ms
    prof = reference_profile(raw, DEVICES[2][2])
    t = TruthTiming(prof, truth)
    for p in raw["points"]:
        assert t.step(**p["inputs"]) - 1.5e-3 == pytest.approx(p["s"], rel=0.01)
    # and it runs on the twins' profiles, differing from nominal
    tp4 = load_profile("h200-70b-fp8-tp4")
    mine, nominal = TruthTiming(tp4, truth), timing(tp4, "nominal")
    assert mine.step(8192, 8192 * 4096.5, 0, 0, 0) != pytest.approx(
        nominal.step(8192, 8192 * 4096.5, 0, 0, 0), rel=0.05
    )
    assert mine.load(100, "cpu") > 0 and mine.decode_step(4, 4 * 50_000) > 0


def test_a_bad_run_is_flagged_in_the_file() -> None:
    from loadtest.gpu_check.fit import fit_truth

    raw = _synthetic_raw(noise=0.4, link=False)
    raw["points"][0] = {**raw["points"][0], "error": "OutOfMemoryError: x"}
    del raw["points"][0]["s"]
    raw["points"] = [p for p in raw["points"] if p["kind"] != "mixed"]
    raw["skipped"] = [{"kind": "prefill", "why": "budget"}]
    w = " | ".join(fit_truth(raw)["warnings"])
    for needle in (
        "1 step(s) failed",
        "1 step(s) skipped",
        "interference held",
        "> 15%",
        "host link",
    ):
        assert needle in w


def test_the_host_link_fit() -> None:
    from loadtest.gpu_check.fit import fit_link

    rows = [
        {"bytes": s, "copies": k, "s": 50e-6 + k * (s + 8e3) / 40e9}
        for s in (4096, 65536, 1 << 20)
        for k in (32, 256)
    ]
    got = fit_link(rows)
    assert got is not None
    assert got["bw"] == pytest.approx(40e9, rel=1e-3)
    assert got["half_bytes"] == pytest.approx(8e3, rel=1e-3)
    assert got["latency_s"] == pytest.approx(50e-6, rel=1e-3)
    assert fit_link(rows[:2]) is None


def test_the_dry_run_measures_fits_and_writes_everything(tmp_path: Path) -> None:
    """``make gpu-check DRY=1`` minus the kernel benchmarks (the kernels tier runs those)."""
    from loadtest.gpu_check.model import grid

    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.gpu_check",
            "--dry-run",
            "--skip-kernels",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = out / "model" / "model.txt"
    said = (
        proc.stdout[-2000:]
        + proc.stderr[-2000:]
        + (log.read_text()[-3000:] if log.exists() else "")
    )
    assert proc.returncode == 0, said
    raw = json.loads((out / "model" / "raw.json").read_text())
    assert raw["dry_run"] and len(raw["points"]) == len(grid(True)) and not raw["skipped"]
    assert all(p["s"] > 0 and p["reps"] >= 3 for p in raw["points"])
    assert {p["kind"] for p in raw["points"]} == {"prefill", "decode", "mixed"}
    assert raw["attention_check"]["prefill_path"] and raw["attention_check"]["decode"]["ok"]
    assert len(raw["host_link"]) == 4 and raw["ceilings"]["gemm_tflops"] > 0
    data = json.loads((out / "measured-dry.json").read_text())
    assert json.loads((out / "measured-dry.raw.json").read_text()) == raw
    # a CPU's tiny steps follow the truth's model too, if loosely (1000x outliers did not)
    assert data["measured"]["dry_run"] and data["fit"]["rms_rel_err"] < 0.5
    assert len(data["fit"]["points"]) == len(raw["points"])
    truth = load_measured(out / "measured-dry.json")
    t = timing(load_profile("h200-8b"), truth)
    assert t.step(512, 512 * 1000, 744, 4, 4000) > 0
    text = (out / "summary.txt").read_text()
    assert "DRY RUN" in text and "fitted: MFU" in text and "fit (" in text
    assert text.strip() in proc.stdout
    # a dry run's truth is not a measurement: install refuses it
    inst = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.gpu_check",
            "install",
            str(out),
            "--dest",
            str(tmp_path / "truths"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert inst.returncode == 2 and "dry run" in inst.stdout
    assert not (tmp_path / "truths").exists()


def test_install_copies_a_measured_truth_and_its_raw_timings(tmp_path: Path) -> None:
    from loadtest.gpu_check.__main__ import install
    from loadtest.gpu_check.fit import fit_truth

    run = tmp_path / "run"
    run.mkdir()
    raw = _synthetic_raw(noise=0.01)
    (run / "measured-h100.json").write_text(json.dumps(fit_truth(raw)))
    assert install(run, tmp_path / "truths") == 2  # the raw timings are missing
    (run / "measured-h100.raw.json").write_text(json.dumps(raw))
    assert install(run, tmp_path / "truths") == 0
    assert json.loads((tmp_path / "truths" / "measured-h100.raw.json").read_text()) == raw
    assert load_measured(tmp_path / "truths" / "measured-h100.json").name == "measured-h100"


BLOCKED = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"scipy", "vllm", "transformers", "aiohttp", "orjson", "redis",
                                  "zmq", "httpx", "router"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Refuse())
import json
from loadtest.gpu_check import fit, model
from loadtest.gpu_check.__main__ import main
from tests.unit.test_gpu_check import _synthetic_raw
data = fit.fit_truth(_synthetic_raw(noise=0.01))
print(json.dumps({"solver": data["fit"]["solver"], "rms": data["fit"]["rms_rel_err"]}))
"""


def test_measuring_and_fitting_need_only_torch_numpy_and_yaml() -> None:
    """The GPU host has torch, triton and transformers, no scipy, vLLM or package index."""
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKED], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["solver"] == "numpy" and got["rms"] < 0.02


# ---- the twin's side: --truth measured-h100 ----


def test_an_unmeasured_truth_says_so_everywhere(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(truth_mod, "TRUTHS_DIR", tmp_path)
    assert MEASURED in TRUTH_NAMES
    prof = load_profile("h200-8b")
    for call in (
        lambda: timing(prof, MEASURED),
        lambda: describe(MEASURED),
        lambda: check(MEASURED),
    ):
        with pytest.raises(NotMeasuredError, match=r"has not been measured yet.*make gpu-check"):
            call()
    with pytest.raises(ValueError, match="unknown truth"):
        check("measured_h100")


def test_a_committed_measured_truth_runs_and_a_malformed_one_is_refused(
    tmp_path: Path, monkeypatch
) -> None:
    from loadtest.gpu_check.fit import fit_truth

    monkeypatch.setattr(truth_mod, "TRUTHS_DIR", tmp_path)
    data = fit_truth(_synthetic_raw(noise=0.01))
    (tmp_path / "measured-h100.json").write_text(json.dumps(data))
    check(MEASURED)
    assert describe(MEASURED)["gemm"] == pytest.approx(data["truth"]["gemm"])
    t = timing(load_profile("h200-70b-fp8-tp4"), MEASURED)
    assert isinstance(t, TruthTiming) and t.name == MEASURED
    bad = dict(data, truth={k: v for k, v in data["truth"].items() if k != "hbm"})
    (tmp_path / "measured-h100.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="must give exactly"):
        timing(load_profile("h200-8b"), MEASURED)
    (tmp_path / "measured-h100.json").write_text(json.dumps(dict(data, name="measured-h200")))
    with pytest.raises(ValueError, match="its 'name' must be its file's name"):
        check(MEASURED)
    (tmp_path / "measured-h100.json").write_text(json.dumps(dict(data, format=99)))
    with pytest.raises(ValueError, match="not a format-1"):
        check(MEASURED)


def test_the_clis_refuse_an_unmeasured_truth_with_the_reason() -> None:
    # a measured name with no file (measured-h100 itself once a GPU run commits it)
    for argv in (
        ["sim", "--truth", "measured-nowhere"],
        [
            "bench",
            "loadtest/data/mooncake-slice.jsonl.gz",
            "--out",
            "/nonexistent",
            "--truth",
            "nominal,measured-nowhere",
        ],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "kvroute.cli", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr[-1000:]
        assert "'measured-nowhere' has not been measured yet" in proc.stderr
        assert "docs/gpu-check.md" in proc.stderr


def test_saved_timings_refit_without_a_gpu(tmp_path: Path, capsys) -> None:
    """``python -m loadtest.gpu_check fit RAW --out DIR``: the same truth, another assumed
    engine overhead moving only ``overhead``; an unknown device needs its figures."""
    from loadtest.gpu_check.__main__ import main

    raw = _synthetic_raw(noise=0.01)
    path = tmp_path / "raw.json"
    path.write_text(json.dumps(raw))
    files = {}
    for ms in ("1.5", "3.5"):
        out = tmp_path / ms
        assert main(["fit", str(path), "--out", str(out), "--engine-overhead-ms", ms]) == 0
        files[ms] = json.loads((out / "measured-h100.json").read_text())
        assert (out / "measured-h100.raw.json").exists() and (out / "summary.txt").exists()
    a, b = files["1.5"]["truth"], files["3.5"]["truth"]
    assert b["overhead"] - a["overhead"] == pytest.approx(2e-3 / 4e-3)
    assert {k: v for k, v in a.items() if k != "overhead"} == {
        k: v for k, v in b.items() if k != "overhead"
    }
    assert "to commit it: python -m loadtest.gpu_check install" in capsys.readouterr().out
    raw["host"]["device"] = "Some Other GPU"
    path.write_text(json.dumps(raw))
    assert main(["fit", str(path), "--out", str(tmp_path / "x")]) == 2
    assert "no data-sheet figures for 'Some Other GPU'" in capsys.readouterr().out
    args = ["--name", "measured-other", "--peak-tflops", "500", "--peak-hbm-gbps", "2000"]
    assert main(["fit", str(path), "--out", str(tmp_path / "o"), *args]) == 0
    assert load_measured(tmp_path / "o" / "measured-other.json").name == "measured-other"
