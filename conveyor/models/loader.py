"""load_model: a Hugging Face directory (or the built-in embedded model) -> (nn.Module, ModelInfo)."""

from __future__ import annotations

import json
import os

import torch

from conveyor.models.build import ModelInfo, build_model, choose_dtype, make_info
from conveyor.models.config import parse_config
from conveyor.models.cpu_layout import prepare_for_cpu
from conveyor.models.embedded import EMBEDDED_NAME, load_embedded
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
    """Load a HF checkpoint directory, or the embedded random-weights bench model when ``model`` is None.

    Raises FileNotFoundError for a missing directory / config / weights, ValueError for an unsupported
    architecture, dtype or a checkpoint that does not fit the config.
    """
    if model is None or model == EMBEDDED_NAME:
        torch_dtype, why = choose_dtype(dtype, device)
        net, info = load_embedded(torch_dtype, device, seed)
        info.dtype_reason = why
    else:
        net, info = _load_hf_dir(model, dtype, device)
    if torch.device(device).type == "cpu":
        from conveyor.kernels import load_cpu_kernels

        prepare_for_cpu(net, load_cpu_kernels())
    return net, info


def _load_hf_dir(model: str, dtype: str | torch.dtype, device: str | torch.device) -> tuple[torch.nn.Module, ModelInfo]:
    config_path = os.path.join(model, "config.json")
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model directory")
    with open(config_path) as f:
        raw = json.load(f)
    cfg = parse_config(raw, where=config_path)
    torch_dtype, why = choose_dtype(dtype, device, raw.get("torch_dtype") or raw.get("dtype"))
    cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(_generation_eos(model)))
    files = checkpoint_files(model)
    net = build_model(cfg, torch_dtype, device)
    with torch.no_grad():
        load_into(net, iter_weights(files), where=model)
    info = make_info(os.path.basename(os.path.normpath(model)), cfg, net, torch_dtype)
    info.dtype_reason = why
    return net, info
