"""Triton kernels with torch references (DCP LSE merge, fused decode pieces) — not built yet."""
