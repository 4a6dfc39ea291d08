"""PEFT LoRA adapters (``adapter_config.json`` + ``adapter_model.safetensors``) read and checked against a base model.

What a base model offers an adapter is ``LoRABase`` (plain data, in ``ModelInfo``, so the API process checks an
adapter without the model): its layer count and each target module's (in, out) features. ``read_adapter`` reads
a directory and refuses, naming why, anything conveyor would not compute exactly: a missing file, a PEFT type or
feature other than plain LoRA (DoRA, ``modules_to_save``, trained biases, per-module rank or alpha patterns,
``fan_in_fan_out`` weights), a target module outside q/k/v/o and gate/up/down, a rank above ``--max-lora-rank``,
and weights of another base model's shape. The result holds per (layer, module) the shrink ``A`` [in, r] and the
expand ``B`` [r, out] float32 with the scaling (lora_alpha / r, or lora_alpha / sqrt(r) for rsLoRA) folded into B,
so a row's delta is ``x @ A @ B``, what PEFT's merged weight ``W + scaling * B_peft @ A_peft`` adds.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors",)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_FAMILIES = ("llama", "qwen2", "qwen3")  # the dense pre-norm decoders whose q/k/v rows are stored in HF order
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight$")


class AdapterError(ValueError):
    """An adapter conveyor refuses, with the reason."""


@dataclass(frozen=True)
class LoRABase:
    """What a base model offers an adapter: ``shapes`` maps each target module to its (in, out) features;
    ``unsupported``: why this model carries no adapter (None: it does)."""

    num_layers: int
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    unsupported: str | None = None


def lora_base_of(cfg) -> LoRABase:
    """The ``LoRABase`` of a ``models.config.ModelConfig``."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "down_proj": (inter, h)}
    reasons = []
    if cfg.family not in LORA_FAMILIES:
        reasons.append(f"the {cfg.family} family (LoRA runs on {', '.join(LORA_FAMILIES)} decoders)")
    if cfg.moe is not None:
        reasons.append("a mixture of experts")
    if cfg.rotary_dim is not None:
        reasons.append("partial rotary (q/k rows reordered)")
    if not cfg.causal:
        reasons.append("an encoder")
    return LoRABase(cfg.num_layers, shapes, "; ".join(reasons) or None)


@dataclass
class LoRAAdapter:
    """An adapter's weights, ready to install: ``weights[(layer, module)] = (A [in, r], B [r, out] x scaling)``,
    float32 torch tensors; ``rank`` the largest r."""

    path: str
    rank: int
    weights: dict

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_config(path: str) -> dict:
    """The adapter's config, checked for what conveyor computes (``AdapterError`` naming what it does not)."""
    if not os.path.isdir(path):
        raise AdapterError(f"LoRA adapter {path!r}: no such directory")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise AdapterError(f"LoRA adapter {path!r}: missing {CONFIG_FILE}")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise AdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} does not read as JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {path!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = [
        (cfg.get("use_dora"), "DoRA (use_dora)"),
        (cfg.get("modules_to_save"), f"modules_to_save {cfg.get('modules_to_save')}"),
        (cfg.get("bias", "none") != "none", f"trained biases (bias={cfg.get('bias')!r})"),
        (cfg.get("rank_pattern"), "per-module ranks (rank_pattern)"),
        (cfg.get("alpha_pattern"), "per-module alphas (alpha_pattern)"),
        (cfg.get("fan_in_fan_out"), "fan_in_fan_out weights"),
        (cfg.get("layers_pattern"), "layers_pattern"),
    ]
    found = [what for present, what in unsupported if present]
    if found:
        raise AdapterError(f"LoRA adapter {path!r}: unsupported feature: {', '.join(found)}")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"LoRA adapter {path!r}: r must be a positive integer and lora_alpha a number")
    targets = cfg.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise AdapterError(f"LoRA adapter {path!r}: target_modules must list module names (got {targets!r})")
    bad = [t for t in targets if t not in TARGET_MODULES]
    if bad:
        raise AdapterError(f"LoRA adapter {path!r}: unsupported target module(s) {bad}; conveyor applies LoRA to "
                           f"{', '.join(TARGET_MODULES)}")
    return cfg


def check_adapter(path: str, base: LoRABase, max_rank: int) -> tuple[dict, str, dict]:
    """Check a PEFT LoRA adapter directory against ``base`` without reading its weights (no torch: the API process
    checks adapters this way). Returns (config, weights file, {(layer, module): {"A": key, "B": key}}) of the
    weights to install; ``AdapterError`` with the reason."""
    from safetensors import safe_open

    if base.unsupported:
        raise AdapterError(f"this model carries no LoRA adapter: {base.unsupported}")
    cfg = read_config(path)
    r = cfg["r"]
    if r > max_rank:
        raise AdapterError(f"LoRA adapter {path!r}: rank {r} is above --max-lora-rank {max_rank}")
    layers = cfg.get("layers_to_transform")
    layers = None if layers is None else set(layers if isinstance(layers, list) else [layers])
    weights_path = next((os.path.join(path, f) for f in WEIGHT_FILES if os.path.isfile(os.path.join(path, f))), None)
    if weights_path is None:
        raise AdapterError(f"LoRA adapter {path!r}: missing adapter_model.safetensors (.bin adapters are not read)")
    keys: dict[tuple[int, str], dict[str, str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        with safe_open(weights_path, "numpy") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    raise AdapterError(f"LoRA adapter {path!r}: weight {key!r} is not a LoRA A/B of "
                                       f"{', '.join(TARGET_MODULES)} (unsupported)")
                layer, module, half = int(m.group(1)), m.group(2), m.group(3)
                if module not in base.shapes:
                    raise AdapterError(f"LoRA adapter {path!r}: unsupported target module {module!r}")
                keys.setdefault((layer, module), {})[half] = key
                shapes[key] = tuple(f.get_slice(key).get_shape())
    except AdapterError:
        raise
    except Exception as exc:  # a truncated or corrupt safetensors file
        raise AdapterError(f"LoRA adapter {path!r}: {os.path.basename(weights_path)} does not read: {exc}") from None
    if not keys:
        raise AdapterError(f"LoRA adapter {path!r}: no LoRA weights in {os.path.basename(weights_path)}")
    wanted = {}
    for (layer, module), pair in sorted(keys.items()):
        where = f"LoRA adapter {path!r}: layer {layer} {module}"
        if layer >= base.num_layers:
            raise AdapterError(f"{where}: the base model has {base.num_layers} layers (an adapter for another base)")
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_A or lora_B is missing")
        a, b = shapes[pair["A"]], shapes[pair["B"]]
        fan_in, fan_out = base.shapes[module]
        if a != (r, fan_in) or b != (fan_out, r):
            raise AdapterError(f"{where}: lora_A {a} / lora_B {b} do not fit the base model's ({fan_out} x "
                               f"{fan_in}) weight at rank {r} (an adapter for another base shape)")
        if layers is None or layer in layers:
            wanted[(layer, module)] = pair
    return cfg, weights_path, wanted


def read_adapter(path: str, base: LoRABase, max_rank: int) -> LoRAAdapter:
    """Read a PEFT LoRA adapter directory checked by ``check_adapter`` (``AdapterError`` with the reason)."""
    from safetensors import safe_open

    cfg, weights_path, wanted = check_adapter(path, base, max_rank)
    r = cfg["r"]
    scaling = cfg.get("lora_alpha", r) / (math.sqrt(r) if cfg.get("use_rslora") else r)
    weights = {}
    try:
        with safe_open(weights_path, "pt") as f:
            for where, pair in wanted.items():
                a, b = f.get_tensor(pair["A"]).float(), f.get_tensor(pair["B"]).float()
                weights[where] = (a.t().contiguous(), (b * scaling).t().contiguous())
    except Exception as exc:  # changed under us since the check
        raise AdapterError(f"LoRA adapter {path!r}: {os.path.basename(weights_path)} does not read: {exc}") from None
    return LoRAAdapter(path, r, weights)
