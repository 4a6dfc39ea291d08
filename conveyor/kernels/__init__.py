"""Native CPU kernels chosen at run time from the CPU's features, with a build cache; see cpu_ops.py."""

from conveyor.kernels.cpu_features import cpu_features, kernel_level
from conveyor.kernels.cpu_ops import CpuKernels, load_cpu_kernels

__all__ = ["CpuKernels", "cpu_features", "kernel_level", "load_cpu_kernels"]
