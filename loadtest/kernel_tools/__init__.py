"""Tooling around the kernels package (harness side of the border, not the product).

* ``compile_check`` — every kernel variant compiled for an NVIDIA target without a GPU;
* ``bench_all`` — every GPU kernel benchmark in one run (``make bench-kernels``);
* ``vllm_patch_check`` — the engine plugin's kernel patches against the vLLM installed in the
  process (run in a vLLM venv);
* ``gpu_session.sh`` — the one device call: the kernels tier on the GPU, the patch check, then
  ``bench_all``.

They import ``kernels`` and ``engine_patches``; neither of those imports this package. See
docs/kernels.md.
"""
