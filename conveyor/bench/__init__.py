"""Benchmarks: workloads, the offline throughput benchmark, metrics shared with the simulator and HTTP client."""
