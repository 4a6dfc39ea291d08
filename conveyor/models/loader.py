"""load_model: a model name, GGUF file or Hugging Face directory (``models/sources.py``) -> (nn.Module, ModelInfo)."""

from __future__ import annotations

import json
import os

import torch

from conveyor.models.build import ModelInfo, build_model, make_info, resolve_dtype
from conveyor.models.config import parse_config
from conveyor.models.cpu_layout import relayout_for_cpu
from conveyor.models.embedded import load_embedded
from conveyor.models.gguf_file import GGUFFile
from conveyor.models.gguf_model import gguf_config, gguf_weights
from conveyor.models.sources import resolve_model
from conveyor.models.weights import checkpoint_files, iter_weights, load_into


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
