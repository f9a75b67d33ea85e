"""A measured GPU truth for the twins (``make gpu-check``, docs/gpu-check.md).

:mod:`loadtest.gpu_check.model` times a Llama-shaped transformer's engine steps (torch only),
:mod:`loadtest.gpu_check.fit` fits :class:`loadtest.twin.truth.Truth`'s figures to them, and
``python -m loadtest.gpu_check`` runs both with the kernel benchmarks and writes the truth
file the twin loads (``--truth measured-h100``). Importing this package imports nothing.
"""
