"""load_model: a model name, GGUF file or Hugging Face directory (``models/sources.py``) -> (nn.Module, ModelInfo)."""

from __future__ import annotations

import json
import logging
import os

import torch

from conveyor.models.build import (
    ModelInfo,
    build_model,
    choose_dtype,
    make_info,
    resolve_dtype,
)
from conveyor.models.cpu_layout import prepare_for_cpu
from conveyor.models.embedded import load_embedded
from conveyor.models.gguf_file import GGUFFile
from conveyor.models.gguf_model import gguf_parts, gguf_quantized, gguf_weights
from conveyor.models.pooling_config import (
    choose_task,
    matryoshka_of,
    pooling_config,
    sentence_transformers_config,
)
from conveyor.models.quantize import (
    QUANTIZATION_CHOICES,
    describe,
    install,
    plan_gguf,
    quantize_linears_int8,
)
from conveyor.models.registry import config_from_gguf, config_from_hf
from conveyor.models.sources import resolve_model
from conveyor.models.w8a8_checkpoint import check_w8a8_config, install_w8a8, split_w8a8
from conveyor.models.weights import checkpoint_files, iter_weights, load_into

logger = logging.getLogger("conveyor.models")


def _generation_eos(model_dir: str) -> list[int]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def load_model(model: str | None, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               seed: int = 0, quantization: str = "auto", convert: str = "auto",
               pooler_config: dict | None = None) -> tuple[torch.nn.Module, ModelInfo]:
    """Load a model by name, GGUF file or HF checkpoint directory; None is the default model (SmolLM2).

    ``quantization`` (``models.quantize``): "auto" keeps a GGUF file's weights in their blocks where the CPU
    kernels have them (else dequantizes, as "none" always does); "int8" quantizes a float checkpoint's linear
    layers to per-channel int8 (activations 15-bit per block), "w8a8" to the same weights against 8-bit
    activations per token, as vLLM's W8A8 (``layers.w8a8``). Quantized weights need the native CPU kernels:
    elsewhere "auto" dequantizes and "int8" / "w8a8" are a ValueError. ``convert`` and ``pooler_config``
    (``models.pooling_config``) say what a model serves where its checkpoint does not (``ModelInfo.task`` /
    ``pooling``).

    Raises FileNotFoundError for a missing model / config / weights (``ModelNotInstalledError`` for a named model
    whose package is missing), ValueError (``GGUFError`` for GGUF files) for an unsupported architecture or
    dtype, a corrupt file, or a checkpoint that does not fit its config.
    """
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}")
    source = resolve_model(model)
    kernels = None
    if torch.device(device).type == "cpu":
        from conveyor.kernels import load_cpu_kernels

        kernels = load_cpu_kernels()
    int8 = quantization in ("int8", "w8a8")
    if int8 and kernels is None:
        raise ValueError(f"--quantization {quantization} runs on the native CPU kernels, which are not available "
                         f"here (device {device}); use --quantization none")
    if int8 and source.kind == "gguf":
        raise ValueError(f"{source.path} is a GGUF file, already quantized: --quantization auto keeps its blocks, "
                         f"none dequantizes them; {quantization} is for float checkpoints")
    keep_quantized = kernels if quantization == "auto" else None
    done: list[str] = []
    st, matryoshka, gguf_pooling, sources = {}, (), None, ()
    if source.kind == "embedded":
        torch_dtype, why = choose_dtype(dtype, device, quantized=int8)
        net, info = load_embedded(torch_dtype, device, seed)
        info.dtype_reason = why
    elif source.kind == "gguf":
        net, info, done, gguf_pooling = _load_gguf(source.path, source.name, dtype, device, keep_quantized)
        sources = ("GGUF pooling_type",) if gguf_pooling else ()
    else:
        net, info, matryoshka, done = _load_hf_dir(source.path, dtype, device, int8, kernels, quantization)
        st = sentence_transformers_config(source.path)
        sources = ("sentence-transformers files",) if st else ()
    info.task = choose_task(info.architecture, info.causal, net.config.num_labels, bool(st), convert)
    info.pooling = pooling_config(info.task, info.causal, st, pooler_config, gguf_pooling, matryoshka,
                                  sources + (("--pooler-config",) if pooler_config else ()))
    if info.pooling is not None:
        logger.info("pooling model, %s", info.pooling.describe())
    if int8 and not done:  # (a W8A8 checkpoint's linears came in as W8A8Linears)
        done = quantize_linears_int8(net, kernels, resolve_dtype(info.dtype), w8a8=quantization == "w8a8")
    if torch.device(device).type == "cpu":
        prepare_for_cpu(net, kernels)
        logger.info("%s", describe(done, net))
    return net, info


def _load_gguf(path: str, name: str, dtype: str | torch.dtype, device: str | torch.device,
               kernels=None) -> tuple[torch.nn.Module, ModelInfo, list[str], int | None]:
    """A GGUF file's model: with ``kernels``, the weights ``plan_gguf`` picks stay in their blocks
    (``QuantLinear`` / ``QuantEmbedding``); every other tensor is dequantized into ``dtype`` ("auto": as
    ``choose_dtype`` picks it for the device, since a quantized checkpoint has no dtype of its own to keep).
    Returns the model, its info, the parameters kept quantized and the file's pooling type (an embedding model's)."""
    with GGUFFile(path) as f:
        cfg, family = config_from_gguf(f)
        plan: dict[str, list[str]] = {}
        if kernels is not None:
            plan = plan_gguf(build_model(cfg, torch.float32, "meta"), f.tensors,
                             lambda n: gguf_parts(n, family, f.tensors[n].shape))
        torch_dtype, why = choose_dtype(dtype, device, quantized=bool(plan))
        net = build_model(cfg, torch_dtype, device, on_meta=frozenset(plan))
        # the tensors read only in blocks: every part of them (each expert's slice of a stack) kept quantized
        planned = {part for parts in plan.values() for part in parts}
        skip = frozenset(n for n, _ in planned
                         if all((n, e) in planned for _, e in gguf_parts(n, family, f.tensors[n].shape)))
        with torch.no_grad():
            load_into(net, gguf_weights(f, cfg, family, torch_dtype, skip), where=path, exclude=frozenset(plan))
            info = make_info(name, cfg, net, torch_dtype, why)  # before a tied lm_head gets a module of its own
            done = install(net, gguf_quantized(f, cfg, family, plan, net), kernels, torch_dtype) if plan else []
        pooling = f.get(f"{f.get('general.architecture')}.pooling_type")
    return net, info, done, pooling


def _load_hf_dir(model: str, dtype: str | torch.dtype, device: str | torch.device, quantized: bool = False,
                 kernels=None, quantization: str = "auto") -> tuple[torch.nn.Module, ModelInfo, tuple[int, ...] | None,
                                                                  list[str]]:
    """A Hugging Face directory's model, its info, the embedding lengths its config declares it was trained to
    be cut to (``pooling_config.matryoshka_of``) and the parameters loaded quantized: a compressed-tensors W8A8
    checkpoint's linears (``models.w8a8_checkpoint``; with ``quantization`` "auto" or "w8a8" and the kernels)."""
    config_path = os.path.join(model, "config.json")
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model directory")
    with open(config_path) as f:
        raw = json.load(f)
    qc = raw.pop("quantization_config", None)
    if qc is not None:
        check_w8a8_config(qc, config_path)
        if kernels is None or quantization not in ("auto", "w8a8"):
            raise ValueError(f"{model} is a W8A8 checkpoint (int8 weights): it runs on the native CPU kernels with "
                             f"--quantization auto or w8a8" + ("" if kernels else " (not available here)"))
    cfg = config_from_hf(raw, where=config_path)
    torch_dtype, why = choose_dtype(dtype, device, raw.get("torch_dtype") or raw.get("dtype"),
                                    quantized or qc is not None)
    cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(_generation_eos(model)))
    files = checkpoint_files(model)
    weights, parts = iter_weights(files), {}
    if qc is not None:
        weights, parts = split_w8a8(weights, build_model(cfg, torch.float32, "meta"))
    net = build_model(cfg, torch_dtype, device, on_meta=frozenset(parts))
    with torch.no_grad():
        load_into(net, weights, where=model, exclude=frozenset(parts))
    info = make_info(os.path.basename(os.path.normpath(model)), cfg, net, torch_dtype, why)
    done = install_w8a8(net, parts, kernels, torch_dtype) if parts else []
    return net, info, matryoshka_of(raw), done
