"""Reading safetensors checkpoints (single file or sharded) and copying them into a model's parameters."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch
from safetensors import safe_open


class WeightTarget(NamedTuple):
    """Where one checkpoint tensor goes: parameter ``param`` whole, or rows [offset, offset + rows) of it when the
    tensor is one part of a fused parameter (q_proj of qkv_proj); transposed first when the checkpoint stores it
    [in, out] (GPT-2's Conv1D); its rows taken in ``row_order`` (partial rotary's q/k layout); ``shift`` added
    (Gemma's norms store w for a layer that multiplies by 1 + w)."""

    param: str
    offset: int | None = None
    rows: int | None = None
    transpose: bool = False
    row_order: torch.Tensor | None = None
    shift: float = 0.0


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a HF directory: model.safetensors, or the shards its index names."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def iter_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; float32 on CPU through numpy, single-threaded. The destination is freshly allocated, so
    the copy is bound by page faults, and torch's two threads mostly waited on each other: loading SmolLM2 spent
    2.19 s in ``copy_`` against 0.46 s on one thread (cProfile, the 2 cores shared with other jobs)."""
    if dst.device.type == "cpu" and dst.dtype == src.dtype == torch.float32 and src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


def load_into(model: torch.nn.Module, weights, where: str, exclude: frozenset[str] = frozenset()) -> None:
    """Copy checkpoint weights in through ``model.map_weight``; ValueError for unknown, misshapen or missing ones.
    Parameters named in ``exclude`` are filled elsewhere (weights kept quantized) and not checked here.

    ``map_weight(name)`` returns the ``WeightTarget`` of a checkpoint tensor, or None to skip it.
    """
    params = {n: p for n, p in model.named_parameters() if n not in exclude}
    rows_loaded = {name: 0 for name in params}
    for name, tensor in weights:
        target = model.map_weight(name)
        if target is None:
            continue
        if target.param not in params:
            raise ValueError(f"{where}: unexpected weight {name!r}")
        if target.transpose:
            tensor = tensor.t()
        if target.row_order is not None:
            tensor = tensor.index_select(0, target.row_order)
        if target.shift:
            tensor = tensor.float() + target.shift  # in float32, as the reference adds it, then rounded once
        dst = params[target.param].data
        if target.offset is not None:
            dst = dst.narrow(0, target.offset, target.rows)
        if dst.shape != tensor.shape:
            raise ValueError(f"{where}: weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        copy_weight(dst, tensor)
        rows_loaded[target.param] += dst.shape[0]
    missing = [n for n, p in params.items() if rows_loaded[n] != p.shape[0]]
    if missing:
        raise ValueError(f"{where}: checkpoint lacks weights for {missing[:4]}{' ...' if len(missing) > 4 else ''}")
