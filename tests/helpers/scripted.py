"""A tiny Llama that writes a scripted reply: real safetensors and a real byte-level BPE tokenizer, with weights
set so that the next token is a fixed function of the current one (a bigram table).

Its embeddings are one-hot (hidden size = vocabulary size) and every layer adds nothing to the residual stream
(``o_proj`` and ``down_proj`` are zero), so the final norm sees the current token's one-hot vector and the
``lm_head`` column of that token picks the next one, with a margin of sqrt(hidden) in the logits: greedy decoding
follows the script exactly, in any batch, and a constrained request falls back to the lowest allowed token id
where the script's token is forbidden. Tests use it to have a model reason (``<think>``...``</think>``) and
answer, deterministically, through the whole server.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # 0 unk/pad, 1 bos, 2 eos (the end of a turn)
THINK_TOKENS = ["<think>", "</think>"]  # added tokens that are not special, as in Qwen3's vocabulary
EOS = "<|im_end|>"

# Qwen3's shape: the template opens a reasoning block unless enable_thinking is false, which writes an empty one.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>{% endif %}"
    "{% endif %}")


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 symbols a byte-level BPE vocabulary spells bytes with."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def save_scripted_llama(path: Path, script: list[str], chat_template: str = THINKING_TEMPLATE) -> Path:
    """A checkpoint whose greedy reply, after a prompt ending in ``script[0]``, is ``script[1:]`` then the end of
    turn. ``script`` holds tokens: single characters (bytes) or the added tokens (``<think>``, ``</think>``); a
    token may appear once only (the next token depends on the current one alone). Every token not in the script
    is followed by the end of turn."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = _byte_chars()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    for tok in THINK_TOKENS:
        vocab[tok] = len(vocab)
    size = len(vocab) + (-len(vocab)) % 8  # a hidden size the heads divide
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.add_tokens(THINK_TOKENS)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))

    def token_id(tok: str) -> int:
        if tok in vocab and len(tok) > 1:
            return vocab[tok]
        (b,) = tok.encode("utf-8")
        return vocab[byte_chars[b]]

    ids = [token_id(t) for t in script]
    assert len(set(ids)) == len(ids), "a token may appear in the script once only"
    following = {a: b for a, b in zip(ids, ids[1:])}
    following[ids[-1]] = vocab[EOS]
    hidden = size
    heads, kv_heads, head_dim, inter = 4, 2, hidden // 4, 16
    eye = torch.eye(size, hidden)
    lm_head = torch.zeros(size, hidden)
    for current in range(size):
        lm_head[following.get(current, vocab[EOS]), current] = 1.0
    tensors = {"model.embed_tokens.weight": eye, "model.norm.weight": torch.ones(hidden), "lm_head.weight": lm_head,
               "model.layers.0.input_layernorm.weight": torch.ones(hidden),
               "model.layers.0.post_attention_layernorm.weight": torch.ones(hidden),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(heads * head_dim, hidden),
               "model.layers.0.self_attn.k_proj.weight": torch.zeros(kv_heads * head_dim, hidden),
               "model.layers.0.self_attn.v_proj.weight": torch.zeros(kv_heads * head_dim, hidden),
               "model.layers.0.self_attn.o_proj.weight": torch.zeros(hidden, heads * head_dim),
               "model.layers.0.mlp.gate_proj.weight": torch.zeros(inter, hidden),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(inter, hidden),
               "model.layers.0.mlp.down_proj.weight": torch.zeros(hidden, inter)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": size,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 1024,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "bos_token_id": vocab["<|im_start|>"], "eos_token_id": vocab[EOS], "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": EOS, "pad_token": "<|endoftext|>", "chat_template": chat_template,
        "added_tokens_decoder": {str(vocab[t]): {"content": t, "special": True} for t in SPECIALS}}))
    return path


# What the scripted model writes after its thinking template: reasoning "ok", then the answer "Paris".
THINK_SCRIPT = ["<think>", "o", "k", "</think>", "\n", "P", "a", "r", "i", "s"]
ANSWER, REASONING = "Paris", "ok"
# A tool whose arguments a constraint can only complete one way on the scripted model (where the script's token is
# forbidden, the lowest allowed token wins: "Oslo" before "Paris")
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}


@contextmanager
def serve_scripted(path: Path, served_model_name: str = "scripted", **app_kwargs):
    """The thinking scripted model served by a real uvicorn on 127.0.0.1 (engine in process, as the other server
    tests); yields the base URL. ``app_kwargs`` go to ``build_app`` (API keys, the Responses store)."""
    from conveyor.server.app import build_app
    from tests.helpers.server import make_engine, running_server

    model = save_scripted_llama(path, THINK_SCRIPT)
    app = build_app(make_engine(model, dtype="float32", num_kv_blocks=128), served_model_name,
                    log_stats_interval_s=0.0, shutdown_timeout_s=2.0, **app_kwargs)
    with running_server(app) as url:
        yield url
