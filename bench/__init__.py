"""Benchmarks (`make bench`); each one's results and how to read them: docs/benchmarks/."""
