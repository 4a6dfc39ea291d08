"""Get a loaded model ready for the CPU: prepacked linear layers and the native kernels wired in.

Linear weights go into oneDNN's blocked layout once (``layers.linear.prepare_linears``: the GEMM rate at
decode and prefill shapes, in float32 and bfloat16). RMSNorm and the gated MLP's activation get the native
CPU kernels when they built (``conveyor.kernels``), so a decoder layer's residual add + norm and its
SiLU-and-mul are one pass each; without kernels they stay torch ops. A mixture of experts' routed MLPs get their
native form (``models.native_moe``: one call a layer for the routing and every chosen expert). A Llama-family model
also gets its decoder layers as one native call for decode-sized steps (``models.native_stack``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from conveyor.layers.linear import PackedLinear, prepare_linears
from conveyor.models.moe import SparseMoE
from conveyor.models.native_moe import NativeExperts
from conveyor.models.native_stack import NativeLayerStack, unsupported_reason

logger = logging.getLogger("conveyor.models")


@torch.no_grad()
def prepare_for_cpu(model: nn.Module, kernels=None) -> None:
    """Pack every linear layer; hand ``kernels`` (a ``conveyor.kernels.CpuKernels`` or None) to the modules
    that use them (those with a ``kernels`` attribute: RMSNorm, the gated MLP)."""
    prepare_linears(model, kernels)
    for module in model.modules():
        if hasattr(module, "kernels") and module is not model and not isinstance(module, PackedLinear):
            module.kernels = kernels
        if isinstance(module, SparseMoE):
            module.native = NativeExperts.build(module, kernels)
    reason = unsupported_reason(model.config)
    if reason is not None:
        logger.info("native layer stack: not for this model (%s); its layers run one by one", reason)
        return
    model.native_stack = NativeLayerStack.build(model, kernels)
