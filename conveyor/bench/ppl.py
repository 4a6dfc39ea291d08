"""``conveyor bench ppl --text FILE``: perplexity of the model on a text file, over sliding windows.

The text is tokenized once and cut into windows of ``--window`` tokens that start every ``--stride`` tokens; each
window scores only the tokens that no earlier window scored, with everything before them in the window as context
(Hugging Face's "perplexity of fixed-length models" recipe, so numbers compare with theirs). ``--chunks`` scores
as llama.cpp's ``llama-perplexity`` does instead, so that its number for the same GGUF and ``-c`` compares:
non-overlapping windows of ``--window`` tokens (a last partial one dropped), each scoring its second half with
its first half as context. All windows go to the engine at once as prompts with ``prompt_logprobs``: continuous
batching runs them together.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from conveyor.core.sampling_params import SamplingParams


@dataclass
class PerplexityResult:
    num_tokens: int  # tokens scored (every token of the text but the first)
    num_windows: int
    nll: float  # summed negative log-likelihood, nats
    wall_s: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.num_tokens)


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored) per window: tokens [first, end) are scored with context [begin, first)."""
    if window < 2 or not 0 < stride <= window:
        raise ValueError(f"need window >= 2 and 0 < stride <= window, got window {window}, stride {stride}")
    out, scored = [], 1  # token 0 has no context: nothing scores it
    begin = 0
    while scored < num_tokens:
        end = min(begin + window, num_tokens)
        out.append((begin, end, scored))
        scored = end
        begin += stride
    return out


def chunks(num_tokens: int, window: int) -> list[tuple[int, int, int]]:
    """``windows``' spans as llama-perplexity cuts them: [k * window, (k + 1) * window) for every whole window,
    each scoring from its middle on (the first window // 2 tokens are context only)."""
    if window < 2:
        raise ValueError(f"need window >= 2, got {window}")
    return [(b, b + window, b + window // 2) for b in range(0, num_tokens - window + 1, window)]


def perplexity(llm, token_ids: list[int], window: int, stride: int, llama_chunks: bool = False) -> PerplexityResult:
    """Perplexity of ``llm`` on ``token_ids`` (see the module docstring; ``llama_chunks``: ``--chunks``)."""
    spans = chunks(len(token_ids), window) if llama_chunks else windows(len(token_ids), window, stride)
    if not spans:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one window of {window}")
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": token_ids[b:e]} for b, e, _ in spans], params, use_tqdm=False)
    wall = time.perf_counter() - start
    nll, count = 0.0, 0
    for (begin, _, first), out in zip(spans, outs):
        scored = out.prompt_logprobs[first - begin:]
        nll -= sum(e.logprob for e in scored)
        count += len(scored)
    return PerplexityResult(count, len(spans), nll, wall)


def add_ppl_parser(sub) -> None:
    from conveyor.engine.args import EngineArgs

    p = sub.add_parser("ppl", help="perplexity of the model on a text file (sliding windows)")
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--window", type=int, default=1024, help="tokens per window (capped at max_model_len - 1)")
    p.add_argument("--stride", type=int, default=512, help="tokens between window starts")
    p.add_argument("--chunks", action="store_true", help="score as llama-perplexity -c WINDOW does: whole windows "
                                                         "side by side, each scoring its second half")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_main)


def _main(ns) -> int:
    from conveyor.engine.args import EngineArgs
    from conveyor.engine.llm import LLM

    with open(ns.text, encoding="utf-8") as f:
        text = f.read()
    llm = LLM(**vars(EngineArgs.from_cli_args(ns)))
    ids = llm.tokenizer.encode(text)
    window = min(ns.window, llm.engine.max_model_len - 1)  # a prompt must leave room for one token
    result = perplexity(llm, ids, window, min(ns.stride, window), llama_chunks=ns.chunks)
    how = "as llama-perplexity scores them" if ns.chunks else f"stride {min(ns.stride, window)}"
    print(f"{llm.engine.model_info.name} ({llm.engine.model_info.dtype}) on {ns.text}: {result.num_tokens} tokens "
          f"scored in {result.num_windows} windows of {window} ({how})")
    print(f"perplexity {result.perplexity:.4f}   (mean NLL {result.nll / result.num_tokens:.4f} nats/token; "
          f"{result.wall_s:.1f} s, {result.num_tokens / result.wall_s:.0f} tok/s)")
    return 0
