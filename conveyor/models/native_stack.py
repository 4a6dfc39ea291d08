"""A Llama-family model's decoder layers as one native call, for steps small enough that every linear layer
runs on the native skinny GEMMs (decode batches: up to 128 rows, 96 on AVX2, in float32 anywhere, in bfloat16
on AMX tiles or, without AMX, on AVX512_BF16's VDPBF16PS: ``layers.linear`` decides the rows per linear).

Why: at those sizes a layer's GEMMs take tens of microseconds, and the per-layer path crosses from Python into
native code about ten times per layer (norm, qkv, attention, o, norm, gate_up, activation, down), allocating a
tensor each time. Measured on the bench model in bfloat16 at batch 4 (2 vCPU Xeon with AMX), that overhead was
about as long as the GEMMs themselves. ``cvk_llama_layers`` runs the same kernels in the same order over every
layer, so its results are bit-identical to the per-layer path (tests/models/test_native_stack.py checks it).

With quantized linears (``layers.quantized.QuantLinear``) the linear fields hold their ``QuantWeight`` descriptors
instead and those GEMMs are the integer kernel's, in float32 or bfloat16, with or without AMX, up to
``QUANT_STACK_MAX_ROWS`` rows; a file with a tensor in a type without a kernel (IQ*, held in float) mixes the two
per linear (a per-layer field says which is which).

Which models it runs is declared, not probed: ``unsupported_reason(cfg)`` names what a model's config has that
the native stack does not compute (Gemma's four norms, tanh-GELU, a second RoPE table, scaled embeddings; GPT-2's
blocks), and such a model runs the per-layer path. It runs per-layer sliding windows and Qwen3's q/k norms (each
head's rows normed by the same row kernel as the per-layer path, so bit-identical still), OLMoE's q/k norms across
heads, and a mixture of experts' routed MLP in float32 (its router on the skinny GEMM, then the same ``cvk_moe`` call
on the same table as the per-layer path's ``models.native_moe``).
With LoRA adapters (``models.lora_model`` calls ``attach_lora``) a step with adapter rows runs here too: after each
linear's GEMM the stack calls the same segmented adapter kernel the per-layer path's ``LoRALinear`` calls, so such
a step keeps the one native call (it used to fall back to the per-layer path, about half of the decode throughput
on SmolLM2: docs/lora.md).
``NativeLayerStack.build(model, kernels)`` also returns None where the kernels cannot apply (no kernels, a linear
without its native packing, norms in another dtype); ``accepts(num_tokens, attn, lora)`` says per step whether this
one can.
"""

from __future__ import annotations

import torch

from conveyor.kernels.cpu_ops import kv_dtype_code
from conveyor.layers.attention.base import AttentionBackend, LayerStackAttention
from conveyor.layers.linear import PackedLinear
from conveyor.layers.lora import LoRALinear, LoRAStep
from conveyor.layers.quantized import QuantLinear, descriptor_address
from conveyor.models.config import ModelConfig
from conveyor.models.moe import SparseMoE
from conveyor.models.step_cut import CutFlag, StepCut

# Quantized stacks run steps up to this many rows, the float stacks' limit (the per-call crossings it saves
# matter at decode sizes; above, the per-layer path runs the same integer kernels).
QUANT_STACK_MAX_ROWS = 128

# The order of the per-layer pointer fields cvk_llama_layers reads (see its comment in csrc/layer_stack.cpp).
_FIELDS = ("in_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias", "down", "down_bias",
           "q_norm", "k_norm", "window", "router", "experts", "quant_mask", "k_cache", "v_cache")
_KV_FIELDS = 2  # the last two fields: filled per KV cache, not per model
# The linears of cvk_llama_layers' lora_linears table, in its order (the fused names models.lora_model wraps).
_LORA_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _named_linears(layer) -> tuple:
    """(field, linear) of the linear layers whose GEMMs the stack runs itself (a mixture's experts: cvk_moe)."""
    attn = (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj))
    if isinstance(layer.mlp, SparseMoE):
        return attn
    return attn + (("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj))


def _linears(layer) -> tuple:
    return tuple(lin for _, lin in _named_linears(layer))


def unsupported_reason(cfg: ModelConfig) -> str | None:
    """What ``cfg``'s layers have that cvk_llama_layers does not compute (None: it runs them)."""
    checks = (
        (cfg.family == "gpt2", "GPT-2 blocks (LayerNorm, learned positions)"),
        (not cfg.gated_mlp or cfg.activation != "silu", f"a {cfg.activation} MLP (the stack runs SiLU-and-mul)"),
        (cfg.sandwich_norms, "four norms a layer"),
        (cfg.local_rope_theta is not None, "a second RoPE table for the windowed layers"),
        (cfg.embed_scale is not None, "scaled embeddings"),
    )
    reasons = [why for failed, why in checks if failed]
    return ", ".join(reasons) if reasons else None


class NativeLayerStack:
    """Runs ``model.layers`` for a step in one native call (see module doc). Holds only pointers into the
    model's own tensors, so the model must outlive it (it is the model's attribute)."""

    def __init__(self, model: torch.nn.Module, kernels, max_rows: int, quantized: bool = False) -> None:
        cfg = model.config
        self.kernels, self.max_rows, self.quantized = kernels, max_rows, quantized
        self.num_layers, self.hidden, self.inter = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = model.layers[0].input_layernorm.eps
        self.scale = model.layers[0].self_attn.scale
        self.dtype = model.layers[0].input_layernorm.weight.dtype
        def weight(lin) -> int:
            return descriptor_address(lin) if isinstance(lin, QuantLinear) else _ptr(lin.skinny)
        self.moe = cfg.moe
        rows = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
            if self.moe is None:
                ffn = [weight(mlp.gate_up_proj), _ptr(mlp.gate_up_proj.bias), weight(mlp.down_proj),
                       _ptr(mlp.down_proj.bias)]
                router = experts = 0
            else:  # the experts' GEMMs are cvk_moe's, from the table
                ffn, router, experts = [0, 0, 0, 0], _ptr(mlp.gate.skinny), _ptr(mlp.native.table)
            mask = sum(1 << _FIELDS.index(name) for name, lin in _named_linears(layer) if isinstance(lin, QuantLinear))
            rows.append([_ptr(layer.input_layernorm.weight), weight(attn.qkv_proj), _ptr(attn.qkv_proj.bias),
                         weight(attn.o_proj), _ptr(attn.o_proj.bias), _ptr(layer.post_attention_layernorm.weight),
                         *ffn, _ptr(q_norm), _ptr(k_norm), attn.window, router, experts, mask, 0, 0])
        self.qk_norm_across_heads = cfg.qk_norm_across_heads
        # the activations' int8 scratch is sized for the widest input (down_proj's, usually)
        self.max_padded_in = max((lin.quant.padded_in for layer in model.layers for lin in _linears(layer)
                                  if isinstance(lin, QuantLinear)), default=0)
        # field-major [fields, layers] int64, as the kernel indexes it
        self._fields = torch.tensor(rows, dtype=torch.int64).t().contiguous()
        self._kv_key: tuple[int, ...] | None = None
        self._lora = None  # (the model's layers.lora.LoRAStep, lora_linears table, rank, adapter dtype, max SR)

    @classmethod
    def build(cls, model: torch.nn.Module, kernels) -> NativeLayerStack | None:
        """The stack for ``model`` (a decoder ``unsupported_reason`` accepts, its linears packed by
        ``prepare_linears``), or None when some part would not run natively."""
        if kernels is None or unsupported_reason(model.config) is not None or not len(model.layers):
            return None
        cfg = model.config
        if not kernels.supports(model.layers[0].input_layernorm.weight.dtype, cfg.head_dim):
            return None
        max_rows = None
        quantized = any(isinstance(lin, QuantLinear) for layer in model.layers for lin in _linears(layer))
        for layer in model.layers:
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            linears = _linears(layer)
            if cfg.moe is not None:  # float32 only: its router on the float32 skinny GEMM
                native = layer.mlp.native
                gate = layer.mlp.gate
                if native is None or native.dtype != torch.float32 or not isinstance(gate, PackedLinear) or \
                        gate.skinny is None:
                    return None
                max_rows = native.max_rows if max_rows is None else min(max_rows, native.max_rows)
            if any(not isinstance(lin, QuantLinear) and (not isinstance(lin, PackedLinear) or lin.skinny is None)
                   for lin in linears):  # each linear quantized, or packed for the native float GEMMs
                return None
            dtypes = {n.weight.dtype for n in norms} | {lin.weight.dtype for lin in linears}
            if len(dtypes) != 1 or any(lin.bias is not None and lin.bias.dtype not in dtypes for lin in linears):
                return None
            rows = min(min(lin.max_rows, QUANT_STACK_MAX_ROWS) if isinstance(lin, QuantLinear) else lin.max_rows
                       for lin in linears)
            max_rows = rows if max_rows is None else min(max_rows, rows)
        return cls(model, kernels, max_rows, quantized) if max_rows else None

    def attach_lora(self, step: LoRAStep, linears: list[dict[str, LoRALinear]]) -> None:
        """Run steps with adapter rows too: ``step`` is the model's ``LoRAStep``, ``linears`` per layer its
        ``LoRALinear``s by fused name (``models.lora_model``). The table holds pointers to their slot tensors,
        which adapters are loaded into in place. (A mixture of experts carries no adapters: nothing to attach.)"""
        wrapped = [lin for layer in linears for lin in layer.values()]
        if not wrapped or self.moe is not None:
            return
        table = torch.zeros(self.num_layers, len(_LORA_LINEARS), 4, dtype=torch.int64)
        for layer, by_name in enumerate(linears):
            for i, name in enumerate(_LORA_LINEARS):
                if (lin := by_name.get(name)) is not None:
                    table[layer, i] = torch.tensor([lin.a.data_ptr(), lin.b.data_ptr(), lin.sub_cols.data_ptr(),
                                                    len(lin.parts)])
        self._lora = (step, table, wrapped[0].rank, wrapped[0].a.dtype, max(lin.a.shape[2] for lin in wrapped))

    def accepts(self, num_tokens: int, attn: AttentionBackend, lora: LoRAStep | None = None) -> bool:
        """Whether a step of ``num_tokens`` rows with this attention object runs here (an object that
        ``supports_layer_stack`` is a ``LayerStackAttention``); ``lora``: the model's ``LoRAStep``, whose adapter
        rows run here when it was attached with its native kernel (not the torch per-adapter loop)."""
        if lora is not None and lora.active and (self._lora is None or self._lora[0] is not lora or
                                                 lora.kernels is None):
            return False
        return 0 < num_tokens <= self.max_rows and attn.supports_layer_stack

    def run(self, embeddings: torch.Tensor, rope_table: torch.Tensor, kv_caches: list[torch.Tensor],
            attn: LayerStackAttention, cut: CutFlag | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer over ``embeddings`` [T, hidden] (consumed: it becomes the residual stream).
        Returns (last layer's output, residual), as the per-layer loop leaves them for the final norm. ``cut``:
        read between layers; raised, the call stops there and raises ``StepCut``."""
        self._bind_kv(kv_caches)
        t, dt = embeddings.shape[0], embeddings.dtype
        q_size = self.num_heads * self.head_dim
        x = torch.empty(t, self.hidden, dtype=dt)
        scratch = (torch.empty(t, self.hidden, dtype=dt),
                   torch.empty(t, q_size + 2 * self.num_kv_heads * self.head_dim, dtype=dt),
                   torch.empty(t, q_size, dtype=dt), torch.empty(t, 2 * self.inter, dtype=dt),
                   torch.empty(t, self.inter, dtype=dt))
        residual = embeddings.contiguous()
        plan = attn.plan(self.num_heads, self.num_kv_heads, self.head_dim)  # the step's, shared with any other call
        quant_scratch = None
        if self.quantized:
            quant_scratch = torch.empty(self.kernels.quant_scratch_bytes(t, self.max_padded_in), dtype=torch.uint8)
        moe = dict(qk_norm_across_heads=int(self.qk_norm_across_heads))
        if self.moe is not None:  # the router's logits, then cvk_moe's scratch
            m = self.moe
            logits = -(-t * m.num_experts * 4 // 64) * 64
            size = logits + self.kernels.moe.scratch_bytes(t, self.hidden, m.intermediate_size, m.num_experts,
                                                           m.top_k, dt)
            self._moe_scratch = torch.empty(size, dtype=torch.uint8)  # alive until the call returns
            moe.update(moe_scratch=self._moe_scratch.data_ptr(), moe_scratch_bytes=size,
                       moe_inter=m.intermediate_size, E=m.num_experts, top_k=m.top_k,
                       norm_topk_prob=int(m.norm_topk_prob))
        lora = None
        if self._lora is not None and self._lora[0].active:
            step, table, rank, weight_dtype, max_sr = self._lora
            self._lora_scratch = torch.empty(t * max_sr, dtype=torch.float32)  # alive until the call returns
            lora = (self.kernels.lora.segments(step.rows, step.seg_start, step.seg_slot, rank, weight_dtype,
                                               self._lora_scratch), table)
        stopped = self.kernels.llama_layers(self._fields, self.num_layers, self.hidden, self.inter, x, residual, scratch,
                                  attn.block_table, attn.query_start, attn.seq_lens, rope_table, self.num_heads,
                                  self.num_kv_heads, self.head_dim, kv_caches[0].shape[3], self.scale, self.eps,
                                  plan=plan, quant_scratch=quant_scratch,
                                  key_mass=attn.mass_buffer(self.num_kv_heads), rope_offset=attn.rope_offset,
                                  moe=moe, kv_dtype=kv_dtype_code(kv_caches[0], self.head_dim, x.dtype), lora=lora,
                                  stop=None if cut is None or cut.cut_layers < 2 else (cut.address, cut.cut_layers))
        if stopped:
            raise StepCut(None, native=True)
        return x, residual

    def _bind_kv(self, kv_caches: list[torch.Tensor]) -> None:
        """Point the per-layer cache fields at ``kv_caches`` ([2, blocks, KVH, block_size, D] per layer in the
        model's dtype, bfloat16 under a float32 model, or int8 rows of D + 4: ``layers.attention.kv_quant``)."""
        key = tuple(cache.data_ptr() for cache in kv_caches)
        if key == self._kv_key:
            return
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {self.num_layers} layers")
        for i, cache in enumerate(kv_caches):
            readable = (cache.dtype == self.dtype or (cache.dtype, self.dtype) == (torch.bfloat16, torch.float32)
                        or (cache.dtype == torch.int8 and cache.shape[-1] == self.head_dim + 4))
            if not readable or not cache.is_contiguous():
                raise ValueError("the native layer stack needs contiguous KV caches in the model's dtype, bfloat16 "
                                 "(a float32 model's) or int8")
            self._fields[len(_FIELDS) - _KV_FIELDS, i] = cache[0].data_ptr()
            self._fields[len(_FIELDS) - 1, i] = cache[1].data_ptr()
        self._kv_key = key
