"""Tiny GGUF files written the way llama.cpp's converter writes them (``gguf.GGUFWriter``), from tiny random
transformers checkpoints: metadata keys, q/k rows permuted for GPT-J-style RoPE, weights quantized by ``gguf``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_level_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 3 control tokens, the 256 byte characters, then merges up to ``size``."""
    chars = list(bytes_to_unicode().values())
    tokens, merges = SPECIALS + chars, []
    pairs = [("Ġ", c) for c in "abcdefghijklmnopqrstuvwxyz"] + [(a, b) for a in "etaoinsrhl" for b in "etaoinsrhl"]
    for left, right in pairs[:size - len(tokens)]:
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    assert len(tokens) == size, "size leaves no room for the byte alphabet"
    return tokens, [3] * len(SPECIALS) + [1] * (size - len(SPECIALS)), merges


def sentencepiece_vocab(size: int) -> tuple[list[str], list[int], list[float]]:
    """(tokens, types, scores) of a SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, pieces."""
    tokens, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["\u2581"] + list("abcdefghijklmnopqrstuvwxyz") + [f"\u2581{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    pieces += [a + b for a in "etaoinsrhl" for b in "etaoinsrhl"]
    pieces = pieces[:size - len(tokens)]
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))]
    assert len(tokens) == size
    return tokens, types, scores


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``permute``: NeoX-halves rows -> GPT-J-pairs rows, per head."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_tensor_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    base, kind = name.rsplit(".", 1)
    if base.startswith("layers."):
        _, i, rest = base.split(".", 2)
        return f"blk.{i}.{LAYER_NAMES[rest]}.{kind}"
    return {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}[base] + f".{kind}"


def write_llama_gguf(path: Path, model, qtype: str = "F32", vocab: str = "gpt2", arch: str = "llama",
                     tokenizer: bool = True, chat_template: str | None = CHAT_TEMPLATE, skip: tuple = (),
                     pre: str = "smollm", qtypes: dict[str, str] | None = None) -> Path:
    """Write ``model`` (a transformers Llama/Qwen2 with vocab 384) as a GGUF file; 2-D weights in ``qtype``, or
    in ``qtypes[hf_name]`` for the tensors it names (a mixed file, as llama.cpp's Q4_K_M is)."""
    import gguf

    cfg = model.config
    qt = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.hidden_size // heads)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        if vocab == "gpt2":
            tokens, types, merges = byte_level_vocab(cfg.vocab_size)
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre(pre)
            w.add_token_list(tokens)
            w.add_token_types(types)
            w.add_token_merges(merges)
            w.add_bos_token_id(1)
            w.add_eos_token_id(2)
        else:
            tokens, types, scores = sentencepiece_vocab(cfg.vocab_size)
            w.add_tokenizer_model("llama")
            w.add_token_list(tokens)
            w.add_token_types(types)
            w.add_token_scores(scores)
            w.add_bos_token_id(1)
            w.add_eos_token_id(2)
        if chat_template:
            w.add_chat_template(chat_template)
    for name, tensor in model.state_dict().items():
        if "rotary_emb" in name or name in skip:
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = permute_qk(data, heads if ".q_proj." in name else kv_heads)
        tensor_qt = gguf.GGMLQuantizationType[qtypes[name]] if qtypes and name in qtypes else qt
        if data.ndim == 2 and tensor_qt != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(data, tensor_qt), raw_dtype=tensor_qt)
        else:
            w.add_tensor(gguf_tensor_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
