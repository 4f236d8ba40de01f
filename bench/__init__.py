"""Benchmarks: `python -m bench.latency` (the latency table of diffusers' memory guide), `python -m bench.kernels`."""
