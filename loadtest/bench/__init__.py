"""Benchmark modules run by ``make bench`` (see :mod:`loadtest.benchmarks`)."""
