#!/usr/bin/env python3
"""Write the models of the sliding-window measurement (docs/models.md, "Sliding windows and the KV cache").

    python benchmarks/windowed_model.py --out /tmp/conveyor-window [--window 512]

- ``<out>/mistral-40m-w<window>``: a Mistral (every layer windowed) of the bench model's shape (8 layers, hidden
  512, 8 query / 4 KV heads of 64, MLP 1408, vocabulary 32,000) with random weights from transformers' own
  initialisation, float32 safetensors, and a word-level tokenizer over the 32,000 ids (the traces are token ids);
- ``<out>/mistral-7b-v0.1``: Mistral-7B-v0.1's published config.json alone (window 4096), which the simulator
  reads (``bench compare --simulate ... --model <dir>``); no weights.

Needs transformers and tokenizers (the test extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB = 32000
MISTRAL_7B_V01 = {  # mistralai/Mistral-7B-v0.1's config.json (the keys conveyor reads)
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": VOCAB,
    "max_position_embeddings": 32768, "sliding_window": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def write_small(path: Path, window: int) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=8192, sliding_window=window, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = transformers.MistralForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab.update({"<unk>": 0, "<s>": 1, "</s>": 2})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                           "unk_token": "<unk>", "model_max_length": 8192}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory to write both model directories into")
    p.add_argument("--window", type=int, default=512, help="the small model's sliding window (tokens)")
    args = p.parse_args()
    out = Path(args.out)
    small = out / f"mistral-40m-w{args.window}"
    small.mkdir(parents=True, exist_ok=True)
    write_small(small, args.window)
    big = out / "mistral-7b-v0.1"
    big.mkdir(parents=True, exist_ok=True)
    (big / "config.json").write_text(json.dumps(MISTRAL_7B_V01, indent=1))
    print(f"wrote {small} and {big}")


if __name__ == "__main__":
    main()
