"""Native CPU kernels chosen at run time from the CPU's features, with a build cache (see cpu_ops.py)."""

from conveyor.kernels.cpu_ops import CpuKernels, load_cpu_kernels

__all__ = ["CpuKernels", "load_cpu_kernels"]
