"""load_model: a Hugging Face directory (or the built-in embedded model) -> (nn.Module, ModelInfo)."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

import torch

from conveyor.models.config import GPT2_LIKE, ModelConfig, parse_config
from conveyor.models.cpu_layout import prepare_for_cpu
from conveyor.models.gpt2 import GPT2LMHeadModel
from conveyor.models.llama import LlamaForCausalLM
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
    dtype_reason: str = ""  # why this dtype (choose_dtype), for the start-up log


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu", checkpoint_dtype=None) -> torch.dtype:
    """A dtype name -> torch dtype (see ``choose_dtype`` for "auto")."""
    return choose_dtype(dtype, device, checkpoint_dtype)[0]


def choose_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu",
                 checkpoint_dtype=None) -> tuple[torch.dtype, str]:
    """The torch dtype for a dtype name, and why (for the start-up log).

    "auto", as vLLM picks it but only where it pays: on a CPU, bfloat16 when the CPU multiplies bfloat16 in
    hardware (AVX512_BF16 or AMX-BF16: about 2-5x float32's matmul rate), float32 elsewhere (AVX2-only CPUs emulate
    bfloat16 at a fraction of float32's speed); on a GPU, the checkpoint's 16-bit dtype when it has one.
    """
    if isinstance(dtype, torch.dtype):
        return dtype, "as given"
    if dtype == "auto":
        if torch.device(device).type == "cpu":
            from conveyor.kernels.cpu_features import cpu_features

            feats = cpu_features()
            if feats.native_bf16:
                have = " and ".join(n for n, f in (("AMX-BF16", "amx_bf16"), ("AVX512_BF16", "avx512_bf16"))
                                    if f in feats.flags)
                return torch.bfloat16, f"auto: bfloat16, this CPU multiplies bfloat16 in hardware ({have})"
            return torch.float32, "auto: float32, this CPU has no native bfloat16 (no AVX512_BF16 or AMX)"
        if checkpoint_dtype in ("bfloat16", "float16"):
            return DTYPES[checkpoint_dtype], f"auto: {checkpoint_dtype}, the checkpoint's dtype"
        return torch.float32, "auto: float32, the checkpoint's dtype"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES) + ['auto']}, got {dtype!r}")
    return DTYPES[dtype], "as asked"


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
    """Load a HF checkpoint directory, or the embedded random-weights bench model when ``model`` is None.

    Raises FileNotFoundError for a missing directory / config / weights, ValueError for an unsupported
    architecture, dtype or a checkpoint that does not fit the config.
    """
    if model is None or model == EMBEDDED_NAME:
        from conveyor.models.embedded import load_embedded
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


EMBEDDED_NAME = "conveyor-embedded-llama-40m-random"
