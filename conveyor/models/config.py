"""``ModelConfig``: what a model family's layers need to know, read from a Hugging Face config.json or a GGUF file's
metadata by the family's module (``models.registry``), the same fields either way.

Beyond the shape, it names each feature a family's layers may have, so that a layer is built from the config and
never guesses: per-layer sliding windows, q/k norms, the Gemma "sandwich" norms, partial rotary, the local layers'
RoPE base, scaled embeddings, the activation, and final logit soft-capping; and, for a mixture of experts, its
router (``MoEConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.sim.model_specs import ModelSpec

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


@dataclass(frozen=True)
class MoEConfig:
    """A routed MLP on every layer: ``num_experts`` gated MLPs of width ``intermediate_size``; each token's
    router logits go through a softmax over all experts, the ``top_k`` largest probabilities pick its experts, and
    (``norm_topk_prob``) are divided by their sum, as transformers' Qwen3-MoE, Mixtral and OLMoE routers compute
    them (no router jitter: that is training only). The output is the probability-weighted sum of the experts'
    outputs, added in increasing expert order."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    family: str = "llama"  # the registry's name of the family whose layers compute it
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # normalised: {"rope_type": ..., parameters} (layers.rope_scaling)
    rotary_dim: int | None = None  # None: the whole head
    # Sliding window of each layer: how many keys (its own included) a query sees; 0: every earlier key.
    # Empty: no layer has one. Slots equal positions here (KV eviction, which shifts them, is refused with windows).
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # Gemma 3: the windowed layers' RoPE base (unscaled)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    # OLMoE: the q and k norms span all heads (one RMSNorm over the whole q and the whole k projection), not a head
    qk_norm_across_heads: bool = False
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 2/3: 4 norms a layer)
    # The checkpoint stores norm weights w of layers that multiply by (norm_offset + w): Gemma's Hugging Face
    # files (1.0); its GGUF files store 1 + w already (0.0). Added once at load.
    norm_offset: float = 0.0
    activation: str = "silu"  # of the gated MLP's gate
    gated_mlp: bool = True  # gate, up and down (GPT-2: up and down only)
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    moe: MoEConfig | None = None  # routed experts in place of the dense MLP on every layer (None: dense)
    # Encoders (models.bert): attention sees every token of the sequence (False), which also means no KV cache
    # and no chunked prompt; token type (segment) embeddings; a classifier's label count (0: no classifier);
    # where learned positions start (RoBERTa: after the padding index)
    causal: bool = True
    has_lm_head: bool = True  # False: a decoder's ``*Model`` checkpoint (an embedder: hidden states only)
    type_vocab_size: int = 0
    num_labels: int = 0
    position_offset: int = 0
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def has_windows(self) -> bool:
        return any(self.layer_windows)

    def spec(self, name: str) -> ModelSpec:
        """The simulator's and the FLOP count's plain description of this model (``sim.model_specs``)."""
        return ModelSpec(name, self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim,
                         self.intermediate_size, self.vocab_size, self.max_position_embeddings,
                         self.tie_word_embeddings, layer_windows=tuple(self.layer_windows),
                         mlp_matrices=3 if self.gated_mlp else 2,
                         num_experts=self.moe.num_experts if self.moe else 0,
                         experts_per_token=self.moe.top_k if self.moe else 0,
                         expert_intermediate_size=self.moe.intermediate_size if self.moe else 0)
