"""load_model: a model name, GGUF file or Hugging Face directory (``models/sources.py``) -> (nn.Module, ModelInfo)."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

import torch

from conveyor.models.config import GPT2_LIKE, ModelConfig, parse_config
from conveyor.models.cpu_layout import relayout_for_cpu
from conveyor.models.gguf_file import GGUFFile
from conveyor.models.gguf_model import gguf_config, gguf_weights
from conveyor.models.gpt2 import GPT2LMHeadModel
from conveyor.models.llama import LlamaForCausalLM
from conveyor.models.sources import resolve_model
from conveyor.models.weights import checkpoint_files, iter_weights, load_into

# float64 is for tests: the numerical oracle in which random weights' near-ties cannot flip.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class ModelInfo:
    """What the engine, runner and server need to know about a loaded model."""

    name: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    dtype: str
    num_params: int


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu", checkpoint_dtype=None) -> torch.dtype:
    """A dtype name -> torch dtype. "auto": float32 on CPU (no fast bf16/fp16 matmul on most CPUs), else the
    checkpoint's 16-bit dtype when it has one."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cpu" or checkpoint_dtype not in ("bfloat16", "float16"):
            return torch.float32
        return DTYPES[checkpoint_dtype]
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES) + ['auto']}, got {dtype!r}")
    return DTYPES[dtype]


@contextlib.contextmanager
def skip_param_init():
    """Make nn.Linear / nn.Embedding skip their random init while the model is built: the checkpoint (or the
    embedded model's seeded init) overwrites every parameter anyway. (Building on the meta device instead
    costs a 1.3 s one-off import of torch's reference ops.)"""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    """A model with uninitialised parameters of ``dtype`` on ``device`` (no random init cost)."""
    cls = GPT2LMHeadModel if cfg.architecture in GPT2_LIKE else LlamaForCausalLM
    with skip_param_init(), torch.device(device):
        model = cls(cfg).to(dtype)
    return model.eval().requires_grad_(False)


def make_info(name: str, cfg: ModelConfig, model: torch.nn.Module, dtype: torch.dtype) -> ModelInfo:
    return ModelInfo(
        name=name, architecture=cfg.architecture, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
        eos_token_ids=list(cfg.eos_token_ids), bos_token_id=cfg.bos_token_id,
        dtype=str(dtype).removeprefix("torch."), num_params=sum(p.numel() for p in model.parameters()))


def _generation_eos(model_dir: str) -> list[int]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def load_model(model: str | None, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               seed: int = 0) -> tuple[torch.nn.Module, ModelInfo]:
    """Load a model by name, GGUF file or HF checkpoint directory; None is the default model (SmolLM2).

    Raises FileNotFoundError for a missing model / config / weights (``ModelNotInstalledError`` for a named model
    whose package is missing), ValueError (``GGUFError`` for GGUF files) for an unsupported architecture or
    dtype, a corrupt file, or a checkpoint that does not fit its config.
    """
    source = resolve_model(model)
    if source.kind == "embedded":
        from conveyor.models.embedded import load_embedded
        net, info = load_embedded(resolve_dtype(dtype, device), device, seed)
    elif source.kind == "gguf":
        net, info = _load_gguf(source.path, source.name, dtype, device)
    else:
        net, info = _load_hf_dir(source.path, dtype, device)
    if torch.device(device).type == "cpu":
        relayout_for_cpu(net)
    return net, info


def _load_gguf(path: str, name: str, dtype: str | torch.dtype,
               device: str | torch.device) -> tuple[torch.nn.Module, ModelInfo]:
    """A GGUF file's model, every tensor dequantized into ``dtype`` ("auto": float32 on CPU, as the checkpoint
    is quantized)."""
    torch_dtype = resolve_dtype(dtype, device)
    with GGUFFile(path) as f:
        cfg = gguf_config(f)
        net = build_model(cfg, torch_dtype, device)
        with torch.no_grad():
            load_into(net, gguf_weights(f, cfg, torch_dtype), where=path)
    return net, make_info(name, cfg, net, torch_dtype)


def _load_hf_dir(model: str, dtype: str | torch.dtype, device: str | torch.device) -> tuple[torch.nn.Module, ModelInfo]:
    config_path = os.path.join(model, "config.json")
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model directory")
    with open(config_path) as f:
        raw = json.load(f)
    cfg = parse_config(raw, where=config_path)
    torch_dtype = resolve_dtype(dtype, device, raw.get("torch_dtype") or raw.get("dtype"))
    cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(_generation_eos(model)))
    files = checkpoint_files(model)
    net = build_model(cfg, torch_dtype, device)
    with torch.no_grad():
        load_into(net, iter_weights(files), where=model)
    return net, make_info(os.path.basename(os.path.normpath(model)), cfg, net, torch_dtype)

