"""Benchmarks: workloads, offline / online / HTTP / single-step benchmarks, the metrics they share, reports."""
