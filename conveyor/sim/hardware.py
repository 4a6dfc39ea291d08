"""The machines the simulator knows: datasheet peaks, the efficiencies assumed on them, and overheads. PURE PYTHON.

A ``Hardware`` is one device (one GPU, or this CPU as a whole). Its peaks are the vendor's datasheet numbers
(dense, no sparsity) for the dtype a server would run; what a real kernel reaches is a fraction of them, the
``*_efficiency`` fields. For the GPUs those fractions are stated assumptions, typical of what cuBLAS GEMMs,
FlashAttention kernels, HBM streaming and NCCL all-reduces reach on such parts; for a CPU they are fitted by
``conveyor sim calibrate`` from timings of the real engine (the profile JSON holds a ``Hardware`` as a dict).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

TFLOPS, GBPS, GB = 1e12, 1e9, 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # FLOP/s per device, dense matmul in the dtype below
    mem_bandwidth: float  # bytes/s per device (HBM, or DRAM for a CPU)
    memory_bytes: float  # per device
    dtype_bytes: int = 2  # bytes per weight / KV element (bf16 on GPUs)
    link_bandwidth: float = 0.0  # bytes/s per device per direction between devices (NVLink); 0: no TP possible
    matmul_efficiency: float = 0.7  # fraction of peak_flops a GEMM reaches
    attention_efficiency: float = 0.5  # fraction of peak_flops attention kernels reach
    memory_efficiency: float = 0.8  # fraction of mem_bandwidth a streaming read reaches
    link_efficiency: float = 0.8  # fraction of link_bandwidth an all-reduce reaches (bus bandwidth)
    allreduce_latency_s: float = 10e-6  # fixed cost of one all-reduce
    step_overhead_s: float = 2e-3  # per forward pass: scheduling, input preparation, launch, sampling sync
    per_request_overhead_s: float = 20e-6  # per request in the batch (its rows, its sampling)
    per_token_overhead_s: float = 0.0  # per token computed (input building)
    source: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Hardware:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown hardware fields {sorted(unknown)}")
        return cls(**data)

    def with_overrides(self, **changes) -> Hardware:
        return replace(self, **changes)


_GPU_SOURCE = ("datasheet peaks (dense bf16, HBM, NVLink per direction); efficiencies assumed: GEMM {m:.0%}, "
               "attention {a:.0%}, HBM {b:.0%}, all-reduce bus {l:.0%}; 2 ms per step, 20 us per request")

HARDWARE: dict[str, Hardware] = {
    # NVIDIA A100 80GB SXM datasheet: 312 TFLOPS bf16 dense, 2,039 GB/s HBM2e, NVLink 600 GB/s (both directions)
    "a100-80gb": Hardware("a100-80gb", 312 * TFLOPS, 2039 * GBPS, 80 * GB, link_bandwidth=300 * GBPS,
                          matmul_efficiency=0.75, source=_GPU_SOURCE.format(m=0.75, a=0.5, b=0.8, l=0.8)),
    # NVIDIA H100 SXM5 datasheet: 989 TFLOPS bf16 dense (1,979 with sparsity), 3.35 TB/s HBM3, NVLink 900 GB/s
    "h100-sxm": Hardware("h100-sxm", 989 * TFLOPS, 3350 * GBPS, 80 * GB, link_bandwidth=450 * GBPS,
                         source=_GPU_SOURCE.format(m=0.7, a=0.5, b=0.8, l=0.8)),
    # NVIDIA H200 SXM datasheet: 989 TFLOPS bf16 dense, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s
    "h200": Hardware("h200", 989 * TFLOPS, 4800 * GBPS, 141 * GB, link_bandwidth=450 * GBPS,
                     source=_GPU_SOURCE.format(m=0.7, a=0.5, b=0.8, l=0.8)),
    # This machine: 2 vCPUs of an Intel Xeon (AVX-512, AMX), the bench model in float32 on one thread, fitted by
    # `conveyor sim calibrate --num-threads 1 --workload workload_longtail_v1.json` on 2026-11-30 09:14 with a
    # load average of 9-10 from other processes (docs/sim/profile-xeon-2vcpu-loaded.json, fit rms 19.5%). Peaks
    # are that run's measured GEMM and copy rates; a GEMM "efficiency" above 1 means the fit moved the GEMM cost
    # into the per-token overhead (for a 40M model the two are nearly collinear). Recalibrate on your machine.
    "xeon-2vcpu-loaded": Hardware("xeon-2vcpu-loaded", 64.28e9, 4.875e9, 25.3 * GB, dtype_bytes=4,
                                  matmul_efficiency=7.06, attention_efficiency=0.799, memory_efficiency=1.41,
                                  step_overhead_s=11.25e-3, per_request_overhead_s=1.851e-3,
                                  per_token_overhead_s=0.944e-3,
                                  source="fitted by conveyor sim calibrate on this machine, 2026-11-30, loaded"),
}


def get_hardware(name: str) -> Hardware:
    key = name.lower()
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)} (or a profile JSON from "
                         "`conveyor sim calibrate`)")
    return HARDWARE[key]
