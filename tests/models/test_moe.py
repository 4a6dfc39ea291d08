"""Mixtures of experts (``models.moe``, ``models.native_moe``, ``kernels/csrc/moe.cpp``) beyond what every family's
test checks (``test_families.py``: each MoE family from its directory and llama.cpp's GGUF against transformers):

- every router setting conveyor does not compute is refused at load, naming the key (one test each);
- the simulator's spec counts the experts a token runs (FLOPs) and the experts a step reads (bytes);
- a step groups its tokens by expert: each chosen expert runs once on its rows, an expert no token chose never;
- GGUF expert stacks stay in their blocks, each expert's slice, in every type the integer kernels run, the
  same weights as the gguf package's dequantization of the stack, close to the float model of the same file;
- the native routed MLP (per layer, and inside the native layer stack) against the torch loop and transformers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.kernels import load_cpu_kernels
from conveyor.models.build import build_model
from conveyor.models.config import ModelConfig
from conveyor.models.gguf_file import GGUFError, GGUFFile
from conveyor.models.registry import config_from_gguf, config_from_hf
from conveyor.models.weights import load_into
from tests.helpers.families import VOCAB, requantize_gguf

KERNELS = load_cpu_kernels()


def qwen3_moe_config(**over) -> dict:
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "vocab_size": VOCAB, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
           "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
           "output_router_logits": False, "rms_norm_eps": 1e-6}
    cfg.update(over)
    return cfg


def test_the_router_is_read_from_each_family():
    moe = config_from_hf(qwen3_moe_config()).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob) == (8, 2, 96, True)
    mixtral = config_from_hf({**qwen3_moe_config(), "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                              "num_experts": None, "moe_intermediate_size": None, "norm_topk_prob": None,
                              "head_dim": None, "router_jitter_noise": 0.1})  # jitter: training only
    assert (mixtral.moe.num_experts, mixtral.moe.intermediate_size, mixtral.moe.norm_topk_prob) == (4, 96, True)
    olmoe = config_from_hf({**qwen3_moe_config(), "architectures": ["OlmoeForCausalLM"], "norm_topk_prob": False,
                            "moe_intermediate_size": None, "head_dim": None, "clip_qkv": None})
    assert olmoe.qk_norm_across_heads and not olmoe.moe.norm_topk_prob and olmoe.moe.intermediate_size == 96


@pytest.mark.parametrize("over,key", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"architectures": ["OlmoeForCausalLM"], "clip_qkv": 8.0}, "clip_qkv"),
    ({"architectures": ["Qwen2MoeForCausalLM"]}, "unsupported architecture"),
    # a dense family never reads the router's keys: an MoE config under it is refused, not run as dense
    ({"architectures": ["Qwen3ForCausalLM"], "moe_intermediate_size": None, "norm_topk_prob": None,
      "decoder_sparse_step": None, "mlp_only_layers": None}, "num_experts"),
])
def test_router_settings_not_computed_are_refused_naming_the_key(over, key):
    with pytest.raises(ValueError, match=key):
        config_from_hf(qwen3_moe_config(**over))


def write_gguf_metadata(path, arch: str, extra: dict) -> str:
    """A GGUF file with an MoE architecture's metadata and a token embedding: enough for ``config_from_gguf``."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    values = {"block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 96,
              "attention.head_count": 4, "attention.head_count_kv": 4, "attention.layer_norm_rms_epsilon": 1e-5,
              "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 96, **extra}
    for key, value in values.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, bool):
            w.add_bool(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_routers_are_read_as_llama_cpp_computes_them(tmp_path):
    for arch, family, norm in (("qwen3moe", "qwen3_moe", True), ("olmoe", "olmoe", False),
                               ("llama", "mixtral", True)):
        with GGUFFile(write_gguf_metadata(tmp_path / f"{arch}.gguf", arch, {})) as f:
            cfg, fam = config_from_gguf(f)
        assert fam.name == family and cfg.moe.num_experts == 8 and cfg.moe.top_k == 2
        assert cfg.moe.norm_topk_prob is norm  # llama.cpp's graph of the architecture decides it


@pytest.mark.parametrize("arch,extra,key", [
    ("qwen3moe", {"expert_weights_norm": False}, "expert_weights_norm"),
    ("olmoe", {"expert_weights_norm": True}, "expert_weights_norm"),
    ("qwen3moe", {"expert_gating_func": 2}, "expert_gating_func"),
    ("qwen3moe", {"expert_weights_scale": 2.5}, "expert_weights_scale"),
    ("qwen3moe", {"expert_shared_count": 1}, "expert_shared_count"),
    ("qwen3moe", {"expert_used_count": 9}, "expert_used_count"),
    ("olmoe", {"attention.clamp_kqv": 8.0}, "clamp_kqv"),
    ("qwen3", {}, "expert_count"),  # a dense architecture's file with experts
])
def test_gguf_router_settings_not_computed_are_refused_naming_the_key(tmp_path, arch, extra, key):
    with GGUFFile(write_gguf_metadata(tmp_path / "m.gguf", arch, extra)) as f:
        with pytest.raises(GGUFError, match=key):
            config_from_gguf(f)


def test_experts_stored_as_one_3d_tensor_are_refused_naming_it():
    """transformers 5 computes with [experts, 2 * width, hidden] stacks; checkpoints store one tensor per expert,
    which is what conveyor reads. A stacked tensor is refused, not guessed at."""
    cfg = config_from_hf(qwen3_moe_config())
    model = build_model(cfg, torch.float32, "cpu")
    stacked = ("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(8, 192, 64))
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.mlp.experts.gate_up_proj'"):
        load_into(model, [stacked], where="ckpt")


def test_spec_counts_the_experts_a_token_runs_and_a_step_reads():
    cfg = config_from_hf(qwen3_moe_config(num_experts=8, num_experts_per_tok=2))
    spec = cfg.spec("tiny")
    h, q, kv, width = 64, 4 * 32, 2 * 32, 96
    attention, router, expert = h * (q + 2 * kv) + q * h, h * 8, 3 * h * width
    assert spec.per_token_linear_params == 2 * (attention + router + 2 * expert)  # two of eight experts a token
    model = build_model(cfg, torch.float32, "meta")
    linear = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and "norm" not in n)
    assert spec.num_params - spec.lm_head_params * 2 - h - 2 * 2 * h == linear  # every expert held
    assert spec.step_linear_params(1) == spec.per_token_linear_params  # one token: its own experts
    assert spec.experts_touched(4) == pytest.approx(8 * (1 - (6 / 8) ** 4))
    assert spec.step_linear_params(4) < 4 * spec.per_token_linear_params  # experts shared by the step's tokens
    assert spec.step_linear_params(10_000) == pytest.approx(2 * (attention + router + 8 * expert))


def test_simulator_prices_the_experts_a_step_reads():
    from conveyor.sim import HARDWARE, RooflineCostModel, StepShape

    spec = config_from_hf(qwen3_moe_config()).spec("tiny")
    cost = RooflineCostModel(spec, HARDWARE["h100-sxm"])
    one, many = (cost.op_counts(StepShape(rows=[(1, 10)] * n, num_sampled=n)) for n in (1, 64))
    per_param = cost.dtype_bytes
    assert one.linear.bytes == spec.step_linear_params(1) * per_param
    assert many.linear.bytes == pytest.approx(spec.step_linear_params(64) * per_param)
    assert one.linear.bytes < many.linear.bytes < 64 * one.linear.bytes
    assert many.linear.flops == 64 * one.linear.flops  # FLOPs: the experts each token runs


def test_a_step_runs_each_chosen_expert_once_on_its_rows():
    """The torch loop: of a step's tokens, each expert sees exactly the rows that chose it, in one call."""
    from conveyor.models.moe import SparseMoE, route, run_experts

    torch.manual_seed(0)
    cfg = ModelConfig(architecture="x", hidden_size=16, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=16,
                      intermediate_size=8, vocab_size=8, max_position_embeddings=8, norm_eps=1e-6,
                      tie_word_embeddings=True, moe=config_from_hf(qwen3_moe_config()).moe)
    calls: dict[int, list[int]] = {}

    class Expert(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i, self.w = i, torch.randn(16, 16)

        def forward(self, x):
            calls.setdefault(self.i, []).append(x.shape[0])
            return x @ self.w

    counter = iter(range(8))
    moe = SparseMoE(cfg, lambda: Expert(next(counter)))
    torch.nn.init.normal_(moe.gate.weight)
    x = torch.randn(5, 16)
    weights, ids = route(moe.gate(x), 2, True)
    out = moe(x)
    chosen = torch.bincount(ids.reshape(-1), minlength=8)
    assert calls == {e: [int(n)] for e, n in enumerate(chosen) if n}  # once each, with all its rows
    want = sum(weights[:, k, None] * torch.stack([x[t] @ moe.experts[int(ids[t, k])].w for t in range(5)])
               for k in range(2))
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(run_experts(x, weights, ids, moe.experts), out)


# --- GGUF expert stacks in every kernel type, and the native routed MLP (real models and engines) ---

KERNEL_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@pytest.fixture
def wide(converted_families):
    """A Qwen3-MoE whose widths are whole K-quant super-blocks (256), converted by llama.cpp's converter (F32)."""
    model, hf_dir, ggufs = converted_families["qwen3_moe_wide"]
    return model, hf_dir, ggufs["f32"]


@pytest.mark.slow
@pytest.mark.skipif(KERNELS is None, reason="the integer kernels need the native CPU kernels")
def test_expert_stacks_stay_in_their_blocks_in_every_kernel_type(wide):
    from conveyor.engine.llm import LLM
    from conveyor.layers.quantized import QuantLinear
    from conveyor.models.gguf_file import dequantize

    _, hf_dir, f32 = wide
    root = hf_dir.parent
    # each layer's gate, up and down stacks in a different type: every type the kernels run, once at least
    types = {"blk.0.ffn_gate_exps.weight": "Q4_K", "blk.0.ffn_up_exps.weight": "Q5_K",
             "blk.0.ffn_down_exps.weight": "Q8_0", "blk.1.ffn_gate_exps.weight": "Q4_0",
             "blk.1.ffn_up_exps.weight": "Q4_1", "blk.1.ffn_down_exps.weight": "Q6_K",
             **{f"blk.{i}.attn_{p}.weight": "Q5_1" for i in range(2) for p in ("q", "k", "v", "output")},
             "blk.0.attn_v.weight": "Q6_K", "blk.1.attn_output.weight": "Q5_0"}  # Q6_K v: q/k/v kept apart
    assert set(types.values()) == set(KERNEL_TYPES)
    path = requantize_gguf(f32, root / "mixed.gguf", types)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    model = llm.engine.model
    with GGUFFile(str(path)) as f:
        stacks = {n: dequantize(f.raw(n), f.tensors[n].qtype).reshape(f.tensors[n].shape) for n in types}
    for layer in range(2):
        for e, expert in enumerate(model.layers[layer].mlp.experts):
            assert isinstance(expert.gate_up_proj, QuantLinear) and isinstance(expert.down_proj, QuantLinear)
            for linear, parts in ((expert.gate_up_proj, ("gate", "up")), (expert.down_proj, ("down",))):
                names = [f"blk.{layer}.ffn_{p}_exps.weight" for p in parts]
                assert linear.quant.source == "+".join(sorted({types[n] for n in names}))
                got = torch.empty(linear.quant.shape)
                KERNELS.quant_dequantize(linear.desc, None, got)
                want = torch.cat([stacks[n][e] for n in names])  # expert e's slice of the stack, as stored
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert model.native_stack is not None and model.native_stack.quantized
    # the same file dequantized into float32 (no integer kernels): close, the activations' rounding apart
    prompt = torch.randint(8, VOCAB, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)
    dense = LLM(str(path), dtype="float32", num_kv_blocks=64, quantization="none")

    def prompt_logprobs(engine):
        out = engine.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        return torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])

    torch.testing.assert_close(prompt_logprobs(llm), prompt_logprobs(dense), atol=0.05, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(KERNELS is None, reason="the native routed MLP needs the native CPU kernels")
@pytest.mark.parametrize("source", ["hf", "q8_0"])
def test_native_routed_mlp_matches_the_torch_loop_and_the_stack_is_bit_identical(wide, source):
    """Per layer: ``cvk_moe`` against the torch loop over the same experts (the softmax's exp differs in the last
    bits); the native layer stack against the per-layer path: bit for bit, every decode step through it."""
    from conveyor.engine.llm import LLM

    hf, hf_dir, f32 = wide
    path = hf_dir if source == "hf" else requantize_gguf(f32, hf_dir.parent / "q8.gguf", {
        n: "Q8_0" for n in GGUFFile(str(f32)).tensors if n.startswith("blk.") and "norm" not in n
        and "gate_inp" not in n})
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, enable_prefix_caching=False)
    model = llm.engine.model
    assert all(layer.mlp.native is not None for layer in model.layers) and model.native_stack is not None
    prompts = [torch.randint(8, VOCAB, (5 + 7 * i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=0)

    def run(stack: bool, native: bool):
        saved = model.native_stack, [layer.mlp.native for layer in model.layers]
        model.native_stack = saved[0] if stack else None
        for layer, n in zip(model.layers, saved[1]):
            layer.mlp.native = n if native else None
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            model.native_stack = saved[0]
            for layer, n in zip(model.layers, saved[1]):
                layer.mlp.native = n
        return [(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs],
                 [e.logprob for e in o.prompt_logprobs[1:]]) for o in outs]

    fused, per_layer, torch_loop = run(True, True), run(False, True), run(False, False)
    assert fused == per_layer
    for (tokens, steps, prompt_lps), (tokens_t, steps_t, prompt_lps_t) in zip(per_layer, torch_loop):
        torch.testing.assert_close(torch.tensor(prompt_lps), torch.tensor(prompt_lps_t), atol=1e-4, rtol=0)
        assert tokens == tokens_t
    if source == "hf":  # and transformers, within the families' tolerance
        prompt = prompts[-1]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        ref = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(torch.tensor(fused[-1][2]), ref, atol=2e-3, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(KERNELS is None, reason="the integer kernels need the native CPU kernels")
def test_the_moe_benchmark_counts_the_bytes_a_token_streams(wide):
    """benchmarks/moe_side_by_side.py profile: per part, conveyor's held bytes beside the file's. Q8_0 is held as
    stored (its bytes equal the file's), Q4_K with a byte per sub-scale and minimum and the file's f16 d and dmin
    (0.578 bytes a value against the file's 0.5625, whose sub-scales take 6 bits), a float32 tensor as it is;
    experts count top_k / E of each stack."""
    import importlib.util
    from pathlib import Path

    from conveyor.engine.llm import LLM

    script = Path(__file__).parents[2] / "benchmarks" / "moe_side_by_side.py"
    spec = importlib.util.spec_from_file_location("moe_side_by_side", script)
    msb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(msb)
    _, hf_dir, f32 = wide
    with GGUFFile(str(f32)) as f:
        names = [n for n in f.tensors if n.startswith("blk.") and "norm" not in n and "gate_inp" not in n]
    types = {n: "Q4_K" if "gate_exps" in n or "up_exps" in n else "Q8_0" for n in names}
    path = requantize_gguf(f32, hf_dir.parent / "bytes.gguf", types)
    model = LLM(str(path), dtype="float32", num_kv_blocks=64).engine.model
    parts = msb.streamed_bytes(model, str(path))
    assert set(parts) == {"attention+router", "experts", "lm_head"}
    held, stored = parts["experts"]
    assert held == pytest.approx({"Q4_K": stored["Q4_K"] * 0.578125 / 0.5625, "Q8_0": stored["Q8_0"]})
    cfg = model.config
    expert_values = 3 * cfg.hidden_size * cfg.moe.intermediate_size * cfg.num_layers * cfg.moe.top_k
    assert stored["Q4_K"] + stored["Q8_0"] == pytest.approx(expert_values * (2 * 0.5625 + 1.0625) / 3 / 2**20)
    held, stored = parts["attention+router"]
    assert set(held) == {"Q8_0", "float32"} and held["Q8_0"] == pytest.approx(stored["Q8_0"])
    # the routers in float32, as streamed: the skinny copy pads their 4 columns (experts) to a group of 16
    assert held["float32"] == pytest.approx(stored["F32"] * 16 / cfg.moe.num_experts)
    held, stored = parts["lm_head"]
    assert held == pytest.approx({"float32": stored["F32"]})
