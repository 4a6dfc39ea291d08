"""A Llama-family model from a GGUF file: the ``ModelConfig`` from its metadata, its tensors under Hugging Face
names (so ``map_weight`` loads them as it loads a safetensors checkpoint), dequantized into the engine's dtype.

llama.cpp's converter permutes the rows of ``q_proj`` / ``k_proj`` of a Llama so that its rotary embedding can
rotate adjacent pairs (GPT-J style) instead of the two halves of each head (NeoX style, what Hugging Face and
conveyor use); ``unpermute_qk`` undoes that. Qwen2 files are stored unpermuted (llama.cpp runs them NeoX style).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from conveyor.models.config import ModelConfig
from conveyor.models.gguf_file import GGUFError, GGUFFile

# GGUF general.architecture -> (our architecture name, q/k rows permuted by llama.cpp's converter)
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}

_LAYER_TENSORS = {  # llama.cpp tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_config(f: GGUFFile) -> ModelConfig:
    """The model's shape from the metadata (``{arch}.block_count``, ``{arch}.embedding_length``, ...)."""
    arch = f.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(f"{f.path}: unsupported architecture {arch!r}; supported GGUF architectures: "
                        f"{', '.join(GGUF_ARCHITECTURES)}")

    def key(name: str, default=None):
        value = f.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"{f.path}: metadata key {arch}.{name} is missing")
        return value

    if "rope_freqs.weight" in f.tensors or f.get(f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise GGUFError(f"{f.path}: RoPE scaling ({f.get(f'{arch}.rope.scaling.type', 'rope_freqs')}) is not "
                        "supported for GGUF models")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"{f.path}: partial rotary embeddings (rope.dimension_count != head size) are not supported")
    if "token_embd.weight" not in f.tensors:
        raise GGUFError(f"{f.path}: the tensor token_embd.weight is missing")
    vocab = int(f.get(f"{arch}.vocab_size") or f.tensors["token_embd.weight"].shape[0])
    eos = [f.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                              "tokenizer.ggml.eom_token_id")]
    bias = "blk.0.attn_q.bias" in f.tensors
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch][0], hidden_size=hidden, num_layers=int(key("block_count")),
        num_heads=heads, num_kv_heads=int(key("attention.head_count_kv", heads)), head_dim=head_dim,
        intermediate_size=int(key("feed_forward_length")), vocab_size=vocab,
        max_position_embeddings=int(key("context_length")),
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in f.tensors, rope_theta=float(key("rope.freq_base", 10000.0)),
        qkv_bias=bias, o_bias="blk.0.attn_output.bias" in f.tensors,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=sorted({int(t) for t in eos if t is not None}))


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None for tensors the model does not use."""
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    return None


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of q/k rows (weights or biases), head by head: its rows are, per head, the
    pairs (x0, x(d/2)), (x1, x(d/2+1)), ...; Hugging Face's are x0 .. x(d/2 - 1), then x(d/2) .. x(d - 1)."""
    rows = w.shape[0]
    # in numpy (w is the float32 output of dequantization): torch's threaded copy of these small tensors cost
    # 0.68 s against 0.02 s single-threaded, measured while the 2 cores were shared
    a = w.numpy().reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
    return torch.from_numpy(np.ascontiguousarray(a).reshape(w.shape))


def qk_row_order(rows: int, n_heads: int) -> torch.Tensor:
    """The row permutation ``unpermute_qk`` applies, as indices (for weights kept quantized, moved row by row)."""
    return unpermute_qk(torch.arange(rows, dtype=torch.float32).unsqueeze(1), n_heads)[:, 0].to(torch.int64)


def gguf_quantized(f: GGUFFile, cfg: ModelConfig, plan: dict[str, list[str]]):
    """{model parameter -> its QuantizedTensor} for the parameters ``plan`` keeps quantized (models.quantize
    .plan_gguf): each GGUF part read in its blocks, q/k rows unpermuted, fused parts stacked in row order."""
    from conveyor.layers.quantized import QuantizedTensor, from_gguf

    permuted = GGUF_ARCHITECTURES[f.get("general.architecture")][1]
    out = {}
    for param, names in plan.items():
        parts = []
        for name in names:
            info = f.tensors[name]
            quant = from_gguf(f.raw(name), info.qtype.name, info.shape)
            if permuted and (".attn_q." in name or ".attn_k." in name):
                heads = cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads
                quant = quant.take_rows(qk_row_order(info.shape[0], heads))
            parts.append(quant)
        out[param] = QuantizedTensor.cat(parts)
    return out


def gguf_weights(f: GGUFFile, cfg: ModelConfig, dtype: torch.dtype,
                 skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in ``dtype``) for every tensor the model uses but those named in ``skip`` (kept
    quantized), dequantized one at a time.

    Tensors of other architectures' layouts (e.g. a fused attn_qkv) are an error, not silently skipped."""
    arch = f.get("general.architecture")
    permuted = GGUF_ARCHITECTURES[arch][1]
    for name in f.tensors:
        target = hf_name(name)
        if target is None:
            if name.startswith("blk.") or name in ("output.weight", "token_embd.weight"):
                raise GGUFError(f"{f.path}: tensor {name!r} has no place in a {arch} model")
            continue
        if name in skip:
            continue
        tensor = f.load(name, torch.float32)
        if permuted and (".attn_q." in name or ".attn_k." in name):
            tensor = unpermute_qk(tensor, cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
        yield target, tensor.to(dtype)
