"""Benchmarks (`make bench`); results are recorded in BENCHMARKS.md."""
