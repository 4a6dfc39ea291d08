"""How to move a prompt's KV from a prefill replica to a decode replica on one machine: measured three ways.

Two Ray Serve deployments (one CPU each) and this process as the ingress, as ``conveyor serve --disaggregate``
runs them. For each size, the producer fills a tensor of that many bytes (the exported KV), and the time is from
the ingress asking for it to the consumer having copied it into a tensor of its own (its KV cache):

- ``object-store``: the producer ``ray.put``s it and streams back a reference; the ingress passes the reference
  on; the consumer ``ray.get``s it (a zero-copy view of the shared-memory store) and copies it in.
- ``by-value``: the producer streams the bytes themselves; the ingress receives them and sends them on as the
  consumer's argument (what a handoff without references costs: two trips through the ingress).
- ``shm``: the producer writes a ``multiprocessing.shared_memory`` segment and streams back its name; the
  consumer attaches, copies and unlinks it (no Ray in the data path; one machine only).

    PYTHONPATH=. .venv/bin/python scripts/kv_transfer_bench.py --sizes-mb 1 8 24 64 --repeats 7
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import numpy as np
import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

METHODS = ("object-store", "by-value", "shm")


@serve.deployment(ray_actor_options={"num_cpus": 1})
class Producer:
    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch

    async def make(self, method: str, num_bytes: int):
        kv = self.torch.full((num_bytes,), 7, dtype=self.torch.uint8)  # the exported KV, as gather_kv leaves it
        data = kv.numpy()
        if method == "object-store":
            yield [ray.put(data)]
        elif method == "by-value":
            yield data
        else:
            from multiprocessing import shared_memory

            shm = shared_memory.SharedMemory(create=True, size=num_bytes)
            np.frombuffer(shm.buf, dtype=np.uint8)[:] = data
            name = shm.name
            shm.close()
            yield name


@serve.deployment(ray_actor_options={"num_cpus": 1})
class Consumer:
    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.cache = torch.zeros(256 << 20, dtype=torch.uint8)  # the KV cache the bytes land in

    async def take(self, method: str, payload, num_bytes: int) -> int:
        if method == "object-store":
            data = await asyncio.wait_for(payload[0], 30)
        elif method == "by-value":
            data = payload
        else:
            from multiprocessing import shared_memory

            shm = shared_memory.SharedMemory(name=payload)
            data = np.frombuffer(shm.buf, dtype=np.uint8)
        self.cache[:num_bytes].copy_(self.torch.from_numpy(np.asarray(data)))
        if method == "shm":
            del data
            shm.close()
            shm.unlink()
        return int(self.cache[num_bytes - 1])


async def one(producer, consumer, method: str, num_bytes: int) -> float:
    start = time.perf_counter()
    stream = producer.options(stream=True).make.remote(method, num_bytes)
    payload = await stream.__anext__()
    async for _ in stream:
        pass
    assert await consumer.take.remote(method, payload, num_bytes) == 7
    return time.perf_counter() - start


async def run(sizes_mb: list[float], repeats: int) -> list[dict]:
    producer, consumer = DeploymentHandle("Producer", "kvp"), DeploymentHandle("Consumer", "kvc")
    rows = []
    for mb in sizes_mb:
        n = int(mb * (1 << 20))
        for method in METHODS:
            await one(producer, consumer, method, n)  # warm: first calls set up routing and the store
            times = [await one(producer, consumer, method, n) for _ in range(repeats)]
            rows.append({"size_mb": mb, "method": method, "median_ms": 1e3 * statistics.median(times),
                         "min_ms": 1e3 * min(times), "GB_s": n / statistics.median(times) / 1e9})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 8, 24, 64])
    ap.add_argument("--repeats", type=int, default=7)
    ns = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
    serve.run(Producer.bind(), name="kvp", route_prefix=None)
    serve.run(Consumer.bind(), name="kvc", route_prefix=None)
    try:
        rows = asyncio.run(run(ns.sizes_mb, ns.repeats))
    finally:
        ray.shutdown()
    print(f"load average {os.getloadavg()[0]:.2f} (1 min)")
    print("| KV size | method | median | min | GB/s (median) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['size_mb']:g} MiB | {r['method']} | {r['median_ms']:.1f} ms | {r['min_ms']:.1f} ms | "
              f"{r['GB_s']:.2f} |")


if __name__ == "__main__":
    main()
