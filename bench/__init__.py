"""Benchmarks: `python -m bench.latency` (the seed latency table), `python -m bench.kernels`."""
