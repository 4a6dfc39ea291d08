"""A model from a GGUF file: its tensors under Hugging Face names (so ``map_weight`` loads them as it loads a
safetensors checkpoint), by the family's table of llama.cpp tensor names (``ModelFamily.gguf_tensors``),
dequantized into the engine's dtype, or kept in their blocks (``gguf_quantized``). The ``ModelConfig`` comes from the
metadata through the registry (``registry.config_from_gguf``).

llama.cpp's converter permutes the rows of ``q_proj`` / ``k_proj`` of a Llama so that its rotary embedding can
rotate adjacent pairs (GPT-J style) instead of the two halves of each head (NeoX style, what Hugging Face and
conveyor use); ``unpermute_qk`` undoes that for the families that declare it (``gguf_permuted_qk``).

A mixture's experts come as 3-D tensors (``ffn_gate_exps`` [experts, rows, cols] ...), which a family's table maps
to a name with ``{expert}`` in it: each slice along the first dimension is one expert's weight (``gguf_parts``),
read as its own 2-D tensor, in its blocks where it stays quantized (a slice of a quantized tensor is whole blocks).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from conveyor.models.config import ModelConfig
from conveyor.models.family import ModelFamily
from conveyor.models.gguf_file import GGUFError, GGUFFile

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
EXPERT = "{expert}"  # in a family's table: a 3-D tensor of stacked experts, one name per expert


def hf_name(gguf_name: str, family: ModelFamily) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name in ``family``'s files, or None for tensors without one."""
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    global_tensors = family.gguf_global_tensors or _GLOBAL_TENSORS
    if base in global_tensors:
        return f"{global_tensors[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in family.gguf_tensors:
        return f"{family.gguf_layer_prefix}.{parts[1]}.{family.gguf_tensors[parts[2]]}.{kind}"
    return None


def gguf_parts(gguf_name: str, family: ModelFamily, shape: tuple[int, ...]) -> list[tuple[str, int | None]]:
    """The Hugging Face names a GGUF tensor fills, each with the index of its slice along the first dimension
    (None: the whole tensor): one name, or one per expert for a 3-D tensor of stacked experts; [] for none."""
    name = hf_name(gguf_name, family)
    if name is None:
        return []
    if EXPERT not in name:
        return [(name, None)]
    if len(shape) != 3:
        raise GGUFError(f"tensor {gguf_name!r} holds stacked experts, so it should be 3-D; it is {list(shape)}")
    return [(name.replace(EXPERT, str(e)), e) for e in range(shape[0])]


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of q/k rows (weights or biases), head by head: its rows are, per head, the
    pairs (x0, x(d/2)), (x1, x(d/2+1)), ...; Hugging Face's are x0 .. x(d/2 - 1), then x(d/2) .. x(d - 1)."""
    rows = w.shape[0]
    # in numpy (w is the float32 output of dequantization): torch's threaded copy of these small tensors cost
    # 0.68 s against 0.02 s single-threaded, measured while the 2 cores were shared
    a = w.numpy().reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
    return torch.from_numpy(np.ascontiguousarray(a).reshape(w.shape))


def qk_row_order(rows: int, n_heads: int) -> torch.Tensor:
    """The row permutation ``unpermute_qk`` applies, as indices (for weights kept quantized, moved row by row)."""
    return unpermute_qk(torch.arange(rows, dtype=torch.float32).unsqueeze(1), n_heads)[:, 0].to(torch.int64)


def _permuted_heads(name: str, cfg: ModelConfig, family: ModelFamily) -> int | None:
    """The head count to unpermute ``name``'s rows by, or None when they are stored as Hugging Face orders them."""
    if not family.gguf_permuted_qk:
        return None
    if ".attn_q." in name:
        return cfg.num_heads
    if ".attn_k." in name:
        return cfg.num_kv_heads
    return None


def gguf_quantized(f: GGUFFile, cfg: ModelConfig, family: ModelFamily,
                   plan: dict[str, list[tuple[str, int | None]]], model):
    """{model parameter -> its QuantizedTensor} for the parameters ``plan`` keeps quantized (models.quantize
    .plan_gguf: the GGUF parts that fill each, as (tensor, expert slice or None)): each part read in its blocks,
    q/k rows unpermuted and put in the order the model computes in (``map_weight``'s ``row_order``), fused parts
    stacked in row order."""
    from conveyor.layers.gguf_blocks import from_gguf
    from conveyor.layers.quantized import QuantizedTensor

    out = {}
    for param, names in plan.items():
        parts = []
        for name, expert in names:
            info = f.tensors[name]
            raw, shape, hf = f.raw(name), info.shape, hf_name(name, family)
            if expert is not None:  # one expert's whole blocks out of the stack
                per_expert = info.nbytes // shape[0]
                raw, shape = raw[expert * per_expert:(expert + 1) * per_expert], shape[1:]
                hf = hf.replace(EXPERT, str(expert))
            quant = from_gguf(raw, info.qtype.name, shape)
            heads = _permuted_heads(name, cfg, family)
            if heads is not None:
                quant = quant.take_rows(qk_row_order(info.shape[0], heads))
            target = model.map_weight(hf)
            if target.row_order is not None:
                quant = quant.take_rows(target.row_order)
            parts.append(quant)
        out[param] = QuantizedTensor.cat(parts)
    return out


def gguf_weights(f: GGUFFile, cfg: ModelConfig, family: ModelFamily, dtype: torch.dtype,
                 skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in ``dtype``) for every tensor the model uses but those named in ``skip`` (kept
    quantized), dequantized one at a time.

    A tensor the family has no place for (another architecture's layout, experts of a mixture) is an error, not
    silently skipped."""
    for name, info in f.tensors.items():
        targets = gguf_parts(name, family, info.shape)
        if not targets:
            if name in family.gguf_consumed:
                continue  # read with the metadata (RoPE factors)
            raise GGUFError(f"{f.path}: tensor {name!r} has no place in a {f.get('general.architecture')} model")
        if name in skip:
            continue
        tensor = f.load(name, torch.float32)
        heads = _permuted_heads(name, cfg, family)
        if heads is not None:
            tensor = unpermute_qk(tensor, heads)
        for target, expert in targets:
            yield target, (tensor if expert is None else tensor[expert]).to(dtype)
