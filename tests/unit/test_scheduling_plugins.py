"""Every scheduling plugin module documents itself with a config example that really loads,
and an out-of-tree scorer is one module plus one line of config (entry point + YAML)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import router.scheduling as pkg
from router.config import RouterConfig
from router.scheduling import registry
from router.scheduling.registry import build_pipeline

FRAMEWORK = {"router.scheduling.pipeline", "router.scheduling.registry", "router.scheduling.ring"}
PLUGIN_MODULES = sorted(
    i.name for i in pkgutil.iter_modules(pkg.__path__, "router.scheduling.")
    if i.name not in FRAMEWORK
)  # fmt: skip
YAML_BLOCK = re.compile(r"\.\. code-block:: yaml\n\n((?:    .*\n|\n)+)")


def examples(module: str) -> list[dict]:
    doc = ast.get_docstring(ast.parse(Path(importlib.import_module(module).__file__).read_text()))
    return [yaml.safe_load(textwrap.dedent(b)) for b in YAML_BLOCK.findall((doc or "") + "\n")]


def test_every_plugin_module_registers_something():
    before = {k: set(v) for k, v in registry._TABLE.items()}
    registry.discover()
    names = {k: set(v) for k, v in registry._TABLE.items()}
    assert names["scorer"] >= {
        "kv_cost",
        "kv_prefix",
        "kv_queue",
        "kv_util",
        "kv_sglang_tree",
        "least_load",
        "round_robin",
        "session_affinity",
        "prefix_hash",
    }
    assert names["policy"] >= {"kv_cost", "llmd", "sglang_tree", "round_robin"}
    assert before["scorer"] <= names["scorer"]


@pytest.mark.parametrize("module", PLUGIN_MODULES)
def test_module_docstring_example_builds_a_pipeline(module):
    found = examples(module)
    assert found, f"{module} has no '.. code-block:: yaml' config example in its docstring"
    for ex in found:
        spec = ex.get("scheduling") or ex.get("policy")
        assert spec, f"{module}: example has neither 'scheduling' nor 'policy': {ex}"
        pipeline = build_pipeline(spec)
        assert pipeline.scorers
        RouterConfig(replicas=["http://a:1"], **ex).validate()  # valid as router config too


def test_out_of_tree_scorer_is_one_module_plus_one_line_of_config(tmp_path, monkeypatch):
    (tmp_path / "my_scorer_mod.py").write_text(
        textwrap.dedent("""
        from router.scheduling.registry import register

        class Constant:
            name = "my_constant"
            def __init__(self, value=0.5):
                self.value = value
            def score(self, ctx, snap, endpoints):
                return {e.name: self.value for e in endpoints}

        @register("scorer", "my_constant")
        def _factory(value=0.5):
            return Constant(value)
    """)
    )
    dist = tmp_path / "my_scorer-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-scorer\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvroute.scheduling]\nmy = my_scorer_mod\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_discovered", False)
    try:
        p = build_pipeline({"scorers": [{"type": "my_constant", "weight": 1.0,
                                         "params": {"value": 0.25}}]})  # fmt: skip
        assert p.scorers[0][0].value == 0.25
    finally:
        registry._TABLE["scorer"].pop("my_constant", None)
        sys.modules.pop("my_scorer_mod", None)
