"""Building a model object: its class by architecture, parameters on the target device, and its ``ModelInfo``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.models import registry
from conveyor.models.config import ModelConfig
from conveyor.models.lora_format import LoRABase, lora_base_of
from conveyor.models.pooling_config import PoolingConfig
from conveyor.sim.model_specs import ModelSpec

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
    # Each layer's sliding window (0: full attention; empty: none has one), for the engine's start-up checks and,
    # later, a KV manager that frees the blocks every layer's window has left
    layer_windows: tuple[int, ...] = ()
    spec: ModelSpec | None = None  # the plain description: the simulator's and the one FLOP count's
    # What it serves (models.pooling_config): "generate", or a pooling model's "embed" / "score" and how it pools
    task: str = "generate"
    pooling: PoolingConfig | None = None
    causal: bool = True  # False: a bidirectional encoder (no KV cache, a sequence runs whole)
    type_vocab_size: int = 0  # token types (segments) the model embeds: 2 for BERT, pairs as two segments
    # What a LoRA adapter of this model must fit (models.lora_format), checked wherever an adapter is named
    lora_base: LoRABase | None = None

    @property
    def embedding_size(self) -> int:
        """The length of the embeddings an embed model returns by default."""
        return (self.pooling.dimensions if self.pooling and self.pooling.dimensions else None) or self.hidden_size


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu", checkpoint_dtype=None) -> torch.dtype:
    """A dtype name -> torch dtype (see ``choose_dtype`` for "auto")."""
    return choose_dtype(dtype, device, checkpoint_dtype)[0]


def choose_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu",
                 checkpoint_dtype=None, quantized: bool = False) -> tuple[torch.dtype, str]:
    """The torch dtype for a dtype name, and why (for the start-up log).

    "auto", as vLLM picks it but only where it pays: on a CPU, bfloat16 when the CPU multiplies bfloat16 in
    hardware (AVX512_BF16 or AMX-BF16: about 2-5x float32's matmul rate), float32 elsewhere (AVX2-only CPUs emulate
    bfloat16 at a fraction of float32's speed); on a GPU, the checkpoint's 16-bit dtype when it has one. With the
    weights ``quantized`` (on the CPU's integer kernels), float32: bfloat16 would halve no weight bytes, only round
    the activations and the KV cache (docs/kernels.md: on SmolLM2's Q4_1 it tips the greedy reply at a near-tie).
    """
    if isinstance(dtype, torch.dtype):
        return dtype, "as given"
    if dtype == "auto":
        if torch.device(device).type == "cpu" and quantized:
            return torch.float32, ("auto: float32, the weights run quantized on the integer kernels (bfloat16 would "
                                   "only round the activations and the KV cache)")
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


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                on_meta: frozenset[str] = frozenset()) -> torch.nn.Module:
    """A model with uninitialised parameters of ``dtype`` on ``device``, for a checkpoint to fill; the parameters
    named in ``on_meta`` stay on the meta device (weights kept quantized: their modules are replaced).

    It is built on the meta device, so that its layers' random init (which the checkpoint, or the embedded
    model's seeded init, would overwrite anyway) costs nothing, and every parameter is then given real, empty
    storage. (Buffers computed at construction, like RoPE's table, are computed on the CPU for real.)
    """
    with torch.device("meta"):
        model = registry.build(cfg)
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if (f"{module_name}.{name}" if module_name else name) in on_meta:
                module.register_parameter(name, torch.nn.Parameter(torch.empty(param.shape, dtype=dtype,
                                                                               device="meta"), requires_grad=False))
                continue
            # torch.empty, not Module.to_empty: its empty_like on meta tensors pulls in sympy (seconds at start-up).
            storage = torch.empty(param.shape, dtype=dtype, device=device)
            module.register_parameter(name, torch.nn.Parameter(storage, requires_grad=False))
    if not on_meta:
        return model.to(device=device, dtype=dtype).eval()
    # Module.to would try to copy the meta parameters: move the buffers (RoPE's table) as it would
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            setattr(module, name, buf.to(device=device, dtype=dtype if buf.is_floating_point() else buf.dtype))
    return model.eval()


def make_info(name: str, cfg: ModelConfig, model: torch.nn.Module, dtype: torch.dtype,
              dtype_reason: str = "") -> ModelInfo:
    return ModelInfo(
        name=name, architecture=cfg.architecture, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
        eos_token_ids=list(cfg.eos_token_ids), bos_token_id=cfg.bos_token_id,
        dtype=str(dtype).removeprefix("torch."), num_params=sum(p.numel() for p in model.parameters()),
        dtype_reason=dtype_reason, layer_windows=tuple(cfg.layer_windows), spec=cfg.spec(name), causal=cfg.causal,
        type_vocab_size=cfg.type_vocab_size, lora_base=lora_base_of(cfg))
