"""Test bed, tiny model, benchmarks, replica twin and replay harness (imports router, costmodel)."""
