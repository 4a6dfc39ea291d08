#!/usr/bin/env python3
"""A mixture of experts against llama.cpp: a random-weight Qwen3-MoE of a realistic shape (``SHAPE``: 1.76B
parameters, 64 experts, 8 a token, 0.32B of them active), written with transformers, converted by llama.cpp's
``convert_hf_to_gguf.py`` and quantized by ``llama-quantize``; conveyor against ``llama-bench`` (batch-1 decode) and
``llama-server`` (the long-tail trace over HTTP) on the same files and threads; and what batching does to the
experts a decode step reads.

    python benchmarks/moe_side_by_side.py make --out DIR --llama-quantize BIN [--types Q8_0,Q4_K_M]
    python benchmarks/moe_side_by_side.py experts --gguf DIR/moe-Q8_0.gguf [--batches 1,4,16,64] [--steps 12]
    python benchmarks/moe_side_by_side.py compare --gguf DIR/moe-Q8_0.gguf [--gguf ...] --llama-bench BIN \
        --llama-server BIN [--threads 2] [--rounds 3] [--num-requests 100]

``make``: the checkpoint in bfloat16 (router weights random too, so tokens spread over the experts), a tiny
SentencePiece tokenizer (the tests' own, ``tests/helpers/families.py``; the converter pads the vocabulary to the
config's 32,000, which the trace's token ids use), ``convert_hf_to_gguf.py --outtype bf16`` (through the tests'
driver: the Qwen3-MoE converter reads only a BPE tokenizer it recognises, so it is pointed at its own SentencePiece
reader), then ``llama-quantize`` to each of ``--types``.

``experts``: in one engine, B requests decoding together (64-token prompts), for each B: ms per decode step with
the native layer stack (best of 2 runs of ``--steps`` steps), then, on the per-layer path, each layer's router
logits read back: how many distinct experts a step touches per layer, and from the experts' stored bytes (what a
step streams: each chosen expert's gate_up and down once) the weight bytes per step and per token, beside the
uniform-routing expectation ``E (1 - (1 - k/E)^B)`` of ``sim.model_specs``.

``compare``: per GGUF file, ``--rounds`` rounds, the engines alternating inside each (the order swapped every
round): ``llama-bench -p 0 -n 128 -r 1`` (tg128); conveyor serve: ``--streams`` batch-1 streams (the trace's first
prompt, ``--output-tokens`` tokens, tok/s after the first token: ``gguf_side_by_side.batch1_decode``) and the
trace sent at t=0 (burst); llama-server (32 slots, ``gguf_side_by_side.llama_server_cmd``): the same burst. A round
gives two ratios (conveyor's median stream / tg128; conveyor's burst output tok/s / llama-server's); the summary
gives their median and range over rounds (the noise), with the load average and CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for path in (HERE, REPO):
    if path not in sys.path:
        sys.path.insert(0, path)

import gguf_side_by_side as sbs  # noqa: E402

# OLMoE-1B-7B's routing (64 experts, 8 a token, 16 layers) at half its width, in Qwen3-MoE's layers (q/k norms,
# 16 query / 4 KV heads of 128): 1.76B parameters, 1.61B of them in experts, 0.32B a token (attention 84M, 8 experts
# 201M, lm_head 33M). The experts' width is a multiple of 256, so llama-quantize's Q4_K_M holds them in K-quants
# (Q4_K, and Q6_K for half the layers' down projections) as it does for published MoE models
SHAPE = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
             num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, intermediate_size=3072,
             vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-6, norm_topk_prob=True,
             tie_word_embeddings=False, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2)


def machine() -> str:
    """The CPU model and the load average now (the numbers' context)."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        flags = [f for f in ("avx512f", "avx512_vnni", "avx512_bf16", "amx_int8") if f in info["flags"].split()]
        cpu = f"{info['model name']} (family {info['cpu family']} model {info['model']}: {' '.join(flags)})"
    except (OSError, KeyError):
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} CPUs; load average {load}"


def check_shape(config: dict) -> None:
    """Refuse an existing checkpoint whose config differs from ``SHAPE`` (numbers measured on another shape would
    be reported as this one's). transformers 5 writes ``num_experts`` as ``num_local_experts`` and
    ``rope_theta`` inside ``rope_parameters``."""
    aliases = {"num_experts": ("num_experts", "num_local_experts")}
    rope = config.get("rope_parameters") or {}
    wrong = []
    for key, want in SHAPE.items():
        names = aliases.get(key, (key,))
        have = next((config[n] for n in names if n in config), rope.get(key))
        if have != want:
            wrong.append(f"{key}={have!r} (want {want!r})")
    if wrong:
        raise SystemExit(f"the existing checkpoint is not the benchmark's shape: {', '.join(wrong)}; "
                         "remove its directory or use another --out")


# ---- make ----------------------------------------------------------------------------------------------------
def make(ns: argparse.Namespace) -> int:
    import torch
    import transformers

    from tests.helpers.families import TINIES, convert_all, write_tokenizer

    out = Path(ns.out)
    hf_dir, bf16 = out / "hf", out / "moe-bf16.gguf"
    if not (hf_dir / "config.json").exists():
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)  # 4 GB of weights instead of 8
        t = time.perf_counter()
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**SHAPE)).eval()
        params = sum(p.numel() for p in model.parameters())
        print(f"built {params / 1e9:.2f}B parameters in {time.perf_counter() - t:.0f} s", flush=True)
        hf_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(hf_dir, safe_serialization=True)
        del model
    else:  # a checkpoint written before (the weights take minutes): it must have this SHAPE
        check_shape(json.loads((hf_dir / "config.json").read_text()))
    if not (hf_dir / "tokenizer.model").exists():  # last, so a run stopped after the weights resumes here
        write_tokenizer(hf_dir, TINIES["qwen3_moe"])
    if not bf16.exists():
        t = time.perf_counter()
        part = bf16.with_suffix(".part")  # renamed once whole
        convert_all([(hf_dir, part, "bf16")], timeout_s=4 * 3600)
        part.rename(bf16)
        print(f"converted in {time.perf_counter() - t:.0f} s", flush=True)
    for qtype in filter(None, ns.types.split(",")):
        dst = out / f"moe-{qtype}.gguf"
        if not dst.exists():
            subprocess.run([ns.llama_quantize, str(bf16), str(dst), qtype, str(ns.threads)], check=True,
                           stdout=subprocess.DEVNULL)
        print(f"{dst}: {dst.stat().st_size / 2**30:.2f} GiB", flush=True)
    return 0


# ---- experts -------------------------------------------------------------------------------------------------
def expert_bytes(net) -> tuple[int, int]:
    """(bytes one expert streams when it runs, its gate_up and down as held, averaged over the layers; the bytes
    of the other linears a step reads once: attention, routers, lm_head)."""
    from conveyor.layers.linear import PackedLinear
    from conveyor.layers.quantized import QuantLinear

    def held(linear) -> int:  # quantized: its packed blocks; float: the skinny copy decode steps stream
        if isinstance(linear, QuantLinear):
            return linear.quant.nbytes
        return (linear.skinny if linear.skinny is not None else linear.weight).numel() * linear.weight.element_size()

    # the mean over layers: llama.cpp's Q4_K_M holds half the layers' down projections in Q6_K (held in float32)
    per_expert = statistics.mean(held(layer.mlp.experts[0].gate_up_proj) + held(layer.mlp.experts[0].down_proj)
                                 for layer in net.layers)
    shared = sum(held(m) for name, m in net.named_modules()
                 if ".experts." not in name and isinstance(m, (QuantLinear, PackedLinear)))
    return per_expert, shared


def experts(ns: argparse.Namespace) -> int:
    import torch

    from conveyor.core.sampling_params import SamplingParams
    from conveyor.engine.llm import LLM

    batches = [int(b) for b in ns.batches.split(",")]
    llm = LLM(ns.gguf, max_num_seqs=max(batches), max_model_len=ns.max_model_len, enable_prefix_caching=False,
              detokenize=False, seed=0, max_num_batched_tokens=4096)
    eng, net = llm.engine, llm.engine.model
    moe = net.config.moe
    per_expert, shared = expert_bytes(net)
    spec = eng.model_info.spec
    stack = net.native_stack
    print(f"{machine()}\n{os.path.basename(ns.gguf)}: {moe.num_experts} experts, {moe.top_k} a token, "
          f"{net.config.num_layers} layers; one expert {per_expert / 2**20:.2f} MiB as held, the other linears "
          f"{shared / 2**20:.0f} MiB; native stack {'on' if stack else 'off'}", flush=True)
    counts: list[tuple[int, int]] = []  # (rows, distinct experts) of each layer's step

    def recorder(gate):
        inner = gate.forward

        def forward(x):
            logits = inner(x)
            counts.append((x.shape[0], int(torch.topk(logits.float(), moe.top_k, dim=-1).indices.unique().numel())))
            return logits
        return forward

    ids = iter(range(10**9))

    def decode(batch: int, steps: int) -> float:
        """ms per step of ``steps`` decode steps of ``batch`` requests."""
        rng = torch.Generator().manual_seed(batch)
        for _ in range(batch):
            prompt = torch.randint(100, eng.model_info.vocab_size, (64,), generator=rng).tolist()
            eng.add_request(f"b{next(ids)}", {"prompt_token_ids": prompt},
                            SamplingParams(max_tokens=steps + 8, ignore_eos=True))
        for _ in range(3):  # the prompts (at most 4,096 tokens: one step), then two decode steps
            eng.step()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        elapsed = (time.perf_counter() - t) / steps
        while eng.has_unfinished_requests():
            eng.step()
        return elapsed * 1e3

    print("| B | distinct experts / layer / step: mean (min-max) | uniform routing | expert MiB / step | "
          "weight MiB / token | ms / step | tok/s |\n|---|---|---|---|---|---|---|")
    for batch in batches:
        ms = min(decode(batch, ns.steps) for _ in range(2))
        net.native_stack = None  # the per-layer path: its routers' logits are read back
        gates = [layer.mlp.gate for layer in net.layers]
        for gate in gates:
            gate.forward = recorder(gate)
        counts.clear()
        decode(batch, 4)
        for gate in gates:
            del gate.forward
        net.native_stack = stack
        decode_counts = [c for rows, c in counts if rows == batch]  # decode steps (the prompts' step left out)
        mean = statistics.mean(decode_counts)
        step_bytes = mean * per_expert * net.config.num_layers + shared
        print(f"| {batch} | {mean:.1f} ({min(decode_counts)}-{max(decode_counts)}) | "
              f"{spec.experts_touched(batch):.1f} | {mean * per_expert * net.config.num_layers / 2**20:.0f} | "
              f"{step_bytes / batch / 2**20:.1f} | {ms:.1f} | {batch / ms * 1e3:.1f} |", flush=True)
    print(f"(after: {machine()})")
    return 0


# ---- profile -------------------------------------------------------------------------------------------------
def streamed_bytes(net, gguf: str) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
    """What one batch-1 decode token streams, per part (attention with the routers, experts, lm_head): (conveyor's
    MiB by held form, the file's MiB by GGUF type). The file's bytes are what llama.cpp streams (it computes on
    the file's blocks); experts count top_k / E of each stack (every expert of a layer is held alike)."""
    from conveyor.layers.linear import PackedLinear
    from conveyor.layers.quantized import QuantLinear
    from conveyor.models.gguf_file import GGUFFile

    moe = net.config.moe
    share = moe.top_k / moe.num_experts
    parts: dict[str, tuple[dict[str, float], dict[str, float]]] = {}

    def add(name: str, side: int, form: str, nbytes: int) -> None:
        if "_exps" in name or ".experts." in name:
            key, nbytes = "experts", nbytes * share
        else:
            key = "lm_head" if name.split(".")[0] in ("lm_head", "output") else "attention+router"
        forms = parts.setdefault(key, ({}, {}))[side]
        forms[form] = forms.get(form, 0.0) + nbytes / 2**20

    for name, m in net.named_modules():
        if isinstance(m, QuantLinear):  # each part of a stack (Q4_K q/k beside a Q6_K v) in its own form
            for part in m.quant.chain():
                add(name, 0, part.source, part.part_nbytes)
        elif isinstance(m, PackedLinear):  # decode steps stream the skinny copy where there is one
            w = m.skinny if m.skinny is not None else m.weight
            add(name, 0, str(m.weight.dtype).replace("torch.", ""), w.numel() * m.weight.element_size())
    with GGUFFile(gguf) as f:
        for info in f.tensors.values():
            if not info.name.startswith("token_embd") and len(info.shape) >= 2:  # not the lookup, nor the norms
                add(info.name, 1, info.qtype.name, info.nbytes)
    return parts


def profile(ns: argparse.Namespace) -> int:
    import torch
    from step_profile import StepProfile

    from conveyor.core.sampling_params import SamplingParams
    from conveyor.engine.llm import LLM

    llm = LLM(ns.gguf, max_num_seqs=1, max_model_len=1024, enable_prefix_caching=False, detokenize=False, seed=0)
    eng = llm.engine
    print(f"{machine()}\n{os.path.basename(ns.gguf)}: batch-1 decode, {ns.steps} steps, native stack "
          f"{'on' if eng.model.native_stack else 'off'}", flush=True)
    prompt = torch.randint(100, eng.model_info.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    eng.add_request("p", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=ns.steps + 8, ignore_eos=True))
    for _ in range(3):  # the prompt, then two decode steps
        eng.step()
    with StepProfile(eng) as prof:
        for _ in range(ns.steps):
            eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    print("| part of the step | ms / step |\n|---|---|")
    for key, seconds in prof.summary().items():
        if seconds > 0:
            print(f"| {key} | {seconds / ns.steps * 1e3:.2f} |")
    print("\n| weights a batch-1 token streams | conveyor holds (MiB) | the file, as llama.cpp reads it (MiB) |"
          "\n|---|---|---|")
    total = [0.0, 0.0]
    for name, sides in streamed_bytes(eng.model, ns.gguf).items():
        cells = []
        for side, forms in enumerate(sides):
            total[side] += sum(forms.values())
            cells.append(" + ".join(f"{form} {mib:.1f}" for form, mib in sorted(forms.items())))
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    print(f"| all | {total[0]:.1f} | {total[1]:.1f} |")
    print(f"(after: {machine()})")
    return 0


# ---- compare -------------------------------------------------------------------------------------------------
def compare(ns: argparse.Namespace) -> int:
    from conveyor.bench.workload import load_workload

    workload = load_workload(ns.trace)
    if ns.num_requests is not None:
        workload = replace(workload, requests=workload.requests[: ns.num_requests])
    log_dir = ns.log_dir or tempfile.mkdtemp(prefix="moe-side-by-side-")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    per_slot = sbs.slot_context(workload, ns.output_tokens, sbs.batch1_prompt(workload).prompt_len)
    results = []
    print(machine(), flush=True)
    for gguf in map(os.path.abspath, ns.gguf):
        rounds = []
        for r in range(ns.rounds):
            row = {"round": r, "load_before": os.getloadavg()[0]}

            def llama() -> None:
                row["tg128"] = sbs.run_llama_bench(ns.llama_bench, gguf, ns.threads, 128, 1)["tg128"]
                port = sbs.free_port()
                cmd = sbs.llama_server_cmd(ns.llama_server, gguf, port, ns.threads, per_slot, ns.llama_server_arg)
                row["llama_burst"] = serve(cmd, port, None, streams=0)["burst"]

            def conveyor() -> None:
                port = sbs.free_port()
                res = serve(sbs.conveyor_cmd(gguf, port, ns.threads, ns.conveyor_arg), port, env, ns.streams)
                row["conveyor_burst"], row["streams"] = res["burst"], res["streams"]

            def serve(cmd, port, server_env, streams: int) -> dict:
                server = sbs.Server(os.path.basename(cmd[0]), cmd, port, log_dir, server_env)
                try:
                    server.wait_ready(ns.ready_timeout)
                    warm = replace(workload, requests=workload.requests[:4])
                    sbs.replay(server.url, warm, math.inf)
                    runs = [sbs.batch1_decode(server.url, sbs.batch1_prompt(workload), ns.output_tokens)["tok_s"]
                            for _ in range(streams)]
                    burst = sbs.replay(server.url, workload, math.inf)
                finally:
                    server.stop()
                return {"streams": runs, "burst": {k: burst[k] for k in ("duration_s", "output_throughput", "short")}}

            for engine in ((llama, conveyor) if r % 2 else (conveyor, llama)):
                engine()
            row["batch1_ratio"] = statistics.median(row["streams"]) / row["tg128"]
            row["trace_ratio"] = row["conveyor_burst"]["output_throughput"] / row["llama_burst"]["output_throughput"]
            row["load_after"] = os.getloadavg()[0]
            rounds.append(row)
            print(f"{os.path.basename(gguf)} round {r}: batch-1 {statistics.median(row['streams']):.1f} tok/s vs "
                  f"tg128 {row['tg128']:.1f} ({row['batch1_ratio']:.2f}x); burst "
                  f"{row['conveyor_burst']['output_throughput']:.1f} vs {row['llama_burst']['output_throughput']:.1f}"
                  f" out tok/s ({row['trace_ratio']:.2f}x); load {row['load_before']:.1f} -> {row['load_after']:.1f}",
                  flush=True)
        results.append({"gguf": gguf, "rounds": rounds})
    print("\n| GGUF | batch-1 / llama-bench tg128: median (range) | trace burst / llama-server: median (range) |"
          "\n|---|---|---|")
    for res in results:
        def cell(key: str) -> str:
            values = [r[key] for r in res["rounds"]]
            return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"
        print(f"| {os.path.basename(res['gguf'])} | {cell('batch1_ratio')} | {cell('trace_ratio')} |")
    print(f"(after: {machine()})")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"machine": machine(), "results": results}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make", help="write the random MoE, convert it, quantize it")
    p.add_argument("--out", required=True)
    p.add_argument("--llama-quantize", required=True)
    p.add_argument("--types", default="Q8_0,Q4_K_M")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.set_defaults(func=make)
    p = sub.add_parser("experts", help="distinct experts, bytes and time per decode step, by batch size")
    p.add_argument("--gguf", required=True)
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.set_defaults(func=experts)
    p = sub.add_parser("profile", help="where a batch-1 decode step's time goes, and the bytes a token streams")
    p.add_argument("--gguf", required=True)
    p.add_argument("--steps", type=int, default=32)
    p.set_defaults(func=profile)
    p = sub.add_parser("compare", help="paired rounds against llama-bench and llama-server")
    p.add_argument("--gguf", action="append", required=True)
    p.add_argument("--llama-bench", required=True)
    p.add_argument("--llama-server", required=True)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=3, help="conveyor batch-1 streams a round (their median)")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--trace", default=sbs.DEFAULT_TRACE)
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--conveyor-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--llama-server-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None)
    p.set_defaults(func=compare)
    ns = ap.parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    raise SystemExit(main())
