"""vLLM engine patches (a ``vllm.general_plugins`` plugin) — not built yet.

Will own: agent-aware tiered offload/retention, local prefill cadence, DCP and fused-decode
presets, router-facing signals. The entry point is added to pyproject.toml together with a
``register()`` that checks the vLLM version; until then nothing here is loaded by vLLM.
"""
