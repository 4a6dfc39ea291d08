"""The numbers behind the claims table (README, docs/simulator.md): the seeds' claims checked on the simulator.

Llama-3-70B on 8x H100-SXM (tensor parallel 8, 400 GiB of KV cache) and Llama-3-8B on one H100 (50 GiB of KV),
on long-tail traffic from ``conveyor bench workload longtail`` (80% chat turns, 20% RAG prompts) and on small
traces built here for the claims about one batch. Every run is a ``conveyor bench compare --simulate`` command,
printed before it runs; its table, plots and report.md land in ``--out/<name>``.

    .venv/bin/python scripts/sim_claims.py --out out/claims
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
from pathlib import Path

from conveyor.bench.workload import Workload, WorkloadRequest
from conveyor.bench.workload_gen import longtail
from conveyor.cli import main as conveyor

SETUPS = {  # name -> model, tensor parallel size, KV cache GiB over all GPUs, long-tail rates (req/s) to replay
    "70b-8xh100": ("llama-3-70b", 8, 400, (4, 16, 32)),
    "8b-1xh100": ("llama-3-8b", 1, 50, (6, 24, 48)),
}


def trace(name: str, lengths: list[tuple[int, int, float]], seed: int = 0) -> Workload:
    """A hand-made trace: (prompt tokens, output tokens, arrival s) per request, random prompt ids."""
    rng = random.Random(seed)
    reqs = [WorkloadRequest(i, t, [rng.randrange(3, 32000) for _ in range(p)], None, o, "",
                            {"temperature": 0.0, "ignore_eos": True}) for i, (p, o, t) in enumerate(lengths)]
    return Workload(name, reqs)


def run(out: Path, name: str, setup: str, workload: Path, *flags: str) -> dict:
    model, tp, kv, _ = SETUPS[setup]
    target = out / setup / name
    argv = ["bench", "compare", "--workload", str(workload), "--simulate", "h100-sxm", "--model", model,
            "--tensor-parallel-size", str(tp), "--kv-cache-memory", str(kv), "--out", str(target), *flags]
    print("$ conveyor " + shlex.join(argv), flush=True)
    conveyor(argv)
    return json.loads((target / "results.json").read_text())


def utilization(run_: dict) -> str:
    e, s = run_["engine"], run_["sim"]
    return (f"useful slots {e['useful_slot_fraction']:.0%}, MFU {s['mfu']:.0%}, MBU {s['mbu']:.0%}, "
            f"out {run_['summary']['output_throughput']:.0f} tok/s")


def latency(run_: dict) -> str:
    s = run_["summary"]
    return (f"TTFT p50/p99 {s['ttft']['p50']:.2f}/{s['ttft']['p99']:.2f} s, ITL p50/p99 {s['itl']['p50'] * 1e3:.1f}/"
            f"{s['itl']['p99'] * 1e3:.1f} ms, E2E p50/p99 {s['e2e']['p50']:.1f}/{s['e2e']['p99']:.1f} s, "
            f"out {s['output_throughput']:.0f} tok/s")


def claims_for(setup: str, out: Path, traces: dict[str, Path]) -> list[str]:
    lines = [f"## {setup}"]
    say = lines.append
    rates = SETUPS[setup][3]

    # 1 + 4a: utilization and throughput, static vs continuous, everyone at t=0
    res = run(out, "offline", setup, traces["longtail"], "--offline", "--no-plots", "--policies",
              "static,continuous,chunked", "--max-num-seqs", "32,256")
    by = {r["label"]: r for r in res["runs"]}
    for label, r in by.items():
        say(f"offline {label}: {utilization(r)}, wasted {r['engine']['wasted_fraction']:.0%}")
    tok_s = {label: r["summary"]["output_throughput"] for label, r in by.items()}
    say(f"offline throughput continuous B=256 / static B=32: {tok_s['continuous B=256'] / tok_s['static B=32']:.1f}x, "
        f"continuous / static at B=32: {tok_s['continuous B=32'] / tok_s['static B=32']:.1f}x")

    # 1: tails online, at rates below static's capacity and above it
    res = run(out, "online", setup, traces["longtail"], "--no-plots", "--policies", "static,continuous,chunked",
              "--max-num-seqs", "32", "--request-rate", ",".join(map(str, rates)))
    for r in res["runs"]:
        say(f"online {r['label']}: {latency(r)}; {utilization(r)}")

    # 2: one 2,000-token answer in a static batch of 32 whose other answers are 20 tokens
    res = run(out, "one-long-answer", setup, traces["one_long_answer"], "--offline", "--no-plots", "--policies",
              "static,continuous", "--max-num-seqs", "32")
    static = res["runs"][0]
    steps = static["steps"]
    busy = sum(s["end"] - s["start"] for s in steps)
    idle31 = sum(s["end"] - s["start"] for s in steps if s["num_idle_slot_tokens"] == 31)
    say(f"one long answer, static B=32: {idle31 / busy:.1%} of the batch's time has 31 idle slots; wasted tokens "
        f"{static['engine']['wasted_fraction']:.1%}; batch wall {static['summary']['duration_s']:.2f} s")

    # 3: a 4,000-token prompt padded beside 50-token ones (static) vs the same prefill unpadded (continuous)
    for n in (2, 32):
        res = run(out, f"padded-prefill-{n}", setup, traces[f"padded_{n}"], "--offline", "--no-plots",
                  "--policies", "static,continuous", "--max-num-seqs", str(n))
        static, cont = res["runs"]
        pad_step, plain_step = static["steps"][0], cont["steps"][0]
        needed = pad_step["num_prefill_tokens"]
        computed = needed + pad_step["num_padding_tokens"]
        padded_s, plain_s = pad_step["end"] - pad_step["start"], plain_step["end"] - plain_step["start"]
        say(f"padded prefill, batch {n}: {computed} tokens computed for {needed} needed ({computed / needed:.1f}x); "
            f"the short prompt's row {4000 / 50:.0f}x its own length; step time padded {1e3 * padded_s:.1f} ms vs "
            f"{1e3 * plain_s:.1f} ms unpadded ({padded_s / plain_s:.1f}x)")

    # 4b: paged vs one slab per request (max_model_len 8192) at equal KV memory, continuous batching
    res = run(out, "paged-vs-slab", setup, traces["longtail"], "--offline", "--no-plots", "--policies",
              "continuous", "--kv-layout", "paged,slab", "--max-model-len", "8192")
    paged, slab = res["runs"]
    say(f"paged vs slab (offline, continuous): {paged['summary']['output_throughput']:.0f} vs "
        f"{slab['summary']['output_throughput']:.0f} tok/s = "
        f"{paged['summary']['output_throughput'] / slab['summary']['output_throughput']:.2f}x; peak concurrency "
        f"{paged['engine']['peak_concurrency']} vs {slab['engine']['peak_concurrency']}")
    res = run(out, "paged-vs-slab-tight", setup, traces["longtail"], "--offline", "--no-plots", "--policies",
              "continuous", "--kv-layout", "paged,slab", "--max-model-len", "8192", "--kv-cache-memory",
              str(SETUPS[setup][2] // 5))
    paged, slab = res["runs"]
    ratio = paged["summary"]["output_throughput"] / slab["summary"]["output_throughput"]
    say(f"paged vs slab with 1/5 the KV memory: {ratio:.2f}x (peak concurrency {paged['engine']['peak_concurrency']} "
        f"vs {slab['engine']['peak_concurrency']})")

    # 5: thirty decodes, then a 4,000-token prompt arrives: whole-prompt prefill vs 512-token chunks
    res = run(out, "long-prompt-stall", setup, traces["stall"], "--no-plots", "--policies", "continuous,chunked",
              "--max-num-batched-tokens", "512")
    for r in res["runs"]:
        gaps = [b - a for t in r["timings"] if t["prompt_tokens"] < 1000
                for a, b in zip(t["token_times"], t["token_times"][1:])]
        ttft = next(t["first_token"] - t["arrival"] for t in r["timings"] if t["prompt_tokens"] >= 1000)
        say(f"stall, {r['label']}: the 30 decodes' ITL p50 {r['summary']['itl']['p50'] * 1e3:.1f} ms, max "
            f"{max(gaps) * 1e3:.1f} ms; the long prompt's TTFT {ttft * 1e3:.0f} ms")

    # 6: max_num_seqs under load
    res = run(out, "max-num-seqs", setup, traces["longtail"], "--no-plots", "--policies", "chunked",
              "--max-num-seqs", "8,32,128,256", "--request-rate", str(rates[-1]))
    for r in res["runs"]:
        say(f"max_num_seqs {r['label']} at {rates[-1]} req/s: {latency(r)}")

    # 7: dynamic batching's max_wait_ms, at a load that leaves the engine idle between batches and at a busy one
    res = run(out, "max-wait-ms", setup, traces["longtail"], "--no-plots", "--policies", "dynamic",
              "--max-num-seqs", "32", "--max-wait-ms", "0,50,200,1000", "--request-rate", f"1,{rates[0]}")
    for r in res["runs"]:
        say(f"max_wait_ms {r['label']}: {latency(r)}")

    # 8: block size, with KV memory tight enough that fragmentation could matter
    res = run(out, "block-size", setup, traces["longtail"], "--offline", "--no-plots", "--policies", "chunked",
              "--block-size", "1,8,16,32,128,512", "--kv-cache-memory", str(SETUPS[setup][2] // 10))
    for r in res["runs"]:
        say(f"block size {r['label']} (KV 1/10): out {r['summary']['output_throughput']:.0f} tok/s, KV waste "
            f"{r['engine']['kv_waste']:.1%}, preemptions {r['engine']['preemptions']}, peak concurrency "
            f"{r['engine']['peak_concurrency']}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/claims")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--setups", default=",".join(SETUPS))
    ns = parser.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    traces = {
        "longtail": longtail(ns.num_requests, seed=7, rate=10.0),
        "one_long_answer": trace("one-long-answer", [(20, 2000, 0.0)] + [(20, 20, 0.0)] * 31),
        "padded_2": trace("padded-2", [(4000, 1, 0.0), (50, 1, 0.0)]),
        "padded_32": trace("padded-32", [(4000, 1, 0.0)] + [(50, 1, 0.0)] * 31),
        "stall": trace("stall", [(200, 300, 0.0)] * 30 + [(4000, 50, 1.0)]),
    }
    paths = {}
    for name, workload in traces.items():
        paths[name] = out / f"{name}.json"
        workload.save(paths[name])
    lines = []
    for setup in ns.setups.split(","):
        lines += claims_for(setup, out, paths) + [""]
    (out / "claims.txt").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
