"""The interface of a model family (``ModelFamily``, what its module declares) and of the model it builds
(``CausalLM``, what the loader, runner and CPU preparation use); ``models.registry`` lists the families."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from conveyor.models.config import ModelConfig
from conveyor.models.gguf_config import GGUFMeta
from conveyor.models.gguf_file import GGUFFile
from conveyor.models.hf_config import HFConfig
from conveyor.models.weights import WeightTarget


class CausalLM(Protocol):
    """What the loader, runner and CPU preparation use of a built model."""

    config: ModelConfig
    lm_head: torch.nn.Module | None
    native_stack: object | None  # models.native_stack.NativeLayerStack, set by models.cpu_layout

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def get_input_embeddings(self) -> torch.nn.Module: ...

    def map_weight(self, name: str) -> WeightTarget | None: ...


@dataclass(frozen=True)
class ModelFamily:
    """One family's declarations (see module doc). ``gguf_tensors``: llama.cpp's per-layer tensor name (after
    ``blk.N.``) -> the Hugging Face name (after ``model.layers.N.``); ``gguf_consumed``: tensors read as metadata
    (RoPE factors), not weights; ``refused_architectures``: HF architectures of the family it refuses, and why;
    ``gguf_accepts``: where families share a GGUF architecture (llama.cpp writes Mixtral as "llama" with experts),
    whether this family reads a given file (None: every file of its architectures)."""

    name: str
    hf_architectures: tuple[str, ...]
    config_from_hf: Callable[[HFConfig, str], ModelConfig]
    build: Callable[[ModelConfig], CausalLM]
    gguf_architectures: tuple[str, ...] = ()
    config_from_gguf: Callable[[GGUFMeta], ModelConfig] | None = None
    gguf_tensors: dict[str, str] = field(default_factory=dict)
    gguf_consumed: tuple[str, ...] = ()
    gguf_permuted_qk: bool = False
    refused_architectures: dict[str, str] = field(default_factory=dict)
    gguf_accepts: Callable[[GGUFFile], bool] | None = None
    # llama.cpp's names of the tensors outside the layers -> Hugging Face's (None: the decoders' token_embd,
    # output_norm, output), and the Hugging Face prefix of layer N's tensors
    gguf_global_tensors: dict[str, str] | None = None
    gguf_layer_prefix: str = "model.layers"


