"""How many tokens the engine core computes past a stop string, now that the API process checks stop strings.

    python scripts/stop_overrun.py [--model conveyor-embedded-llama-40m-random] [--stop e]

Runs ``EngineCoreClient`` (the engine in its own process, as ``conveyor serve`` does) without HTTP, sends 1, 8, 32
and 64 concurrent sampled requests whose text soon meets the stop string, and reports the tokens that arrived for
requests the API side had already ended (``OutputProcessor.num_late_tokens``) per stopped request.
"""

from __future__ import annotations

import argparse
import asyncio

from conveyor import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.core_client import EngineCoreClient


async def run(model: str, stop: str) -> None:
    client = EngineCoreClient(EngineArgs(model=model)).wait_ready()
    client.start()
    try:
        for concurrency in (1, 8, 32, 64):
            before = client.output_processor.num_late_tokens

            async def one(i: int):
                params = SamplingParams(temperature=1.0, seed=i, max_tokens=200, ignore_eos=True, stop=[stop])
                stream = await client.add_request(f"r{concurrency}-{i}", {"prompt_token_ids": [10 + i, 20, 30]},
                                                  params)
                out = None
                async for out in stream:
                    pass
                return out.outputs[0]

            outs = await asyncio.gather(*(one(i) for i in range(concurrency)))
            await asyncio.sleep(1.0)  # tokens still on their way
            stopped = sum(o.finish_reason == "stop" for o in outs)
            late = client.output_processor.num_late_tokens - before
            print(f"{concurrency} concurrent: {stopped} stopped by the string, {late} tokens past it "
                  f"({late / max(stopped, 1):.2f} per stopped request)")
    finally:
        await client.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="conveyor-embedded-llama-40m-random")
    p.add_argument("--stop", default="e")
    ns = p.parse_args()
    asyncio.run(run(ns.model, ns.stop))
