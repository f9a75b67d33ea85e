"""Plugin registry and YAML wiring for the scheduling pipeline.

Owns: the name -> factory tables for ``filter``, ``scorer``, ``picker`` and ``policy`` (a named
pipeline spec), and :func:`build_pipeline` which turns a spec into a :class:`Pipeline`. A spec:

.. code-block:: yaml

    filters: [healthy, serves_model, pool_room]   # the default; or {type: NAME, params: {...}}
    scorers:
      - {type: session_affinity, weight: 2.0, params: {load_factor: 1.25}}
      - {type: least_load, weight: 1.0}
    picker: max_score                          # or {type: max_score, params: {seed: 0}}

Errors (unknown plugin, missing or negative weight, bad params) raise
:class:`router.config.ConfigError` at start-up, never at request time.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

from router.config import ConfigError

KINDS = ("filter", "scorer", "picker", "policy")
_TABLE: dict[str, dict[str, Callable[..., Any]]] = {k: {} for k in KINDS}
DEFAULT_FILTERS = ("healthy", "serves_model", "pool_room")  # a spec without ``filters``
ENTRY_POINT_GROUP = "kvroute.scheduling"  # out-of-tree plugin modules: name = "pkg.module"
_discovered = False
IMPORT_ERRORS: dict[str, str] = {}  # optional plugin module -> why it failed to import
log = logging.getLogger("kvroute.scheduling")


def register(kind: str, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``@register("scorer", "least_load")`` on a factory of keyword params."""
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}")

    def deco(factory: Callable[..., Any]) -> Callable[..., Any]:
        _TABLE[kind][name] = factory
        return factory

    return deco


def register_policy(name: str, spec: Mapping[str, Any]) -> None:
    _TABLE["policy"][name] = lambda: dict(spec)


def discover() -> None:
    """Import every module of :mod:`router.scheduling` (a new in-tree plugin is one new module)
    and every module named in the ``kvroute.scheduling`` entry-point group
    (``[project.entry-points."kvroute.scheduling"] my_scorer = "pkg.my_scorer"``): importing
    a module runs its ``@register`` decorators."""
    global _discovered
    if _discovered:
        return
    import router.scheduling as pkg

    for info in pkgutil.iter_modules(pkg.__path__, "router.scheduling."):
        importlib.import_module(info.name)
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):  # a broken plugin must not take us down
        _optional_import(ep.value.partition(":")[0])
    _discovered = True


def _optional_import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            return None
        IMPORT_ERRORS[name] = repr(e)
    except Exception as e:
        IMPORT_ERRORS[name] = repr(e)
    log.error("scheduling plugin module %s failed to import: %s", name, IMPORT_ERRORS[name])
    return None


def names(kind: str) -> list[str]:
    discover()
    return sorted(_TABLE[kind])


def _make(kind: str, item: Any) -> tuple[Any, Mapping[str, Any]]:
    if isinstance(item, str):
        item = {"type": item}
    if not isinstance(item, Mapping) or "type" not in item:
        raise ConfigError(f"{kind} entry must be a name or a mapping with 'type': {item!r}")
    name = item["type"]
    factory = _TABLE[kind].get(name)
    if factory is None:
        raise ConfigError(
            f"unknown {kind} {name!r}; known: {sorted(_TABLE[kind])}"
            + (f"; plugin import errors: {IMPORT_ERRORS}" if IMPORT_ERRORS else "")
        )
    params = item.get("params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{kind} {name}: params must be a mapping")
    try:
        return factory(**params), item
    except TypeError as e:
        raise ConfigError(f"{kind} {name}: bad params {dict(params)}: {e}") from None


def policy_spec(name: str) -> dict[str, Any]:
    discover()
    f = _TABLE["policy"].get(name)
    if f is None:
        raise ConfigError(
            f"unknown policy {name!r}; known: {sorted(_TABLE['policy'])}"
            + (f"; plugin import errors: {IMPORT_ERRORS}" if IMPORT_ERRORS else "")
        )
    return dict(f())


def build_pipeline(spec: Mapping[str, Any] | str, seed: int | None = None) -> Any:
    """A :class:`~router.scheduling.pipeline.Pipeline` from a policy name or a spec mapping."""
    from router.scheduling.pipeline import Pipeline

    discover()
    if isinstance(spec, str):
        name, spec = spec, policy_spec(spec)
    else:
        name = str(spec.get("name", "custom"))
    unknown = set(spec) - {"name", "filters", "scorers", "picker"}
    if unknown:
        raise ConfigError(f"unknown scheduling keys: {sorted(unknown)}")
    filters = [_make("filter", f)[0] for f in spec.get("filters", DEFAULT_FILTERS)]
    scorers = []
    for s in spec.get("scorers") or []:
        obj, item = _make("scorer", s)
        w = item.get("weight")
        if w is None:
            raise ConfigError(f"scorer {item['type']!r} has no weight")
        if not isinstance(w, (int, float)) or w < 0:
            raise ConfigError(f"scorer {item['type']!r}: weight must be a number >= 0, got {w!r}")
        scorers.append((obj, float(w)))
    if not scorers:
        raise ConfigError("a pipeline needs at least one scorer")
    picker_item = spec.get("picker", "max_score")
    if isinstance(picker_item, str):
        picker_item = {"type": picker_item}
    if seed is not None:
        picker_item = {**picker_item, "params": {"seed": seed, **(picker_item.get("params") or {})}}
    picker = _make("picker", picker_item)[0]
    return Pipeline(name, filters, scorers, picker)
