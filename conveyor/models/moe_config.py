"""Reading a mixture of experts' router from a config.json (``from_hf``) or a GGUF file's metadata (``from_gguf``)
into a ``MoEConfig``, for the MoE families (``qwen3_moe``, ``mixtral``, ``olmoe``); what a router computes that
conveyor does not (shared experts, another gating function, a scale on the weights, dense layers among the sparse
ones) is refused, naming the key.
"""

from __future__ import annotations

from conveyor.models.config import MoEConfig
from conveyor.models.gguf_config import GGUFMeta
from conveyor.models.hf_config import HFConfig

# Training-only settings of the routers (load-balancing losses, router jitter noise): nothing at inference.
_TRAINING_ONLY = ("router_aux_loss_coef", "router_jitter_noise", "output_router_logits", "router_z_loss_coef")
_SOFTMAX = 1  # gguf.ExpertGatingFuncType.SOFTMAX


def from_hf(c: HFConfig, experts_key: str, width_key: str, norm_topk_prob: bool | None) -> MoEConfig:
    """The router of a config.json: experts under ``experts_key`` (transformers 5 may write either name),
    ``num_experts_per_tok``, expert width under ``width_key``; ``norm_topk_prob`` the family's fixed rule (Mixtral
    always renormalises), or None to read the key (Qwen3-MoE, OLMoE; default False, as transformers')."""
    for key in _TRAINING_ONLY:
        c.get(key)
    experts = c.get(experts_key) or c.get("num_local_experts") or c.get("num_experts")
    if not experts:
        raise ValueError(f"{c.where}: the key {experts_key!r} (the number of experts) is missing")
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if c.get(key):
            c.refuse(key, "shared experts are not built")
    c.expect("decoder_sparse_step", 1, why="every layer routed (dense layers among sparse ones are not built)")
    c.expect("mlp_only_layers", [], why="every layer routed (dense layers among sparse ones are not built)")
    c.expect("scoring_func", "softmax", why="the router's gating is a softmax")
    c.expect("topk_method", "greedy", why="experts are picked by a plain top-k")
    norm = bool(c.get("norm_topk_prob", False)) if norm_topk_prob is None else norm_topk_prob
    moe = MoEConfig(num_experts=int(experts), top_k=int(c.require("num_experts_per_tok")),
                    intermediate_size=int(c.require(width_key)), norm_topk_prob=norm)
    if not 0 < moe.top_k <= moe.num_experts:
        c.refuse("num_experts_per_tok", f"{moe.top_k} of {moe.num_experts} experts")
    return moe


def from_gguf(m: GGUFMeta, norm_topk_prob: bool, width_key: str = "expert_feed_forward_length") -> MoEConfig:
    """The router of a GGUF file's ``{arch}.expert_*`` keys. ``norm_topk_prob`` is what llama.cpp computes for
    the architecture (its graph hard-codes it; the converter writes no key for it): a file saying otherwise in
    ``expert_weights_norm`` is refused rather than computed one way or the other."""
    experts, top_k = int(m.require("expert_count")), int(m.require("expert_used_count"))
    if not 0 < top_k <= experts:
        m.refuse("expert_used_count", f"{top_k} of {experts} experts")
    norm = m.get("expert_weights_norm")
    if norm is not None and bool(norm) != norm_topk_prob:
        m.refuse("expert_weights_norm", f"llama.cpp's {m.arch} graph {'always' if norm_topk_prob else 'never'} "
                                        "renormalises the top-k weights")
    if m.get("expert_gating_func", _SOFTMAX) != _SOFTMAX:
        m.refuse("expert_gating_func", "the router's gating is a softmax")
    if float(m.get("expert_weights_scale", 1.0)) not in (0.0, 1.0):  # 0: unset, as llama.cpp reads it
        m.refuse("expert_weights_scale", "the routing weights are not scaled")
    for key in ("expert_shared_count", "expert_shared_feed_forward_length"):
        if m.get(key):
            m.refuse(key, "shared experts are not built")
    width = int(m.require(width_key))
    other = m.get("expert_feed_forward_length")  # the architectures whose experts' width is feed_forward_length
    if other is not None and int(other) != width:
        m.refuse("expert_feed_forward_length", f"llama.cpp's {m.arch} graph sizes its experts by {width_key}")
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=width, norm_topk_prob=norm_topk_prob)


# llama.cpp's per-layer MoE tensors -> their Hugging Face names in conveyor's layers (Qwen3-MoE's): the router, and
# the 3-D stacks of every expert's gate, up and down ("{expert}": one name per slice along the first dimension,
# models.gguf_model.gguf_parts)
EXPERT_TENSORS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
                  "ffn_up_exps": "mlp.experts.{expert}.up_proj", "ffn_down_exps": "mlp.experts.{expert}.down_proj"}
