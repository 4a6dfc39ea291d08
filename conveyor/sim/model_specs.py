"""The shapes of the models the simulator knows, from their Hugging Face ``config.json`` files. PURE PYTHON.

Only what a cost model needs: layer count, widths, heads, vocabulary. Every FLOP and byte count of the cost
models derives from the properties below, so a unit test can check them by hand for a known shape. A loaded
model's spec comes from its config (``models.config.ModelConfig.spec``), and ``forward_flops`` here is the one FLOP
count of a forward pass (``models.flops`` asks it).

A mixture of experts adds its routed MLP's shape (experts, experts per token, expert width): the FLOPs count the
experts a token runs (``per_token_linear_params``), the memory all of them (``num_params``), and the weight bytes a
step streams the experts its tokens choose between them (``step_linear_params``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder (gated MLP, grouped-query attention, RoPE) as a cost model sees it."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Each layer's sliding window (0: full attention; empty: none has one). The attention FLOPs below count every
    # key a query could see without windows: an upper bound for windowed layers.
    layer_windows: tuple[int, ...] = field(default=())
    mlp_matrices: int = 3  # gate, up, down (GPT-2's MLP: 2)
    # A routed MLP in place of the dense one on every layer (0 experts: dense): each token runs experts_per_token
    # gated experts of expert_intermediate_size, chosen by a router of hidden_size x num_experts
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0

    def __post_init__(self) -> None:  # a profile read back from JSON gives a list
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows))

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def expert_params(self) -> int:
        """One expert's weights (gate, up, down); 0 for a dense model."""
        return 3 * self.hidden_size * self.expert_intermediate_size if self.num_experts else 0

    @property
    def _shared_params_per_layer(self) -> int:
        """A layer's weights every token of a step reads whatever it routes to: q/k/v, o, and the dense MLP or the
        router."""
        h = self.hidden_size
        attention = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        if self.num_experts:
            return attention + h * self.num_experts
        return attention + self.mlp_matrices * h * self.intermediate_size

    @property
    def linear_params_per_layer(self) -> int:
        """Weights every computed token multiplies through in one layer: q/k/v, o, gate/up, down (a mixture: the
        router and the experts_per_token experts it runs)."""
        return self._shared_params_per_layer + self.experts_per_token * self.expert_params

    def experts_touched(self, num_tokens: int) -> float:
        """The expected number of distinct experts a step of ``num_tokens`` tokens runs in one layer, when every
        token picks ``experts_per_token`` of ``num_experts`` uniformly and independently: E (1 - (1 - k/E)^n).
        A trained router is skewed, which makes it fewer; docs/moe.md measures it on random weights."""
        if not self.num_experts or num_tokens <= 0:
            return 0.0
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** num_tokens)

    def step_linear_params(self, num_tokens: int) -> float:
        """Weights a step of ``num_tokens`` tokens streams from memory: every layer's shared weights once, and, in a
        mixture, each expert its tokens chose once (``experts_touched``), however many of them chose it."""
        if num_tokens <= 0:
            return 0.0
        return self.num_layers * (self._shared_params_per_layer + self.experts_touched(num_tokens) * self.expert_params
                                  if self.num_experts else self.linear_params_per_layer)

    @property
    def per_token_linear_params(self) -> int:
        return self.num_layers * self.linear_params_per_layer

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def num_params(self) -> int:
        """All parameters: layers (norms included, every expert), embedding, final norm and lm_head (shared when
        tied)."""
        per_layer = self._shared_params_per_layer + self.num_experts * self.expert_params + 2 * self.hidden_size
        embeddings = self.lm_head_params * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size

    def forward_flops(self, num_tokens: int, num_sampled: int, attended_keys: float) -> float:
        """Matmul FLOPs of ``num_tokens`` tokens, ``num_sampled`` of them through the lm_head, whose queries attend
        to ``attended_keys`` keys in all: the same count as ``models.flops.forward_flops`` on a loaded model."""
        linear = 2.0 * self.per_token_linear_params * num_tokens
        lm_head = 2.0 * self.lm_head_params * num_sampled
        attention = 4.0 * self.num_layers * self.q_dim * attended_keys
        return linear + lm_head + attention


# The numbers are those of each model's published config.json (Hugging Face hub), copied here so the simulator
# needs no files: name -> (hidden, layers, heads, kv heads, head_dim, intermediate, vocab, context, tied).
_TABLE = {
    # conveyor's embedded bench model (models/embedded.py: the peers' benchmark config, random weights, 40M parameters)
    "bench-llama-40m": (512, 8, 8, 4, 64, 1408, 32000, 4096, True),
    "smollm2-135m": (576, 30, 9, 3, 64, 1536, 49152, 8192, True),  # HuggingFaceTB/SmolLM2-135M-Instruct
    "llama-3-8b": (4096, 32, 32, 8, 128, 14336, 128256, 8192, False),  # meta-llama/Meta-Llama-3-8B
    "llama-3-70b": (8192, 80, 64, 8, 128, 28672, 128256, 8192, False),  # meta-llama/Meta-Llama-3-70B
    "qwen2.5-7b": (3584, 28, 28, 4, 128, 18944, 152064, 32768, False),  # Qwen/Qwen2.5-7B-Instruct
}
# Mixtures of experts: the same fields, then (experts, experts a token, an expert's intermediate size).
_MOE_TABLE = {
    "qwen3-30b-a3b": ((2048, 48, 32, 4, 128, 6144, 151936, 40960, False), (128, 8, 768)),  # Qwen/Qwen3-30B-A3B
}
MODELS: dict[str, ModelSpec] = {name: ModelSpec(name, *row) for name, row in _TABLE.items()}
MODELS.update({name: ModelSpec(name, *row, num_experts=moe[0], experts_per_token=moe[1],
                               expert_intermediate_size=moe[2]) for name, (row, moe) in _MOE_TABLE.items()})
# The names conveyor's real engine reports for the same shapes, so a profile measured on one finds its spec.
ALIASES = {"conveyor-embedded-llama-40m-random": "bench-llama-40m", "llama-40m-fp32": "bench-llama-40m",
           "smollm2-135m-fp32": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m"}


def get_model_spec(name: str) -> ModelSpec:
    """The table's spec for ``name`` (case-insensitive; the real engine's model names are aliases)."""
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r} for the simulator; known: {', '.join(MODELS)} "
                         "(or pass a Hugging Face model directory)")
    return MODELS[key]
