"""The native decoder-layer stack (models.native_stack): bit-identical to the per-layer path it replaces for
decode-sized steps, in float32 and bfloat16 (on AMX tiles, or VDPBF16PS where AVX512_BF16 is there without AMX),
with and without q/k/v biases, and used only where it applies. CONVEYOR_CPU_ISA picks the level these run at."""

from __future__ import annotations

import pytest
import torch
import transformers

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm import LLM
from conveyor.kernels import load_cpu_kernels
from conveyor.layers import linear
from conveyor.layers.linear import AMX_MAX_ROWS, BF16_DOT_MAX_ROWS, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS_AVX2
from conveyor.models.native_stack import NativeLayerStack
from tests.helpers.checkpoints import write_word_tokenizer

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no native kernels on this CPU")
BF16_NATIVE = KERNELS is not None and (KERNELS.amx or KERNELS.bf16_dot)
DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not BF16_NATIVE, reason="bfloat16 linears run natively only on AMX or AVX512_BF16"))]
VOCAB = 384


def save_model(path, cls, config):
    """A random checkpoint whose norm weights and biases are random too (a miswired one cannot hide)."""
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, VOCAB)
    return path


def llama(path):
    return save_model(path, transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False))


def llama_mlp_bias(path):  # gate_up and down biases (the bfloat16 stack forms silu(gate) * up in the GEMM)
    return save_model(path, transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False, mlp_bias=True))


def llama_head_dim_32(path):  # the native attention's generic head-size path
    return save_model(path, transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False))


def qwen2(path):  # q/k/v biases
    return save_model(path, transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False, rope_theta=1000.0))


def qwen3(path):  # q/k RMSNorm per head, normed in place inside the stack; head_dim apart from hidden / heads
    return save_model(path, transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False))


def mistral_window(path):  # a sliding window of 6 on every layer (the prompts run to 176 tokens)
    return save_model(path, transformers.MistralForCausalLM, transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False, sliding_window=6))


def generate(llm, with_stack: bool):
    model = llm.engine.model
    stack = model.native_stack
    if not with_stack:
        model.native_stack = None
    try:
        # 20 requests: decode steps of up to 20 rows, so the second 16-row group of a tile is used too
        prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % VOCAB for j in range(5 + 9 * i)]} for i in range(20)]
        params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=3)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        model.native_stack = stack
    return [(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make", [llama, llama_mlp_bias, qwen2, llama_head_dim_32, qwen3, mistral_window])
def test_stack_is_bit_identical_to_the_per_layer_path(tmp_path, dtype, make):
    llm = LLM(str(make(tmp_path / "m")), dtype=dtype, enable_prefix_caching=False, detokenize=False, block_size=16)
    stack = llm.engine.model.native_stack
    assert isinstance(stack, NativeLayerStack)
    f32_rows = SKINNY_MAX_ROWS_AVX2 if stack.kernels.level == "avx2" else SKINNY_MAX_ROWS
    bf16_rows = AMX_MAX_ROWS if stack.kernels.amx else BF16_DOT_MAX_ROWS
    assert stack.max_rows == (f32_rows if dtype == "float32" else bf16_rows)
    calls = []
    run = stack.run
    stack.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)
    try:
        fused = generate(llm, with_stack=True)
    finally:
        del stack.run
    assert calls and max(calls) <= stack.max_rows  # the decode steps went through it, the prefills did not
    assert fused == generate(llm, with_stack=False)  # tokens and logprobs, exactly


def test_stack_applies_only_where_every_part_runs_natively(tmp_path):
    llm = LLM(str(llama(tmp_path / "m")), dtype="float32", enable_prefix_caching=False, detokenize=False)
    stack = llm.engine.model.native_stack
    from conveyor.layers.attention import CpuAttention, NativeCpuAttention

    native = object.__new__(NativeCpuAttention)
    assert stack.accepts(1, native) and stack.accepts(stack.max_rows, native)
    assert not stack.accepts(stack.max_rows + 1, native) and not stack.accepts(0, native)
    assert not stack.accepts(1, object.__new__(CpuAttention))  # the torch attention path keeps the layer loop
    assert NativeLayerStack.build(llm.engine.model, None) is None
    from conveyor.models.native_stack import unsupported_reason
    from dataclasses import replace

    cfg = llm.engine.model.config  # declined by the declared check, not by probing modules: Gemma's layers
    assert unsupported_reason(cfg) is None
    gemma_like = replace(cfg, sandwich_norms=True, activation="gelu_tanh", embed_scale=11.3)
    assert unsupported_reason(gemma_like) == "a gelu_tanh MLP (the stack runs SiLU-and-mul), four norms a layer, " \
                                             "scaled embeddings"
    float64 = LLM(str(tmp_path / "m"), dtype="float64", enable_prefix_caching=False, detokenize=False)
    assert float64.engine.model.native_stack is None  # no native kernels in float64


@pytest.mark.parametrize("with_stack", [True, False], ids=["stack", "per_layer"])
def test_attention_plan_is_built_once_per_step(tmp_path, monkeypatch, with_stack):
    """Every step's attention object plans once (its first layer), and every layer, or the stack, reuses it."""
    from conveyor.layers.attention import NativeCpuAttention

    llm = LLM(str(llama(tmp_path / "m")), dtype="float32", enable_prefix_caching=False, detokenize=False)
    kernels = llm.engine.model.native_stack.kernels
    steps, plans = [], []
    init, plan = NativeCpuAttention.__init__, kernels.attention_plan
    monkeypatch.setattr(NativeCpuAttention, "__init__", lambda self, *a: steps.append(1) or init(self, *a))
    monkeypatch.setattr(kernels, "attention_plan", lambda *a: plans.append(1) or plan(*a))
    generate(llm, with_stack=with_stack)
    assert steps and len(plans) == len(steps)  # 3 layers, one plan per step


def test_bfloat16_stack_follows_the_cpu_level(tmp_path):
    """bfloat16 decode steps take the native stack where the level has AMX or VDPBF16PS (avx512bf16); below it
    (CONVEYOR_CPU_ISA=avx512 or avx2: an AVX2-only Zen 3's path) the per-layer path on oneDNN, as before."""
    llm = LLM(str(llama(tmp_path / "m")), dtype="bfloat16", enable_prefix_caching=False, detokenize=False)
    stack = llm.engine.model.native_stack
    assert (stack is not None) == BF16_NATIVE
    qkv = llm.engine.model.layers[0].self_attn.qkv_proj
    assert (qkv.skinny is not None) == BF16_NATIVE  # no second copy of a weight nothing reads
    out = generate(llm, with_stack=True)
    assert all(len(tokens) == 12 for tokens, _ in out)


@pytest.mark.skipif(not BF16_NATIVE or KERNELS.amx, reason="the VDPBF16PS path (AVX512_BF16 without AMX)")
@pytest.mark.parametrize("make", [llama, qwen2])
def test_bfloat16_on_vdpbf16ps_stays_close_to_onednn(tmp_path, monkeypatch, make):
    """The native bfloat16 path (stack and skinny linears on VDPBF16PS) against the per-layer path on oneDNN that
    ran before it: the same greedy tokens, logprobs within bfloat16 rounding (the two sum in other orders)."""
    path = make(tmp_path / "m")
    native = generate(LLM(str(path), dtype="bfloat16", enable_prefix_caching=False, detokenize=False), True)
    monkeypatch.setattr(linear, "BF16_DOT_MAX_ROWS", 0)  # no native bfloat16 linears: no stack either
    onednn_llm = LLM(str(path), dtype="bfloat16", enable_prefix_caching=False, detokenize=False)
    assert onednn_llm.engine.model.native_stack is None
    onednn = generate(onednn_llm, True)
    assert [tokens for tokens, _ in native] == [tokens for tokens, _ in onednn]
    got = torch.tensor([lp for _, lps in native for lp, _ in lps])
    want = torch.tensor([lp for _, lps in onednn for lp, _ in lps])
    torch.testing.assert_close(got, want, atol=0.1, rtol=2e-2)
