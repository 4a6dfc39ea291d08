"""Every model family, from its Hugging Face directory and from llama.cpp's own GGUF of it, against transformers:
tiny random checkpoints written by transformers (``tests/helpers/families.py``), converted by
``convert_hf_to_gguf.py``. Prompts are longer than every sliding window (and than Phi-3's original context, so
LongRoPE's long factors are transformers' too).

- float32: every prompt token's logprob, and every greedy token's, within 2e-3 of transformers' (chunked prefill
  crossing the windows; the native kernels and the torch backend);
- float64: greedy continuations batched with others (chunked prefill, prefix-cache hits, preemption) are
  token-identical to each request alone;
- bfloat16, ``--quantization int8`` and the converter's Q8_0 kept in its blocks: close to transformers;
- the GGUF's chat template and end-of-turn tokens drive ``LLM.chat`` with no extra settings.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm import LLM
from conveyor.kernels import load_cpu_kernels
from conveyor.layers.quantized import QuantLinear
from tests.helpers.families import TINIES, VOCAB, converter_available, save_tiny

pytestmark = pytest.mark.slow  # real models and engines: run by CI, skipped by -m "not slow"
transformers = pytest.importorskip("transformers")
if not converter_available():  # scripts/setup.sh extracts it; CI runs that first
    raise RuntimeError("llama.cpp's convert_hf_to_gguf.py is missing from .cache/llama.cpp: run scripts/setup.sh")

KERNELS = load_cpu_kernels()
PROMPT = torch.randint(8, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()
GREEDY = 6
WINDOWED_EVERY_LAYER = {"mistral", "phi3"}  # (Gemma 3 has global layers)
# the tokens each family's chat turns end with (what llama.cpp finds by text; the converter writes one eos id)
END_OF_TURN = {"llama3": ("<|eot_id|>", "<|eom_id|>"), "mistral": ("</s>",), "qwen2": ("<|im_end|>",),
               "qwen3": ("<|im_end|>",), "gemma3": ("<end_of_turn>",), "phi3": ("<|end|>",),
               "qwen3_moe": ("<|im_end|>",), "mixtral": ("</s>",), "olmoe": ("<|im_end|>",)}


class Checkpoint:
    def __init__(self, name: str, hf, model_dir, ggufs: dict) -> None:
        self.name, self.hf, self.dir, self.ggufs = name, hf, model_dir, ggufs
        self.gguf = ggufs.get("f32")

    def path(self, source: str) -> str:
        return str(self.dir if source == "hf" else self.gguf)

    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        """transformers' float32 log-softmax at every position of ``tokens``."""
        with torch.no_grad():
            return torch.log_softmax(self.hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def converted(converted_families) -> dict:
    return converted_families


CONVERTED = [name for name, tiny in TINIES.items() if tiny.converts]


@pytest.fixture(params=CONVERTED)
def ckpt(request, converted) -> Checkpoint:
    return Checkpoint(request.param, *converted[request.param])


def score(llm: LLM, prompt: list[int] = PROMPT):
    """(prompt logprobs [n - 1], greedy tokens, their logprobs) of one request."""
    params = SamplingParams(max_tokens=GREEDY, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    prompt_lps = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
    return prompt_lps, out.outputs[0].token_ids, torch.tensor([lp.logprob for lp in out.outputs[0].logprobs])


def assert_close_to_transformers(ckpt: Checkpoint, llm: LLM, atol: float) -> None:
    prompt_lps, tokens, token_lps = score(llm)
    ref = ckpt.logprobs(PROMPT + tokens)
    n = len(PROMPT)
    torch.testing.assert_close(prompt_lps, ref[torch.arange(n - 1), torch.tensor(PROMPT[1:])], atol=atol, rtol=0)
    steps = ref[n - 1:-1]
    want = steps[torch.arange(len(tokens)), torch.tensor(tokens)]
    torch.testing.assert_close(token_lps, want, atol=atol, rtol=0)
    # greedy: each token is transformers' argmax, up to the tolerance (a near tie may pick either)
    assert (steps.max(dim=-1).values - want).max() <= atol


@pytest.mark.parametrize("source,backend", [("hf", "cpu"), ("gguf", "cpu"), ("hf", "cpu-torch")])
def test_float32_matches_transformers(ckpt, source, backend):
    llm = LLM(ckpt.path(source), dtype="float32", attention_backend=backend, max_num_batched_tokens=16,
              block_size=4, num_kv_blocks=64, enable_prefix_caching=False, quantization="none")
    cfg = ckpt.hf.config
    types = getattr(cfg, "layer_types", None) or (["sliding_attention"] * cfg.num_hidden_layers
                                                  if getattr(cfg, "sliding_window", None) else [])
    windows = tuple(cfg.sliding_window if t == "sliding_attention" else 0 for t in types)
    assert llm.engine.model_info.layer_windows == (windows if any(windows) else ())
    assert_close_to_transformers(ckpt, llm, atol=2e-3)
    if source == "gguf":
        check_chat(ckpt, llm)


def test_batched_equals_one_at_a_time(ckpt):
    """float64 (random weights' near-ties cannot flip): prompts sharing a prefix longer than the windows, chunked,
    hitting the prefix cache and preempted, against each alone."""
    prefix = PROMPT[:20]
    prompts = [{"prompt_token_ids": prefix + PROMPT[20 + i:26 + 3 * i]} for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = LLM(str(ckpt.dir), dtype="float64", max_num_seqs=1, policy="continuous", enable_prefix_caching=False)
    want = [alone.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    # a window on every layer gives back the blocks outside it (docs/models.md): a tighter cache still preempts
    tight = dict(num_kv_blocks=20, block_size=2, max_model_len=40) if ckpt.name in WINDOWED_EVERY_LAYER else \
        dict(num_kv_blocks=16, block_size=4, max_model_len=64)
    llm = LLM(str(ckpt.dir), dtype="float64", max_num_batched_tokens=12, debug_invariants=True, **tight)
    assert (llm.engine.kv_manager.null_block_id is not None) == (ckpt.name in WINDOWED_EVERY_LAYER)
    llm.generate(prompts[:1], params, use_tqdm=False)  # its prefix is cached now
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_cached_tokens for o in outs) >= 3 * 16
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.skipif(KERNELS is None, reason="the integer kernels need the native CPU kernels")
@pytest.mark.parametrize("variant", ["bfloat16", "int8", "gguf-q8_0"])
def test_bfloat16_and_quantized_stay_close(ckpt, variant):
    if variant == "gguf-q8_0":
        llm = LLM(str(ckpt.ggufs["q8_0"]), dtype="float32", num_kv_blocks=64)
    else:
        llm = LLM(str(ckpt.dir), dtype="bfloat16" if variant == "bfloat16" else "float32", num_kv_blocks=64,
                  quantization="int8" if variant == "int8" else "none")
    quantized = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    assert bool(quantized) == (variant != "bfloat16")  # the new linears run on the integer kernels too
    prompt_lps, _, _ = score(llm)
    ref = ckpt.logprobs(PROMPT)[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    torch.testing.assert_close(prompt_lps, ref, atol=0.1, rtol=0)
    assert (prompt_lps - ref).abs().mean() < 0.02


def test_ministral_windows_on_some_layers_match_transformers(tmp_path):
    """MinistralForCausalLM's per-layer windows (``layer_types``), from its directory (no GGUF: llama.cpp's
    converter does not know it)."""
    ckpt = Checkpoint("ministral", save_tiny(tmp_path, "ministral"), tmp_path, {})
    llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=16, block_size=4, num_kv_blocks=64)
    assert llm.engine.model_info.layer_windows == (8, 0, 8)
    assert_close_to_transformers(ckpt, llm, atol=2e-3)


def check_chat(ckpt: Checkpoint, llm: LLM) -> None:
    """The GGUF's chat template and end-of-turn token drive ``LLM.chat`` with no extra settings."""
    tok = llm.engine.tokenizer
    for text in END_OF_TURN[ckpt.name]:  # stop tokens without extra flags
        end = tok.encode(text, add_special_tokens=False)
        assert len(end) == 1 and end[0] in llm.engine.model_info.eos_token_ids, text
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert "hello" in text
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4, temperature=0),
                   use_tqdm=False)[0]
    assert out.outputs[0].token_ids and out.outputs[0].finish_reason in ("stop", "length")


def test_kv_eviction_with_a_windowed_model_is_refused_at_start_up(converted):
    """Eviction shifts KV slots away from positions, which windows are counted in: refused, naming both."""
    _, model_dir, _ = converted["mistral"]
    with pytest.raises(ValueError, match="--kv-eviction sink does not run with a sliding-window model"):
        LLM(str(model_dir), kv_eviction="sink", kv_budget_tokens=64)


def test_served_gguf_chats_with_its_own_template_and_stop_tokens(ckpt):
    """`conveyor serve`'s app over a real uvicorn server, the OpenAI client, the GGUF alone (no template, no stop
    settings passed): the reply stops at a stop token or the length."""
    import openai

    from tests.helpers.server import serve_model

    with serve_model(ckpt.gguf, dtype="float32", num_kv_blocks=64) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                               max_tokens=5, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
    assert reply.usage.prompt_tokens > 3  # the family's template wrapped the message
