"""The ``vllm.general_plugins`` entry point: :func:`register`.

vLLM calls every general plugin in each of its processes (API server, engine core, and each
worker: ``vllm/plugins/__init__.py``), possibly more than once. So :func:`register`

* checks the vLLM version first and refuses, with one log line, any version it does not know
  (:mod:`engine_patches.versions`) — nothing is patched then;
* registers by lazy import path only (the offloading specs under their names in vLLM's
  ``OffloadingSpecFactory``), so no engine code is imported into the API server;
* is idempotent: a second call in the same process does nothing and returns the same answer;
* logs under ``vllm.kvroute``, so vLLM's own log configuration (level, process prefix)
  applies.

With ``KVROUTE_KERNELS`` set, :func:`register` also installs kvroute's Triton kernels in
place of vLLM functions (:mod:`engine_patches.kernel_patches`): CUDA platforms only — on
any other platform the setting is refused with one log line and nothing is patched.

Everything else the plugin offers is opted into by flags (``kvroute engine flags``):
``--scheduler-cls engine_patches.scheduler.CadenceScheduler`` for the bounded prefill cadence,
``kv_connector_extra_config.spec_name`` for the host/disk tiers.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

from engine_patches import __version__, kernel_patches, versions

logger = logging.getLogger("vllm.kvroute")

# Offloading specs by name -> (module, class); vLLM imports them only when a config names one.
OFFLOADING_SPECS: dict[str, tuple[str, str]] = {
    "KVRouteOffloadingSpec": ("engine_patches.offload", "KVRouteOffloadingSpec"),
    "KVRouteTieringSpec": ("engine_patches.offload", "KVRouteTieringSpec"),
}

# None: not called yet in this process; else what the first call decided.
_outcome: bool | None = None


def register() -> bool:
    """Register the plugin in this vLLM process; ``False`` (and one log line) if refused."""
    global _outcome
    if _outcome is not None:
        return _outcome
    _configure_logging()
    try:
        version = versions.check()
    except versions.UnsupportedVllmVersion as e:
        logger.error("%s", e)
        _outcome = False
        return False
    try:
        _register_offloading_specs()
    except Exception:  # never take a vLLM process down from a plugin
        logger.exception("kvroute engine plugin: registering the offloading specs failed")
        _outcome = False
        return False
    try:
        kernel_patches.install_from_env()
    except Exception:  # the kernels are an optimisation: never take vLLM down for them
        logger.exception(
            "kvroute engine plugin: installing the kernels (%s) failed", kernel_patches.ENV
        )
    logger.info(
        "kvroute engine plugin %s registered on vLLM %s (pid %d, process %s)",
        __version__,
        version,
        os.getpid(),
        multiprocessing.current_process().name,
    )
    _outcome = True
    return True


def _configure_logging() -> None:
    """Make our lines come out with vLLM's format and process prefix.

    vLLM 0.32.0 configures its ``vllm`` logger only after the API server has loaded the
    plugins (engine core and workers are configured by then), so there an INFO line would be
    lost. When the ``vllm`` logger has no handler yet, apply vLLM's own environment-driven
    configuration (``VLLM_CONFIGURE_LOGGING``, ``VLLM_LOGGING_LEVEL``...) early; vLLM's later
    configuration replaces it as usual.
    """
    try:
        import vllm.logger as vlog

        configure = getattr(vlog, "_configure_vllm_root_logger", None)
        if configure is not None and not logging.getLogger("vllm").handlers:
            configure()
    except Exception:  # pragma: no cover - logging must never stop the plugin
        pass


def _register_offloading_specs() -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    for name, (module, cls) in OFFLOADING_SPECS.items():
        if name not in OffloadingSpecFactory._registry:
            OffloadingSpecFactory.register_spec(name, module, cls)
