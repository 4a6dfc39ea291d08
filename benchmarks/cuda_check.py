"""The CUDA path, checked on a machine with a GPU: correctness against the CPU reference, then throughput.

No development or CI machine has a GPU, so nothing else runs conveyor on CUDA. This script is what a session lent
one runs (docs/benchmarks.md, "The CUDA path"):

    PYTHONPATH=. python benchmarks/cuda_check.py --out cuda_check.json

Correctness, on a small random Llama written here with transformers (float32, real safetensors, a word-level
tokenizer): the same prompts, greedy, through the CPU ``reference`` backend and through the engine on CUDA, with
chunked prefill, prefix caching, preemption (a KV pool too small for the batch) and n-gram speculation on the
CUDA side, and each attention backend that runs there (``triton`` where Triton imports, ``cpu-torch``); tokens
must match and logprobs agree to float32 rounding. transformers' own greedy decode on CUDA is
the third opinion. Throughput, on a random Llama of TinyLlama-1.1B's shape in bfloat16: the offline batch
(prompts of ``--prompt-len`` random tokens, ``--output-len`` tokens each, ``ignore_eos``) and one request's decode
rate, beside transformers' ``generate`` for that one request. Exits non-zero when a correctness check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from conveyor import LLM, SamplingParams

TINY = dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048)
# TinyLlama-1.1B's shape: what a GPU's throughput is worth reporting on
DEVICE = "cuda"  # --device cpu: a dry run of this script where there is no GPU
LARGE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, max_position_embeddings=4096)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# docs/benchmarks.md, "The CUDA path" (2026-12-04, cpu-torch on an H200): the offline batch of 256 x (512 in, 256 out)
OFFLINE_BEFORE_S = 19.28
# sim.hardware's names of the GPUs a device name may contain, for their HBM bandwidth
GPU_HARDWARE = {"H200": "h200", "H100": "h100-sxm", "A100": "a100-80gb"}


def gpu_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "none"


def decode_roofline(path: Path) -> float | None:
    """Tokens/s a batch-1 decode of the model at ``path`` would reach streaming every weight once per token at the
    GPU's effective HBM bandwidth (sim.hardware: datasheet x memory efficiency), the embedding table left out (a
    token reads one row of it); None for a GPU sim.hardware does not know."""
    from conveyor.sim.hardware import get_hardware

    name = next((hw for key, hw in GPU_HARDWARE.items() if key in gpu_name()), None)
    if name is None:
        return None
    hardware = get_hardware(name)
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    embedding = LARGE["vocab_size"] * LARGE["hidden_size"] * 2  # bfloat16
    return hardware.mem_bandwidth * hardware.memory_efficiency / (weights - embedding)


def triton_runs() -> bool:
    """Whether the "triton" attention backend runs here: Triton installed, and CUDA (or its interpreter on a CPU)."""
    from conveyor.layers.attention.triton_paged import triton_serves

    return triton_serves(DEVICE, torch.float32, TINY["hidden_size"] // TINY["num_attention_heads"])


def write_llama(path: Path, shape: dict, dtype: torch.dtype) -> Path:
    """A random Llama saved as a Hugging Face directory, with a word-level tokenizer of its vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.checkpoints import write_word_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False, **shape)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, shape["vocab_size"])
    return path


def random_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(4, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(4, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs], o.metrics.num_preemptions)
            for o in outs]


def compare(name: str, ref, got) -> dict:
    """Token agreement and logprob drift of ``got`` against ``ref``, request by request, up to the first
    divergence (after it the contexts differ, and so may everything)."""
    same = sum(a[0] == b[0] for a, b in zip(ref, got))
    drift = 0.0
    for (rt, rl, _), (gt, gl, _) in zip(ref, got):
        for i, (x, y) in enumerate(zip(rt, gt)):
            drift = max(drift, abs(rl[i] - gl[i]))
            if x != y:
                break
    preempted = sum(g[2] for g in got)
    row = {"check": name, "identical_requests": same, "requests": len(ref), "max_logprob_diff": drift,
           "preemptions": preempted}
    print(f"  {name:<44} identical {same}/{len(ref)}   max |logprob diff| {drift:.2e}   preemptions {preempted}",
          flush=True)
    return row


def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: int, dtype: torch.dtype) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=DEVICE)
            gen = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(ids), pad_token_id=3)
            out.append(gen[0, len(p):].tolist())
    return out


def correctness(workdir: Path) -> tuple[list[dict], bool]:
    print("correctness: random Llama", TINY, flush=True)
    path = write_llama(workdir / "tiny", TINY, torch.float32)
    prompts = random_prompts(24, (3, 400), TINY["vocab_size"], seed=1)
    prompts += random_prompts(8, (5, 60), TINY["vocab_size"], seed=2, shared_prefix=96)  # prefix-cache hits
    max_tokens = 48
    common = dict(dtype="float32", seed=0, max_model_len=1024)

    ref = greedy(LLM(str(path), device="cpu", attention_backend="reference", **common), prompts, max_tokens)
    rows = []
    configs = {
        f"{DEVICE}, defaults": dict(),
        f"{DEVICE}, chunked prefill (64-token steps)": dict(max_num_batched_tokens=64, long_prefill_token_threshold=32),
        f"{DEVICE}, prefix caching": dict(enable_prefix_caching=True),
        f"{DEVICE}, preemption (66-block pool)": dict(num_kv_blocks=66, block_size=16),
        f"{DEVICE}, n-gram speculation k=4": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                                 "adaptive": False}),
        f"{DEVICE}, cpu-torch backend": dict(attention_backend="cpu-torch"),
    }
    if triton_runs():  # the Triton paged attention backend, named (auto picks it only without flash-attn), and the
        # decode graphs over it (--cuda-graphs, a CUDA device only: the CPU dry run under the interpreter skips them)
        configs[f"{DEVICE}, triton backend"] = dict(attention_backend="triton")
        if DEVICE == "cuda":
            configs[f"{DEVICE}, triton + CUDA graphs for decodes"] = dict(attention_backend="triton", cuda_graphs=True)
        configs[f"{DEVICE}, triton, chunked prefill + prefix caching"] = dict(
            attention_backend="triton", max_num_batched_tokens=64, long_prefill_token_threshold=32,
            enable_prefix_caching=True)
    for name, extra in configs.items():
        llm = LLM(str(path), device=DEVICE, **common, **extra)
        if name == f"{DEVICE}, defaults":
            print(f"  attention backend on {DEVICE}: {getattr(llm.engine.executor, 'backend', '?')}", flush=True)
        rows.append(compare(name, ref, greedy(llm, prompts, max_tokens)))
        del llm
        empty_cache()
    hf = hf_greedy(path, prompts, max_tokens, torch.float32)
    same = sum(a[0] == h for a, h in zip(ref, hf))
    print(f"  {f'transformers on {DEVICE} (tokens only)':<44} identical {same}/{len(ref)}", flush=True)
    rows.append({"check": f"transformers on {DEVICE}", "identical_requests": same, "requests": len(ref)})
    bf16 = greedy(LLM(str(path), device=DEVICE, dtype="bfloat16", seed=0, max_model_len=1024), prompts, max_tokens)
    agree = [sum(x == y for x, y in zip(a[0], b[0])) / max_tokens for a, b in zip(ref, bf16)]
    print(f"  {DEVICE} bfloat16 vs cpu float32: mean token agreement {sum(agree) / len(agree):.3f} (report only)")
    rows.append({"check": f"{DEVICE} bfloat16 token agreement (report only)", "mean": sum(agree) / len(agree)})
    ok = all(r["identical_requests"] == r["requests"] for r in rows if "identical_requests" in r
             and r["check"] != f"transformers on {DEVICE}") and all(r.get("max_logprob_diff", 0) < 1e-3 for r in rows)
    return rows, ok


def throughput(workdir: Path, num_prompts: int, prompt_len: int, output_len: int,
               attention_backend: str = "auto", cuda_graphs: bool = False) -> list[dict]:
    print("throughput: random Llama", LARGE, "bfloat16", flush=True)
    path = write_llama(workdir / "large", LARGE, torch.bfloat16)
    rows = []
    llm = LLM(str(path), device=DEVICE, dtype="bfloat16", seed=0, max_num_seqs=256, max_num_batched_tokens=8192,
              attention_backend=attention_backend, cuda_graphs=cuda_graphs)
    print(f"  attention backend: {getattr(llm.engine.executor, 'backend', '?')}, CUDA graphs: {cuda_graphs}",
          flush=True)
    prompts = random_prompts(num_prompts, (prompt_len, prompt_len), LARGE["vocab_size"], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], SamplingParams(max_tokens=8), use_tqdm=False)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"run": f"offline batch: {num_prompts} x ({prompt_len} in, {output_len} out)", "wall_s": wall,
           "output_tok_s": gen / wall, "total_tok_s": (gen + num_prompts * prompt_len) / wall}
    print(f"  {row['run']}: {wall:.2f} s, {row['output_tok_s']:.0f} output tok/s, {row['total_tok_s']:.0f} "
          f"total tok/s", flush=True)
    if (num_prompts, prompt_len, output_len) == (256, 512, 256) and "H200" in gpu_name():
        print(f"  before the triton backend: {OFFLINE_BEFORE_S} s on an H200 (issue 55 asks <= "
              f"{OFFLINE_BEFORE_S / 5:.2f} s: {OFFLINE_BEFORE_S / wall:.2f}x now)", flush=True)
    rows.append(row)
    one = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompts[0][:128]}], one, use_tqdm=False)[0]
    times = out.outputs[0].token_times
    decode = (len(times) - 1) / (times[-1] - times[0])
    roof = decode_roofline(path)
    rows.append({"run": "conveyor batch-1 decode (128 in, 256 out)", "tok_s": decode,
                 "wall_s": time.perf_counter() - t0, "roofline_tok_s": roof})
    print(f"  conveyor batch-1 decode: {decode:.1f} tok/s" + (
        f", {decode / roof:.0%} of the weight-streaming roofline {roof:.0f} tok/s (issue 55 asks >= 50%)"
        if roof else ""), flush=True)
    del llm
    empty_cache()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    ids = torch.tensor([prompts[0][:128]], device=DEVICE)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=3)
        sync()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=256, min_new_tokens=256, do_sample=False, pad_token_id=3)
        sync()
        hf = 256 / (time.perf_counter() - t0)
    rows.append({"run": "transformers generate batch-1 (128 in, 256 out)", "tok_s": hf})
    print(f"  transformers generate batch-1: {hf:.1f} tok/s (prefill included); conveyor / transformers "
          f"{decode / hf:.2f}x", flush=True)
    return rows


def profile(workdir: Path, num_prompts: int, prompt_len: int, output_len: int) -> None:
    """Where the offline batch's time goes on this device: cProfile's top functions and torch's top operators."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    path = write_llama(workdir / "large", LARGE, torch.bfloat16)
    llm = LLM(str(path), device=DEVICE, dtype="bfloat16", seed=0, max_num_seqs=256, max_num_batched_tokens=8192)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(num_prompts, (prompt_len, prompt_len),
                                                                  LARGE["vocab_size"], seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=8), use_tqdm=False)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with torch_profile(activities=activities) as tp:
        llm.generate(prompts, params, use_tqdm=False)
    key = "cuda_time_total" if DEVICE == "cuda" else "cpu_time_total"
    print(tp.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-correctness", action="store_true", help="throughput only (a before/after rerun)")
    ap.add_argument("--profile", action="store_true", help="only profile the offline batch (no checks)")
    ap.add_argument("--large", default=None, help="JSON overrides of the throughput model's shape")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    ap.add_argument("--cuda-graphs", action="store_true", help="the throughput runs with --cuda-graphs")
    ap.add_argument("--attention-backend", default="auto", help="the throughput runs' backend (auto: triton where "
                    "flash-attn is absent; cpu-torch: the batched torch ops, for a before/after)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if args.large:
        LARGE.update(json.loads(args.large))
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    gpu = gpu_name()
    print(f"torch {torch.__version__}, {gpu}", flush=True)
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            profile(Path(tmp), args.num_prompts, args.prompt_len, args.output_len)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        rows, ok = ([], None) if args.skip_correctness else correctness(Path(tmp))
        if not args.skip_throughput:
            rows += throughput(Path(tmp), args.num_prompts, args.prompt_len, args.output_len,
                               args.attention_backend, args.cuda_graphs)
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "gpu": gpu,
                                              "correct": ok, "rows": rows}, indent=1))
    print("correctness:", {None: "skipped", True: "PASS", False: "FAIL"}[ok])
    return 1 if ok is False else 0


if __name__ == "__main__":
    sys.exit(main())
