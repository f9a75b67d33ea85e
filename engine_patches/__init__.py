"""kvroute's engine half: a vLLM plugin (``vllm.general_plugins`` entry point).

Owns: the plugin's ``register()`` (:mod:`engine_patches.plugin`), the vLLM version gate
(:mod:`engine_patches.versions`), the flag presets and ``kvroute engine flags``
(:mod:`engine_patches.presets`, :mod:`engine_patches.cli`), the bounded prefill cadence
(:mod:`engine_patches.cadence` policy, :mod:`engine_patches.scheduler` the vLLM scheduler
class), a host-DRAM offloading tier that works on the CPU platform
(:mod:`engine_patches.offload`), agent-aware retention on it
(:mod:`engine_patches.retention_rule` the pure rule, :mod:`engine_patches.retention` the vLLM
policy), and kvroute's Triton kernels in place of vLLM functions on CUDA hosts when
``KVROUTE_KERNELS`` asks (:mod:`engine_patches.kernel_patches`). Every vLLM private these
touch is listed, with why and its public replacement, in :mod:`engine_patches.privates`. The
pure rules (``cadence``,
``retention_rule``) are also what the replica twin runs (``loadtest.twin.engine``), so the twin
decides as the plugin does.

Every module here imports without vLLM installed (the router's venv has none): vLLM is only
imported inside functions that run in vLLM processes. Must not import ``router`` or
``loadtest``.
"""

__version__ = "0.1.0"
