"""Moving a request's KV cache from a prefill instance to a decode instance: bytes and link time. PURE PYTHON.

Bytes per token from the model spec: K and V, every layer, every KV head, in the cache's dtype::

    kv_bytes_per_token = 2 x layers x kv_heads x head_dim x dtype_bytes     (Llama-3-70B, bf16: 320 KiB)

A transfer takes ``bytes / (lanes x bandwidth x efficiency) + latency``. With tensor parallelism every GPU holds
its shard of the KV heads and has its own link (NVLink port, or the one RDMA NIC per GPU of a DGX/HGX H100), so a
shard-to-shard copy runs ``min(tp_prefill, tp_decode)`` links in parallel (``lanes``). Transfers on one link
queue behind each other (``KVLink``): one in flight per prefill-to-decode pair of instances.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.sim.model_specs import ModelSpec

GBIT = 1e9 / 8  # bytes/s in one Gb/s


@dataclass(frozen=True)
class LinkSpec:
    """One device's link to another instance: datasheet bandwidth per direction, latency, achieved fraction."""

    name: str
    bandwidth: float  # bytes/s per device per direction
    latency_s: float  # fixed cost of one transfer (setup, completion notification)
    efficiency: float  # fraction of ``bandwidth`` a bulk KV copy reaches
    per_device: bool = True  # each GPU of the instance has its own link (lanes = min(tp_p, tp_d)); else one

    def seconds(self, num_bytes: float, lanes: int = 1) -> float:
        """How long ``num_bytes`` take over ``lanes`` such links in parallel (a zero-byte transfer: latency)."""
        lanes = lanes if self.per_device else 1
        if self.bandwidth == float("inf"):
            return self.latency_s
        return num_bytes / (lanes * self.bandwidth * self.efficiency) + self.latency_s

    def describe(self) -> str:
        bw = "infinite" if self.bandwidth == float("inf") else f"{self.bandwidth / 1e9:g} GB/s"
        return (f"{self.name}: {bw} per direction{' per GPU' if self.per_device else ' in all'}, "
                f"{self.efficiency:.0%} efficiency, {self.latency_s * 1e6:g} us per transfer")


LINKS: dict[str, LinkSpec] = {
    # H100 SXM NVLink 4: 900 GB/s both directions per GPU, 450 each way; a copy engine reaches ~80% of it.
    "nvlink": LinkSpec("nvlink", 450e9, 10e-6, 0.8),
    # ConnectX-7 400 Gb/s InfiniBand/RoCE, one NIC per GPU (DGX H100); GPUDirect RDMA reaches ~80-90% on bulk
    # writes (we assume 80%), plus ~50 us to register, post and signal completion per transfer.
    "rdma-400g": LinkSpec("rdma-400g", 400 * GBIT, 50e-6, 0.8),
    # The slow case: one 25 Gb/s Ethernet NIC for the whole instance, TCP (60% achieved, 200 us per transfer).
    "ethernet-25g": LinkSpec("ethernet-25g", 25 * GBIT, 200e-6, 0.6, per_device=False),
    # One machine, Ray's object store between two replica processes (conveyor serve --disaggregate): measured by
    # scripts/kv_transfer_bench.py on a 2-vCPU EPYC (docs/disaggregation.md), end to end, so 100% "efficiency";
    # the latency is the hand-off's extra Serve hop and fetch. --kv-link-gbps resets the bandwidth.
    "local-object-store": LinkSpec("local-object-store", 0.85e9, 10e-3, 1.0, per_device=False),
    # The ideal: no transfer time at all (the tests' bound, and "what if the link were free").
    "infinite": LinkSpec("infinite", float("inf"), 0.0, 1.0),
}


def get_link(name: str) -> LinkSpec:
    key = name.lower()
    if key not in LINKS:
        raise ValueError(f"unknown KV link {name!r}; known: {', '.join(LINKS)}")
    return LINKS[key]


def kv_bytes_per_token(spec: ModelSpec, dtype_bytes: int = 2) -> int:
    """Bytes one token's K and V take over all layers (the whole model, all TP shards together)."""
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype_bytes


class KVLink:
    """A link between one prefill and one decode instance: transfers run one after another (FIFO)."""

    def __init__(self, spec: LinkSpec, lanes: int = 1) -> None:
        self.spec, self.lanes = spec, lanes
        self.free_at = 0.0  # when the transfer in flight (if any) ends
        self.bytes_moved = 0.0
        self.busy_s = 0.0

    def transfer(self, num_bytes: float, now: float) -> tuple[float, float]:
        """Queue a transfer at ``now``; return (start, end) on the virtual clock."""
        start = max(now, self.free_at)
        seconds = self.spec.seconds(num_bytes, self.lanes)
        self.free_at = start + seconds
        self.bytes_moved += num_bytes
        self.busy_s += seconds
        return start, self.free_at
