"""The model registry: real checkpoints' configs read by their families, and every refusal of what conveyor
does not compute, naming the field (a test per refusal). RoPE scalings against transformers' own init functions."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.layers.rope_scaling import rope_inv_freq
from conveyor.models.build import build_model
from conveyor.models.gguf_file import GGUFError, GGUFFile
from conveyor.models.registry import config_from_gguf, config_from_hf
from conveyor.models.weights import load_into

transformers = pytest.importorskip("transformers")

# Shapes as the published config.json files have them (sizes shrunk where they do not matter)
LLAMA_32 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "head_dim": 64,
            "intermediate_size": 8192, "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 128256,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
            "hidden_act": "silu", "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
            "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
            "transformers_version": "4.45.0.dev0"}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "head_dim": 128,
         "intermediate_size": 3072, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
         "max_position_embeddings": 40960, "max_window_layers": 28, "rms_norm_eps": 1e-6, "rope_scaling": None,
         "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": True,
         "vocab_size": 151936, "attention_bias": False, "hidden_act": "silu", "bos_token_id": 151643,
         "eos_token_id": 151645, "torch_dtype": "bfloat16"}
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
             "head_dim": 256, "intermediate_size": 6912, "num_attention_heads": 4, "num_hidden_layers": 26,
             "num_key_value_heads": 1, "max_position_embeddings": 32768, "query_pre_attn_scalar": 256,
             "rms_norm_eps": 1e-6, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
             "sliding_window": 512, "sliding_window_pattern": 6, "final_logit_softcapping": None,
             "attn_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh", "vocab_size": 262144,
             "cache_implementation": "hybrid", "attention_bias": False, "bos_token_id": 2, "eos_token_id": [1, 106]}
PHI4_MINI = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
             "intermediate_size": 8192, "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
             "partial_rotary_factor": 0.75, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 262144,
             "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48},
             "full_attn_mod": 1, "interpolate_factor": 1, "lm_head_bias": False, "mlp_bias": False,
             "attention_bias": False, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "tie_word_embeddings": True,
             "vocab_size": 200064, "hidden_act": "silu"}
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
           "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
           "intermediate_size": 1536, "is_llama_config": True, "max_position_embeddings": 8192, "model_type": "llama",
           "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2,
           "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None,
           "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
           "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
           "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 49152}
QWEN25 = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
          "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
          "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
          "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
          "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
          "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
MISTRAL_V01 = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
               "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
               "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
               "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 32000, "hidden_act": "silu",
               "tie_word_embeddings": False}


@pytest.mark.parametrize("raw,family,windows", [
    (LLAMA_32, "llama", ()), (QWEN3, "qwen3", ()), (MISTRAL_V01, "llama", (4096,) * 32), (SMOLLM2, "llama", ()),
    (QWEN25, "qwen2", ()),
    (GEMMA3_1B, "gemma3", tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))), (PHI4_MINI, "phi3", ()),
], ids=["llama3.2", "qwen3", "mistral", "smollm2", "qwen2.5", "gemma3", "phi4-mini"])
def test_published_configs_are_read_by_their_family(raw, family, windows):
    cfg = config_from_hf(raw)
    assert cfg.family == family and cfg.layer_windows == windows


def test_windows_where_transformers_applies_them():
    assert config_from_hf({**LLAMA_32, "sliding_window": 16}).layer_windows == ()  # Llama's code ignores it
    assert config_from_hf({**MISTRAL_V01, "sliding_window": None}).layer_windows == ()
    qwen = config_from_hf({**QWEN25, "use_sliding_window": True, "sliding_window": 64})
    assert qwen.layer_windows == (0,) * 21 + (64,) * 3  # from max_window_layers on


def test_features_each_family_declares():
    gemma = config_from_hf(GEMMA3_1B)
    assert (gemma.qk_norm, gemma.sandwich_norms, gemma.norm_offset, gemma.activation) == (True, True, 1.0, "gelu_tanh")
    assert (gemma.local_rope_theta, gemma.rope_theta, gemma.attn_scale) == (10000.0, 1000000.0, 256 ** -0.5)
    assert gemma.embed_scale == math.sqrt(1152) and gemma.eos_token_ids == [1, 106]
    phi = config_from_hf(PHI4_MINI)
    assert phi.rotary_dim == 96 and phi.rope_scaling["rope_type"] == "longrope"
    assert config_from_hf(QWEN3).qk_norm and config_from_hf(LLAMA_32).rope_scaling["rope_type"] == "llama3"


def test_metadata_keys_are_accepted():
    """A directory transformers saved from a GGUF names the file in ``_model_name_or_path``: metadata, not math."""
    cfg = config_from_hf({**LLAMA_32, "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2",
                          "_name_or_path": "x/y"})
    assert cfg == config_from_hf(LLAMA_32)


REFUSALS = [
    ({**LLAMA_32, "rope_scaling": {"rope_type": "fancy", "factor": 2.0}}, "RoPE type 'fancy'"),
    ({**LLAMA_32, "rope_scaling": {**LLAMA_32["rope_scaling"], "beta": 3}}, "parameters conveyor does not compute: beta"),
    ({**LLAMA_32, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is a setting conveyor does not know"),
    ({**LLAMA_32, "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({**GEMMA3_1B, "architectures": ["Gemma3ForConditionalGeneration"], "vision_config": {}}, "vision_config"),
    ({**GEMMA3_1B, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({**GEMMA3_1B, "architectures": ["Gemma2ForCausalLM"]}, "attn_logit_softcapping"),
    ({**GEMMA3_1B, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({**QWEN3, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 60}, "unsupported architecture"),
    ({**QWEN3, "num_experts": 8}, "num_experts=8 is a setting conveyor does not know"),
    ({**PHI4_MINI, "full_attn_mod": 2}, "full_attn_mod=2"),
    ({**MISTRAL_V01, "layer_types": ["chunked_attention"] * 32}, "layer_types"),
    ({**LLAMA_32, "partial_rotary_factor": 0.3}, "partial_rotary_factor"),
    ({**SMOLLM2, "rope_interleaved": True}, "rope_interleaved=True"),
    ({**LLAMA_32, "quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config="),
]


@pytest.mark.parametrize("raw,match", REFUSALS, ids=[m.split()[0].split("=")[0] for _, m in REFUSALS])
def test_a_config_conveyor_cannot_compute_is_refused_naming_the_field(raw, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("[", r"\[")):
        config_from_hf(raw)


def test_attention_sinks_in_a_checkpoint_are_refused_naming_the_tensor():
    tiny = {**LLAMA_32, "hidden_size": 64, "head_dim": 16, "intermediate_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 32, "max_position_embeddings": 64}
    model = build_model(config_from_hf(tiny), torch.float32, "cpu")
    weights = [(f"model.{n}", p.detach().clone()) for n, p in model.named_parameters()]
    weights.append(("model.layers.0.self_attn.sinks", torch.zeros(4)))
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.self_attn.sinks'"):
        load_into(model, weights, where="tiny")


def write_gguf(path, arch="llama", extra=None, tensors=("token_embd",)):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
                       "attention.head_count": 2, "attention.head_count_kv": 2}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value in (extra or {}).items():
        add = w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32
        add(key, value)
    for name in tensors:
        w.add_tensor(f"{name}.weight", torch.zeros(16, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("extra,tensors,match", [
    # a "llama" file with experts is Mixtral's, whose router needs the experts a token uses
    ({"llama.expert_count": 8}, ("token_embd",), "llama.expert_used_count is missing"),
    ({"llama.rope.scaling.attn_factor": 2.0}, ("token_embd",), "attn_factor"),
    ({}, ("token_embd", "rope_freqs", "output"), "rope_freqs"),
    ({"llama.rope.scaling.type": "fancy"}, ("token_embd",), "llama.rope.scaling.type='fancy'"),
], ids=["expert_count", "attn_factor", "rope_freqs_size", "rope_type"])
def test_gguf_metadata_conveyor_cannot_compute_is_refused(tmp_path, extra, tensors, match):
    with GGUFFile(write_gguf(tmp_path / "m.gguf", extra=extra, tensors=tensors)) as f:
        with pytest.raises(GGUFError, match=match):
            config_from_gguf(f)


def test_gguf_attention_sinks_are_refused_naming_the_tensor(tmp_path):
    from conveyor.models.gguf_model import gguf_weights

    with GGUFFile(write_gguf(tmp_path / "s.gguf", tensors=("token_embd", "blk.0.attn_sinks"))) as f:
        cfg, family = config_from_gguf(f)
        with pytest.raises(GGUFError, match="tensor 'blk.0.attn_sinks.weight' has no place in a llama model"):
            list(gguf_weights(f, cfg, family, torch.float32))


def test_gguf_of_an_unknown_architecture_and_a_gemma3_window_pattern(tmp_path):
    with GGUFFile(write_gguf(tmp_path / "x.gguf", arch="mamba")) as f, pytest.raises(GGUFError, match="'mamba'"):
        config_from_gguf(f)
    path = write_gguf(tmp_path / "g.gguf", arch="gemma3", extra={"gemma3.attention.sliding_window": 4,
                                                                   "gemma3.rope.freq_base_swa": 10000.0})
    with GGUFFile(path) as f:
        cfg, family = config_from_gguf(f)
    assert family.name == "gemma3" and cfg.layer_windows == (4,) and cfg.attn_scale == 16 ** -0.5


# ---- RoPE scalings against transformers' ROPE_INIT_FUNCTIONS -------------------------------------------------
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.7,
                    "mscale_all_dim": 0.7, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 32,
                 "long_factor": [1.0 + 0.3 * i for i in range(8)], "short_factor": [1.0 + 0.01 * i for i in range(8)]},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_scalings_match_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**ROPES[name], "rope_theta": 50000.0}
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                                      rope_parameters=dict(params))
    # longrope: transformers takes the long factors past the original length (conveyor: whenever it serves past it)
    want, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", seq_len=200)
    got, factor = rope_inv_freq(16, 50000.0, {k: v for k, v in params.items() if k != "rope_theta"}, 256)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor)
