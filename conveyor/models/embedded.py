"""The benchmark model: the peers' bench shape (llama-40m) with RANDOM weights, built in (no files).

"conveyor-embedded-llama-40m-random" is a 40M-parameter Llama (hidden 512, 8 layers, 8 heads / 4 KV heads,
head_dim 64, MLP 1408, vocab 32000, tied embeddings, RoPE theta 10000). Its weights are random, drawn at load
time from a seed (nothing is stored on disk): its text is gibberish, but it does exactly the work of the real
shape, which is what the benchmarks measure. Its tokenizer is ``ByteTokenizer`` (``load_tokenizer(EMBEDDED_NAME)``).
"""

from __future__ import annotations

import sys

import torch

from conveyor.models.build import ModelInfo, build_model, make_info
from conveyor.models.config import ModelConfig
from conveyor.models.sources import EMBEDDED_NAME
EMBEDDED_CONFIG = dict(
    architecture="LlamaForCausalLM", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
    intermediate_size=1408, vocab_size=32000, max_position_embeddings=4096, norm_eps=1e-5,
    tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=1, eos_token_ids=[2])
INIT_STD = 0.02  # transformers' initializer_range


def load_embedded(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                  seed: int = 0) -> tuple[torch.nn.Module, ModelInfo]:
    """Build the embedded model and fill it deterministically from ``seed`` (norms 1, the rest N(0, 0.02))."""
    cfg = ModelConfig(**EMBEDDED_CONFIG)
    model = build_model(cfg, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # named_parameters order is fixed by the model code
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, INIT_STD, generator=gen)
    model = model.to(device=device, dtype=dtype)
    return model, make_info(EMBEDDED_NAME, cfg, model, dtype)


def warn_if_random(model_name: str) -> None:
    """On stderr, for the command-line front ends: a model named ``EMBEDDED_NAME`` answers noise."""
    if model_name == EMBEDDED_NAME:
        print(f"[conveyor] {EMBEDDED_NAME} has RANDOM weights: its output is noise (it exists for benchmarks)",
              file=sys.stderr)
